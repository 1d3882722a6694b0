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


# ------------------------------------------------ grouped-query attention as 5-D einsums


def gqa_args(k_heads, groups, seed=7):
    """q ``[B, S, K*G, D]``, k and v ``[B, S, K, D]`` (unrepeated), a causal keep-mask."""
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(kq, (B, S, k_heads * groups, D))
    k = jax.random.normal(kk, (B, S, k_heads, D))
    v = jax.random.normal(kv, (B, S, k_heads, D))
    return q, k, v, jnp.tril(jnp.ones((S, S), bool))[None, None]


def tunix_gqa(k_first=False, v_first=True, scale=True):
    """tunix's Llama 3: q regrouped to ``[B, T, K, G, D]``, 5-D scores ``[B, K, G, T, S]``
    (scaled there), merged to ``[B, N, T, S]`` for the mask and softmax, the probabilities
    split back to 5-D for the contraction with the unrepeated v."""

    def attn(q, k, v, mask):
        n, kh = q.shape[2], k.shape[2]
        q5 = q.reshape(B, S, kh, n // kh, D)
        if k_first:
            s = jnp.einsum("BSKH,BTKGH->BKGTS", k, q5)
        else:
            s = jnp.einsum("BTKGH,BSKH->BKGTS", q5, k)
        if scale:
            s = s * (D**-0.5)
        s = jnp.where(mask, s.reshape(B, n, S, S), -1e9)
        p = jax.nn.softmax(s, axis=-1).reshape(B, kh, n // kh, S, S)
        if v_first:
            o = jnp.einsum("BSKH,BKGTS->BTKGH", v, p)
        else:
            o = jnp.einsum("BKGTS,BSKH->BTKGH", p, v)
        return o.reshape(B, S, n, D)

    return attn


@pytest.mark.slow
@pytest.mark.parametrize("k_heads, groups", [(2, 1), (2, 2), (1, 4), (1, 2)])
def test_5d_grouped_einsums_become_one_attention(k_heads, groups):
    """GQA (G = 1, 2, 4) and MQA (K = 1) as 5-D einsums with unrepeated k and v: the 5-D
    scores are the split of 4-D scores of q and k repeated per group, the split moves down
    the scale and cancels with the merge of the heads, the split probabilities become a 4-D
    contraction with v repeated: one grouped flash attention."""
    args = gqa_args(k_heads, groups)
    fn = tunix_gqa()
    fast = check(fn, args, {"attention_scaled_mask": 1}, grad=True)
    _, _, report = rewrite(fn, args)
    assert canonical(report) == {
        "canonical_split_scores": 1,
        "canonical_split_scalar": 1,
        "canonical_reshapes": 2,  # q's merge cancels its split, the scores' merge theirs
        "canonical_grouped_probs": 1,
    }
    (node,) = kernel_nodes(fast, args)
    plan = node.attrs["plan"]
    assert plan.kernel_shapes[1] == plan.kernel_shapes[2]  # k and v: the unrepeated kv heads
    assert sorted(plan.kernel_shapes[0]) == sorted((B, S, k_heads * groups, D))
    assert sorted(plan.kernel_shapes[1]) == sorted((B, S, k_heads, D))


@pytest.mark.slow
@pytest.mark.parametrize("k_first", [False, True])
@pytest.mark.parametrize("v_first", [False, True])
def test_5d_grouped_einsums_either_operand_order(k_first, v_first):
    args = gqa_args(2, 2, seed=k_first + 2 * v_first)
    check(tunix_gqa(k_first, v_first, scale=False), args, {"attention_mask": 1}, grad=True)


@pytest.mark.slow
def test_5d_grouped_scores_without_a_transpose():
    """Scores contracted straight into the ``dot_general``'s own layout ``[B, K, G, T, S]``
    (q moved to ``[B, K, G, T, D]`` first): the merge needs no transpose."""

    def attn(q, k, v, mask):
        q5 = jnp.transpose(q.reshape(B, S, 2, 2, D), (0, 2, 3, 1, 4))  # [B, K, G, T, D]
        s = jax.lax.dot_general(q5, k, (((4,), (3,)), ((0, 1), (0, 2))))  # [B, K, G, T, S]
        s = jnp.where(mask, s.reshape(B, 4, S, S), -1e9)
        p = jax.nn.softmax(s, axis=-1).reshape(B, 2, 2, S, S)
        return jnp.einsum("BKGTS,BSKH->BTKGH", p, v).reshape(B, S, 4, D)

    args = gqa_args(2, 2, seed=3)
    check(attn, args, {"attention_mask": 1}, grad=True)


def test_5d_heads_merged_group_major_are_left_alone():
    """Heads merged (G, K), group first, are ``jnp.tile``'s grouping (head n reads kv head
    n % K), not the kernel's: neither 5-D contraction is rewritten, the program is unchanged."""

    def attn(q, k, v, mask):
        q5 = q.reshape(B, S, 2, 2, D)  # [B, T, G, K, D]
        s = jnp.einsum("BTGKH,BSKH->BGKTS", q5, k).reshape(B, 4, S, S)
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1).reshape(B, 2, 2, S, S)
        return jnp.einsum("BGKTS,BSKH->BTGKH", p, v).reshape(B, S, 4, D)

    args = gqa_args(2, 2, seed=4)
    _, got, report = rewrite(attn, args)
    assert not report
    assert not {"canonical_grouped_scores", "canonical_grouped_probs"} & set(canonical(report))
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn(*args)), rtol=1e-5, atol=1e-6)


def gemma_gqa(scale_first=False):
    """Gemma 2 (gemma, tunix): 5-D scores moved to ``[B, T, K, G, S]`` and merged to the
    query-major ``[B, T, N, S]``, soft-capped and masked there; the probabilities split back
    for the contraction with the unrepeated v."""

    def attn(q, k, v, mask):
        q5 = q.reshape(B, S, 2, 2, D)
        s = jnp.einsum("BTKGH,BSKH->BTKGS", q5, k).reshape(B, S, 4, S)
        s = jnp.tanh(s / 50.0) * 50.0
        p = jax.nn.softmax(jnp.where(mask[:, 0, :, None, :], s, -1e9), axis=-1)
        o = jnp.einsum("BSKH,BTKGS->BTKGH", v, p.reshape(B, S, 2, 2, S))
        return o.reshape(B, S, 4, D)

    return attn


@pytest.mark.slow
def test_5d_scores_merged_query_major_become_one_attention_region():
    """No ``dot_general`` makes ``[B, T, N, S]``: the merged 4-D scores are transposed into
    it, and the transpose moves down the soft-cap, the mask and the softmax into the
    contraction with v, so the chain runs in the scores' own layout: one attention region
    (the soft-cap in the kernel's ``score_mod``)."""
    args = gqa_args(2, 2, seed=5)
    fn = gemma_gqa()
    fast, _, report = rewrite(fn, args)
    assert report.counts()["attention_region_done"] == 1
    assert canonical(report) == {
        "canonical_split_scores": 1,
        "canonical_reshapes": 2,
        "canonical_transpose_scalar": 2,
        "canonical_transpose_unary": 1,
        "canonical_transpose_where": 1,
        "canonical_transpose_softmax": 1,
        "canonical_grouped_probs": 1,
        "canonical_transposed_probs": 1,
    }
    check(fn, args, report.counts(), grad=True)
    assert len(kernel_nodes(fast, args)) == 0  # (an AttentionRegion node, not FlashAttention)


def test_transposes_of_other_values_stay_before_pointwise_operations():
    """Only rank-4 transposes of a contraction's (or pointwise) result move: a transposed
    input, or a rank-3 transpose, is left where it is."""

    def f(x, y):
        a = jnp.tanh(jnp.transpose(x, (0, 2, 1, 3))) * 2.0
        b = jnp.tanh(jnp.transpose(jnp.einsum("abc,acd->abd", y, y), (0, 2, 1)))
        return a, b

    x = jax.random.normal(jax.random.PRNGKey(6), (2, 3, 4, 5))
    y = jax.random.normal(jax.random.PRNGKey(7), (2, 3, 3))
    _, got, report = rewrite(f, (x, y))
    assert not report.canonical
    for a, b in zip(got, f(x, y), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)


# ------------------------------------------ grouped scores kept at rank 5 up to the contraction


def keras_gqa(rezero=True, mask_per_kv_head=False):
    """keras-hub's Gemma 2: 5-D scores ``[B, K, G, T, S]`` (``einsum("BSKH,BTKGH->BKGTS")``),
    soft-capped, masked by a mask broadcast to rank 5, softmax over the last axis, re-zeroed
    by the same mask (Keras's ``Softmax(mask=)``), contracted at rank 5 with the unrepeated v."""

    def attn(q, k, v, mask):
        n, kh = q.shape[2], k.shape[2]
        q5 = q.reshape(B, S, kh, n // kh, D)
        s = jnp.einsum("BSKH,BTKGH->BKGTS", k, q5)
        s = jnp.tanh(s / 50.0) * 50.0
        m = jnp.broadcast_to(mask[:, :, None], s.shape)
        if mask_per_kv_head:  # a mask that differs per kv head: not a [B, N, T, S] broadcast
            m = m & (jnp.arange(kh) == 0)[None, :, None, None, None]
        p = jax.nn.softmax(jnp.where(m, s, -1e9), axis=-1)
        if rezero:
            p = jnp.where(m, p, 0.0)
        o = jnp.einsum("BKGTS,BSKH->BTKGH", p, v)
        return o.reshape(B, S, n, D)

    return attn


@pytest.mark.slow
@pytest.mark.parametrize("k_heads, groups", [(1, 2), (2, 2)])
@pytest.mark.parametrize("rezero", [True, False])
def test_5d_scores_chain_at_rank_5_becomes_one_attention_region(k_heads, groups, rezero):
    """The 5-D scores are the split of the 4-D grouped scores; the split moves down the
    soft-cap, the rank-5 mask and fill (merged to rank 4 broadcasts), the softmax and the
    re-zeroing, and cancels with the contraction's merge: one attention region, the
    re-zeroing its zero rows (MQA, K = 1, as keras-hub's Gemma 2, and GQA)."""
    args = gqa_args(k_heads, groups, seed=8)
    fn = keras_gqa(rezero)
    fast, _, report = rewrite(fn, args)
    counts = report.counts()
    assert counts.get("attention_region_zero" if rezero else "attention_region") == 1, report
    got = canonical(report)
    assert got["canonical_split_unary"] == 1 and got["canonical_split_softmax"] == 1
    assert got["canonical_split_scalar"] == 2
    assert got["canonical_split_where"] == (2 if rezero else 1)
    check(fn, args, counts, grad=True)
    assert len(kernel_nodes(fast, args)) == 0  # (an AttentionRegion node)


def test_5d_scores_masked_per_kv_head_keep_their_rank():
    """A mask that varies along K but not G is no broadcast of a ``[B, N, T, S]`` mask
    (``rules.merged_broadcast``): the split stops at it, no attention is rewritten, and the
    program computes the same."""
    args = gqa_args(2, 2, seed=9)
    fn = keras_gqa(rezero=False, mask_per_kv_head=True)
    _, got, report = rewrite(fn, args)
    assert not report
    assert "canonical_split_where" not in canonical(report)
    np.testing.assert_allclose(np.asarray(got), np.asarray(fn(*args)), rtol=1e-5, atol=1e-6)


def test_5d_scores_split_only_at_the_head_pair():
    """Heads grouped (G, K) (``jnp.tile``'s grouping) are no split of 4-D scores: nothing
    moves, and the rank-5 chain computes as written."""

    def attn(q, k, v, mask):
        q5 = q.reshape(B, S, 2, 2, D)  # [B, T, G, K, D]
        s = jnp.tanh(jnp.einsum("BSKH,BTGKH->BGKTS", k, q5) / 50.0) * 50.0
        p = jax.nn.softmax(jnp.where(mask[:, :, None], s, -1e9), axis=-1)
        return jnp.einsum("BGKTS,BSKH->BTGKH", p, v).reshape(B, S, 4, D)

    args = gqa_args(2, 2, seed=10)
    _, got, report = rewrite(attn, args)
    assert not report
    assert not {"canonical_split_scores", "canonical_split_unary"} & set(canonical(report))
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn(*args)), rtol=1e-5, atol=1e-6)


def _vmapped_softmax(s):
    """penzai's ``nmap(softmax)`` over S of ``[T, S, B, K, G]``: the max taken there, the
    exponent in ``[T, B, K, G, S]``, which the result keeps."""
    f = jax.nn.softmax
    for _ in range(3):
        f = jax.vmap(f, in_axes=1, out_axes=0)
    return jax.vmap(f, in_axes=0, out_axes=0)(s)


def penzai_gqa(q, k, v, mask):
    """penzai's llama: 5-D scores ``[B, T, K, G, S]`` moved to ``[T, S, B, K, G]`` for the
    mask, a ``vmap``-form softmax over S into ``[T, B, K, G, S]``, contracted with the
    unrepeated v without moving back."""
    q5 = q.reshape(B, S, 2, 2, D)
    s = jnp.transpose(jnp.einsum("BSKH,BTKGH->BTKGS", k, q5), (1, 4, 0, 2, 3))
    s = jnp.where(mask[0, 0][:, :, None, None, None], s, -1e9)
    o = jnp.einsum("BSKH,TBKGS->BTKGH", v, _vmapped_softmax(s))
    return o.reshape(B, S, 4, D)


@pytest.mark.slow
def test_5d_scores_moved_between_frames_become_one_attention():
    """The split moves down the rank-5 transposes that keep K and G adjacent (composed with
    the split scores' own), the mask, and the ``vmap``-form softmax whose max is taken in the
    other frame (``canonical_split_softmax_moved``): one grouped flash attention."""
    args = gqa_args(2, 2, seed=11)
    fast = check(penzai_gqa, args, {"attention_mask": 1}, grad=True)
    _, _, report = rewrite(penzai_gqa, args)
    got = canonical(report)
    assert got["canonical_split_scores"] >= 1 and got["canonical_split_softmax_moved"] == 1
    assert got["canonical_split_transposes"] >= 1
    assert len(kernel_nodes(fast, args)) == 1


def test_5d_softmax_max_taken_over_another_axis_is_left_alone():
    """A max over another axis than the sum's is no softmax: nothing is rewritten."""

    def attn(q, k, v, mask):
        q5 = q.reshape(B, S, 2, 2, D)
        s = jnp.transpose(jnp.einsum("BSKH,BTKGH->BTKGS", k, q5), (1, 4, 0, 2, 3))
        m = jnp.transpose(jnp.max(s, axis=0), (1, 2, 3, 0))[None]  # over T, not S
        e = jnp.exp(jnp.transpose(s, (0, 2, 3, 4, 1)) - jax.lax.stop_gradient(m))
        p = e / e.sum(-1, keepdims=True)
        return jnp.einsum("BSKH,TBKGS->BTKGH", v, p).reshape(B, S, 4, D)

    args = gqa_args(2, 2, seed=12)
    _, got, report = rewrite(attn, args)
    assert not report
    assert "canonical_split_softmax_moved" not in canonical(report)
    np.testing.assert_allclose(np.asarray(got), np.asarray(attn(*args)), rtol=1e-5, atol=1e-6)
