"""What the standard rules must leave alone: unsupported shapes and dtypes, values needed
elsewhere, opaque or effectful primitives in the way, and look-alikes that compute something
else. Each program still runs and still computes what it computed."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pypm_testing.rules import check, kernel_nodes, rewrite

B, S, H, D = 2, 8, 2, 32


def qkv(d=D, seed=0, dtype=jnp.float32, kv_heads=H, dv=None):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (B, S, H, d), dtype)
    k = jax.random.normal(ks[1], (B, S, kv_heads, d), dtype)
    v = jax.random.normal(ks[2], (B, S, kv_heads, dv or d), dtype)
    return q, k, v


def attn(q, k, v):
    w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k))
    return jnp.einsum("bhqk,bkhd->bqhd", w, v)


@pytest.mark.slow
def test_head_dim_the_kernel_does_not_take():
    check(attn, qkv(d=264), {})  # flash attention takes head dims 1..256
    check(attn, qkv(d=512), {})


@pytest.mark.slow
def test_small_and_odd_head_dims_are_rewritten():
    """The other side of that boundary: the kernel zero-pads head dims below 256."""
    check(attn, qkv(d=8), {"attention": 1}, grad=True)
    check(attn, qkv(d=20), {"attention": 1})


def test_value_head_dim_differs_from_query_head_dim():
    check(attn, qkv(dv=64), {})  # the kernel needs k and v of one shape


def test_probabilities_also_returned():
    """output_attentions: the probabilities are needed anyway; no kernel runs beside them."""

    def attn_and_weights(q, k, v):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k))
        return jnp.einsum("bhqk,bkhd->bqhd", w, v), w

    check(attn_and_weights, qkv(), {})


def test_scores_also_used_elsewhere():
    def attn_and_scores(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v), s.mean()

    check(attn_and_scores, qkv(), {})


def test_optimization_barrier_between_softmax_and_values():
    def attn_barrier(q, k, v):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k))
        w = jax.lax.optimization_barrier(w)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    check(attn_barrier, qkv(), {})


def test_callback_on_the_probabilities():
    def attn_callback(q, k, v):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k))
        w = jax.pure_callback(lambda a: np.asarray(a), jax.ShapeDtypeStruct(w.shape, w.dtype), w)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    check(attn_callback, qkv(), {})


def test_effect_reading_the_probabilities():
    seen = []

    def attn_debug(q, k, v):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k))
        jax.debug.callback(lambda a: seen.append(a.shape), w)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    check(attn_debug, qkv(), {})


def test_softmax_over_the_query_axis():
    def not_attention(q, k, v):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k), axis=-2)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    check(not_attention, qkv(), {})


def test_mask_fill_that_does_not_mask():
    """A fill of -10 is a penalty, not a mask: no mask rule takes it, and the region rules
    keep it in the logits (``score_mod``), not in the kernel's mask."""

    def soft_mask(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        s = jnp.where(jnp.tril(jnp.ones((S, S), bool)), s, -10.0)  # a penalty, not a mask
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    args = qkv()
    fast, got, report = rewrite(soft_mask, args)
    assert all(r.rule.startswith("attention_region") for r in report) and report
    (node,) = [n for n in fast.lifted(*args).graph.nodes() if n.op.name == "AttentionRegion"]
    plan = node.attrs["plan"]
    assert plan.mask == () and plan.band is None and "-10.0" in plan.describe()
    np.testing.assert_allclose(got, jax.jit(soft_mask)(*args), rtol=1e-5, atol=1e-5)


def test_tiled_kv_heads_are_not_read_as_grouped():
    """``jnp.tile`` maps query head h to kv head h % Hkv, not h // g: the kernel gets the
    tiled keys themselves (still one kernel, still the same result)."""

    def attn_tiled(q, k, v):
        return attn(q, jnp.tile(k, (1, 1, 2, 1)), jnp.tile(v, (1, 1, 2, 1)))

    args = qkv(kv_heads=1)
    fast = check(attn_tiled, args, {"attention": 1})
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].kernel_shapes[1][2] == H


def test_integer_and_mixed_precision_dense():
    x = jnp.arange(2 * 8 * 64, dtype=jnp.int32).reshape(2, 8, 64) % 7
    w = jnp.ones((64, 32), jnp.int32)
    check(lambda x, w: jnp.maximum(x @ w, 0), (x, w), {})  # the kernel takes floats

    def mixed(x, w):  # bf16 operands, f32 result: the kernel would return bf16
        return jax.nn.relu(jnp.dot(x, w, preferred_element_type=jnp.float32))

    xb = jax.random.normal(jax.random.PRNGKey(0), (2, 8, 64), jnp.bfloat16)
    check(mixed, (xb, jnp.ones((64, 32), jnp.bfloat16)), {})


def test_dense_with_a_batched_weight():
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 64))
    w = jax.random.normal(jax.random.PRNGKey(2), (2, 64, 32))
    check(lambda x, w: jax.nn.relu(jnp.einsum("bsk,bkn->bsn", x, w)), (x, w), {})


def test_preactivation_used_elsewhere():
    def dense_twice(x, w, b):
        y = x @ w + b
        return jax.nn.gelu(y), y.sum()

    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 64))
    w = jax.random.normal(jax.random.PRNGKey(2), (64, 32))
    check(dense_twice, (x, w, jnp.ones((32,))), {})


def test_unsupported_sites_leave_the_program_untouched():
    """No rule fired: the lifted program is the original, equation for equation."""
    args = qkv(d=264)  # the kernel takes head dims 1..256
    fast, _, report = rewrite(attn, args)
    assert list(report) == []
    prims = [n.op.name for n in fast.lifted(*args).graph.nodes() if n.op.name != "const"]
    assert "dot_general" in prims and "exp" in prims
