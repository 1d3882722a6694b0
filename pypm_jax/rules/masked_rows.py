"""Attention whose probabilities are re-zeroed by its own mask → ``masked_rows="zero"``.

Keras's ``Softmax(mask=...)`` masks the scores (``where(mask, s, -1e9)``) and then zeroes
the probabilities of the masked keys again (``where(mask, p, 0)``, or, in older Keras,
``p * cast(mask)``), so that a row whose every key is masked gives 0 instead of the uniform
average. For every other row the second step changes nothing (the masked keys' weights are
already 0), so the whole is the kernel's masked attention with its option
``masked_rows="zero"``: the rules here match the attention rules' masked spellings with the
re-zeroing between the softmax and the output contraction, where the re-zeroing mask is the
very value that masks the scores (the patterns bind one ``mask`` in both places).
"""

from __future__ import annotations

from ..lang import frontend as pm
from ..vocab import prims as P
from ._kernels import FlashAttention
from ._plans import attention_plan, attention_supported, bias_sign, scale_kind, zero_rows_plan
from .attention import Biased, Kv, Masked, MaskOf, Probs, Scaled, Scores, Softmax, Splat

__all__ = [
    "MASKED_ROWS_RULES",
    "ReZeroed",
    "attention_mask_zero",
    "attention_bias_mask_zero",
    "attention_scaled_mask_zero",
    "attention_scaled_bias_mask_zero",
]


@pm.pattern
def ReZeroed(p, mask):
    """``where(mask, p, 0)``: the probabilities of the masked keys set to 0."""
    c = pm.var()
    assert c.value == 0
    return P.select_n(MaskOf(mask), Splat(c), p)


@pm.pattern
def ReZeroed(p, mask):  # noqa: F811 (alternates share a name)
    """``p * cast(mask)``, either order (the cast mask maybe broadcast)."""
    return P.mul(p, MaskOf(P.convert_element_type(mask)))


@pm.pattern
def ReZeroed(p, mask):  # noqa: F811
    return P.mul(MaskOf(P.convert_element_type(mask)), p)


@pm.pattern
def ZeroedWeighted(v, x, z, mask):
    """softmax(x), re-zeroed by mask, contracted with v (either operand order)."""
    return P.dot_general(Probs(ReZeroed(Softmax(x, z), mask)), Kv(v))


@pm.pattern
def ZeroedWeighted(v, x, z, mask):  # noqa: F811
    return P.dot_general(Kv(v), Probs(ReZeroed(Softmax(x, z), mask)))


@pm.pattern
def AttentionMaskZero(o, a, b, v, s, z, mask):
    xm = pm.var()
    o <= ZeroedWeighted(v, xm, z, mask)
    xm <= Masked(s, mask)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionBiasMaskZero(o, a, b, v, s, z, xb, bias, mask):
    xm = pm.var()
    o <= ZeroedWeighted(v, xm, z, mask)
    xm <= Masked(xb, mask)
    xb <= Biased(s, bias)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaledMaskZero(o, a, b, v, s, z, sc, c, mask):
    xm = pm.var()
    o <= ZeroedWeighted(v, xm, z, mask)
    xm <= Masked(sc, mask)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaledBiasMaskZero(o, a, b, v, s, z, sc, c, xb, bias, mask):
    xm = pm.var()
    o <= ZeroedWeighted(v, xm, z, mask)
    xm <= Masked(xb, mask)
    xb <= Biased(sc, bias)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


@pm.rule(AttentionMaskZero, single_use=True)
def attention_mask_zero(o, a, b, v, s, z, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          None, (mask.shape, mask.dtype))  # fmt: skip
    plan = zero_rows_plan(plan)
    assert attention_supported(plan)
    return FlashAttention(a, b, v, 0, mask, 1, plan=plan)


@pm.rule(AttentionBiasMaskZero, single_use=True)
def attention_bias_mask_zero(o, a, b, v, s, z, xb, bias, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), (mask.shape, mask.dtype), 1.0,
                          bias_sign(xb.op))  # fmt: skip
    plan = zero_rows_plan(plan)
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, mask, 1, plan=plan)


@pm.rule(AttentionScaledMaskZero, single_use=True)
def attention_scaled_mask_zero(o, a, b, v, s, z, sc, c, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          None, (mask.shape, mask.dtype), scale_kind(sc.op))  # fmt: skip
    plan = zero_rows_plan(plan)
    assert attention_supported(plan)
    return FlashAttention(a, b, v, 0, mask, c, plan=plan)


@pm.rule(AttentionScaledBiasMaskZero, single_use=True)
def attention_scaled_bias_mask_zero(o, a, b, v, s, z, sc, c, xb, bias, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), (mask.shape, mask.dtype),
                          scale_kind(sc.op), bias_sign(xb.op))  # fmt: skip
    plan = zero_rows_plan(plan)
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, mask, c, plan=plan)


# Most specific first, as the attention rules.
MASKED_ROWS_RULES = [
    attention_scaled_bias_mask_zero,
    attention_bias_mask_zero,
    attention_scaled_mask_zero,
    attention_mask_zero,
]
