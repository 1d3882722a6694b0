"""MoE experts run densely: a weight ``[E, H, F]`` with an expert axis, an activation
shared by every expert, the epilogue a region (``gemm_epilogue_region``) lowered to
``pallas_kernels.gemm_fused_experts`` (the experts on the kernel's grid).

keras-hub's Mixtral computes ``einsum("th,ehm->etm", x, w)`` for every expert: a
``dot_general`` of the weight and x, transposed to ``[E, T, F]``. Kernels run in the Pallas
interpreter; values (f32: 1e-5 relative) and gradients equal the original's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pypm_jax.rules import GemmRegion
from pypm_testing.rules import TOL, kernel_nodes, rel_close, rewrite, vjps_close

E, B, S, H, F = 4, 2, 8, 64, 128


def _args(w_shape=(E, H, F), seed=0, x_shape=(B * S, H)):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(k[0], x_shape)
    w1 = jax.random.normal(k[1], w_shape) / 8
    w2 = jax.random.normal(k[2], w_shape) / 8
    b = jax.random.normal(k[3], (E, F))
    return x, w1, w2, b


def mixtral(x, w1, w2, b):  # keras-hub's MixtralMoeExperts: silu(gate) * up, every expert
    gate = jax.nn.silu(jnp.einsum("th,ehm->etm", x, w1))
    return jnp.einsum("th,ehm->etm", x, w2) * gate


def activation_first(x, w1, w2, b):  # the same dot_general with x as its lhs, [B, S, H]
    def experts(w):
        d = jax.lax.dot_general(x, w, (((2,), (1,)), ((), ())))  # [B, S, E, F]
        return jnp.transpose(d, (2, 0, 1, 3))

    return jax.nn.gelu(experts(w1)) * experts(w2)


def stored_nk(x, w1, w2, b):  # weights stored [E, F, H]
    return jnp.tanh(jnp.einsum("th,emh->etm", x, w1))


def expert_bias(x, w1, w2, b):  # a bias per expert: [E, 1, F]
    return jax.nn.relu(jnp.einsum("th,ehm->etm", x, w1) + b[:, None, :])


# name -> (fn, shapes, region rewrites, GEMMs left to XLA): a gated pair is two rewrites,
# the product read by the activation's kernel as a full tile, or (Mixtral's order) the
# up projection's kernel reading the activation's kernel
CASES = {
    "mixtral": (mixtral, {}, 2, 0),
    "activation first": (activation_first, {"x_shape": (B, S, H)}, 2, 1),
    "stored [E, F, H]": (stored_nk, {"w_shape": (E, F, H)}, 1, 0),
    "per-expert bias": (expert_bias, {}, 1, 0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_experts_are_region_kernels_with_equal_values_and_gradients(name):
    fn, shapes, rewrites, left = CASES[name]
    args = _args(**shapes)
    fast, got, report = rewrite(fn, args)
    assert report.counts() == {"gemm_epilogue_region": rewrites}, str(report)
    nodes = kernel_nodes(fast, args)
    assert nodes and all(n.op is GemmRegion for n in nodes), str(report)
    assert all(n.attrs["plan"].experts == E for n in nodes)
    graph = fast.lifted(*args).graph
    assert len([n for n in graph.nodes() if n.op.name == "dot_general"]) == left, str(report)
    want = jax.jit(fn)(*args)
    rel_close(want, got, name, tol=TOL["float32"])
    vjps_close(fn, fast, args, want, name, seed=9)


def test_per_expert_activations_and_other_layouts_are_left_alone():
    """A batched ``dot_general`` (x per expert, ``[E, C, H]``: the same form as attention's
    batched dots) and experts' results in another axis order keep their ``dot_general``."""
    x, w1, _, _ = _args()
    xe = jax.random.normal(jax.random.PRNGKey(5), (E, S, H))

    def per_expert(xe, w):
        return jax.nn.silu(jnp.einsum("ech,ehm->ecm", xe, w))

    def experts_last(x, w):
        return jax.nn.silu(jnp.einsum("th,ehm->tem", x, w))

    def tokens_last(x, w):
        return jax.nn.silu(jnp.einsum("th,ehm->emt", x, w))

    for fn, args in ((per_expert, (xe, w1)), (experts_last, (x, w1)), (tokens_last, (x, w1))):
        fast, got, report = rewrite(fn, args)
        assert not report.counts(), f"{fn.__name__}: {report}"
        rel_close(jax.jit(fn)(*args), got, fn.__name__)
