"""Forward-mode derivatives of the kernels (``pallas_kernels._autodiff``), in interpret mode:
jvp, jacfwd and linearize equal the reference's, and reverse mode still runs the Pallas
backward kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pypm_testing.kernels import rnd

Q, K, V = (rnd(i, (1, 8, 2, 32)) for i in range(3))
MASK = jnp.tril(jnp.ones((8, 8), bool))[None, None]
X, W, B = rnd(3, (5, 24)), rnd(4, (24, 40), scale=0.3), rnd(5, (40,))


def attention(impl):
    return lambda q, k, v: pk.flash_attention(q, k, v, None, MASK, impl=impl)


def gemm(impl):
    return lambda x, w, b: pk.gemm_epilogue(x, w, b, activation="gelu_tanh", impl=impl)


def pallas_calls(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op, args", [(attention, (Q, K, V)), (gemm, (X, W, B))])
def test_jvp_and_linearize_equal_the_references(op, args):
    kernel, reference = op("interpret"), op("xla")
    tangents = tuple(rnd(10 + i, a.shape) for i, a in enumerate(args))
    close(jax.jvp(kernel, args, tangents), jax.jvp(reference, args, tangents))
    _, lin = jax.linearize(kernel, *args)
    close(lin(*tangents), jax.jvp(reference, args, tangents)[1])
    # the value is the kernel's: its forward kernel runs
    assert pallas_calls(lambda *a: jax.jvp(kernel, a, tangents), *args) == 1


def test_jacfwd_equals_the_references():
    def loss(f):  # of three coefficients mixing the operands
        return lambda c: jnp.sum(f(c[0] * Q, K + c[1] * Q, V * c[2]) ** 2)

    kernel, reference = attention("interpret"), attention("xla")
    c = jnp.array([1.0, 0.5, -2.0])
    close(jax.jacfwd(loss(kernel))(c), jax.jacfwd(loss(reference))(c))
    # (jax.hessian through an optimized program: tests/jax/test_jax_autodiff.py)


def test_reverse_mode_still_runs_the_backward_kernels():
    kernel, reference = attention("interpret"), attention("xla")

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))

    close(grads(kernel)(Q, K, V), grads(reference)(Q, K, V))
    # one forward kernel (with its statistics) and the dq and dk/dv kernels: the
    # backward is the kernels', not the reference's transposed
    assert pallas_calls(grads(kernel), Q, K, V) == 3


def test_the_autodiff_registries_jax_provides_are_where_the_kernels_use_them():
    """Fails loudly when JAX moves the registries ``pallas_kernels._autodiff`` uses."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    from pallas_kernels._autodiff import kernel_tangent_p

    assert isinstance(kernel_tangent_p, Primitive)
    assert ad.primitive_jvps[kernel_tangent_p] and ad.primitive_transposes[kernel_tangent_p]
    assert hasattr(batching, "primitive_batchers") and hasattr(mlir, "register_lowering")
    assert callable(mlir.lower_fun) and callable(ad.instantiate_zeros)
    assert callable(ad.is_undefined_primal) and ad.Zero


def test_a_user_kernel_with_a_custom_vjp_gets_forward_mode():
    calls = []

    @jax.custom_vjp
    def kernel(x, y):
        return jnp.sin(x) * y

    def fwd(x, y):
        return kernel(x, y), (x, y)

    def bwd(res, g):
        calls.append("bwd")
        x, y = res
        return g * jnp.cos(x) * y, g * jnp.sin(x)

    kernel.defvjp(fwd, bwd)
    f = pk.with_forward_mode(kernel, lambda x, y: jnp.sin(x) * y)
    x, y = jnp.linspace(0.0, 1.0, 5), jnp.full(5, 2.0)
    close(jax.jvp(f, (x, y), (y, x)), (jnp.sin(x) * y, jnp.cos(x) * y * y + jnp.sin(x) * x))
    close(jax.grad(lambda x: jnp.sum(f(x, y)))(x), jnp.cos(x) * y)
    assert calls == ["bwd"]  # reverse mode ran the custom_vjp's backward
