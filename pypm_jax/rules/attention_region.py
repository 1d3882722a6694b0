"""Attention score and mask modifiers as regions → the flash-attention kernel's ``score_mod``
/ ``mask_mod``, in the pattern language.

The attention rules (``attention.py``) know a fixed list of logits spellings: a scale, a
bias, a mask, in that order. Programs write more: a soft-cap ``tanh(s / c) * c`` (Gemma 2),
ALiBi added *before* the scale (Falcon), the scale after a bias, masks combined in any
order, a bias after a mask. These rules take the whole pointwise *region* between the
scores ``dot_general`` and the softmax into the kernel, as data:

* ``attention_region`` matches an attention whose logits are ``Spine(s, a, b)``: a chain of
  pointwise operators the kernel can lower (``rules.region_op``) from the scores
  ``s = Scores(a, b)`` to the softmax, each operator's other operands literals or values
  computed outside the chain. It replaces the attention by an :data:`AttentionRegion`
  node whose ``x`` input is the logits and whose region is empty.
* ``attention_region_zero`` matches the same attention with its probabilities re-zeroed by
  the mask that masks its logits (Keras's ``Softmax(mask=)``: ``where(mask, p, 0)`` or
  ``p * cast(mask)`` after ``where(mask, logits, -1e9)``, as ``rules/masked_rows.py`` reads
  the fixed spellings): the region node with the kernel's ``masked_rows="zero"``. That mask
  must be the logits' outermost and only mask (``rules.region_finishes`` checks it), so a
  row it empties is exactly the row the kernel zeroes.
* ``attention_region_*`` take the operator that computes ``x`` into the region, one at a
  time (a literal operand becomes a ``("lit", v)`` argument, any other operand a captured
  input of the kernel, with a ``broadcast_in_dim`` that only broadcasts as numpy does
  dropped), until ``x`` is the scores; ``attention_region_done`` then splits the outer
  ``where(mask, ., big_negative)`` steps off as the kernel's ``mask_mod``.

* ``attention_region_index_expr`` takes a captured index expression (iotas and literals: a
  causal, sliding-window or chunked mask, relative distances) into the region too, whole,
  its iotas the kernel's positions (``attention_region_index*`` do it an operator at a
  time where the whole walk stops); ``attention_region_done`` proves the band of
  keys such a mask keeps (``rules._plans._band``).

The first rule's guard (``rules.region_finishes``, :mod:`._region_walk`) replays what the
later rules will do on the matched terms and refuses a match they could not finish -- one
needing more than six captured operands at once, a region the kernel cannot compute or
take -- saying why, so a region node is always finished and lowers. What the region cannot
hold (a reduction, a gather on the chain, scores read elsewhere) stops ``Spine``. Either
way the attention is left alone, every other one is still rewritten, and ``pm.explain`` on
``attention_region`` shows the node that stopped it or the refusal's words. The region is
plain data on the node's ``plan`` (``rules._plans.RegionPlan``), and the rewrite report
shows it.
"""

from __future__ import annotations

from ..lang import frontend as pm
from ..vocab import prims as P
from ._kernels import AttentionRegion
from ._plans import (
    attention_plan,
    is_literal,
    numpy_broadcast,
    region_cast,
    region_done,
    region_index,
    region_inline,
    region_literal,
    region_op,
    region_push,
    region_reframe,
    region_seed,
)
from ._region_walk import region_finishes, region_index_expr
from .attention import Scores, Splat, Weighted
from .masked_rows import ZeroedWeighted

__all__ = [
    "REGION_RULES",
    "Spine",
    "Captured",
    "attention_region",
    "attention_region_zero",
    "attention_region_unary",
    "attention_region_convert",
    "attention_region_integer_pow",
    "attention_region_literal",
    "attention_region_literal_first",
    "attention_region_capture",
    "attention_region_capture_first",
    "attention_region_where_fill",
    "attention_region_where_fill_second",
    "attention_region_where",
    "attention_region_where_second",
    "attention_region_done",
    "IndexOnly",
    "attention_region_index_expr",
    "attention_region_index",
    "attention_region_index_broadcast",
    "attention_region_index_reshape",
    "attention_region_index_slice",
    "attention_region_index_unary",
    "attention_region_index_literal",
    "attention_region_index_literal_first",
    "attention_region_index_binary",
    "attention_region_index_binary_second",
    "attention_region_index_where",
]


# ------------------------------------------------------------------------- the spine


@pm.pattern
def Spine(s, a, b):
    """The scores ``s = Scores(a, b)`` under a chain of pointwise operators the region can
    hold; the other operands of each are anything but the chain."""
    s <= Scores(a, b)
    return s


@pm.pattern
def UnaryOp(t):
    """``f(t)``, f a unary operator a region can hold. A sub-pattern's guard is checked as
    soon as its body matched and a match constraint after the pattern it constrains, so
    ``t <= Spine(..); return UnaryOp(t)`` turns any other operator away before exploring
    its operand (a guard beside ``f(Spine(..))`` would be checked only after ``Spine`` had
    walked back through every operator of that arity: the whole network behind it)."""
    f = pm.Op(1, 1)
    assert region_op(f.name, 1)
    return f(t)


@pm.pattern
def BinaryOp(t, u):
    """``f(t, u)``, f a binary operator a region can hold (see :func:`UnaryOp`)."""
    f = pm.Op(2, 1)
    assert region_op(f.name, 2)
    return f(t, u)


@pm.pattern
def Spine(s, a, b):  # noqa: F811 (alternates share a name)
    t = pm.var()
    t <= Spine(s, a, b)
    return UnaryOp(t)


@pm.pattern
def Spine(s, a, b):  # noqa: F811
    y = P.convert_element_type(Spine(s, a, b))
    assert region_cast(y.dtype)
    return y


@pm.pattern
def Spine(s, a, b):  # noqa: F811
    return P.integer_pow(Spine(s, a, b))


@pm.pattern
def Spine(s, a, b):  # noqa: F811
    t = pm.var()
    t <= Spine(s, a, b)
    return BinaryOp(t, pm.var())


@pm.pattern
def Spine(s, a, b):  # noqa: F811
    t = pm.var()
    t <= Spine(s, a, b)
    return BinaryOp(pm.var(), t)


@pm.pattern
def Spine(s, a, b):  # noqa: F811
    """``jnp.where(p, spine, other)`` or ``jnp.where(p, other, spine)``."""
    return P.select_n(pm.var(), pm.var(), Spine(s, a, b))


@pm.pattern
def Spine(s, a, b):  # noqa: F811
    return P.select_n(pm.var(), Spine(s, a, b), pm.var())


@pm.pattern
def Captured(w):
    """An operand the kernel captures: w itself, or what a numpy-style broadcast made it
    from (the kernel broadcasts captures to the score tile)."""
    y = P.broadcast_in_dim(w)
    assert numpy_broadcast(y.broadcast_dimensions, w.shape, y.shape)
    return y


@pm.pattern
def Captured(w):  # noqa: F811
    return w


# --------------------------------------------------------------------- the first rule


@pm.pattern
def AttentionRegionPattern(o, a, b, v, s, z, x):
    o <= Weighted(v, x, z)
    x <= Spine(s, a, b)
    return o


@pm.rule(AttentionRegionPattern, single_use=True)
def attention_region(o, a, b, v, s, z, x):
    """An attention whose logits no fixed spelling matched: the region node, its region
    still to take in."""
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype))  # fmt: skip
    seed = region_seed(plan)
    assert seed is not None
    assert region_finishes(seed, x.term, s.term)
    return AttentionRegion(a, b, v, x, 0, 0, 0, 0, 0, 0, plan=seed)


@pm.pattern
def AttentionRegionZeroPattern(o, a, b, v, s, z, x, mask):
    """As :func:`AttentionRegionPattern`, the probabilities re-zeroed by ``mask``
    (``where(mask, p, 0)``, ``p * cast(mask)``: Keras's ``Softmax(mask=)``)."""
    o <= ZeroedWeighted(v, x, z, mask)
    x <= Spine(s, a, b)
    return o


@pm.rule(AttentionRegionZeroPattern, single_use=True)
def attention_region_zero(o, a, b, v, s, z, x, mask):
    """An attention whose probabilities are re-zeroed by the mask that masks its logits
    (their outermost and only ``where``): the region node with the kernel's
    ``masked_rows="zero"`` (a row the mask empties outputs 0, as the program's does)."""
    plan = attention_plan((a.shape, b.shape, v.shape), (a.dtype, b.dtype, v.dtype),
                          (s.dimension_numbers, s.shape, z.axes),
                          (o.dimension_numbers, o.shape, o.dtype))  # fmt: skip
    seed = region_seed(plan, "zero")
    assert seed is not None
    assert region_finishes(seed, x.term, s.term, mask.term)
    return AttentionRegion(a, b, v, x, 0, 0, 0, 0, 0, 0, plan=seed)


# --------------------------------------------------- taking one operator into the region
#
# Each rule matches a region node whose ``x`` the pattern names, and replaces it by one
# whose ``x`` is the operand below (the spine: ``Spine(t, a, b)`` where both operands could
# be). A new capture goes first; the last capture input, unused then, falls off.


@pm.pattern
def Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5):
    r <= AttentionRegion(a, b, v, x, c0, c1, c2, c3, c4, c5)
    return r


@pm.pattern
def UnaryAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y):
    f = pm.Op(1, 1)
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= f(y)
    assert region_op(f.name, 1)
    return r


@pm.rule(UnaryAbove)
def attention_region_unary(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y):
    plan = region_push(r.plan, x.op, (("acc",),))
    assert plan is not None
    return AttentionRegion(a, b, v, y, c0, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def ConvertAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y):
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= P.convert_element_type(y)
    return r


@pm.rule(ConvertAbove)
def attention_region_convert(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y):
    plan = region_push(r.plan, "convert_element_type", (("acc",),), (("new_dtype", x.dtype),))
    assert plan is not None
    return AttentionRegion(a, b, v, y, c0, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def IntegerPowAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y):
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= P.integer_pow(y)
    return r


@pm.rule(IntegerPowAbove)
def attention_region_integer_pow(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y):
    plan = region_push(r.plan, "integer_pow", (("acc",),), (("y", x.y),))
    assert plan is not None
    return AttentionRegion(a, b, v, y, c0, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def LiteralAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, c):
    f = pm.Op(2, 1)
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= f(y, Splat(c))
    assert region_op(f.name, 2)
    return r


@pm.rule(LiteralAbove)
def attention_region_literal(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, c):
    """``f(x, literal)``: ``scores * 0.125``, ``tanh(.) * 50.0``, ``i >= 0``."""
    plan = region_push(r.plan, x.op, (("acc",), ("lit", c.value)))
    assert plan is not None
    return AttentionRegion(a, b, v, y, c0, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def LiteralFirstAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, c):
    f = pm.Op(2, 1)
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= f(Splat(c), y)
    assert region_op(f.name, 2)
    return r


@pm.rule(LiteralFirstAbove)
def attention_region_literal_first(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, c):
    plan = region_push(r.plan, x.op, (("lit", c.value), ("acc",)))
    assert plan is not None
    return AttentionRegion(a, b, v, y, c0, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def CaptureAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, w):
    f, t = pm.Op(2, 1), pm.var()
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= f(y, Captured(w))
    y <= Spine(t, a, b)
    assert region_op(f.name, 2)
    return r


@pm.rule(CaptureAbove)
def attention_region_capture(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, w):
    """``f(x, w)`` with w computed elsewhere (a bias, a learned soft-cap): w is captured."""
    plan = region_push(r.plan, x.op, (("acc",), ("in", 0)), (), (w.shape,))
    assert plan is not None
    return AttentionRegion(a, b, v, y, w, c0, c1, c2, c3, c4, plan=plan)


@pm.pattern
def CaptureFirstAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, w):
    f, t = pm.Op(2, 1), pm.var()
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= f(Captured(w), y)
    y <= Spine(t, a, b)
    assert region_op(f.name, 2)
    return r


@pm.rule(CaptureFirstAbove)
def attention_region_capture_first(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, w):
    plan = region_push(r.plan, x.op, (("in", 0), ("acc",)), (), (w.shape,))
    assert plan is not None
    return AttentionRegion(a, b, v, y, w, c0, c1, c2, c3, c4, plan=plan)


@pm.pattern
def WhereFillAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, c):
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= P.select_n(Captured(p), Splat(c), y)
    return r


@pm.rule(WhereFillAbove)
def attention_region_where_fill(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, c):
    """``jnp.where(p, x, literal)`` (a mask: p is captured)."""
    plan = region_push(r.plan, "select_n", (("in", 0), ("lit", c.value), ("acc",)), (),
                       (p.shape,))  # fmt: skip
    assert plan is not None
    return AttentionRegion(a, b, v, y, p, c0, c1, c2, c3, c4, plan=plan)


@pm.pattern
def WhereFillSecondAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, c):
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= P.select_n(Captured(p), y, Splat(c))
    return r


@pm.rule(WhereFillSecondAbove)
def attention_region_where_fill_second(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, c):
    """``jnp.where(p, literal, x)`` (``where(mask == 0, big_negative, x)``)."""
    plan = region_push(r.plan, "select_n", (("in", 0), ("acc",), ("lit", c.value)), (),
                       (p.shape,))  # fmt: skip
    assert plan is not None
    return AttentionRegion(a, b, v, y, p, c0, c1, c2, c3, c4, plan=plan)


@pm.pattern
def WhereAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, w):
    t = pm.var()
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= P.select_n(Captured(p), Captured(w), y)
    y <= Spine(t, a, b)
    return r


@pm.rule(WhereAbove)
def attention_region_where(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, w):
    """``jnp.where(p, x, w)`` with w computed elsewhere: p and w are captured."""
    plan = region_push(r.plan, "select_n", (("in", 0), ("in", 1), ("acc",)), (),
                       (p.shape, w.shape))  # fmt: skip
    assert plan is not None
    return AttentionRegion(a, b, v, y, p, w, c0, c1, c2, c3, plan=plan)


@pm.pattern
def WhereSecondAbove(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, w):
    t = pm.var()
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= P.select_n(Captured(p), y, Captured(w))
    y <= Spine(t, a, b)
    return r


@pm.rule(WhereSecondAbove)
def attention_region_where_second(r, a, b, v, x, c0, c1, c2, c3, c4, c5, y, p, w):
    plan = region_push(r.plan, "select_n", (("in", 0), ("acc",), ("in", 1)), (),
                       (p.shape, w.shape))  # fmt: skip
    assert plan is not None
    return AttentionRegion(a, b, v, y, p, w, c0, c1, c2, c3, plan=plan)


# ------------------------------------------------------------ index expressions
#
# A captured operand computed from iotas and literals alone (a causal or sliding-window
# mask, the distances of a relative-position bias) is taken into the region too, down to
# its iotas, which become the kernel's query / key (/ batch / head) positions: the kernel
# then reads no mask array, and the region proves the band of keys it can skip. These
# rules work on the first capture ``c0``, where a new capture goes, so an index expression
# is taken in depth first before the spine moves on.


@pm.pattern
def IndexOnly():
    """A value computed from iotas and literals alone, by operators a region can hold."""
    return P.iota()


@pm.pattern
def IndexOnly():  # noqa: F811
    c = pm.var()
    assert is_literal(c.value)
    return c


@pm.pattern
def IndexUnaryOp(t):
    """``f(t)``, f a unary operator an index expression may use (see :func:`UnaryOp`)."""
    f = pm.Op(1, 1)
    assert region_op(f.name, 1) or f.name in ("convert_element_type", "broadcast_in_dim")
    return f(t)


@pm.pattern
def IndexOnly():  # noqa: F811
    t = pm.var()
    t <= IndexOnly()
    return IndexUnaryOp(t)


@pm.pattern
def IndexOnly():  # noqa: F811
    y = P.reshape(IndexOnly())
    assert y.dimensions == None  # noqa: E711 (guard data)
    return y


@pm.pattern
def IndexOnly():  # noqa: F811
    return P.slice(IndexOnly())


@pm.pattern
def IndexOnly():  # noqa: F811
    t, t2 = pm.var(), pm.var()
    t <= IndexOnly()
    t2 <= IndexOnly()
    return BinaryOp(t, t2)


@pm.pattern
def IndexOnly():  # noqa: F811
    return P.select_n(IndexOnly(), IndexOnly(), IndexOnly())


@pm.pattern
def First(r, a, b, v, x, c0, c1, c2, c3, c4, c5):
    """A region node whose first capture is an index expression."""
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= IndexOnly()
    return r


@pm.rule(First)
def attention_region_index_expr(r, a, b, v, x, c0, c1, c2, c3, c4, c5):
    """``c0``, an index expression, taken into the region whole (``rules.region_index_expr``:
    its iotas become positions). The rules below take one operator at a time where it
    cannot (they stop where this stops; kept for what the whole walk refuses)."""
    plan = region_index_expr(r.plan, c0.term)
    assert plan is not None
    return AttentionRegion(a, b, v, x, c1, c2, c3, c4, c5, 0, plan=plan)


@pm.rule(First)
def attention_region_index(r, a, b, v, x, c0, c1, c2, c3, c4, c5):
    """``c0`` is an iota: a position (or a literal: its value)."""
    if c0.op == P.iota:
        plan = region_index(r.plan, c0.dimension, c0.shape)
        assert plan is not None
        return AttentionRegion(a, b, v, x, c1, c2, c3, c4, c5, 0, plan=plan)
    plan = region_literal(r.plan, c0.value)
    assert plan is not None
    return AttentionRegion(a, b, v, x, c1, c2, c3, c4, c5, 0, plan=plan)


@pm.pattern
def FirstLayout(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    r <= First(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= P.broadcast_in_dim(u)
    return r


@pm.rule(FirstLayout)
def attention_region_index_broadcast(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    plan = region_reframe(r.plan, "broadcast_in_dim", c0.broadcast_dimensions, u.shape)
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def FirstReshape(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    r <= First(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= P.reshape(u)
    return r


@pm.rule(FirstReshape)
def attention_region_index_reshape(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    plan = region_reframe(r.plan, "reshape", c0.dimensions, u.shape)
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def FirstSlice(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    r <= First(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= P.slice(u)
    return r


@pm.rule(FirstSlice)
def attention_region_index_slice(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    plan = region_reframe(r.plan, "slice", (c0.start_indices, c0.strides), u.shape)
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def FirstUnary(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    f = pm.Op(1, 1)
    r <= First(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= f(u)
    assert region_op(f.name, 1) or f.name == "convert_element_type"
    return r


@pm.rule(FirstUnary)
def attention_region_index_unary(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u):
    if c0.op == P.convert_element_type:
        plan = region_inline(r.plan, "convert_element_type", (("in", 0),),
                             (("new_dtype", c0.dtype),), (u.shape,))  # fmt: skip
        assert plan is not None
        return AttentionRegion(a, b, v, x, u, c1, c2, c3, c4, c5, plan=plan)
    plan = region_inline(r.plan, c0.op, (("in", 0),), (), (u.shape,))
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def FirstBinaryLiteral(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, c):
    f = pm.Op(2, 1)
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= f(u, Splat(c))
    assert region_op(f.name, 2) and is_literal(c.value)
    return r


@pm.rule(FirstBinaryLiteral)
def attention_region_index_literal(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, c):
    """``f(c0, literal)`` (``i - window``, ``i // chunk``) where c0 reads an index."""
    plan = region_inline(r.plan, c0.op, (("in", 0), ("lit", c.value)), (), (u.shape,))
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def FirstLiteralBinary(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, c):
    f = pm.Op(2, 1)
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= f(Splat(c), u)
    assert region_op(f.name, 2) and is_literal(c.value)
    return r


@pm.rule(FirstLiteralBinary)
def attention_region_index_literal_first(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, c):
    plan = region_inline(r.plan, c0.op, (("lit", c.value), ("in", 0)), (), (u.shape,))
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, c1, c2, c3, c4, c5, plan=plan)


@pm.pattern
def FirstBinary(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, w):
    """``f(u, w)`` with u an index expression (w maybe one too, maybe data: a padding
    mask and-ed with a causal one)."""
    f = pm.Op(2, 1)
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= f(u, Captured(w))
    u <= IndexOnly()
    assert region_op(f.name, 2)
    return r


@pm.rule(FirstBinary)
def attention_region_index_binary(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, w):
    plan = region_inline(r.plan, c0.op, (("in", 0), ("in", 1)), (), (u.shape, w.shape))
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, w, c1, c2, c3, c4, plan=plan)


@pm.pattern
def FirstBinarySecond(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, w):
    f = pm.Op(2, 1)
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= f(Captured(w), u)
    u <= IndexOnly()
    assert region_op(f.name, 2)
    return r


@pm.rule(FirstBinarySecond)
def attention_region_index_binary_second(r, a, b, v, x, c0, c1, c2, c3, c4, c5, u, w):
    plan = region_inline(r.plan, c0.op, (("in", 1), ("in", 0)), (), (u.shape, w.shape))
    assert plan is not None
    return AttentionRegion(a, b, v, x, u, w, c1, c2, c3, c4, plan=plan)


@pm.pattern
def FirstWhere(r, a, b, v, x, c0, c1, c2, c3, c4, c5, p, t, f):
    r <= First(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    c0 <= P.select_n(p, f, t)
    return r


@pm.rule(FirstWhere)
def attention_region_index_where(r, a, b, v, x, c0, c1, c2, c3, c4, c5, p, t, f):
    """``where(p, t, f)`` of index expressions (``jnp.tril``, ``//`` rounding down)."""
    plan = region_inline(r.plan, "select_n", (("in", 0), ("in", 1), ("in", 2)), (),
                         (p.shape, f.shape, t.shape))  # fmt: skip
    assert plan is not None
    return AttentionRegion(a, b, v, x, p, f, t, c1, c2, c3, plan=plan)


@pm.pattern
def ScoresReached(r, a, b, v, x, c0, c1, c2, c3, c4, c5):
    r <= Open(r, a, b, v, x, c0, c1, c2, c3, c4, c5)
    x <= Scores(a, b)
    return r


@pm.rule(ScoresReached)
def attention_region_done(r, a, b, v, x, c0, c1, c2, c3, c4, c5):
    """``x`` is the scores of the node's own a and b: the kernel computes them."""
    plan = region_done(r.plan)
    assert plan is not None
    return AttentionRegion(a, b, v, 0, c0, c1, c2, c3, c4, c5, plan=plan)


# The first rule runs after the fixed attention rules (which keep every spelling they
# match); then index expressions are taken in before the spine moves on, literal
# operands before captured ones.
REGION_RULES = [
    attention_region,
    attention_region_zero,
    attention_region_index_expr,
    attention_region_index,
    attention_region_index_broadcast,
    attention_region_index_reshape,
    attention_region_index_slice,
    attention_region_index_unary,
    attention_region_index_literal,
    attention_region_index_literal_first,
    attention_region_index_binary,
    attention_region_index_binary_second,
    attention_region_index_where,
    attention_region_done,
    attention_region_unary,
    attention_region_convert,
    attention_region_integer_pow,
    attention_region_literal,
    attention_region_literal_first,
    attention_region_where_fill,
    attention_region_where_fill_second,
    attention_region_capture,
    attention_region_capture_first,
    attention_region_where,
    attention_region_where_second,
]
