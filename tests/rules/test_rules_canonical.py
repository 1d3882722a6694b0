"""Canonical forms (``pypm_jax/rules/canonical.py``) and re-zeroed probabilities
(``pypm_jax/rules/masked_rows.py``): hand-written reproductions of how living model code
spells attention, each rewritten to one flash-attention kernel with outputs and gradients
equal to the original (kernels in the Pallas interpreter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pypm_testing.rules import check, kernel_nodes, rewrite

B, S, H, D = 2, 8, 2, 32


def qkv(seed=0):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    return tuple(jax.random.normal(k, (B, S, H, D)) for k in (kq, kk, kv))


def keep_mask(fully_masked_row=True):
    """``[B, 1, S, S]``: padding of batch 1's last keys; a query row with no key at all."""
    keep = jnp.ones((B, 1, S, S), bool).at[1, :, :, -3:].set(False)
    return keep.at[0, 0, 2, :].set(False) if fully_masked_row else keep


def canonical(report):
    return report.canonical.counts()


# ----------------------------------------------------------------- no-op layout and copy


@pytest.mark.slow
def test_copies_and_layout_round_trips_disappear():
    """penzai copies every named-axis result; axes swapped there and back, or split and
    merged back, compute nothing either: the attention between them is rewritten."""

    def attn(q, k, v):
        s = jnp.copy(jnp.einsum("bqhd,bkhd->bhqk", q, k))
        s = jnp.swapaxes(jnp.swapaxes(s, 1, 2), 1, 2).reshape(B, H * S, S).reshape(s.shape)
        p = jnp.copy(jax.nn.softmax(s))
        return jnp.copy(jnp.einsum("bhqk,bkhd->bqhd", p, v))

    args = qkv()
    fast = check(attn, args, {"attention": 1}, grad=True)
    _, _, report = rewrite(attn, args)
    assert canonical(report) == {
        "canonical_copy": 3,
        "canonical_transposes": 1,
        "canonical_reshapes": 1,
    }
    assert "canonical forms: canonical_copy x3" in str(report)
    assert len(kernel_nodes(fast, args)) == 1


def test_only_round_trips_disappear():
    """Transposes or reshapes that do not give the operand back are real layout changes."""

    def f(x):
        y = jnp.transpose(jnp.transpose(x, (1, 2, 0)), (0, 2, 1))
        return y.reshape(4, 15).reshape(60) * 2.0

    x = jax.random.normal(jax.random.PRNGKey(5), (3, 4, 5))
    fast, got, report = rewrite(f, (x,))
    assert not report.canonical
    ops = [n.op.name for n in fast.lifted(x).graph.nodes()]
    assert ops.count("transpose") == 2 and ops.count("reshape") == 2
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(x)))


# --------------------------------------------------------------------- vmap softmax


def penzai_attention(q, k, v, mask):
    """The softmax ``vmap``-ped over every axis but the keys (penzai's ``nmap``): the max is
    taken before ``vmap`` moves the batch axis, and the result is moved back."""
    s = jnp.copy(jnp.einsum("bqhd,bkhd->bhqk", q, k) * (D**-0.5))
    s = jnp.copy(jnp.where(mask, s, -1e9))
    softmax = jax.nn.softmax
    for axis in (0, 1, 0):  # innermost first: heads, then queries, then batch
        softmax = jax.vmap(softmax, in_axes=axis, out_axes=axis)
    p = jnp.copy(softmax(s))
    return jnp.copy(jnp.einsum("bhqk,bkhd->bqhd", p, v))


@pytest.mark.slow
def test_vmap_softmax_moved_back_is_read_by_every_attention_rule():
    args = (*qkv(), keep_mask(fully_masked_row=False))
    assert "transpose" in str(jax.make_jaxpr(penzai_attention)(*args))
    check(penzai_attention, args, {"attention_scaled_mask": 1}, grad=True)
    _, _, report = rewrite(penzai_attention, args)
    assert canonical(report)["canonical_softmax"] == 1


@pytest.mark.slow
def test_vmap_softmax_over_heads_with_a_bias():
    def attn(q, k, v, bias):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
        p = jax.vmap(jax.nn.softmax, in_axes=1, out_axes=1)(s)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    bias = jax.random.normal(jax.random.PRNGKey(3), (B, 1, S, S))
    check(attn, (*qkv(), bias), {"attention_bias": 1}, grad=True)


def test_vmap_softmax_not_moved_back_is_left_to_the_other_rules():
    """Without the inverse transpose the probabilities stay in the moved frame: not the
    canonical softmax's to rewrite (nothing reads the plain form there)."""

    def f(s):
        return jax.vmap(jax.nn.softmax, in_axes=1, out_axes=0)(s)

    s = jax.random.normal(jax.random.PRNGKey(4), (3, 4, 5))
    _, got, report = rewrite(f, (s,))
    assert "canonical_softmax" not in canonical(report)
    np.testing.assert_allclose(np.asarray(got), np.asarray(f(s)), rtol=1e-6)


# ------------------------------------------------------------------ re-zeroed softmax


def keras_where(q, k, v, mask):
    """Keras's ``Softmax(mask=)``: mask the scores, softmax, re-zero with the same mask."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q * (D**-0.5), k)
    p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(mask, p, 0.0), v)


def keras_multiply(q, k, v, mask):
    """Older Keras: the re-zeroing is ``p * cast(mask)``."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.float32(D**0.5)
    p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p * mask.astype(p.dtype), v)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, rule",
    [(keras_where, "attention_mask_zero"), (keras_multiply, "attention_scaled_mask_zero")],
)
def test_rezeroed_probabilities_become_masked_rows_zero(fn, rule):
    args = (*qkv(), keep_mask())
    want = fn(*args)
    assert float(jnp.max(jnp.abs(want[0, 2]))) == 0.0  # the fully masked row is 0
    fast = check(fn, args, {rule: 1}, grad=True)
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].masked_rows == "zero" and node.attrs["plan"].mask


def test_rezeroed_by_another_mask_is_left_alone():
    """Re-zeroing by a mask other than the one that masked the scores is not the kernel's
    option: the attention is not rewritten."""

    def attn(q, k, v, mask, other):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(other, p, 0.0), v)

    args = (*qkv(), keep_mask(), keep_mask(fully_masked_row=False))
    _, got, report = rewrite(attn, args)
    assert not report
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn(*args)), rtol=1e-6)


# ------------------------------------------------------------------ a rank-0 bias


@pytest.mark.slow
def test_a_rank0_bias_goes_to_the_kernel():
    """BEiT's default config adds ``jnp.array(0.0)`` (its relative position bias off)."""

    def attn(q, k, v, bias):
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    args = (*qkv(), jnp.array(0.25))
    fast = check(attn, args, {"attention_bias": 1}, grad=True)
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].kernel_shapes[3] == ()


# ---------------------------------------------------------------- Keras causal masks


def keras_mha_causal(q, k, v, pad):
    """Keras ``MultiHeadAttention(use_causal_mask=True)``: the triangle as ``cumsum(ones)``
    rows >= columns, ``and``-ed with the padding mask, applied by ``Softmax(mask=)``."""
    ones = jnp.ones((1, S, S), jnp.int32)
    causal = jnp.cumsum(ones, axis=-2) >= jnp.cumsum(ones, axis=-1)
    mask = (pad[:, None, :] & causal)[:, None]
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    p = jax.nn.softmax(jnp.where(mask, s, -1e9))
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(mask, p, 0.0), v)


def keras_hub_causal(q, k, v, pad):
    """keras-hub's ``compute_causal_mask`` (float aranges, the cache index added before
    ``expand_dims``) merged with the int32 padding mask by ``ops.minimum``; its Softmax
    reads the int mask as ``mask > 0``."""
    i = jnp.arange(S, dtype=jnp.float32) + jnp.float32(0)
    causal = jnp.expand_dims(jnp.expand_dims(i, 1) >= jnp.arange(S, dtype=jnp.float32), 0)
    causal = jnp.broadcast_to(causal, (B, S, S)).astype(jnp.int32)
    mask = jnp.minimum(pad.astype(jnp.int32)[:, None, :], causal)[:, None] > 0
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
    p = jax.nn.softmax(jnp.where(mask, s, -1e9))
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(mask, p, 0.0), v)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fn, rule",
    [(keras_mha_causal, "attention_mask_zero"), (keras_hub_causal, "attention_mask_zero")],
)
def test_keras_causal_masks_are_causal(fn, rule):
    pad = jnp.ones((B, S), bool).at[1, -3:].set(False)
    args = (*qkv(), pad)
    fast = check(fn, args, {rule: 1, "attention_causal_mask": 1}, grad=True)
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].mask_is_causal


def test_minimum_with_a_possibly_negative_mask_is_not_causal():
    """``min(m, tril) != 0`` of an int mask m that may hold -1 attends above the diagonal
    (``> 0`` would not): only the attention rule fires."""

    def attn(q, k, v, m):
        ones = jnp.ones((1, S, S), jnp.int32)
        causal = (jnp.cumsum(ones, axis=-2) >= jnp.cumsum(ones, axis=-1)).astype(jnp.int32)
        mask = jnp.minimum(m, causal)[:, None]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(mask != 0, s, -1e9)), v)

    m = -jnp.ones((B, S, S), jnp.int32)
    _, _, report = rewrite(attn, (*qkv(), m))
    assert report.counts() == {"attention_mask": 1}


# ------------------------------------------------------------ fused attention already


@pytest.mark.slow
def test_a_program_calling_a_pallas_kernel_is_left_alone():
    """A program that already calls a fused attention (here the Pallas kernel itself, in
    the interpreter) has no softmax for the rules to see: nothing is rewritten, and the
    kernel call runs as the program wrote it."""
    from pallas_kernels import flash_attention

    def attn(q, k, v):
        return flash_attention(q, k, v, impl="interpret")

    args = qkv()
    _, got, report = rewrite(attn, args)
    assert not report and not report.canonical
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn(*args)), rtol=1e-6)


# ---------------------------------------------------------------------- attention sinks


def gpt_oss(q, k, v, sinks, bias):
    """GPT-OSS: a per-head sink logit concatenated to the scores before the softmax and
    sliced off after (the causal mask is an added bias)."""
    w = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (D**-0.5) + bias
    col = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (B, H, S, 1))
    p = jax.nn.softmax(jnp.concatenate([w, col], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def sink_args():
    causal = jnp.where(jnp.tril(jnp.ones((S, S), bool)), 0.0, jnp.finfo(jnp.float32).min)
    return (*qkv(), jnp.array([0.5, -1.0]), causal[None, None])


@pytest.mark.slow
def test_attention_sinks_go_to_the_kernel():
    args = sink_args()
    fast = check(gpt_oss, args, {"attention_scaled_bias_sinks": 1}, grad=True)
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].sinks and len(node.inputs) == 7
    want = jax.grad(lambda s: jnp.sum(gpt_oss(*args[:3], s, args[4]) ** 2))(args[3])
    got = jax.grad(lambda s: jnp.sum(fast(*args[:3], s, args[4]) ** 2))(args[3])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-3, atol=1e-6)


def test_a_sink_column_sliced_off_elsewhere_is_left_alone():
    """Slicing off another entry than the sink is not the kernel's sinks."""

    def attn(q, k, v, sinks, bias):
        w = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
        col = jnp.broadcast_to(sinks.reshape(1, -1, 1, 1), (B, H, S, 1))
        p = jax.nn.softmax(jnp.concatenate([w, col], axis=-1), axis=-1)[..., 1:]
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    _, _, report = rewrite(attn, sink_args())
    assert not report
