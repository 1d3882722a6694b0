"""Causal masks proven from the program let the flash-attention kernel skip the blocks above
the diagonal (its ``mask_is_causal`` promise).

Each test builds a mask (or a ``where(mask, 0, big_negative)`` bias) the way a library does,
checks which rules fired, that the kernel node's plan makes the promise exactly when the
mask is False above the diagonal, and that outputs and gradients match the original program
(kernels in the Pallas interpreter, which skips blocks as on a GPU; its 16-row blocks skip
some at the lengths used here).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax

from pallas_kernels._attention import _FULLY_MASKED_THRESHOLD
from pypm_jax.rules._plans import AttentionPlan, causal_plan, has_rows
from pypm_jax.rules.causal import CAUSAL_FILL_MAX
from pypm_testing.rules import check, kernel_nodes

B, S, H, D = 2, 40, 2, 32
SKV = 56
MASKED = {"attention_mask": 1, "attention_causal_mask": 1}


def qkv(skv=S, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (B, S, H, D), dtype)
    k = jax.random.normal(kk, (B, skv, H, D), dtype)
    v = jax.random.normal(kv, (B, skv, H, D), dtype)
    return q, k, v


def causal_of(fast, args):
    (node,) = kernel_nodes(fast, args)
    return node.attrs["plan"].mask_is_causal


@pytest.mark.slow
def test_flax_make_causal_mask():
    def attn(q, k, v):
        mask = nn.make_causal_mask(jnp.ones(q.shape[:2]))
        return nn.dot_product_attention(q, k, v, mask=mask)

    fast = check(attn, qkv(), MASKED, grad=True)
    assert causal_of(fast, qkv())


@pytest.mark.slow
@pytest.mark.parametrize("left", [False, True])
def test_flax_causal_and_padding_masks(left):
    """``combine_masks(padding, causal)``; left padding leaves whole query rows masked (the
    kernel then averages over every key, as the original does)."""

    def attn(q, k, v, keep):
        causal = nn.make_causal_mask(jnp.ones(q.shape[:2]))
        mask = nn.combine_masks(nn.make_attention_mask(keep, keep), causal)
        return nn.dot_product_attention(q, k, v, mask=mask)

    keep = jnp.ones((B, S), bool)
    keep = keep.at[1, :20].set(False) if left else keep.at[1, -20:].set(False)
    args = (*qkv(), keep)
    fast = check(attn, args, MASKED, grad=True)
    assert causal_of(fast, args)


@pytest.mark.slow
def test_longer_keys_top_left():
    """``make_attention_mask(q_idx, k_idx, ge)`` with more keys than queries: top-left, as
    the kernel's flag."""

    def attn(q, k, v):
        mask = nn.make_attention_mask(
            jnp.arange(q.shape[1]), jnp.arange(k.shape[1]), jnp.greater_equal
        )
        return nn.dot_product_attention(q, k, v, mask=mask)

    args = qkv(skv=SKV)
    fast = check(attn, args, MASKED, grad=True)
    assert causal_of(fast, args)


@pytest.mark.slow
@pytest.mark.parametrize("k, causal", [(0, True), (-2, True), (1, False)])
def test_jnp_tril(k, causal):
    """``jnp.tril(ones, k)``: causal for k <= 0; k = 1 lets query i see key i + 1."""

    def attn(q, k_, v):
        mask = jnp.tril(jnp.ones((q.shape[1], k_.shape[1]), bool), k)
        return nn.dot_product_attention(q, k_, v, mask=mask[None, None])

    counts = MASKED if causal else {"attention_mask": 1}
    fast = check(attn, qkv(), counts, grad=True)
    assert causal_of(fast, qkv()) is causal


@pytest.mark.slow
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda s: jnp.triu(jnp.ones((s, s), bool))[None, None], id="triu"),
        pytest.param(
            lambda s: nn.make_causal_mask(jnp.ones((1, s))).swapaxes(-1, -2), id="transposed"
        ),
        # a KV-cache style window: rows 2..2+s of a bigger table are not top-left aligned
        pytest.param(
            lambda s: nn.make_causal_mask(jnp.ones((1, s + 2)))[:, :, 2:, 2:], id="offset"
        ),
        pytest.param(lambda s: nn.make_causal_mask(jnp.ones((1, s + 2)))[:, :, 2:, :s], id="rows"),
    ],
)
def test_masks_that_are_not_causal_stay_masks(make):
    def attn(q, k, v):
        return nn.dot_product_attention(q, k, v, mask=make(q.shape[1]))

    fast = check(attn, qkv(), {"attention_mask": 1}, grad=True)
    assert not causal_of(fast, qkv())


@pytest.mark.slow
def test_sliced_table_is_causal():
    """Hugging Face's decoders: a ``[1, 1, P, P]`` table sliced ``[:, :, :T, :S]``."""

    def attn(q, k, v):
        table = nn.make_causal_mask(jnp.ones((1, 64), bool), dtype=bool)
        mask = table[:, :, : q.shape[1], : k.shape[1]]
        return nn.dot_product_attention(q, k, v, mask=jnp.broadcast_to(mask, (B, 1, S, S)))

    fast = check(attn, qkv(), MASKED, grad=True)
    assert causal_of(fast, qkv())


def _hf_bias(mask, fill, dtype=jnp.float32):
    """``lax.select(mask > 0, 0, fill)``, as Hugging Face's Flax decoders build the bias."""
    zero = jnp.full(mask.shape, 0.0).astype(dtype)
    return lax.select(mask > 0, zero, jnp.full(mask.shape, fill).astype(dtype))


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype, cast", [(jnp.float32, False), (jnp.bfloat16, False), (jnp.bfloat16, True)]
)
def test_hugging_face_causal_bias(dtype, cast):
    """Built in the model's dtype (``finfo(dtype).min``), or in float32 and cast."""

    def attn(q, k, v, keep):
        causal = nn.make_causal_mask(jnp.ones((1, q.shape[1]), bool), dtype=bool)
        mask = nn.combine_masks(jnp.broadcast_to(keep[:, None, None, :], (B, 1, S, S)), causal)
        if cast:
            bias = _hf_bias(mask, jnp.finfo(jnp.float32).min).astype(dtype)
        else:
            bias = _hf_bias(mask, jnp.finfo(dtype).min, dtype)
        return nn.dot_product_attention(q, k, v, bias=bias)

    # left padding: batch 1's first 20 query rows see no key (their scores keep gradients);
    # float32's finfo.min is -inf in bfloat16, which makes those rows NaN in the original
    # (and in the kernel), so the cast spelling is checked with right padding
    keep = jnp.ones((B, S), bool)
    keep = keep.at[1, -20:].set(False) if cast else keep.at[1, :20].set(False)
    args = (*qkv(dtype=dtype), keep)
    counts = {"attention_bias": 1, "attention_causal_bias": 1}
    fast = check(attn, args, counts, grad=dtype == jnp.float32)
    (node,) = kernel_nodes(fast, args)
    plan = node.attrs["plan"]
    assert plan.mask_is_causal and not plan.mask and plan.bias == 1


@pytest.mark.slow
@pytest.mark.parametrize("fill", [-1e4, -1e9, -1e38])
def test_a_bias_above_the_kernels_threshold_makes_no_promise(fill):
    """A row whose keys such a fill masks would not look fully masked to the kernel, which
    would then not revisit the blocks it skipped: no promise."""

    def attn(q, k, v):
        mask = nn.make_causal_mask(jnp.ones((1, q.shape[1]), bool), dtype=bool)
        return nn.dot_product_attention(q, k, v, bias=_hf_bias(mask, fill))

    fast = check(attn, qkv(), {"attention_bias": 1}, grad=True)
    assert not causal_of(fast, qkv())


def test_causal_fill_max_is_the_kernels_threshold():
    assert CAUSAL_FILL_MAX == _FULLY_MASKED_THRESHOLD


def test_alibi_plus_causal_bias():
    """BLOOM: an ALiBi bias plus the causal bias; the ALiBi part stays the kernel's bias."""

    def attn(q, k, v):
        mask = nn.make_causal_mask(jnp.ones((1, q.shape[1]), bool), dtype=bool)
        slopes = jnp.array([0.5, 0.25])[None, :, None, None]
        alibi = slopes * jnp.arange(k.shape[1], dtype=jnp.float32)[None, None, None, :]
        return nn.dot_product_attention(q, k, v, bias=_hf_bias(mask, -3e38) + alibi)

    fast = check(attn, qkv(), {"attention_bias": 1, "attention_causal_bias": 1}, grad=True)
    assert causal_of(fast, qkv())


def test_mask_argument_is_not_assumed_causal():
    """A mask passed in is data: its values are unknown when the program is rewritten."""

    def attn(q, k, v, mask):
        return nn.dot_product_attention(q, k, v, mask=mask)

    args = (*qkv(), nn.make_causal_mask(jnp.ones((B, S))))
    fast = check(attn, args, {"attention_mask": 1})
    assert not causal_of(fast, args)


def test_a_one_row_mask_is_not_proven_causal():
    """A mask of one row (what encoders pass: padding, broadcast over the queries) is turned
    away by ``Rows`` before ``Tril()`` explores it, even one ``Tril()`` would prove (key 0
    alone): no promise."""
    assert has_rows((1, 1, S, SKV)) and has_rows((S, 2))
    assert not has_rows((1, 1, 1, SKV)) and not has_rows((SKV,)) and not has_rows(None)

    def attn(q, k, v):
        key0 = jnp.tril(jnp.ones((1, k.shape[1]), bool))[None, None]
        return nn.dot_product_attention(q, k, v, mask=key0)

    fast = check(attn, qkv(), {"attention_mask": 1})
    assert not causal_of(fast, qkv())

    def biased(q, k, v):
        pad = jnp.arange(k.shape[1])[None, None, None, :] < 30
        return nn.dot_product_attention(q, k, v, bias=_hf_bias(pad, -3e38))

    fast = check(biased, qkv(), {"attention_bias": 1})
    assert not causal_of(fast, qkv())


def _plan(perm_scores=(0, 1, 2, 3), **kw):
    shapes = ((B, S, H, D), (B, SKV, H, D), (B, SKV, H, D), None, (1, 1, S, SKV))
    fields = dict(
        layout="BSHD", q_operand=0, perm_q=(0, 1, 2, 3), perm_k=(0, 1, 2, 3),
        perm_v=(0, 1, 2, 3), perm_scores=perm_scores, perm_out=(0, 1, 2, 3), scale_input=0,
        bias=0, mask=True, kernel_shapes=shapes, dtype="float32", out_shape=(B, S, H, D),
        out_dtype="float32",
    )  # fmt: skip
    return AttentionPlan(**{**fields, **kw})


def test_causal_plan_checks_axes_lengths_and_dtypes():
    mask = ((1, 1, S, SKV), "bool")
    assert causal_plan(_plan(), mask, "mask").mask_is_causal
    assert causal_plan(_plan(mask_is_causal=True), mask, "mask") is None  # once
    assert causal_plan(_plan(mask=False), mask, "mask") is None
    # scores in [B, H, Skv, Sq]: the mask's last two axes are (key, query)
    assert causal_plan(_plan((0, 1, 3, 2)), ((1, 1, SKV, S), "bool"), "mask") is None
    # a key axis of size 1, broadcast by the kernel, is no triangle; a query axis may be
    assert causal_plan(_plan(), ((1, 1, S, 1), "bool"), "mask") is None
    assert causal_plan(_plan(), ((1, 1, 1, SKV), "bool"), "mask").mask_is_causal
    assert causal_plan(_plan(), ((1, 1, S, SKV), "float32"), "mask") is None
    # a bias: added, float32 or bfloat16
    biased = _plan(bias=1, mask=False)
    assert causal_plan(biased, mask, "bias", "float32").mask_is_causal
    assert causal_plan(biased, mask, "bias", "bfloat16").mask_is_causal
    assert causal_plan(biased, mask, "bias", "float16") is None
    assert causal_plan(biased._replace(bias=-1), mask, "bias", "float32") is None
    assert causal_plan(_plan(), mask, "bias", "float32") is None  # no bias
    assert causal_plan(_plan(), mask, "other") is None


@pytest.mark.slow
def test_dot_product_attention_mask_and_causal_two_layers():
    """``jax.nn.dot_product_attention(mask=..., is_causal=True)`` twice (the triangle is one
    shared value): both get the kernel's causal flag; lengths that span several blocks."""

    def attn(q, k, v, keep):
        mask = keep[:, None, None, :]
        h = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
        return jax.nn.dot_product_attention(
            h, k, v, mask=mask, is_causal=True, implementation="xla"
        )

    args = (*qkv(), jnp.ones((B, S), bool).at[1, :20].set(False))
    fast = check(attn, args, {"attention_dpa_mask_causal": 2}, grad=True)
    assert all(n.attrs["plan"].causal for n in kernel_nodes(fast, args))


@pytest.mark.slow
def test_exact_triangle_only_for_the_causal_flag():
    """``tril(ones, -1)`` hides the diagonal too: not the kernel's triangle, so no flag (it
    is still causal: the kernel may skip blocks)."""

    def attn(q, k, v):
        mask = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool), -1)
        return nn.dot_product_attention(q, k, v, mask=mask[None, None])

    fast = check(attn, qkv(), MASKED, grad=True)
    (node,) = kernel_nodes(fast, qkv())
    assert node.attrs["plan"].mask_is_causal and not node.attrs["plan"].causal


@pytest.mark.slow
@pytest.mark.parametrize(
    "compare",
    [
        lambda i, j: i >= j,
        lambda i, j: j <= i,
        lambda i, j: i > j,  # strictly below: query 0 sees no key (uniform weights, as XLA)
        lambda i, j: j < i,
    ],
    ids=["ge", "le", "gt", "lt"],
)
def test_every_comparison_spelling(compare):
    def attn(q, k, v):
        i = jnp.arange(q.shape[1])[:, None]
        j = jnp.arange(k.shape[1])[None, :]
        return nn.dot_product_attention(q, k, v, mask=compare(i, j)[None, None])

    fast = check(attn, qkv(), MASKED, grad=True)
    assert causal_of(fast, qkv())
