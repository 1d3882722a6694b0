"""Attention → ``pallas_kernels.flash_attention``, written in the pattern language.

An attention is ``o = softmax(logits) · v`` with ``logits = f(q · k)``. Real programs spell
every piece several ways; each piece is one pattern whose alternates are those spellings,
and the rules at the bottom put the pieces together:

* ``Scores``   ``dot_general`` of q and k in any dimension numbers, either operand order;
  kv heads may be repeated for grouped-query attention (``Kv``).
* ``Scaled``   ``div``/``mul`` of the scores by a scalar (a literal goes to the kernel, a value
  computed at run time scales q). A scale on q or k needs no pattern: the scaled q (or k)
  simply *is* the kernel's q (k), bit for bit.
* ``Biased``   an additive bias (padding, causal or ALiBi biases): ``add`` either order, or
  ``sub`` (DistilBERT's ``scores - 1e30 * (1 - mask)``).
* ``Masked``   ``select_n``/``jnp.where`` of the scores and a large negative constant.
* ``Softmax``  ``exp(x - max) / sum`` with or without ``max(-inf, .)``, ``stop_gradient`` and
  the max subtraction (``jax.nn.softmax``, its ``custom_jvp`` form, Flax, Hugging Face), and
  the ``vmap``-ped form of ``jax.nn.dot_product_attention``.
* ``Weighted`` the probabilities (maybe cast, maybe times an all-ones head mask) contracted
  with v, either operand order.

Layouts are not patterns: the guard function :func:`~pypm_jax.rules._plans.attention_plan`
reads the ``dimension_numbers`` and shapes and works out which axis is batch, heads,
sequence and head-dim for every operand -- or rejects the match. The rule's replacement is
one :data:`FlashAttention` node carrying that plan.

Rules demand single use of interior values: when the softmax probabilities are also returned
(``output_attentions``), the attention is left alone instead of being computed twice.
"""

from __future__ import annotations

from ..lang import frontend as pm
from ..vocab import prims as P
from . import _plans
from ._kernels import FlashAttention
from ._plans import (
    attention_output,
    attention_plan,
    attention_supported,
    bias_sign,
    dpa_plan,
    head_mask_identity,
    inserts_unit_axes,
    interleaved_repeat,
    scale_kind,
    softmax_axes,
    unit_broadcast,
    vmapped_softmax_axes,
)

__all__ = [
    "ATTENTION_RULES",
    "Moved",
    "Splat",
    "Expand",
    "Cast",
    "StopGrad",
    "MaxOf",
    "Softmax",
    "Kv",
    "Probs",
    "OutputDot",
    "Weighted",
    "Scaled",
    "Biased",
    "Masked",
    "GroupedMask",
    "DpaMask",
    "DpaGrouped",
    "DpaOut",
    "DpaLogits",
]

LAYOUT = pm.opclass("layout")
NEG_INF = float("-inf")
# A select_n fill value at or below this masks a score out (the kernel uses finfo(f32).min;
# for every row with one unmasked key both give the same softmax, and fully masked rows get
# uniform weights either way).
MASK_FILL_MAX = -1e9

# ----------------------------------------------------------------- small spellings


@pm.pattern
def Moved(x):
    """x moved by one layout operator, cast or copied. Its own pattern, so that the operator
    is checked before a caller explores x (a guard comes after every constraint), and one
    call of ``Splat`` below it, so that generated code runs ``Splat``."""
    f = pm.Op(1, 1)
    assert f.op_class == LAYOUT
    return f(x)


@pm.pattern
def Moved(x):  # noqa: F811 (alternates share a name)
    return P.convert_element_type(x)


@pm.pattern
def Moved(x):  # noqa: F811
    return P.copy(x)


@pm.pattern
def Splat(c):
    """A value every element of which is the literal c: c moved by layout ops, cast, copied."""
    return Moved(Splat(c))


@pm.pattern
def Splat(c):  # noqa: F811
    return c


@pm.pattern
def Expand(r):
    """``keepdims=True``: r with size-1 axes inserted (a broadcast or a reshape)."""
    y = P.broadcast_in_dim(r)
    assert inserts_unit_axes(y.broadcast_dimensions, y.shape, r.shape)
    return y


@pm.pattern
def Expand(r):  # noqa: F811
    y = P.reshape(r)
    assert inserts_unit_axes(None, y.shape, r.shape)
    return y


@pm.pattern
def Cast(x):
    """x, maybe converted to another element type (bf16 softmaxes sum in f32)."""
    return P.convert_element_type(x)


@pm.pattern
def Cast(x):  # noqa: F811
    return x


@pm.pattern
def StopGrad(x):
    return P.stop_gradient(x)


@pm.pattern
def StopGrad(x):  # noqa: F811
    return x


@pm.pattern
def MaxOf(m):
    """The row max m, which ``jax.nn.softmax`` clamps with ``max(-inf, .)`` (or not)."""
    c = pm.var()
    assert c.value == NEG_INF
    return P.max(Splat(c), m)


@pm.pattern
def MaxOf(m):  # noqa: F811
    c = pm.var()
    assert c.value == NEG_INF
    return P.max(m, Splat(c))


@pm.pattern
def MaxOf(m):  # noqa: F811
    return m


# --------------------------------------------------------------------------- softmax


@pm.pattern
def Softmax(x, z):
    """softmax(x) over the axis z (the normaliser ``reduce_sum``) sums: ``exp(x - max) / sum``."""
    e, m, kept_sum, kept_max = pm.var(), pm.var(), pm.var(), pm.var()
    kept_sum <= Cast(Expand(z))
    z <= P.reduce_sum(Cast(e))
    e <= P.exp(P.sub(x, StopGrad(kept_max)))
    kept_max <= Expand(MaxOf(m))
    m <= P.reduce_max(x)
    assert softmax_axes(x.shape, z.axes, m.axes, kept_sum.shape, kept_max.shape)
    return P.div(e, kept_sum)


@pm.pattern
def Softmax(x, z):  # noqa: F811
    """The unstabilised ``exp(x) / sum(exp(x))``."""
    e, kept_sum = pm.var(), pm.var()
    kept_sum <= Cast(Expand(z))
    z <= P.reduce_sum(Cast(e))
    e <= P.exp(x)
    assert softmax_axes(x.shape, z.axes, z.axes, kept_sum.shape, kept_sum.shape)
    return P.div(e, kept_sum)


@pm.pattern
def Softmax(x, z):  # noqa: F811
    """``vmap`` of ``jax.nn.softmax``: x is a transpose of u, whose max was taken before the
    batch axis moved (``jax.nn.dot_product_attention`` over query groups)."""
    e, m, u, kept_sum, kept_max, moved_max = (
        pm.var(),
        pm.var(),
        pm.var(),
        pm.var(),
        pm.var(),
        pm.var(),
    )
    kept_sum <= Cast(Expand(z))
    z <= P.reduce_sum(Cast(e))
    e <= P.exp(P.sub(x, StopGrad(kept_max)))
    kept_max <= Expand(moved_max)
    moved_max <= P.transpose(MaxOf(m))
    m <= P.reduce_max(u)
    x <= P.transpose(u)
    assert vmapped_softmax_axes(
        x.shape, x.permutation, z.axes, m.axes, moved_max.permutation, kept_sum.shape,
        kept_max.shape,
    )  # fmt: skip
    return P.div(e, kept_sum)


# -------------------------------------------------------------- operands and probabilities


@pm.pattern
def Kv(x):
    """Keys or values, maybe repeated per query group: ``jnp.repeat(x, g, axis=heads)``."""
    rep, bc = pm.var(), pm.var()
    rep <= P.reshape(bc)
    bc <= P.broadcast_in_dim(x)
    assert interleaved_repeat(bc.broadcast_dimensions, bc.shape, x.shape, rep.shape)
    return rep


@pm.pattern
def Kv(x):  # noqa: F811
    return x


@pm.pattern
def HeadMasked(p):
    """Hugging Face's ``einsum("...hqk,h->...hqk", p, head_mask)`` with the default all-ones
    head mask (``jnp.ones`` cast and sliced per layer)."""
    t, d, hm, c = pm.var(), pm.var(), pm.var(), pm.var()
    t <= P.transpose(d)
    d <= P.dot_general(hm, p)
    hm <= Splat(c)
    assert c.value == 1 and head_mask_identity(d.dimension_numbers, t.permutation, p.rank)
    return t


@pm.pattern
def Probs(p):
    """The probabilities as the output contraction reads them."""
    return p


@pm.pattern
def Probs(p):  # noqa: F811
    return P.convert_element_type(Probs(p))


@pm.pattern
def Probs(p):  # noqa: F811
    return HeadMasked(p)


@pm.pattern
def OutputDot(p, w):
    """``dot_general(p, w)`` that :func:`~pypm_jax.rules._plans.attention_plan` can read as
    an attention's output (``rules.attention_output``). Its guard is checked once the
    ``dot_general`` matched, before the constraints on ``p`` and ``w`` that follow it
    explore the softmax: a ``dot_general`` no plan takes fails in a few steps."""
    o = pm.var()
    o <= P.dot_general(p, w)
    assert attention_output(o.dimension_numbers, o.rank)
    return o


@pm.pattern
def Weighted(v, x, z):
    """softmax(x) · v: the output ``dot_general``, probabilities first or v first."""
    p, w = pm.var(), pm.var()
    p <= Probs(Softmax(x, z))
    w <= Kv(v)
    return OutputDot(p, w)


@pm.pattern
def Weighted(v, x, z):  # noqa: F811
    w, p = pm.var(), pm.var()
    w <= Kv(v)
    p <= Probs(Softmax(x, z))
    return OutputDot(w, p)


# ---------------------------------------------------------------------- logit spellings


@pm.pattern
def Scores(a, b):
    """The scores ``dot_general``; which operand is the query the plan tells."""
    return P.dot_general(Kv(a), Kv(b))


@pm.pattern
def Scaled(s, c):
    """Scores scaled by a scalar constant (``scores / sqrt(d)``, ``scores * d ** -0.5``)."""
    assert c.rank == 0
    return P.div(s, c)


@pm.pattern
def Scaled(s, c):  # noqa: F811
    assert c.rank == 0
    return P.mul(s, c)


@pm.pattern
def Scaled(s, c):  # noqa: F811
    assert c.rank == 0
    return P.mul(c, s)


@pm.pattern
def Biased(s, bias):
    """Scores plus an additive bias (or minus one: the plan negates it)."""
    return P.add(s, bias)


@pm.pattern
def Biased(s, bias):  # noqa: F811
    return P.add(bias, s)


@pm.pattern
def Biased(s, bias):  # noqa: F811
    return P.sub(s, bias)


@pm.pattern
def MaskOf(m):
    """A boolean mask maybe broadcast along its size-1 axes (the kernel broadcasts itself)."""
    y = P.broadcast_in_dim(m)
    assert unit_broadcast(y.broadcast_dimensions, y.shape, m.shape)
    return y


@pm.pattern
def MaskOf(m):  # noqa: F811
    return m


@pm.pattern
def Masked(s, mask):
    """``jnp.where(mask, s, big_negative)``; mask is nonzero where a key is attended."""
    c = pm.var()
    assert c.value <= MASK_FILL_MAX
    return P.select_n(MaskOf(mask), Splat(c), s)


@pm.pattern
def Masked(s, mask):  # noqa: F811
    """``jnp.where(mask == 0, big_negative, s)``."""
    c = pm.var()
    assert c.value <= MASK_FILL_MAX
    return P.select_n(MaskOf(P.eq(mask, 0)), s, Splat(c))


# ---------------------------------------------------------- jax.nn.dot_product_attention


@pm.pattern
def GroupedMask(m):
    """``jax.nn.dot_product_attention`` regroups a ``[B, 1, T, S]`` mask to ``[B, 1, G, T, S]``
    (a new axis, broadcast to G when G > 1), or a ``[B, N, T, S]`` one to ``[B, K, G, T, S]``."""
    y = P.broadcast_in_dim(m)
    assert y.broadcast_dimensions == (0, 1, 3, 4)
    return y


@pm.pattern
def GroupedMask(m):  # noqa: F811
    y, e = pm.var(), pm.var()
    y <= P.broadcast_in_dim(e)
    e <= P.broadcast_in_dim(m)
    assert e.broadcast_dimensions == (0, 1, 3, 4)
    assert unit_broadcast(y.broadcast_dimensions, y.shape, e.shape)
    return y


@pm.pattern
def GroupedMask(m):  # noqa: F811
    assert m.rank == 4
    return P.reshape(m)


@pm.pattern
def DpaMask(m):
    """The mask as applied under ``vmap`` over query groups:
    ``and(ones, transpose(GroupedMask(mask)))``."""
    c, t = pm.var(), pm.var()
    t <= DpaGrouped(GroupedMask(m))
    assert c.value == True  # noqa: E712 (guard data)
    return P.and_(Splat(c), t)


@pm.pattern
def DpaMask(m):  # noqa: F811
    """``is_causal=True`` without a mask: ``and(ones_like(logits), tril[None, None])``, made
    outside the ``vmap`` over query groups and broadcast over them. The ``[1, 1, T, S]``
    triangle is the kernel's mask."""
    c, a, y = pm.var(), pm.var(), pm.var()
    y <= P.broadcast_in_dim(a)
    a <= P.and_(Splat(c), m)
    assert c.value == True and m.rank == 4 and y.broadcast_dimensions == (1, 2, 3, 4)  # noqa: E712
    return y


@pm.pattern
def DpaGrouped(t):
    """A grouped ``[B, K, G, T, S]`` mask or bias moved as ``vmap`` over G moves it."""
    y = P.transpose(t)
    assert y.permutation == (2, 0, 1, 3, 4)
    return y


# ============================================================ the attention patterns
#
# Every pattern binds: o (the output dot_general: the value replaced), a and b (operands of
# the scores dot_general, program order), v, s (the scores), z (the softmax's sum, for its
# axis), and what its spelling adds: bias, mask, or the scale c and the scaled scores sc.
# Patterns say what is connected to what; whether the dimension numbers compute an
# attention, and whether the kernel takes it, is the rule's guard (the driver then tries the
# pattern's next solution, so a wrong reading of the operands just moves on).


@pm.pattern
def Attention(o, a, b, v, s, z):
    o <= Weighted(v, s, z)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionBias(o, a, b, v, s, z, xb, bias):
    o <= Weighted(v, xb, z)
    xb <= Biased(s, bias)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionMask(o, a, b, v, s, z, mask):
    xm = pm.var()
    o <= Weighted(v, xm, z)
    xm <= Masked(s, mask)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionBiasMask(o, a, b, v, s, z, xb, bias, mask):
    xm = pm.var()
    o <= Weighted(v, xm, z)
    xm <= Masked(xb, mask)
    xb <= Biased(s, bias)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaled(o, a, b, v, s, z, sc, c):
    o <= Weighted(v, sc, z)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaledBias(o, a, b, v, s, z, sc, c, xb, bias):
    o <= Weighted(v, xb, z)
    xb <= Biased(sc, bias)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaledMask(o, a, b, v, s, z, sc, c, mask):
    xm = pm.var()
    o <= Weighted(v, xm, z)
    xm <= Masked(sc, mask)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


@pm.pattern
def AttentionScaledBiasMask(o, a, b, v, s, z, sc, c, xb, bias, mask):
    xm = pm.var()
    o <= Weighted(v, xm, z)
    xm <= Masked(xb, mask)
    xb <= Biased(sc, bias)
    sc <= Scaled(s, c)
    s <= Scores(a, b)
    return o


@pm.pattern
def DpaOut(t1, t2, o, v, x, z):
    """``jax.nn.dot_product_attention``'s output: ``softmax(x) · v``, ``encoded`` in
    ``[B, K, H, G, T]``, moved back (two transposes, a reshape) to ``[B, T, N, H]``."""
    r = pm.var()
    r <= P.reshape(t2)
    t2 <= P.transpose(t1)
    t1 <= P.transpose(o)
    o <= P.dot_general(v, Probs(Softmax(x, z)))
    return r


@pm.pattern
def DpaLogits(q, k, s, c):
    """Its logits: q regrouped to ``[B, T, K, G, H]``, contracted with k, times the constant
    scale, transposed as the ``vmap`` over G moves them."""
    q5 = pm.var()
    s <= P.dot_general(q5, k)
    q5 <= P.reshape(q)
    assert c.rank == 0
    return P.transpose(P.mul(s, c))


@pm.pattern
def AttentionDpa(r, q, k, v, s, xt, z, o, t1, t2, c):
    """``jax.nn.dot_product_attention`` (XLA implementation), as ``nnx.MultiHeadAttention``
    calls it: q regrouped to ``[B, T, K, G, H]``, logits scaled by a constant, softmax
    ``vmap``-ped over G, the result moved back to ``[B, T, N, H]``."""
    r <= DpaOut(t1, t2, o, v, xt, z)
    xt <= DpaLogits(q, k, s, c)
    return r


@pm.pattern
def AttentionDpaMask(r, q, k, v, s, xt, z, o, t1, t2, c, mask):
    xm, fill = pm.var(), pm.var()
    r <= DpaOut(t1, t2, o, v, xm, z)
    xm <= P.select_n(DpaMask(mask), Splat(fill), xt)
    xt <= DpaLogits(q, k, s, c)
    assert fill.value <= MASK_FILL_MAX
    return r


@pm.pattern
def AttentionDpaBias(r, q, k, v, s, xt, z, o, t1, t2, c, bias):
    """``jax.nn.dot_product_attention(..., bias=bias)``: ``logits + bias`` before softmax."""
    xb = pm.var()
    r <= DpaOut(t1, t2, o, v, xb, z)
    xb <= P.add(xt, DpaGrouped(Cast(GroupedMask(bias))))
    xt <= DpaLogits(q, k, s, c)
    return r


@pm.pattern
def AttentionDpaBiasMask(r, q, k, v, s, xt, z, o, t1, t2, c, bias, mask):
    """``jax.nn.dot_product_attention(..., bias=bias, mask=mask)`` (or ``is_causal``)."""
    xb, xm, fill = pm.var(), pm.var(), pm.var()
    r <= DpaOut(t1, t2, o, v, xm, z)
    xm <= P.select_n(DpaMask(mask), Splat(fill), xb)
    xb <= P.add(xt, DpaGrouped(Cast(GroupedMask(bias))))
    xt <= DpaLogits(q, k, s, c)
    assert fill.value <= MASK_FILL_MAX
    return r


# ======================================================================= the rules
#
# Each rule plans the kernel call from the matched attributes (None when the dimension
# numbers are not an attention), checks that the kernel takes it, and replaces the output by
# one FlashAttention node. Absent bias/mask inputs are the literal 0 and an absent scale the
# literal 1 (the plan says to ignore them).


@pm.rule(Attention, single_use=True)
def attention(o, a, b, v, s, z):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, 0, 0, 1, plan=plan)


@pm.rule(AttentionBias, single_use=True)
def attention_bias(o, a, b, v, s, z, xb, bias):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), None, 1.0, bias_sign(xb.op))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, 0, 1, plan=plan)


@pm.rule(AttentionMask, single_use=True)
def attention_mask(o, a, b, v, s, z, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          None, (mask.shape, mask.dtype))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, 0, mask, 1, plan=plan)


@pm.rule(AttentionBiasMask, single_use=True)
def attention_bias_mask(o, a, b, v, s, z, xb, bias, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), (mask.shape, mask.dtype), 1.0,
                          bias_sign(xb.op))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, mask, 1, plan=plan)


@pm.rule(AttentionScaled, single_use=True)
def attention_scaled(o, a, b, v, s, z, sc, c):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          None, None, scale_kind(sc.op))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, 0, 0, c, plan=plan)


@pm.rule(AttentionScaledBias, single_use=True)
def attention_scaled_bias(o, a, b, v, s, z, sc, c, xb, bias):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), None, scale_kind(sc.op),
                          bias_sign(xb.op))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, 0, c, plan=plan)


@pm.rule(AttentionScaledMask, single_use=True)
def attention_scaled_mask(o, a, b, v, s, z, sc, c, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          None, (mask.shape, mask.dtype), scale_kind(sc.op))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, 0, mask, c, plan=plan)


@pm.rule(AttentionScaledBiasMask, single_use=True)
def attention_scaled_bias_mask(o, a, b, v, s, z, sc, c, xb, bias, mask):
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype),
                          (bias.shape, bias.dtype), (mask.shape, mask.dtype),
                          scale_kind(sc.op), bias_sign(xb.op))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, mask, c, plan=plan)


@pm.rule(AttentionDpa, single_use=True)
def attention_dpa(r, q, k, v, s, xt, z, o, t1, t2, c):
    plan = dpa_plan((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype),
                    (s.dimension_numbers, s.shape, xt.permutation, z.axes),
                    (o.dimension_numbers, (t1.permutation, t2.permutation), r.shape, r.dtype),
                    None)  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(q, k, v, 0, 0, c, plan=plan)


@pm.rule(AttentionDpaMask, single_use=True)
def attention_dpa_mask(r, q, k, v, s, xt, z, o, t1, t2, c, mask):
    plan = dpa_plan((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype),
                    (s.dimension_numbers, s.shape, xt.permutation, z.axes),
                    (o.dimension_numbers, (t1.permutation, t2.permutation), r.shape, r.dtype),
                    (mask.shape, mask.dtype))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(q, k, v, 0, mask, c, plan=plan)


@pm.rule(AttentionDpaBias, single_use=True)
def attention_dpa_bias(r, q, k, v, s, xt, z, o, t1, t2, c, bias):
    plan = dpa_plan((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype),
                    (s.dimension_numbers, s.shape, xt.permutation, z.axes),
                    (o.dimension_numbers, (t1.permutation, t2.permutation), r.shape, r.dtype),
                    None, (bias.shape, bias.dtype))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(q, k, v, bias, 0, c, plan=plan)


@pm.rule(AttentionDpaBiasMask, single_use=True)
def attention_dpa_bias_mask(r, q, k, v, s, xt, z, o, t1, t2, c, bias, mask):
    plan = dpa_plan((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype),
                    (s.dimension_numbers, s.shape, xt.permutation, z.axes),
                    (o.dimension_numbers, (t1.permutation, t2.permutation), r.shape, r.dtype),
                    (mask.shape, mask.dtype), (bias.shape, bias.dtype))  # fmt: skip
    assert attention_supported(plan)
    return FlashAttention(q, k, v, bias, mask, c, plan=plan)


# Most specific first: a spelling with a mask or bias must not be read as a plainer one.
ATTENTION_RULES = [
    attention_dpa_bias_mask,
    attention_dpa_mask,
    attention_dpa_bias,
    attention_dpa,
    attention_scaled_bias_mask,
    attention_bias_mask,
    attention_scaled_bias,
    attention_scaled_mask,
    attention_bias,
    attention_mask,
    attention_scaled,
    attention,
]

_ = _plans  # guard functions are registered on import
