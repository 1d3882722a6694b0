"""Causal masks → the flash-attention kernel's ``mask_is_causal`` promise, in the pattern language.

Decoder models hand the attention a mask (or a ``where(mask, 0, finfo.min)`` bias) that is
False above the diagonal: query i never attends key j > i. The attention rules pass it to the
kernel as data, which then computes every block above the diagonal only to mask it out.
These rules run on the kernel nodes the attention rules produce and, when they can *prove*
from the program that the mask (or bias) hides every key above the diagonal, make the
kernel's ``mask_is_causal`` promise: the kernel skips those blocks (about half the work at
long sequences) and computes exactly what it did before -- it still reads the mask and
bias, and it revisits the skipped blocks for rows left with no key (left padding), which
average over every key, with the bias's gradients, as in the original program.

The proof is structural: ``Tril()`` matches the ways real programs build a mask that is False
above the diagonal of its last two axes --

* ``ge(row_index, col_index)`` of iotas (Flax's ``make_causal_mask``, which Hugging Face's
  decoders keep as a ``[1, 1, P, P]`` table, and ``jnp.tril``'s ``_tri``), with offsets that
  only lower the band (GPT-Neo's local attention: ``tril(m, -window)``);
* moved by broadcasts, slices from the origin (``table[:, :, :T, :S]``) and leading-axis
  reshapes that keep (i, j) in place, cast, compared ``!= 0`` / ``> 0``;
* combined: ``and`` with anything (a padding mask), ``xor`` of two (GPT-Neo's local window),
  a ``select_n`` whose every case is causal or zero (``jnp.tril``, Mistral's sliding window).

``ExactTril()`` proves more: nonzero exactly on and below the diagonal (``jnp.tril(ones)``).
``jax.nn.dot_product_attention(mask=m, is_causal=True)`` ands such a triangle into its mask;
``attention_dpa_mask_causal`` (and ``..._bias_mask_causal``) give the kernel m and its own
``causal`` flag for the triangle (the kernel takes one mask).

Guards (``rules._plans``) check every step keeps the last two axes in place; ``causal_plan``
checks those are the kernel's (query, key) axes at the full key length (the kernel's diagonal
is top-left aligned). A mask the rules cannot prove causal runs as before, every block.
"""

from __future__ import annotations

from ..core.dtypes import DTYPES
from ..lang import frontend as pm
from ..vocab import prims as P
from ._kernels import FlashAttention
from ._plans import (
    attention_supported,
    causal_flag_plan,
    causal_plan,
    dpa_plan,
    has_rows,
    keeps_axes,
    moves_last_to_row,
    reshape_keeps_last_two,
    slice_keeps_origin,
    tril_compare,
)
from .attention import (
    MASK_FILL_MAX,
    Cast,
    DpaGrouped,
    DpaLogits,
    DpaMask,
    DpaOut,
    GroupedMask,
    Splat,
)

__all__ = [
    "CAUSAL_RULES",
    "KeyIndex",
    "QueryIndex",
    "QueryAtMost",
    "KeyAtLeast",
    "Tril",
    "AtMostZero",
    "Causal",
    "CausalBias",
    "attention_causal_mask",
    "attention_causal_bias",
    "attention_dpa_mask_causal",
    "attention_dpa_bias_mask_causal",
    "ExactTril",
    "CAUSAL_FILL_MAX",
]

# The kernel treats a row whose running max is at most this as fully masked (and then
# visits the blocks it skipped): pallas_kernels' MASK_VALUE / 2 = finfo(float32).min / 2.
CAUSAL_FILL_MAX = -1.7014117331926443e38
BOOL = DTYPES["bool"]

COMPARE = pm.opclass("binary_pointwise")  # (JAX's comparisons are binary pointwise ops)

# ------------------------------------------------------------------ index arrays
#
# KeyIndex:   y[..., j] == j along the last axis.
# QueryIndex: y[..., i, :] == i along the second-last axis.


@pm.pattern
def KeyIndex():
    y = P.iota()
    assert y.dimension == y.rank - 1
    return y


@pm.pattern
def KeyIndex():  # noqa: F811 (alternates share a name)
    y, x = pm.var(), pm.var()
    y <= P.broadcast_in_dim(x)
    x <= KeyIndex()
    assert keeps_axes(y.broadcast_dimensions, x.shape, y.shape, 1)
    return y


@pm.pattern
def QueryIndex():
    y = P.iota()
    assert y.rank >= 2 and y.dimension == y.rank - 2
    return y


@pm.pattern
def QueryIndex():  # noqa: F811
    """Flax's ``expand_dims(idx, -1)``: a key index moved to the row axis."""
    y, x = pm.var(), pm.var()
    y <= P.broadcast_in_dim(x)
    x <= KeyIndex()
    assert moves_last_to_row(y.broadcast_dimensions, x.shape, y.shape)
    return y


@pm.pattern
def QueryIndex():  # noqa: F811
    y, x = pm.var(), pm.var()
    y <= P.broadcast_in_dim(x)
    x <= QueryIndex()
    assert keeps_axes(y.broadcast_dimensions, x.shape, y.shape, 2)
    return y


# QueryAtMost: y[..., i, j] <= i.  KeyAtLeast: y[..., i, j] >= j.


@pm.pattern
def QueryAtMost():
    return QueryIndex()


@pm.pattern
def QueryAtMost():  # noqa: F811
    """``i + k`` with ``k <= 0`` (``jnp.tril(m, k)``)."""
    c = pm.var()
    assert c.value <= 0
    return P.add(QueryAtMost(), Splat(c))


@pm.pattern
def QueryAtMost():  # noqa: F811
    c = pm.var()
    assert c.value <= 0
    return P.add(Splat(c), QueryAtMost())


@pm.pattern
def QueryAtMost():  # noqa: F811
    c = pm.var()
    assert c.value >= 0
    return P.sub(QueryAtMost(), Splat(c))


@pm.pattern
def QueryAtMost():  # noqa: F811
    """A key index plus ``k <= 0``, then moved to the row axis (keras-hub's
    ``compute_causal_mask`` adds its cache index before ``expand_dims``)."""
    y, x, c = pm.var(), pm.var(), pm.var()
    y <= P.broadcast_in_dim(x)
    x <= P.add(KeyIndex(), Splat(c))
    assert c.value <= 0 and moves_last_to_row(y.broadcast_dimensions, x.shape, y.shape)
    return y


@pm.pattern
def KeyAtLeast():
    return KeyIndex()


@pm.pattern
def KeyAtLeast():  # noqa: F811
    c = pm.var()
    assert c.value >= 0
    return P.add(KeyAtLeast(), Splat(c))


@pm.pattern
def KeyAtLeast():  # noqa: F811
    c = pm.var()
    assert c.value >= 0
    return P.add(Splat(c), KeyAtLeast())


# ------------------------------------------------------------------ the causal mask
#
# Tril: y[..., i, j] is zero (False) wherever j > i.


@pm.pattern
def Tril():
    """``row >= col`` (or ``>``): j > i means row <= i < j <= col, so row < col: False."""
    f, y, r, c = pm.Op(2, 1), pm.var(), pm.var(), pm.var()
    y <= f(r, c)
    r <= QueryAtMost()
    c <= KeyAtLeast()
    assert f.op_class == COMPARE and f.name in ("ge", "gt")
    assert tril_compare(r.shape, c.shape, y.shape)
    return y


@pm.pattern
def Tril():  # noqa: F811
    """``col <= row`` (or ``<``)."""
    f, y, r, c = pm.Op(2, 1), pm.var(), pm.var(), pm.var()
    y <= f(c, r)
    r <= QueryAtMost()
    c <= KeyAtLeast()
    assert f.op_class == COMPARE and f.name in ("le", "lt")
    assert tril_compare(r.shape, c.shape, y.shape)
    return y


@pm.pattern
def Tril():  # noqa: F811
    """Keras's ``cumsum(ones, axis=-2) >= cumsum(ones, axis=-1)``: i + 1 >= j + 1."""
    y, r, c, one_r, one_c = pm.var(), pm.var(), pm.var(), pm.var(), pm.var()
    y <= P.ge(r, c)
    r <= P.cumsum(Splat(one_r))
    c <= P.cumsum(Splat(one_c))
    assert one_r.value == 1 and one_c.value == 1 and not r.reverse and not c.reverse
    assert r.axis == r.rank - 2 and c.axis == c.rank - 1
    assert tril_compare(r.shape, c.shape, y.shape)
    return y


@pm.pattern
def Tril():  # noqa: F811
    """A boolean ``minimum`` of masks (Keras merges masks with ``ops.minimum``): False
    wherever one of them is, either order."""
    y = P.min(Tril(), pm.var())
    assert y.dtype == BOOL
    return y


@pm.pattern
def Tril():  # noqa: F811
    y = P.min(pm.var(), Tril())
    assert y.dtype == BOOL
    return y


@pm.pattern
def Tril():  # noqa: F811
    y, x = pm.var(), pm.var()
    y <= P.broadcast_in_dim(x)
    x <= Tril()
    assert keeps_axes(y.broadcast_dimensions, x.shape, y.shape, 2)
    return y


@pm.pattern
def Tril():  # noqa: F811
    """``table[:, :, :T, :S]``: Hugging Face's decoders slice a ``[1, 1, P, P]`` table."""
    y = P.slice(Tril())
    assert slice_keeps_origin(y.start_indices, y.strides, 2)
    return y


@pm.pattern
def Tril():  # noqa: F811
    y, x = pm.var(), pm.var()
    y <= P.reshape(x)
    x <= Tril()
    assert reshape_keeps_last_two(y.dimensions, x.shape, y.shape)
    return y


@pm.pattern
def Tril():  # noqa: F811
    """A cast keeps zeros zero (and False False)."""
    return P.convert_element_type(Tril())


@pm.pattern
def Tril():  # noqa: F811
    return P.copy(Tril())


@pm.pattern
def Tril():  # noqa: F811
    """``mask != 0`` (``jnp.logical_and``'s reading of a numeric mask)."""
    c = pm.var()
    assert c.value == 0
    return P.ne(Tril(), Splat(c))


@pm.pattern
def Tril():  # noqa: F811
    """``mask > 0`` (Hugging Face's ``attention_mask > 0``)."""
    c = pm.var()
    assert c.value >= 0
    return P.gt(Tril(), Splat(c))


@pm.pattern
def Tril():  # noqa: F811
    """``and`` with anything: a causal mask combined with a padding mask."""
    return P.and_(Tril(), pm.var())


@pm.pattern
def Tril():  # noqa: F811
    return P.and_(pm.var(), Tril())


@pm.pattern
def Tril():  # noqa: F811
    """GPT-Neo's local window: ``causal ^ tril(causal, -window)``."""
    return P.xor(Tril(), Tril())


@pm.pattern
def Tril():  # noqa: F811
    """``jnp.tril(m)``: ``where(tri, m, 0)``."""
    c = pm.var()
    assert c.value == 0
    return P.select_n(Tril(), Splat(c), pm.var())


@pm.pattern
def Tril():  # noqa: F811
    """``where(p, causal, 0)``."""
    c = pm.var()
    assert c.value == 0
    return P.select_n(pm.var(), Splat(c), Tril())


@pm.pattern
def Tril():  # noqa: F811
    """Mistral's sliding window: ``where(tril(ones, -window), False, causal)``."""
    c = pm.var()
    assert c.value == 0
    return P.select_n(pm.var(), Tril(), Splat(c))


@pm.pattern
def Tril():  # noqa: F811
    return P.select_n(pm.var(), Tril(), Tril())


# ExactTril: y[..., i, j] is nonzero exactly where j <= i: the kernel's own causal flag may
# then stand for it. Only the spellings of jax.nn.dot_product_attention's is_causal triangle
# (jnp.tril(ones)[None, None]), the one place the rules use it.


# AtMostZero: y[..., i, j] <= 0 wherever j > i (a Tril(), or its minimum with anything);
# Causal: a mask proven False above the diagonal, Tril() or AtMostZero() > c >= 0.


@pm.pattern
def AtMostZero():
    return Tril()


@pm.pattern
def AtMostZero():  # noqa: F811
    """``minimum`` with any mask, either order (keras-hub merges int32 padding and causal
    masks with ``ops.minimum``; the padding mask is data, maybe negative: the result is
    still at most zero above the diagonal)."""
    return P.min(AtMostZero(), pm.var())


@pm.pattern
def AtMostZero():  # noqa: F811
    return P.min(pm.var(), AtMostZero())


@pm.pattern
def AtMostZero():  # noqa: F811
    y, x = pm.var(), pm.var()
    y <= P.broadcast_in_dim(x)
    x <= AtMostZero()
    assert keeps_axes(y.broadcast_dimensions, x.shape, y.shape, 2)
    return y


@pm.pattern
def Causal():
    return Tril()


@pm.pattern
def Causal():  # noqa: F811
    """``mask > c`` (c >= 0) of a mask at most zero above the diagonal: keras-hub's
    ``minimum`` of int32 padding and causal masks, then ``mask > 0.5`` in its Softmax."""
    c = pm.var()
    assert c.value >= 0
    return P.gt(AtMostZero(), Splat(c))


@pm.pattern
def ExactQuery():
    return QueryIndex()


@pm.pattern
def ExactQuery():  # noqa: F811
    """``i + 0`` (``jnp.tril``'s ``_tri`` adds its k)."""
    c = pm.var()
    assert c.value == 0
    return P.add(QueryIndex(), Splat(c))


@pm.pattern
def ExactTril():
    y, r, c = pm.var(), pm.var(), pm.var()
    y <= P.ge(r, c)
    r <= ExactQuery()
    c <= KeyIndex()
    assert tril_compare(r.shape, c.shape, y.shape)
    return y


@pm.pattern
def ExactTril():  # noqa: F811
    """``jnp.tril(ones)``: ``where(tri, 1, 0)``, so its values are 0 and 1 (or bool)."""
    zero, one = pm.var(), pm.var()
    assert zero.value == 0 and one.value == 1
    return P.select_n(ExactTril(), Splat(zero), Splat(one))


@pm.pattern
def ExactTril():  # noqa: F811
    """``tril[None, None]``, as a broadcast or a reshape."""
    y, x = pm.var(), pm.var()
    y <= P.broadcast_in_dim(x)
    x <= ExactTril()
    assert keeps_axes(y.broadcast_dimensions, x.shape, y.shape, 2)
    return y


@pm.pattern
def ExactTril():  # noqa: F811
    y, x = pm.var(), pm.var()
    y <= P.reshape(x)
    x <= ExactTril()
    assert reshape_keeps_last_two(y.dimensions, x.shape, y.shape)
    return y


@pm.pattern
def Rows(p):
    """``p``, if it has more than one row (second-last axis). Encoders hand the attention a
    padding mask broadcast over the queries: one row, never worth proving causal (a causal
    one-row mask would show each query key 0 alone). Checked here, the guard turns such a
    mask away before ``Tril()`` explores it: a match constraint (``p <= Tril()``) is tried
    after the pattern it constrains, a sub-pattern's guard as soon as its body matched."""
    assert has_rows(p.shape)
    return p


@pm.pattern
def CausalBias(p):
    """``where(p, 0, big_negative)`` of a causal p: Hugging Face's decoders' attention bias.
    big_negative must be at most the kernel's ``MASK_VALUE / 2`` (``finfo.min``, of float32
    or bfloat16, is): a row whose every key it masks then looks fully masked to the kernel."""
    fill, zero = pm.var(), pm.var()
    p <= Causal()
    assert fill.value <= CAUSAL_FILL_MAX and zero.value == 0
    return P.select_n(Rows(p), Splat(fill), Splat(zero))


@pm.pattern
def CausalBias(p):  # noqa: F811
    """Cast (to the scores' dtype): zero stays zero, big_negative stays at most the threshold
    or becomes -inf (a float16 bias, which could overflow, is refused by causal_plan)."""
    return P.convert_element_type(CausalBias(p))


@pm.pattern
def CausalBias(p):  # noqa: F811
    """Plus another bias (BLOOM's ALiBi), either order. Assumed finite and below
    ``-MASK_VALUE / 2`` (1.7e38), so big_negative plus it still hides a key: true of every
    bias a program adds to its scores (a larger one would overflow them)."""
    return P.add(CausalBias(p), pm.var())


@pm.pattern
def CausalBias(p):  # noqa: F811
    return P.add(pm.var(), CausalBias(p))


# ======================================================================= the rules
#
# Each matches a FlashAttention node, never anything else, so it costs nothing where there is
# no attention; causal_plan returns None once the promise is made, so no rule fires twice.


@pm.pattern
def CausalMasked(f, a, b, v, bias, mask, c):
    f <= FlashAttention(a, b, v, bias, Rows(mask), c)
    mask <= Causal()
    return f


@pm.pattern
def CausalBiased(f, a, b, v, bias, mask, c, p):
    f <= FlashAttention(a, b, v, bias, mask, c)
    bias <= CausalBias(p)
    return f


@pm.pattern
def DpaCausalMask(m, tri):
    """``jax.nn.dot_product_attention(mask=m, is_causal=True)``: its mask (``DpaMask``) and
    the ``[1, 1, T, S]`` triangle, broadcast over the query groups, ``and``-ed."""
    y = pm.var()
    y <= P.broadcast_in_dim(tri)
    tri <= ExactTril()
    assert y.broadcast_dimensions == (1, 2, 3, 4)
    return P.and_(DpaMask(m), y)


@pm.pattern
def AttentionDpaMaskCausal(r, q, k, v, s, xt, z, o, t1, t2, c, mask, tri):
    xm, fill = pm.var(), pm.var()
    r <= DpaOut(t1, t2, o, v, xm, z)
    xm <= P.select_n(DpaCausalMask(mask, tri), Splat(fill), xt)
    xt <= DpaLogits(q, k, s, c)
    assert fill.value <= MASK_FILL_MAX
    return r


@pm.pattern
def AttentionDpaBiasMaskCausal(r, q, k, v, s, xt, z, o, t1, t2, c, bias, mask, tri):
    xb, xm, fill = pm.var(), pm.var(), pm.var()
    r <= DpaOut(t1, t2, o, v, xm, z)
    xm <= P.select_n(DpaCausalMask(mask, tri), Splat(fill), xb)
    xb <= P.add(xt, DpaGrouped(Cast(GroupedMask(bias))))
    xt <= DpaLogits(q, k, s, c)
    assert fill.value <= MASK_FILL_MAX
    return r


@pm.rule(AttentionDpaMaskCausal, single_use=True)
def attention_dpa_mask_causal(r, q, k, v, s, xt, z, o, t1, t2, c, mask, tri):
    """``mask=`` and ``is_causal=True``: the mask goes to the kernel, the triangle becomes the
    kernel's causal flag (masked scores are replaced either way)."""
    plan = dpa_plan((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype),
                    (s.dimension_numbers, s.shape, xt.permutation, z.axes),
                    (o.dimension_numbers, (t1.permutation, t2.permutation), r.shape, r.dtype),
                    (mask.shape, mask.dtype))  # fmt: skip
    plan = causal_flag_plan(plan, tri.shape)
    assert attention_supported(plan)
    return FlashAttention(q, k, v, 0, mask, c, plan=plan)


@pm.rule(AttentionDpaBiasMaskCausal, single_use=True)
def attention_dpa_bias_mask_causal(r, q, k, v, s, xt, z, o, t1, t2, c, bias, mask, tri):
    plan = dpa_plan((q.shape, k.shape, v.shape), (q.dtype, k.dtype, v.dtype),
                    (s.dimension_numbers, s.shape, xt.permutation, z.axes),
                    (o.dimension_numbers, (t1.permutation, t2.permutation), r.shape, r.dtype),
                    (mask.shape, mask.dtype), (bias.shape, bias.dtype))  # fmt: skip
    plan = causal_flag_plan(plan, tri.shape)
    assert attention_supported(plan)
    return FlashAttention(q, k, v, bias, mask, c, plan=plan)


@pm.rule(CausalMasked)
def attention_causal_mask(f, a, b, v, bias, mask, c):
    """The kernel's mask is False above the diagonal: the kernel may skip those blocks."""
    plan = causal_plan(f.plan, (mask.shape, mask.dtype), "mask")
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, mask, c, plan=plan)


@pm.rule(CausalBiased)
def attention_causal_bias(f, a, b, v, bias, mask, c, p):
    """The kernel's bias is ``where(p, 0, big_negative)`` of a causal p (maybe plus another
    bias): the kernel may skip the blocks above the diagonal."""
    plan = causal_plan(f.plan, (p.shape, p.dtype), "bias", bias.dtype)
    assert attention_supported(plan)
    return FlashAttention(a, b, v, bias, mask, c, plan=plan)


CAUSAL_RULES = [
    attention_dpa_bias_mask_causal,
    attention_dpa_mask_causal,
    attention_causal_mask,
    attention_causal_bias,
]
