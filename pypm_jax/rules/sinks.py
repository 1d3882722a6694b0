"""Attention sinks → the kernel's ``sinks``, in the pattern language.

GPT-OSS gives every head one extra logit, a learned "sink" that takes part in the softmax
but reads no value: the scores are concatenated with a column holding ``sinks[h]``
(``[N]`` reshaped and broadcast to ``[B, N, T, 1]``) on the key axis, the softmax runs over
keys and sink, and the probabilities are sliced back to the keys before the product with v.
That is ``flash_attention(..., sinks=sinks)``: the rules here match the concatenation and
the slice around the softmax, and the guard :func:`~pypm_jax.rules._plans.sinks_plan`
checks that the column lies along the heads, is concatenated after the logits on the
softmax axis, and that the slice keeps exactly the logits' entries.
"""

from __future__ import annotations

from ..lang import frontend as pm
from ..vocab import prims as P
from ._kernels import FlashAttentionSinks
from ._plans import (
    attention_plan,
    attention_supported,
    bias_sign,
    scale_kind,
    sink_axis,
    sinks_plan,
)
from .attention import Biased, Kv, Probs, Scaled, Scores, Softmax

__all__ = [
    "SINKS_RULES",
    "SinkColumn",
    "attention_sinks",
    "attention_scaled_sinks",
    "attention_bias_sinks",
    "attention_scaled_bias_sinks",
]


@pm.pattern
def SinkColumn(col, src, sinks):
    """``[N]`` sinks broadcast to the logits' shape with one key: directly (``src`` is the
    sinks), or reshaped to ``[1, N, 1, 1]`` first (``src`` is ``sinks.reshape(1, -1, 1, 1)``)."""
    col <= P.broadcast_in_dim(src)
    src <= sinks
    assert sinks.rank == 1
    return col


@pm.pattern
def SinkColumn(col, src, sinks):  # noqa: F811 (alternates share a name)
    col <= P.broadcast_in_dim(src)
    src <= P.reshape(sinks)
    assert sinks.rank == 1
    return col


@pm.pattern
def SinkWeighted(v, x, z, sinks, cat, sl, col, src):
    """softmax over ``concatenate(x, column of sinks)``, sliced back to x's keys, times v
    (probabilities first or v first)."""
    p = pm.var()
    sl <= P.slice(p)
    p <= Softmax(cat, z)
    cat <= P.concatenate(x, col)
    col <= SinkColumn(col, src, sinks)
    return P.dot_general(Probs(sl), Kv(v))


@pm.pattern
def SinkWeighted(v, x, z, sinks, cat, sl, col, src):  # noqa: F811
    p = pm.var()
    sl <= P.slice(p)
    p <= Softmax(cat, z)
    cat <= P.concatenate(x, col)
    col <= SinkColumn(col, src, sinks)
    return P.dot_general(Kv(v), Probs(sl))


@pm.pattern
def AttentionSinks(o, a, b, v, s, z, sinks, cat, sl, col, src):
    o <= SinkWeighted(v, s, z, sinks, cat, sl, col, src)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaledSinks(o, a, b, v, s, z, sc, c, sinks, cat, sl, col, src):
    o <= SinkWeighted(v, sc, z, sinks, cat, sl, col, src)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionBiasSinks(o, a, b, v, s, z, xb, bias, sinks, cat, sl, col, src):
    o <= SinkWeighted(v, xb, z, sinks, cat, sl, col, src)
    xb <= Biased(s, bias)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaledBiasSinks(o, a, b, v, s, z, sc, c, xb, bias, sinks, cat, sl, col, src):
    o <= SinkWeighted(v, xb, z, sinks, cat, sl, col, src)
    xb <= Biased(sc, bias)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


# ======================================================================= the rules


@pm.rule(AttentionSinks, single_use=True)
def attention_sinks(o, a, b, v, s, z, sinks, cat, sl, col, src):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype))  # fmt: skip
    plan = sinks_plan(plan, sink_axis(col.broadcast_dimensions, src.shape, sinks.shape),
                      (cat.dimension, s.shape), (sl.start_indices, sl.limit_indices, sl.strides))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttentionSinks(a, b, v, 0, 0, 1, sinks, plan=plan)


@pm.rule(AttentionScaledSinks, single_use=True)
def attention_scaled_sinks(o, a, b, v, s, z, sc, c, sinks, cat, sl, col, src):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          None, None, scale_kind(sc.op))  # fmt: skip
    plan = sinks_plan(plan, sink_axis(col.broadcast_dimensions, src.shape, sinks.shape),
                      (cat.dimension, s.shape), (sl.start_indices, sl.limit_indices, sl.strides))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttentionSinks(a, b, v, 0, 0, c, sinks, plan=plan)


@pm.rule(AttentionBiasSinks, single_use=True)
def attention_bias_sinks(o, a, b, v, s, z, xb, bias, sinks, cat, sl, col, src):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), None, 1.0, bias_sign(xb.op))  # fmt: skip
    plan = sinks_plan(plan, sink_axis(col.broadcast_dimensions, src.shape, sinks.shape),
                      (cat.dimension, s.shape), (sl.start_indices, sl.limit_indices, sl.strides))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttentionSinks(a, b, v, bias, 0, 1, sinks, plan=plan)


@pm.rule(AttentionScaledBiasSinks, single_use=True)
def attention_scaled_bias_sinks(o, a, b, v, s, z, sc, c, xb, bias, sinks, cat, sl, col, src):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), None, scale_kind(sc.op),
                          bias_sign(xb.op))  # fmt: skip
    plan = sinks_plan(plan, sink_axis(col.broadcast_dimensions, src.shape, sinks.shape),
                      (cat.dimension, s.shape), (sl.start_indices, sl.limit_indices, sl.strides))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttentionSinks(a, b, v, bias, 0, c, sinks, plan=plan)


# Most specific first, as the attention rules.
SINKS_RULES = [
    attention_scaled_bias_sinks,
    attention_bias_sinks,
    attention_scaled_sinks,
    attention_sinks,
]
