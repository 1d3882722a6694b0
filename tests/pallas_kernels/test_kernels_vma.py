"""Kernels inside ``jax.shard_map(check_vma=True)`` (shard_map's default) declare how their
results vary across the mesh.

With ``check_vma`` every value's type records the manual mesh axes it varies along, and a
``pallas_call`` must give its results that record (``ShapeDtypeStruct(manual_axis_type=)``).
The kernels make their operands vary together (``pcast``: a replicated operand's cotangent is
summed over the mesh) and give every Pallas result, forward and backward, that type. These
tests trace the kernels (``jax.make_jaxpr``): tracing is where JAX checks the types. (JAX's
Pallas *interpreter* cannot yet evaluate such a kernel: its grid loop carries buffers whose
varying axes it drops, so ``tests/jax/test_jax_sharded.py`` runs a ``check_vma=True`` body on
the kernels' plain-JAX reference and this file checks the types the GPU lowering sees.)
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import _dispatch as dsp

MESH = Mesh(np.array(jax.devices()[:1]), ("x",))


def _normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _attention(q, k, v, bias):
    return pk.flash_attention(q, k, v, bias, impl="interpret")


def _gemm(x, w, b):
    return pk.gemm_fused(x, w, lambda acc, b: jnp.tanh(acc + b), b, impl="interpret")


CASES = {
    # q/k/v split over "x", the bias replicated (it varies along no axis)
    "attention": (
        _attention,
        [_normal(i, (2, 8, 2, 32)) for i in range(3)] + [_normal(3, (1, 2, 8, 8))],
        (P("x"),) * 3 + (P(),),
    ),  # fmt: skip
    # x split over "x", the weight and bias replicated
    "gemm": (
        _gemm,
        [_normal(4, (16, 32)), _normal(5, (32, 64)), _normal(6, (64,))],
        (P("x"), P(), P()),
    ),  # fmt: skip
}


def _pallas_results(jaxpr) -> list:
    """The result types of every ``pallas_call`` in ``jaxpr`` and its sub-jaxprs."""
    found = []

    def walk(x):
        if isinstance(x, jax.extend.core.Jaxpr):
            for eqn in x.eqns:
                if eqn.primitive.name == "pallas_call":
                    found.extend(v.aval for v in eqn.outvars)
                for param in eqn.params.values():
                    walk(param)
        elif isinstance(x, jax.extend.core.ClosedJaxpr):
            walk(x.jaxpr)
        elif isinstance(x, (tuple, list)):
            for item in x:
                walk(item)

    walk(jaxpr)
    return found


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_results_vary_like_their_operands(name: str) -> None:
    kernel, args, specs = CASES[name]
    body = jax.shard_map(kernel, mesh=MESH, in_specs=specs, out_specs=P("x"), check_vma=True)
    jaxpr = jax.make_jaxpr(body)(*args)  # before the fix: "manual_axis_type ... must not be None"
    results = _pallas_results(jaxpr)
    assert results, "no pallas_call traced"
    assert all(dsp.varying_axes(a) == {"x"} for a in results), results


@pytest.mark.parametrize(("name", "kernels"), [("attention", 6), ("gemm", 1)])
def test_kernel_gradients_trace_with_the_replicated_operands_summed(name: str, kernels: int):
    """The backward kernels' results vary too (attention: the forward's output and row
    statistics, dQ, dK, dV; the GEMM's backward is XLA's); a replicated operand's cotangent is summed over the mesh (a ``psum``
    from ``pcast``'s transpose) so it is replicated again."""
    kernel, args, specs = CASES[name]
    body = jax.shard_map(kernel, mesh=MESH, in_specs=specs, out_specs=P("x"), check_vma=True)
    loss = jax.grad(lambda *a: jnp.sum(body(*a) ** 2), argnums=tuple(range(len(args))))
    jaxpr = jax.make_jaxpr(loss)(*args)
    results = _pallas_results(jaxpr)
    assert len(results) == kernels
    assert all(dsp.varying_axes(a) == {"x"} for a in results), results
    text = str(jaxpr)
    assert "psum" in text  # the replicated operand's cotangent


def test_vary_together_leaves_values_and_unsharded_operands_alone() -> None:
    x, w = _normal(7, (4, 8)), _normal(8, (8,))
    assert dsp.vary_together([x, None, w]) == [x, None, w]  # outside shard_map: no axes

    def body(x, w):
        xs, ws = dsp.vary_together([x, w])
        assert dsp.varying_axes(xs) == dsp.varying_axes(ws) == {"x"}
        return xs + ws

    f = jax.shard_map(body, mesh=MESH, in_specs=(P("x"), P()), out_specs=P("x"), check_vma=True)
    np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(x + w))


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernels_run_inside_a_checked_shard_map_gpu(name: str) -> None:
    """The Triton kernels run in a ``check_vma=True`` body: values and gradients equal the
    XLA reference's."""
    kernel, args, specs = CASES[name]

    def run(impl: str):
        def body(*a):
            if name == "attention":
                return pk.flash_attention(*a, impl=impl)
            return pk.gemm_fused(a[0], a[1], lambda acc, b: jnp.tanh(acc + b), a[2], impl=impl)

        f = jax.shard_map(body, mesh=MESH, in_specs=specs, out_specs=P("x"), check_vma=True)
        loss = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=tuple(range(len(args))))
        return jax.jit(f)(*args), jax.jit(loss)(*args)

    (out, grads), (want, want_grads) = run("pallas"), run("xla")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=2e-5, atol=2e-5)
    for g, w in zip(grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-4)
