"""Canonical forms, in the pattern language: rules that run before the kernel rules.

Living model code spells the same computation in ways that differ only by operations that
compute nothing. The kernel rules (``attention.py``, ``causal.py``, ``gemm.py``) would need an
alternate for every such spelling inside every piece; instead these rules rewrite each one
to a single form first, so every kernel rule sees that form:

* ``copy(x)`` is ``x`` (penzai emits a ``copy`` after every named-axis operation);
* two transposes that cancel (``swapaxes`` there and back) and two row-major reshapes back
  to the operand's shape (split and merged back) are ``x`` (JAX itself elides a single
  identity ``transpose``/``reshape``/``broadcast_in_dim`` when it traces one);
* a softmax in ``vmap``'s form, taken on ``transpose(u)`` (the max taken on ``u`` before the
  transpose) and moved back by the inverse transpose, is the plain softmax of ``u``: that
  is what ``jax.vmap(jax.nn.softmax)`` over any axis but the softmax's (penzai's ``nmap``)
  makes, and the attention rules read the plain form. (``jax.nn.dot_product_attention``
  uses the softmax in the moved frame without moving it back; its own rules read that.)
* grouped-query attention written as 5-D einsums (q regrouped to ``[.., K, G, ..]``, k and
  v unrepeated) is the 4-D attention of q with its heads merged and k, v repeated per group
  as ``jnp.repeat`` does (``Kv``): the merged scores and the split probabilities are
  rewritten to 4-D contractions, a scalar scale between the scores and their merge moves
  before it, and a rank-4 transpose of scores merged query-major (``[B, T, N, S]``) moves
  down the soft-cap, the mask and the softmax into the contraction with v. Grouped scores
  moved so that K and G are adjacent are the split of 4-D scores, and the split moves down
  the chain (soft-cap, scale, broadcast mask and fill, softmax, re-zeroing, rank-5
  transposes that keep the pair together, a ``vmap``-form softmax) until a merge cancels it
  or the contraction with v reads it: a chain kept at rank 5 runs at rank 4.

Each rule replaces a value by one that is equal element for element, so it never changes
what the program computes, only how the kernel rules see it; where no kernel rule fires,
the program is the same computation, with fewer operations (except that the grouped rules
repeat k and v per group; the rules that build computations are ``single_use``, so none is
computed twice). The rules are named ``canonical_*`` so reports can tell them from the
kernel rewrites.
"""

from __future__ import annotations

from ..lang import frontend as pm
from ..vocab import prims as P
from ._plans import (
    compose_permutations,
    fold_operand_transpose,
    grouped_probs_plan,
    grouped_scores_plan,
    inverse_of,
    inverse_permutation,
    kept_dims,
    kept_shape,
    merged_axis,
    merged_broadcast,
    merges_through,
    moved_axes,
    moved_softmax_axis,
    noop_reshape,
    row_major,
    scale_kind,
    sinks_transpose,
    softmax_axes,
    split_permutation,
    split_scores,
    vmapped_softmax_axes,
)
from ._weight_slices import (
    squeezed_permutation,
    swapped_dot,
    weight_side,
    weight_slice,
    weight_split,
    weight_squeeze,
)
from .attention import NEG_INF, Expand, Probs, Scaled, Softmax, Splat, StopGrad

__all__ = [
    "CANONICAL_RULES",
    "VmapSoftmaxBack",
    "canonical_copy",
    "canonical_reshapes",
    "canonical_transposes",
    "canonical_softmax",
    "canonical_scaled_reshape",
    "canonical_grouped_scores",
    "canonical_grouped_scores_moved",
    "canonical_grouped_probs",
    "canonical_split_scores",
    "canonical_split_unary",
    "canonical_split_scalar",
    "canonical_split_where",
    "canonical_split_where_second",
    "canonical_split_softmax",
    "canonical_split_transpose",
    "canonical_split_transposes",
    "canonical_split_softmax_moved",
    "canonical_transpose_unary",
    "canonical_transpose_scalar",
    "canonical_transpose_where",
    "canonical_transpose_softmax",
    "canonical_transposed_probs",
    "canonical_transposed_probs_second",
    "canonical_sliced_dot",
    "canonical_split_dot",
    "canonical_squeezed_dot",
    "canonical_swapped_dot",
]

# ---------------------------------------------------------------- no-op layout


@pm.pattern
def Copied(x):
    return P.copy(x)


@pm.pattern
def TransposedBack(x):
    """``transpose(transpose(x, a), b)`` where ``b`` undoes ``a`` (``swapaxes`` there and
    back). Two transposes that do not cancel stay: ``jax.nn.dot_product_attention``'s rules
    read its output's two."""
    y, t = pm.var(), pm.var()
    y <= P.transpose(t)
    t <= P.transpose(x)
    assert inverse_permutation(t.permutation, y.permutation)
    return y


@pm.pattern
def ReshapedBack(x):
    """``reshape(reshape(x))`` back to ``x``'s shape, both row-major (split and merged
    back): the elements never moved."""
    y, r = pm.var(), pm.var()
    y <= P.reshape(r)
    r <= P.reshape(x)
    assert row_major(y.dimensions) and row_major(r.dimensions)
    assert noop_reshape(None, x.shape, y.shape)
    return y


@pm.rule(Copied)
def canonical_copy(x):
    """``copy(x)`` → ``x``: JAX's ``copy`` is the identity on values."""
    return x


@pm.rule(TransposedBack)
def canonical_transposes(x):
    """Two transposes that cancel → the operand."""
    return x


@pm.rule(ReshapedBack)
def canonical_reshapes(x):
    """Two row-major reshapes back to the operand's shape → the operand."""
    return x


# ------------------------------------------------------------------- vmap softmax


@pm.pattern
def MaxClamp(mm, m):
    """``mm`` is the row max ``m``, maybe clamped ``max(-inf, m)`` as ``jax.nn.softmax`` does."""
    c = pm.var()
    assert c.value == NEG_INF
    mm <= P.max(Splat(c), m)
    return mm


@pm.pattern
def MaxClamp(mm, m):  # noqa: F811 (alternates share a name)
    c = pm.var()
    assert c.value == NEG_INF
    mm <= P.max(m, Splat(c))
    return mm


@pm.pattern
def MaxClamp(mm, m):  # noqa: F811
    mm <= m
    return mm


@pm.pattern
def VmapSoftmaxBack(y, u, m, mm, z, x):
    """``transpose(softmax(transpose(u)))`` as ``vmap`` makes it, the max taken on ``u``: the
    root ``y`` moves the probabilities back into ``u``'s frame. Binds the row max ``m`` of
    ``u`` and its clamped form ``mm`` (reused by the plain form), the sum ``z`` and ``x``."""
    e, kept_sum, kept_max, moved_max, p = pm.var(), pm.var(), pm.var(), pm.var(), pm.var()
    y <= P.transpose(p)
    p <= P.div(e, kept_sum)
    kept_sum <= Expand(z)
    z <= P.reduce_sum(e)
    e <= P.exp(P.sub(x, StopGrad(kept_max)))
    kept_max <= Expand(moved_max)
    moved_max <= P.transpose(MaxClamp(mm, m))
    m <= P.reduce_max(u)
    x <= P.transpose(u)
    assert vmapped_softmax_axes(
        x.shape, x.permutation, z.axes, m.axes, moved_max.permutation, kept_sum.shape,
        kept_max.shape,
    )  # fmt: skip
    assert inverse_permutation(x.permutation, y.permutation)
    return y


@pm.rule(VmapSoftmaxBack)
def canonical_softmax(y, u, m, mm, z, x):
    """The plain softmax of ``u`` over the axis ``m`` reduces, reusing its row max:
    ``exp(u - stop_gradient(mm[..., None])) / sum(..)[..., None]``."""
    shape, dims = kept_shape(u.shape, m.axes), kept_dims(u.shape, m.axes)
    assert shape is not None and dims is not None
    e = P.exp(
        P.sub(u, P.stop_gradient(P.broadcast_in_dim(mm, shape=shape, broadcast_dimensions=dims)))
    )
    total = P.broadcast_in_dim(P.reduce_sum(e, axes=m.axes), shape=shape, broadcast_dimensions=dims)
    return P.div(e, total)


# -------------------------------------------------- grouped-query attention as 5-D einsums


@pm.pattern
def ReshapedScaled(r, s, sc, c):
    """``reshape(s * c)`` (or ``/ c``) of rank-5 scores ``s`` to rank 4 (tunix scales its
    5-D grouped scores before merging the query heads)."""
    r <= P.reshape(sc)
    sc <= Scaled(s, c)
    assert s.rank == 5 and r.rank == 4 and row_major(r.dimensions)
    return r


@pm.rule(ReshapedScaled, single_use=True)
def canonical_scaled_reshape(r, s, sc, c):
    """``reshape(s * c)`` → ``reshape(s) * c`` for a scalar ``c``: the scale commutes with
    the layout, and the reshape then meets the scores ``dot_general``."""
    if scale_kind(sc.op) == -1:
        return P.div(P.reshape(s, new_sizes=r.shape, dimensions=None), c)
    return P.mul(P.reshape(s, new_sizes=r.shape, dimensions=None), c)


# A rank-5 scores chain (``[B, K, G, T, S]``: soft-cap, a broadcast mask, the softmax,
# re-zeroing) up to the 5-D contraction with v. The grouped scores are the split
# ``reshape(S4)`` of the 4-D scores ``S4`` (``canonical_split_scores``, where K and G are
# adjacent), and the split moves down the chain, one operation at a time, each
# ``f(reshape(x))`` becoming ``reshape(f(x))`` (only rank 4 → 5 row-major splits), until the
# probabilities meet v, where the grouped rules read them (or the contraction's own merge
# cancels the split). The chain then runs at rank 4, in the contraction's layout.


@pm.pattern
def SplitScores(t, s, a, b):
    """``transpose(dot_general(a, b))``: 5-D grouped scores moved so that (K, G) are
    adjacent, K first (``rules.split_scores``)."""
    t <= P.transpose(s)
    s <= P.dot_general(a, b)
    assert split_scores(a.shape, b.shape, s.dimension_numbers, t.permutation, t.shape) is not None
    return t


@pm.rule(SplitScores, single_use=True)
def canonical_split_scores(t, s, a, b):
    """Grouped 5-D scores → ``reshape(S4)``, ``S4`` the 4-D scores of the merged query
    heads and k repeated per group (``canonical_grouped_scores_moved``'s), split back."""
    merged = split_scores(a.shape, b.shape, s.dimension_numbers, t.permutation, t.shape)
    assert merged is not None
    plan = grouped_scores_plan(a.shape, b.shape, s.dimension_numbers, t.permutation, merged,
                               None)  # fmt: skip
    assert plan is not None
    q5 = a if plan[0] == 0 else b
    k4 = b if plan[0] == 0 else a
    q = P.reshape(q5, new_sizes=plan[1], dimensions=None)
    k = P.reshape(P.broadcast_in_dim(k4, shape=plan[2], broadcast_dimensions=plan[3]),
                  new_sizes=plan[4], dimensions=None)  # fmt: skip
    if plan[5] == 1:
        d = P.dot_general(k, q, dimension_numbers=plan[6], precision=s.precision,
                          preferred_element_type=s.preferred_element_type)  # fmt: skip
    else:
        d = P.dot_general(q, k, dimension_numbers=plan[6], precision=s.precision,
                          preferred_element_type=s.preferred_element_type)  # fmt: skip
    if plan[7] == ():
        return P.reshape(d, new_sizes=t.shape, dimensions=None)
    return P.reshape(P.transpose(d, permutation=plan[7]), new_sizes=t.shape, dimensions=None)


@pm.pattern
def SplitUnary(y, r, x, f):
    """``f(reshape(x))`` for a unary pointwise ``f``, the reshape splitting an axis of a
    rank-4 ``x`` in two."""
    y <= f(r)
    r <= P.reshape(x)
    assert row_major(r.dimensions) and merges_through(f.name, r.shape, x.shape)
    return y


@pm.rule(SplitUnary, single_use=True)
def canonical_split_unary(y, r, x, f):
    """``f(reshape(x))`` → ``reshape(f(x))``."""
    if f.name == "tanh":
        return P.reshape(P.tanh(x), new_sizes=r.shape, dimensions=None)
    if f.name == "logistic":
        return P.reshape(P.logistic(x), new_sizes=r.shape, dimensions=None)
    if f.name == "exp":
        return P.reshape(P.exp(x), new_sizes=r.shape, dimensions=None)
    assert f.name == "neg"
    return P.reshape(P.neg(x), new_sizes=r.shape, dimensions=None)


@pm.pattern
def SplitScalar(y, a, b, x, f):
    """``f(reshape(x), c)`` or ``f(c, reshape(x))`` for a binary pointwise ``f`` and a
    scalar ``c`` (a soft-cap's ``s / cap``, ``* cap``)."""
    y <= f(a, b)
    a <= P.reshape(x)
    assert b.rank == 0 and row_major(a.dimensions) and merges_through(f.name, a.shape, x.shape)
    return y


@pm.pattern
def SplitScalar(y, a, b, x, f):  # noqa: F811
    y <= f(a, b)
    b <= P.reshape(x)
    assert a.rank == 0 and row_major(b.dimensions) and merges_through(f.name, b.shape, x.shape)
    return y


@pm.rule(SplitScalar, single_use=True)
def canonical_split_scalar(y, a, b, x, f):
    """``f(reshape(x), c)`` → ``reshape(f(x, c))`` (either operand order)."""
    if a.rank == 0:
        if f.name == "mul":
            return P.reshape(P.mul(a, x), new_sizes=b.shape, dimensions=None)
        if f.name == "div":
            return P.reshape(P.div(a, x), new_sizes=b.shape, dimensions=None)
        if f.name == "add":
            return P.reshape(P.add(a, x), new_sizes=b.shape, dimensions=None)
        assert f.name == "sub"
        return P.reshape(P.sub(a, x), new_sizes=b.shape, dimensions=None)
    if f.name == "mul":
        return P.reshape(P.mul(x, b), new_sizes=a.shape, dimensions=None)
    if f.name == "div":
        return P.reshape(P.div(x, b), new_sizes=a.shape, dimensions=None)
    if f.name == "add":
        return P.reshape(P.add(x, b), new_sizes=a.shape, dimensions=None)
    assert f.name == "sub"
    return P.reshape(P.sub(x, b), new_sizes=a.shape, dimensions=None)


@pm.pattern
def SplitWhere(y, m, c, r, x, m0, c0):
    """``select_n(m, c, reshape(x))`` (``jnp.where(m, reshape(x), c)``), ``m`` and ``c``
    broadcasts (a mask and a fill) that stay broadcasts merged (``rules.merged_broadcast``)."""
    y <= P.select_n(m, c, r)
    r <= P.reshape(x)
    m <= P.broadcast_in_dim(m0)
    c <= P.broadcast_in_dim(c0)
    assert row_major(r.dimensions) and r.rank == 5 and x.rank == 4
    assert merged_broadcast(m.broadcast_dimensions, m0.shape, m.shape, x.shape) is not None
    assert merged_broadcast(c.broadcast_dimensions, c0.shape, c.shape, x.shape) is not None
    return y


@pm.rule(SplitWhere, single_use=True)
def canonical_split_where(y, m, c, r, x, m0, c0):
    """``select_n(m, c, reshape(x))`` → ``reshape(select_n(m', c', x))``, the mask and the
    fill broadcast to ``x``'s shape."""
    pm_ = merged_broadcast(m.broadcast_dimensions, m0.shape, m.shape, x.shape)
    pc = merged_broadcast(c.broadcast_dimensions, c0.shape, c.shape, x.shape)
    assert pm_ is not None and pc is not None
    mask = m0
    if pm_[0] == 1:
        mask = P.reshape(m0, new_sizes=pm_[1], dimensions=None)
    fill = c0
    if pc[0] == 1:
        fill = P.reshape(c0, new_sizes=pc[1], dimensions=None)
    out = P.select_n(
        P.broadcast_in_dim(mask, shape=x.shape, broadcast_dimensions=pm_[2]),
        P.broadcast_in_dim(fill, shape=x.shape, broadcast_dimensions=pc[2]),
        x,
    )
    return P.reshape(out, new_sizes=r.shape, dimensions=None)


@pm.pattern
def SplitWhereSecond(y, m, c, r, x, m0, c0):
    """``select_n(m, reshape(x), c)`` (``jnp.where(m, c, reshape(x))``), the same."""
    y <= P.select_n(m, r, c)
    r <= P.reshape(x)
    m <= P.broadcast_in_dim(m0)
    c <= P.broadcast_in_dim(c0)
    assert row_major(r.dimensions) and r.rank == 5 and x.rank == 4
    assert merged_broadcast(m.broadcast_dimensions, m0.shape, m.shape, x.shape) is not None
    assert merged_broadcast(c.broadcast_dimensions, c0.shape, c.shape, x.shape) is not None
    return y


@pm.rule(SplitWhereSecond, single_use=True)
def canonical_split_where_second(y, m, c, r, x, m0, c0):
    """``select_n(m, reshape(x), c)`` → ``reshape(select_n(m', x, c'))``."""
    pm_ = merged_broadcast(m.broadcast_dimensions, m0.shape, m.shape, x.shape)
    pc = merged_broadcast(c.broadcast_dimensions, c0.shape, c.shape, x.shape)
    assert pm_ is not None and pc is not None
    mask = m0
    if pm_[0] == 1:
        mask = P.reshape(m0, new_sizes=pm_[1], dimensions=None)
    fill = c0
    if pc[0] == 1:
        fill = P.reshape(c0, new_sizes=pc[1], dimensions=None)
    out = P.select_n(
        P.broadcast_in_dim(mask, shape=x.shape, broadcast_dimensions=pm_[2]),
        x,
        P.broadcast_in_dim(fill, shape=x.shape, broadcast_dimensions=pc[2]),
    )
    return P.reshape(out, new_sizes=r.shape, dimensions=None)


@pm.pattern
def SplitSoftmax(p, r, x, m, z):
    """The plain softmax (``jax.nn.softmax``'s, max taken on its own operand) of a split
    ``reshape(x)`` over an axis the split keeps (``rules.merged_axis``)."""
    e, kept_sum, kept_max, mm = pm.var(), pm.var(), pm.var(), pm.var()
    p <= P.div(e, kept_sum)
    kept_sum <= Expand(z)
    z <= P.reduce_sum(e)
    e <= P.exp(P.sub(r, StopGrad(kept_max)))
    kept_max <= Expand(MaxClamp(mm, m))
    m <= P.reduce_max(r)
    r <= P.reshape(x)
    assert row_major(r.dimensions)
    assert softmax_axes(r.shape, z.axes, m.axes, kept_sum.shape, kept_max.shape)
    assert merged_axis(r.shape, x.shape, z.axes) is not None
    return p


@pm.rule(SplitSoftmax, single_use=True)
def canonical_split_softmax(p, r, x, m, z):
    """``softmax(reshape(x))`` → ``reshape(softmax(x))`` over the same axis of ``x``. (The
    ``max(-inf, .)`` clamp computes nothing and is left out.)"""
    axes = merged_axis(r.shape, x.shape, z.axes)
    assert axes is not None
    shape, dims = kept_shape(x.shape, axes), kept_dims(x.shape, axes)
    assert shape is not None and dims is not None
    top = P.broadcast_in_dim(P.reduce_max(x, axes=axes), shape=shape, broadcast_dimensions=dims)
    e = P.exp(P.sub(x, P.stop_gradient(top)))
    total = P.broadcast_in_dim(P.reduce_sum(e, axes=axes), shape=shape, broadcast_dimensions=dims)
    return P.reshape(P.div(e, total), new_sizes=r.shape, dimensions=None)


@pm.pattern
def SplitMoved(y, r, x):
    """``transpose(reshape(x))``, a split of rank-4 ``x`` moved so that the split pair stays
    adjacent and in order (``rules.split_permutation``)."""
    y <= P.transpose(r)
    r <= P.reshape(x)
    assert row_major(r.dimensions)
    assert split_permutation(y.permutation, r.shape, x.shape, x.op) is not None
    return y


@pm.rule(SplitMoved, single_use=True)
def canonical_split_transpose(y, r, x):
    """``transpose(reshape(x))`` → ``reshape(transpose(x))``: the split moves down the
    transpose, which becomes a rank-4 one."""
    perm = split_permutation(y.permutation, r.shape, x.shape, x.op)
    assert perm is not None
    return P.reshape(P.transpose(x, permutation=perm), new_sizes=y.shape, dimensions=None)


@pm.pattern
def SplitMovedTwice(y, r, t, w):
    """``transpose(reshape(transpose(w)))``: the same, the split value itself moved."""
    y <= P.transpose(r)
    r <= P.reshape(t)
    t <= P.transpose(w)
    assert row_major(r.dimensions)
    assert split_permutation(y.permutation, r.shape, t.shape, t.op) is not None
    return y


@pm.rule(SplitMovedTwice, single_use=True)
def canonical_split_transposes(y, r, t, w):
    """``transpose(reshape(transpose(w)))`` → ``reshape(transpose(w))``, one transpose (none
    where they cancel)."""
    perm = split_permutation(y.permutation, r.shape, t.shape, t.op)
    assert perm is not None
    both = compose_permutations(t.permutation, perm)
    assert both is not None
    if both == (0, 1, 2, 3):
        return P.reshape(w, new_sizes=y.shape, dimensions=None)
    return P.reshape(P.transpose(w, permutation=both), new_sizes=y.shape, dimensions=None)


@pm.pattern
def SplitSoftmaxMoved(p, x, tx, u, tu, w, z, m):
    """A softmax of ``x = reshape(transpose(w))`` whose max is taken on another split of
    the same ``w``, ``u = reshape(transpose(w))`` (penzai's ``vmap``-form softmax once the
    splits moved down: the max on the value before the ``vmap``'s transpose)."""
    e, kept_sum, kept_max, mm = pm.var(), pm.var(), pm.var(), pm.var()
    p <= P.div(e, kept_sum)
    kept_sum <= Expand(z)
    z <= P.reduce_sum(e)
    e <= P.exp(P.sub(x, StopGrad(kept_max)))
    kept_max <= Expand(MaxClamp(mm, m))
    m <= P.reduce_max(u)
    x <= P.reshape(tx)
    tx <= P.transpose(w)
    u <= P.reshape(tu)
    tu <= P.transpose(w)
    assert row_major(x.dimensions) and row_major(u.dimensions) and kept_sum.shape == kept_max.shape
    assert moved_softmax_axis(
        tx.permutation, x.shape, tx.shape, tu.permutation, u.shape, tu.shape, z.axes, m.axes,
        kept_max.shape,
    ) is not None  # fmt: skip
    return p


@pm.rule(SplitSoftmaxMoved, single_use=True)
def canonical_split_softmax_moved(p, x, tx, u, tu, w, z, m):
    """→ ``reshape(softmax(transpose(w)))``, the plain softmax over the axis both reduce."""
    axes = moved_softmax_axis(
        tx.permutation, x.shape, tx.shape, tu.permutation, u.shape, tu.shape, z.axes, m.axes,
        None,
    )  # fmt: skip
    assert axes is not None
    shape, dims = kept_shape(tx.shape, axes), kept_dims(tx.shape, axes)
    assert shape is not None and dims is not None
    y = P.transpose(w, permutation=tx.permutation)
    top = P.broadcast_in_dim(P.reduce_max(y, axes=axes), shape=shape, broadcast_dimensions=dims)
    e = P.exp(P.sub(y, P.stop_gradient(top)))
    total = P.broadcast_in_dim(P.reduce_sum(e, axes=axes), shape=shape, broadcast_dimensions=dims)
    return P.reshape(P.div(e, total), new_sizes=x.shape, dimensions=None)


@pm.pattern
def MergedScores(r, s, a, b):
    """``reshape(dot_general(a, b))``: 5-D grouped scores with (K, G) merged into heads."""
    r <= P.reshape(s)
    s <= P.dot_general(a, b)
    return r


@pm.pattern
def MergedScoresMoved(r, t, s, a, b):
    """``reshape(transpose(dot_general(a, b)))``: the same, moved before the merge."""
    r <= P.reshape(t)
    t <= P.transpose(s)
    s <= P.dot_general(a, b)
    return r


@pm.rule(MergedScores, single_use=True)
def canonical_grouped_scores(r, s, a, b):
    """Grouped 5-D scores with their (K, G) axes merged → the 4-D scores of q (the merged
    query heads) and k repeated per group (``jnp.repeat``), which the attention rules read
    (``Kv``); q's reshape usually cancels with the one that made q 5-D."""
    plan = grouped_scores_plan(a.shape, b.shape, s.dimension_numbers, None, r.shape,
                               r.dimensions)  # fmt: skip
    assert plan is not None
    q5 = a if plan[0] == 0 else b
    k4 = b if plan[0] == 0 else a
    q = P.reshape(q5, new_sizes=plan[1], dimensions=None)
    k = P.reshape(P.broadcast_in_dim(k4, shape=plan[2], broadcast_dimensions=plan[3]),
                  new_sizes=plan[4], dimensions=None)  # fmt: skip
    if plan[5] == 1:
        d = P.dot_general(k, q, dimension_numbers=plan[6], precision=s.precision,
                          preferred_element_type=s.preferred_element_type)  # fmt: skip
    else:
        d = P.dot_general(q, k, dimension_numbers=plan[6], precision=s.precision,
                          preferred_element_type=s.preferred_element_type)  # fmt: skip
    if plan[7] == ():
        return d
    return P.transpose(d, permutation=plan[7])


@pm.rule(MergedScoresMoved, single_use=True)
def canonical_grouped_scores_moved(r, t, s, a, b):
    """The same, for scores transposed before the merge."""
    plan = grouped_scores_plan(a.shape, b.shape, s.dimension_numbers, t.permutation, r.shape,
                               r.dimensions)  # fmt: skip
    assert plan is not None
    q5 = a if plan[0] == 0 else b
    k4 = b if plan[0] == 0 else a
    q = P.reshape(q5, new_sizes=plan[1], dimensions=None)
    k = P.reshape(P.broadcast_in_dim(k4, shape=plan[2], broadcast_dimensions=plan[3]),
                  new_sizes=plan[4], dimensions=None)  # fmt: skip
    if plan[5] == 1:
        d = P.dot_general(k, q, dimension_numbers=plan[6], precision=s.precision,
                          preferred_element_type=s.preferred_element_type)  # fmt: skip
    else:
        d = P.dot_general(q, k, dimension_numbers=plan[6], precision=s.precision,
                          preferred_element_type=s.preferred_element_type)  # fmt: skip
    if plan[7] == ():
        return d
    return P.transpose(d, permutation=plan[7])


@pm.pattern
def SoftmaxOut():
    """Softmax probabilities (maybe cast), or those moved by a transpose
    (``canonical_transpose_softmax`` makes them; ``canonical_transposed_probs`` folds it)."""
    s, z = pm.var(), pm.var()
    return Probs(Softmax(s, z))


@pm.pattern
def SoftmaxOut():  # noqa: F811
    s, z = pm.var(), pm.var()
    return P.transpose(Probs(Softmax(s, z)))


@pm.pattern
def SplitProbs(o, x, y, p):
    """``dot_general(x, y)`` where x or y is ``reshape(p)``: rank-4 softmax probabilities
    with their heads split into (K, G) for a 5-D contraction with unrepeated values. (Only
    probabilities: a 5-D *scores* contraction of a split q is ``MergedScores``' where its
    heads are merged back, and ``jax.nn.dot_product_attention``'s rules read it as it is.)"""
    o <= P.dot_general(x, y)
    x <= P.reshape(p)
    p <= SoftmaxOut()
    assert row_major(x.dimensions)
    return o


@pm.pattern
def SplitProbs(o, x, y, p):  # noqa: F811
    o <= P.dot_general(x, y)
    y <= P.reshape(p)
    p <= SoftmaxOut()
    assert row_major(y.dimensions)
    return o


@pm.rule(SplitProbs, single_use=True)
def canonical_grouped_probs(o, x, y, p):
    """Grouped 5-D probabilities · unrepeated v → the 4-D contraction of the probabilities
    with v repeated per group (what the attention rules read), its heads split back into
    (K, G) and moved into the original output's layout."""
    plan = grouped_probs_plan(x.shape, y.shape, p.shape, o.dimension_numbers, None)
    assert plan is not None
    v4 = y if plan[0] == 0 else x
    v = P.reshape(P.broadcast_in_dim(v4, shape=plan[1], broadcast_dimensions=plan[2]),
                  new_sizes=plan[3], dimensions=None)  # fmt: skip
    if plan[0] == 0:
        d = P.dot_general(p, v, dimension_numbers=plan[4], precision=o.precision,
                          preferred_element_type=o.preferred_element_type)  # fmt: skip
    else:
        d = P.dot_general(v, p, dimension_numbers=plan[4], precision=o.precision,
                          preferred_element_type=o.preferred_element_type)  # fmt: skip
    split = P.reshape(d, new_sizes=plan[5], dimensions=None)
    if plan[6] == ():
        return split
    return P.transpose(split, permutation=plan[6])


# ------------------------------------------- scores moved into a query-major layout
#
# Gemma and tunix's Gemma merge grouped scores into ``[B, T, N, S]`` (queries before heads),
# which no ``dot_general`` produces: ``canonical_grouped_scores_moved`` leaves a transpose
# after the 4-D contraction. These rules move that transpose down the scores chain (the
# soft-cap's scalar operations, the mask, the softmax) and fold it into the contraction with
# v, so the chain runs in the contraction's own layout, the one the attention rules read.
# Only rank-4 transposes of values computed by a ``dot_general`` or pointwise from one
# (``rules.sinks_transpose``): ``jax.nn.dot_product_attention``'s rank-5 moves stay.


@pm.pattern
def MovedUnary(y, t, x, f):
    """``f(transpose(x))`` for a unary pointwise ``f``."""
    y <= f(t)
    t <= P.transpose(x)
    assert sinks_transpose(f.name, x.op, x.rank)
    return y


@pm.rule(MovedUnary, single_use=True)
def canonical_transpose_unary(y, t, x, f):
    """``f(transpose(x))`` → ``transpose(f(x))``."""
    if f.name == "tanh":
        return P.transpose(P.tanh(x), permutation=t.permutation)
    if f.name == "logistic":
        return P.transpose(P.logistic(x), permutation=t.permutation)
    if f.name == "exp":
        return P.transpose(P.exp(x), permutation=t.permutation)
    assert f.name == "neg"
    return P.transpose(P.neg(x), permutation=t.permutation)


@pm.pattern
def MovedScalar(y, a, b, x, f):
    """``f(transpose(x), c)`` or ``f(c, transpose(x))`` for a binary pointwise ``f`` and a
    scalar ``c`` (a soft-cap's ``s / cap``, ``* cap``)."""
    y <= f(a, b)
    a <= P.transpose(x)
    assert b.rank == 0 and sinks_transpose(f.name, x.op, x.rank)
    return y


@pm.pattern
def MovedScalar(y, a, b, x, f):  # noqa: F811
    y <= f(a, b)
    b <= P.transpose(x)
    assert a.rank == 0 and sinks_transpose(f.name, x.op, x.rank)
    return y


@pm.rule(MovedScalar, single_use=True)
def canonical_transpose_scalar(y, a, b, x, f):
    """``f(transpose(x), c)`` → ``transpose(f(x, c))`` (either operand order)."""
    if a.rank == 0:
        if f.name == "mul":
            return P.transpose(P.mul(a, x), permutation=b.permutation)
        if f.name == "div":
            return P.transpose(P.div(a, x), permutation=b.permutation)
        if f.name == "add":
            return P.transpose(P.add(a, x), permutation=b.permutation)
        assert f.name == "sub"
        return P.transpose(P.sub(a, x), permutation=b.permutation)
    if f.name == "mul":
        return P.transpose(P.mul(x, b), permutation=a.permutation)
    if f.name == "div":
        return P.transpose(P.div(x, b), permutation=a.permutation)
    if f.name == "add":
        return P.transpose(P.add(x, b), permutation=a.permutation)
    assert f.name == "sub"
    return P.transpose(P.sub(x, b), permutation=a.permutation)


@pm.pattern
def MovedWhere(y, m, c, t, x):
    """``select_n(m, c, transpose(x))`` (``jnp.where(m, transpose(x), c)``), ``m`` and ``c``
    as large as the result (a broadcast mask and fill)."""
    y <= P.select_n(m, c, t)
    t <= P.transpose(x)
    assert m.rank == 4 and c.rank == 4 and sinks_transpose(y.op, x.op, x.rank)
    return y


@pm.rule(MovedWhere, single_use=True)
def canonical_transpose_where(y, m, c, t, x):
    """``select_n(m, c, transpose(x))`` → ``transpose(select_n(m', c', x))``, the mask and
    the fill moved back by the inverse transpose."""
    back = inverse_of(t.permutation)
    assert back is not None
    return P.transpose(
        P.select_n(P.transpose(m, permutation=back), P.transpose(c, permutation=back), x),
        permutation=t.permutation,
    )


@pm.pattern
def MovedSoftmax(p, t, u, m, z):
    """The plain softmax (``jax.nn.softmax``'s, max taken on its own operand) of a rank-4
    ``transpose(u)``."""
    e, kept_sum, kept_max, mm = pm.var(), pm.var(), pm.var(), pm.var()
    p <= P.div(e, kept_sum)
    kept_sum <= Expand(z)
    z <= P.reduce_sum(e)
    e <= P.exp(P.sub(t, StopGrad(kept_max)))
    kept_max <= Expand(MaxClamp(mm, m))
    m <= P.reduce_max(t)
    t <= P.transpose(u)
    assert t.rank == 4 and softmax_axes(t.shape, z.axes, m.axes, kept_sum.shape, kept_max.shape)
    return p


@pm.rule(MovedSoftmax, single_use=True)
def canonical_transpose_softmax(p, t, u, m, z):
    """``softmax(transpose(u))`` → ``transpose(softmax(u))`` over the moved axis. (The
    ``max(-inf, .)`` clamp computes nothing and is left out.)"""
    axes = moved_axes(t.permutation, m.axes)
    shape, dims = kept_shape(u.shape, axes), kept_dims(u.shape, axes)
    assert axes is not None and shape is not None and dims is not None
    top = P.broadcast_in_dim(P.reduce_max(u, axes=axes), shape=shape, broadcast_dimensions=dims)
    e = P.exp(P.sub(u, P.stop_gradient(top)))
    total = P.broadcast_in_dim(P.reduce_sum(e, axes=axes), shape=shape, broadcast_dimensions=dims)
    return P.transpose(P.div(e, total), permutation=t.permutation)


@pm.pattern
def TransposedProbs(o, t, y, p):
    """``dot_general(transpose(p), y)``, ``p`` softmax probabilities."""
    s, z = pm.var(), pm.var()
    o <= P.dot_general(t, y)
    t <= P.transpose(p)
    p <= Probs(Softmax(s, z))
    return o


@pm.rule(TransposedProbs, single_use=True)
def canonical_transposed_probs(o, t, y, p):
    """``dot_general(transpose(p), y)`` → ``dot_general(p, y)`` with the transpose folded
    into the dimension numbers (where p's free axes keep their order: the same result)."""
    dn = fold_operand_transpose(o.dimension_numbers, t.permutation, 0)
    assert dn is not None
    return P.dot_general(p, y, dimension_numbers=dn, precision=o.precision,
                         preferred_element_type=o.preferred_element_type)  # fmt: skip


@pm.pattern
def TransposedProbsSecond(o, x, t, p):
    """``dot_general(x, transpose(p))``, ``p`` softmax probabilities."""
    s, z = pm.var(), pm.var()
    o <= P.dot_general(x, t)
    t <= P.transpose(p)
    p <= Probs(Softmax(s, z))
    return o


@pm.rule(TransposedProbsSecond, single_use=True)
def canonical_transposed_probs_second(o, x, t, p):
    """The same, the probabilities second."""
    dn = fold_operand_transpose(o.dimension_numbers, t.permutation, 1)
    assert dn is not None
    return P.dot_general(x, p, dimension_numbers=dn, precision=o.precision,
                         preferred_element_type=o.preferred_element_type)  # fmt: skip


# ------------------------------------------------------------- sliced projections


@pm.pattern
def SlicedDot(y, d, x, w):
    """``slice(dot_general(x, w))`` narrowing only axes the weight ``w`` contributes (a
    fused gate/up projection cut into its halves), the full result read only by such
    slices."""
    y <= P.slice(d)
    d <= P.dot_general(x, w)
    assert weight_slice(d.term, y.term, None) != None  # noqa: E711
    return y


@pm.pattern
def SlicedDotT(y, t, d, x, w):
    """The same through the einsum's output transpose: ``slice(transpose(dot_general))``."""
    y <= P.slice(t)
    t <= P.transpose(d)
    d <= P.dot_general(x, w)
    assert weight_slice(d.term, y.term, t.permutation) != None  # noqa: E711
    return y


@pm.pattern
def SplitDot(y, d, x, w):
    """One output of ``split(dot_general(x, w))`` along a weight axis in two
    (``jnp.split(x @ w, 2, axis=-1)``): the first half..."""
    S = pm.Op(1, 2)
    assert S.name == "split"
    y <= S(d)[0]
    d <= P.dot_general(x, w)
    assert weight_split(d.term, y.term) != None  # noqa: E711
    return y


@pm.pattern
def SplitDot(y, d, x, w):  # noqa: F811
    """... and the second."""
    S = pm.Op(1, 2)
    assert S.name == "split"
    y <= S(d)[1]
    d <= P.dot_general(x, w)
    assert weight_split(d.term, y.term) != None  # noqa: E711
    return y


@pm.pattern
def SqueezedDot(y, d, x, w):
    """``squeeze(dot_general(x, w))`` of size-1 axes the weight contributes."""
    y <= P.squeeze(d)
    d <= P.dot_general(x, w)
    assert weight_squeeze(d.term, y.dimensions, None) != None  # noqa: E711
    return y


@pm.pattern
def SqueezedDotT(y, t, d, x, w):
    y <= P.squeeze(t)
    t <= P.transpose(d)
    d <= P.dot_general(x, w)
    assert weight_squeeze(d.term, y.dimensions, t.permutation) != None  # noqa: E711
    return y


@pm.pattern
def SwappedDot(y, d, a, b):
    """``transpose(dot_general(a, b))`` that is ``dot_general(b, a)``, ``b`` contracting its
    last axis (the weight-first form ``jnp.einsum`` writes for some output orders)."""
    y <= P.transpose(d)
    d <= P.dot_general(a, b)
    assert swapped_dot(d.term, y.permutation) != None  # noqa: E711
    return y


@pm.rule(SlicedDot)
def canonical_sliced_dot(y, d, x, w):
    """``slice(x · w)`` → ``x · slice(w)``: the weight sliced as the result was (the
    weight is either operand: ``weight_side``)."""
    s = weight_slice(d.term, y.term, None)
    if weight_side(d.term) == 1:
        ws = P.slice(w, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            x,
            ws,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        xs = P.slice(x, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            xs,
            w,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )


@pm.rule(SlicedDotT)
def canonical_sliced_dot_t(y, t, d, x, w):
    """``slice(transpose(x · w))`` → ``transpose(x · slice(w))``."""
    s = weight_slice(d.term, y.term, t.permutation)
    if weight_side(d.term) == 1:
        ws = P.slice(w, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.transpose(
            P.dot_general(
                x,
                ws,
                dimension_numbers=d.dimension_numbers,
                precision=d.precision,
                preferred_element_type=d.preferred_element_type,
            ),
            permutation=t.permutation,
        )
    else:
        xs = P.slice(x, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.transpose(
            P.dot_general(
                xs,
                w,
                dimension_numbers=d.dimension_numbers,
                precision=d.precision,
                preferred_element_type=d.preferred_element_type,
            ),
            permutation=t.permutation,
        )


@pm.rule(SplitDot)
def canonical_split_dot(y, d, x, w):
    """``split(x · w)[i]`` → ``x · slice(w)``: the weight cut as the result was."""
    s = weight_split(d.term, y.term)
    if weight_side(d.term) == 1:
        ws = P.slice(w, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            x,
            ws,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        xs = P.slice(x, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            xs,
            w,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )


@pm.rule(SqueezedDot, single_use=True)
def canonical_squeezed_dot(y, d, x, w):
    """``squeeze(x · w)`` → ``x · squeeze(w)``: the size-1 weight axis dropped first."""
    s = weight_squeeze(d.term, y.dimensions, None)
    if weight_side(d.term) == 1:
        return P.dot_general(
            x,
            P.squeeze(w, dimensions=s[0]),
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        return P.dot_general(
            P.squeeze(x, dimensions=s[0]),
            w,
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )


@pm.rule(SqueezedDotT, single_use=True)
def canonical_squeezed_dot_t(y, t, d, x, w):
    """``squeeze(transpose(x · w))`` → ``transpose(x · squeeze(w))``."""
    s = weight_squeeze(d.term, y.dimensions, t.permutation)
    perm = squeezed_permutation(t.permutation, y.dimensions)
    if weight_side(d.term) == 1:
        dot = P.dot_general(
            x,
            P.squeeze(w, dimensions=s[0]),
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        dot = P.dot_general(
            P.squeeze(x, dimensions=s[0]),
            w,
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    return P.transpose(dot, permutation=perm)


@pm.rule(SwappedDot, single_use=True)
def canonical_swapped_dot(y, d, a, b):
    """``transpose(a · b)`` → ``b · a`` where the transpose only swaps the operands'
    axes."""
    return P.dot_general(
        b,
        a,
        dimension_numbers=swapped_dot(d.term, y.permutation),
        precision=d.precision,
        preferred_element_type=d.preferred_element_type,
    )


CANONICAL_RULES = [
    canonical_copy,
    canonical_transposes,
    canonical_reshapes,
    canonical_softmax,
    canonical_scaled_reshape,
    canonical_grouped_scores,
    canonical_grouped_scores_moved,
    canonical_grouped_probs,
    canonical_split_scores,
    canonical_split_unary,
    canonical_split_scalar,
    canonical_split_where,
    canonical_split_where_second,
    canonical_split_softmax,
    canonical_split_transposes,
    canonical_split_transpose,
    canonical_split_softmax_moved,
    canonical_transpose_unary,
    canonical_transpose_scalar,
    canonical_transpose_where,
    canonical_transpose_softmax,
    canonical_transposed_probs,
    canonical_transposed_probs_second,
    canonical_sliced_dot,
    canonical_sliced_dot_t,
    canonical_split_dot,
    canonical_squeezed_dot,
    canonical_squeezed_dot_t,
    canonical_swapped_dot,
]
