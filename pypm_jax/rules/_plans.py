"""Guard functions of the standard rules: pure Python over attribute values, never JAX.

Patterns stay data (guards are core-calculus expressions, never Python callables): a guard names these functions, registered under stable
``rules.*`` names, and calls them with the attributes of matched values (shapes, dtypes,
``dimension_numbers``, ``axes``, ``permutation``...). They answer two kinds of questions:

* small structural predicates (is this ``broadcast_in_dim`` only inserting size-1 axes? is this
  ``reshape(broadcast_in_dim(k))`` an interleaved repeat of kv heads?), and
* *plans*: how a matched attention or GEMM maps onto a kernel. A plan names, for the kernel's
  layout, which axis of each operand is batch / heads / sequence / head-dim, the transposes
  that bring the operands into the kernel's layout and the kernel's result back into the
  layout of the value the rule replaces. A plan is ``None`` when the matched dimension
  numbers do not compute an attention (or a GEMM) the kernel can express, so a guard
  ``plan(...) is not None`` rejects those matches and the matcher backtracks.

Everything here is total: a malformed argument returns ``None``/``False`` rather than raising
(an exception would make the guard undefined, which also fails, but with a worse message).
"""

from __future__ import annotations

__all__ = [
    "AttentionPlan",
    "GemmPlan",
    "attention_plan",
    "attention_output",
    "dpa_plan",
    "attention_supported",
    "causal_plan",
    "causal_flag_plan",
    "zero_rows_plan",
    "sink_axis",
    "sinks_plan",
    "keeps_axes",
    "moves_last_to_row",
    "slice_keeps_origin",
    "reshape_keeps_last_two",
    "tril_compare",
    "gemm_plan",
    "gemm_supported",
    "inserts_unit_axes",
    "unit_broadcast",
    "interleaved_repeat",
    "softmax_axes",
    "vmapped_softmax_axes",
    "noop_reshape",
    "inverse_permutation",
    "row_major",
    "kept_shape",
    "kept_dims",
    "grouped_scores_plan",
    "grouped_probs_plan",
    "sinks_transpose",
    "merges_through",
    "split_scores",
    "split_permutation",
    "compose_permutations",
    "moved_softmax_axis",
    "merged_axis",
    "merged_broadcast",
    "inverse_of",
    "moved_axes",
    "fold_operand_transpose",
    "head_mask_identity",
    "scale_kind",
    "bias_sign",
    "activation_of",
    "bias_vector",
]

from typing import Any, NamedTuple

from ..lang.registry import guard_fn
from ..semantics.guards import Refusal
from ._region import PRIMS, describe, region_error

# --------------------------------------------------------------------------- helpers


def _ints(xs: Any) -> tuple[int, ...] | None:
    try:
        return tuple(map(int, xs))  # (guards call this ~50 times per attention matched)
    except (TypeError, ValueError):
        return None


def _dn(
    dn: Any,
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """``((lc, rc), (lb, rb))`` of a ``dot_general`` as four int tuples."""
    try:
        (lc, rc), (lb, rb) = dn
    except (TypeError, ValueError):
        return None
    parts = (_ints(lc), _ints(rc), _ints(lb), _ints(rb))
    if any(p is None for p in parts):
        return None
    return parts  # type: ignore[return-value]


def _dtype_name(dt: Any) -> str | None:
    """A pm dtype (or anything with a numpy name) as the numpy name the kernels take."""
    name = getattr(dt, "numpy_name", None)
    if name is None and isinstance(dt, str):
        name = dt
    return name


def _perm_apply(shape: tuple[int, ...], perm: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(shape[p] for p in perm)


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)


def _is_perm(perm: Any, n: int) -> bool:
    p = _ints(perm)
    return p is not None and sorted(p) == list(range(n))


def _axis(axes: Any, rank: int) -> int | None:
    """The single axis of a reduction's ``axes`` (non-negative), or None."""
    a = _ints(axes)
    if a is None or len(a) != 1:
        return None
    ax = a[0] % rank if rank else None
    return ax


def _drop_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


# ------------------------------------------------------------------ small predicates


@guard_fn("rules.inserts_unit_axes")
def inserts_unit_axes(broadcast_dimensions: Any, out_shape: Any, in_shape: Any) -> bool:
    """Is this expansion only inserting size-1 axes (``keepdims=True`` after a reduction)?

    ``broadcast_dimensions`` of a ``broadcast_in_dim``, or None for a ``reshape``.
    """
    out, inp = _ints(out_shape), _ints(in_shape)
    if out is None or inp is None or len(out) < len(inp):
        return False
    if broadcast_dimensions is None:  # reshape: same elements in the same order
        return _drop_ones(out) == _drop_ones(inp)
    dims = _ints(broadcast_dimensions)
    if dims is None or len(dims) != len(inp) or list(dims) != sorted(set(dims)):
        return False
    if any(out[d] != s for d, s in zip(dims, inp, strict=True)):
        return False
    return all(out[i] == 1 for i in range(len(out)) if i not in dims)


@guard_fn("rules.unit_broadcast")
def unit_broadcast(broadcast_dimensions: Any, out_shape: Any, in_shape: Any) -> bool:
    """A ``broadcast_in_dim`` that keeps every axis in place, only growing size-1 axes.

    Such a broadcast of a mask or bias can be skipped: the kernel broadcasts by itself.
    """
    dims, out, inp = _ints(broadcast_dimensions), _ints(out_shape), _ints(in_shape)
    if dims is None or out is None or inp is None or len(out) != len(inp):
        return False
    if dims != tuple(range(len(inp))):
        return False
    return all(i == o or i == 1 for i, o in zip(inp, out, strict=True))


@guard_fn("rules.interleaved_repeat")
def interleaved_repeat(
    broadcast_dimensions: Any, expanded_shape: Any, in_shape: Any, out_shape: Any
) -> bool:
    """Is ``reshape(broadcast_in_dim(x))`` the interleaved repeat ``jnp.repeat(x, g, axis)``?

    ``broadcast_in_dim`` inserts one new axis right after ``axis`` and the reshape merges the
    two, so head ``h`` of the result is head ``h // g`` of ``x`` -- the grouping the flash
    attention kernel uses for grouped kv heads. (A tile -- new axis *before* ``axis`` -- maps
    ``h`` to ``h % n`` and is not accepted.)
    """
    dims, exp, inp, out = (
        _ints(v) for v in (broadcast_dimensions, expanded_shape, in_shape, out_shape)
    )
    if dims is None or exp is None or inp is None or out is None:
        return False
    r = len(inp)
    if len(exp) != r + 1 or len(out) != r or len(dims) != r:
        return False
    missing = [i for i in range(r + 1) if i not in dims]
    if len(missing) != 1 or missing[0] == 0:
        return False
    new = missing[0]
    axis = new - 1
    if dims != tuple(i if i <= axis else i + 1 for i in range(r)):
        return False
    if any(exp[d] != s for d, s in zip(dims, inp, strict=True)):
        return False
    g = exp[new]
    want = tuple(s * g if i == axis else s for i, s in enumerate(inp))
    return g >= 1 and out == want


@guard_fn("rules.softmax_axes")
def softmax_axes(
    x_shape: Any, sum_axes: Any, max_axes: Any, sum_kept_shape: Any, max_kept_shape: Any
) -> bool:
    """The max and the sum of a softmax reduce the same single axis of ``x`` and are put
    back in place of that axis (given both expansions only insert size-1 axes)."""
    x = _ints(x_shape)
    if x is None or not x:
        return False
    ax = _axis(sum_axes, len(x))
    if ax is None or _axis(max_axes, len(x)) != ax:
        return False
    kept = tuple(1 if i == ax else d for i, d in enumerate(x))
    return _ints(sum_kept_shape) == kept and _ints(max_kept_shape) == kept


@guard_fn("rules.vmapped_softmax_axes")
def vmapped_softmax_axes(
    x_shape: Any,
    x_perm: Any,
    sum_axes: Any,
    max_axes: Any,
    max_perm: Any,
    sum_kept_shape: Any,
    max_kept_shape: Any,
) -> bool:
    """A softmax of ``x = transpose(u, x_perm)`` whose max was taken on ``u`` and then moved
    by ``transpose(., max_perm)`` (what ``vmap`` makes of ``jax.nn.softmax``)."""
    x, xp, mp = _ints(x_shape), _ints(x_perm), _ints(max_perm)
    if x is None or xp is None or mp is None or not _is_perm(xp, len(x)):
        return False
    ax = _axis(sum_axes, len(x))
    if ax is None:
        return False
    u_ax = xp[ax]  # the softmax axis, in u's frame
    if _axis(max_axes, len(x)) != u_ax:
        return False
    # the max's axes (u's axes minus u_ax, in order) must land where x keeps them
    rest_u = [i for i in range(len(x)) if i != u_ax]
    want = tuple(rest_u.index(xp[i]) for i in range(len(x)) if i != ax)
    if mp != want:
        return False
    kept = tuple(1 if i == ax else d for i, d in enumerate(x))
    return _ints(sum_kept_shape) == kept and _ints(max_kept_shape) == kept


# ------------------------------------------------------------------ canonical forms


@guard_fn("rules.noop_reshape")
def noop_reshape(dimensions: Any, in_shape: Any, out_shape: Any) -> bool:
    """A row-major ``reshape`` (no ``dimensions``) to the operand's own shape."""
    inp, out = _ints(in_shape), _ints(out_shape)
    return dimensions is None and inp is not None and inp == out


@guard_fn("rules.inverse_permutation")
def inverse_permutation(first: Any, then: Any) -> bool:
    """Does ``transpose(transpose(x, first), then)`` give back ``x``?"""
    a, b = _ints(first), _ints(then)
    if a is None or b is None or len(a) != len(b) or not _is_perm(a, len(a)):
        return False
    return _perm_apply(a, b) == tuple(range(len(a)))


@guard_fn("rules.row_major")
def row_major(dimensions: Any) -> bool:
    """A ``reshape`` without ``dimensions``: it keeps the elements in row-major order."""
    return dimensions is None


@guard_fn("rules.kept_shape")
def kept_shape(shape: Any, axes: Any) -> tuple[int, ...] | None:
    """``shape`` with its one reduced axis kept as size 1 (``keepdims=True``), or None."""
    s = _ints(shape)
    ax = None if s is None else _axis(axes, len(s))
    if ax is None:
        return None
    return tuple(1 if i == ax else d for i, d in enumerate(s))


@guard_fn("rules.kept_dims")
def kept_dims(shape: Any, axes: Any) -> tuple[int, ...] | None:
    """The ``broadcast_dimensions`` that put a reduction over one axis back in place (with
    a size-1 axis there), or None."""
    s = _ints(shape)
    ax = None if s is None else _axis(axes, len(s))
    if ax is None:
        return None
    return tuple(i for i in range(len(s)) if i != ax)


# ------------------------------------------------------- grouped-query attention (5-D)
#
# Grouped-query attention written as a 5-D einsum: q regrouped to ``[.., K, G, ..]`` (kv head
# k, group member g; query head n = k*G + g) and contracted with the *unrepeated* k (and the
# probabilities with the unrepeated v). The canonical rules rewrite both contractions to the
# 4-D form the attention rules read: q with its (K, G) axes merged, k (or v) repeated per
# group as ``jnp.repeat`` does (``reshape(broadcast_in_dim(.))``, ``interleaved_repeat``).


def _merge(shape: tuple[int, ...], i: int) -> tuple[int, ...]:
    """``shape`` with axes ``i`` and ``i + 1`` merged (row-major)."""
    return (*shape[:i], shape[i] * shape[i + 1], *shape[i + 2 :])


def _repeat(shape: tuple[int, ...], axis: int, g: int) -> tuple[Any, ...]:
    """``(broadcast shape, broadcast_dimensions, reshaped shape)`` of ``jnp.repeat(x, g,
    axis)`` spelled ``reshape(broadcast_in_dim(x))``: the group axis right after ``axis``."""
    expanded = (*shape[: axis + 1], g, *shape[axis + 1 :])
    dims = tuple(i if i <= axis else i + 1 for i in range(len(shape)))
    return expanded, dims, (*shape[:axis], shape[axis] * g, *shape[axis + 1 :])


def _free(rank: int, contract: tuple[int, ...], batch: tuple[int, ...]) -> list[int]:
    return [i for i in range(rank) if i not in contract and i not in batch]


def _frame(first: str, firsts: list[int], second: str, seconds: list[int], order: Any) -> list:
    """Labels of a ``dot_general``'s output axes: the batch pairs (``order``), then the first
    operand's free axes, then the second's."""
    return [("b", order[0]), ("b", order[1]), *((first, i) for i in firsts)] + [
        (second, i) for i in seconds
    ]


def _grouped_dn(
    g_first: bool, cg: int, bg: tuple[int, ...], co: int, bo: tuple[int, ...], order: Any
) -> tuple[Any, ...]:
    """``dimension_numbers`` of a 4-D contraction of the merged operand (contracting ``cg``,
    batch axes ``bg``) with the repeated one (``co``, ``bo``), batch pairs in ``order``."""
    gb, ob = tuple(bg[o] for o in order), tuple(bo[o] for o in order)
    if g_first:
        return (((cg,), (co,)), (gb, ob))
    return (((co,), (cg,)), (ob, gb))


def _perm_to(frame: list[Any], target: list[Any]) -> tuple[int, ...]:
    """The transpose taking ``frame`` to ``target`` (``()`` when they agree)."""
    if frame == target:
        return ()
    return tuple(frame.index(lab) for lab in target)


@guard_fn("rules.grouped_scores_plan")
def grouped_scores_plan(
    a_shape: Any, b_shape: Any, dn: Any, perm: Any, out_shape: Any, dimensions: Any
) -> tuple[Any, ...] | None:
    """``reshape(transpose(dot_general(a, b), perm))`` (``perm`` None: no transpose) that merges
    the (K, G) axes of 5-D grouped scores into query heads, as a 4-D contraction.

    One operand is the grouped query ``q5`` (rank 5: a batch axis K paired with the other
    operand's kv-head axis, the group axis G right after it, free), the other ``k4`` (rank 4,
    one free axis); one contracted axis, two batch axes. The reshape (row-major, rank 4) must
    merge K and G, K first (head ``k*G + g``: ``jnp.repeat``'s grouping; a (G, K) merge is
    ``jnp.tile``'s and is refused).

    Returns ``(grouped, q4_shape, expanded, dims, repeated, k_first, dn4, perm4)``:
    ``grouped`` is the index (0, 1) of q5 among (a, b); q4 is ``reshape(q5, q4_shape)``; k
    repeated per group is ``reshape(broadcast_in_dim(k4, expanded, dims), repeated)``; the
    4-D ``dot_general`` takes them in the order ``k_first`` says, with ``dn4``, chosen so
    that no transpose follows where one order gives the reshape's layout; ``perm4`` is the
    transpose after it (``()``: none). None if the match is not such a merge.
    """
    a, b, out, d = _ints(a_shape), _ints(b_shape), _ints(out_shape), _dn(dn)
    if dimensions is not None or a is None or b is None or out is None or d is None:
        return None
    ca, cb, ba, bb = d
    if len(out) != 4 or len(ca) != 1 or len(cb) != 1 or len(ba) != 2 or len(bb) != 2:
        return None
    if (len(a), len(b)) == (5, 4):
        grouped, q, k, cq, ck, bq, bk = 0, a, b, ca[0], cb[0], ba, bb
    elif (len(a), len(b)) == (4, 5):
        grouped, q, k, cq, ck, bq, bk = 1, b, a, cb[0], ca[0], bb, ba
    else:
        return None
    if any(not 0 <= i < len(s) for s, ax in ((q, (cq, *bq)), (k, (ck, *bk))) for i in ax):
        return None
    q_free, k_free = _free(5, (cq,), bq), _free(4, (ck,), bk)
    if len(q_free) != 2 or len(k_free) != 1 or q[cq] != k[ck]:
        return None
    if any(q[bq[j]] != k[bk[j]] for j in (0, 1)):
        return None
    if grouped == 0:
        frame = _frame("q", q_free, "k", k_free, (0, 1))
    else:
        frame = _frame("k", k_free, "q", q_free, (0, 1))
    if perm is None:
        moved = frame
    else:
        p = _ints(perm)
        if p is None or not _is_perm(p, 5):
            return None
        moved = [frame[i] for i in p]
    sizes = {("b", j): q[bq[j]] for j in (0, 1)}
    sizes.update({("q", i): q[i] for i in q_free})
    sizes.update({("k", i): k[i] for i in k_free})
    shape5 = tuple(sizes[lab] for lab in moved)
    for i in range(4):
        kl, gl = moved[i], moved[i + 1]
        if _merge(shape5, i) != out or kl[0] != "b" or gl != ("q", bq[kl[1]] + 1):
            continue
        j, kq = kl[1], bq[kl[1]]
        g = q[kq + 1]

        def m(ax: int, kq: int = kq) -> int:  # q5's axes as q4's
            return ax - 1 if ax > kq + 1 else ax

        expanded, dims, repeated = _repeat(k, bk[j], g)
        target = [lab for lab in moved if lab != gl]
        t_free = [i for i in q_free if i != gl[1]]
        qb4 = tuple(m(x) for x in bq)
        best = None
        for k_first in (grouped, 1 - grouped):  # program order first
            for order in ((0, 1), (1, 0)):
                if k_first:
                    f4 = _frame("k", k_free, "q", t_free, order)
                else:
                    f4 = _frame("q", t_free, "k", k_free, order)
                dn4 = _grouped_dn(not k_first, m(cq), qb4, ck, bk, order)
                p4 = _perm_to(f4, target)
                if best is None or (best[2] and not p4):
                    best = (k_first, dn4, p4)
        k_first, dn4, p4 = best  # type: ignore[misc]
        return (grouped, _merge(q, kq), expanded, dims, repeated, k_first, dn4, p4)
    return None


@guard_fn("rules.grouped_probs_plan")
def grouped_probs_plan(
    x_shape: Any, y_shape: Any, p4_shape: Any, dn: Any, dimensions: Any
) -> tuple[Any, ...] | None:
    """``dot_general(x, y)`` of 5-D grouped probabilities ``p5 = reshape(p4)`` (one of x, y:
    heads N of the rank-4 ``p4`` split into (K, G), K first) and unrepeated values ``v`` (the
    other, rank 4), as a 4-D contraction of ``p4`` with v repeated per group.

    ``p5``'s K must be a batch axis paired with v's kv-head axis and G a free axis; one
    contracted axis, two batch axes. Returns ``(grouped, expanded, dims, repeated, dn4,
    split, perm5)``: ``grouped`` is p5's index among (x, y), which the 4-D ``dot_general``
    keeps (p4 in its place, v repeated as ``reshape(broadcast_in_dim(v, expanded, dims),
    repeated)`` in the other) with ``dn4``; its result reshaped to ``split`` (heads split
    back into (K, G)) and transposed by ``perm5`` (``()``: none) is the original 5-D output.
    None if the match is not such a contraction.
    """
    x, y, p4, d = _ints(x_shape), _ints(y_shape), _ints(p4_shape), _dn(dn)
    if dimensions is not None or x is None or y is None or p4 is None or d is None:
        return None
    cx, cy, bx, by = d
    if len(p4) != 4 or len(cx) != 1 or len(cy) != 1 or len(bx) != 2 or len(by) != 2:
        return None
    if (len(x), len(y)) == (5, 4):
        grouped, p5, v, cp, cv, bp, bv = 0, x, y, cx[0], cy[0], bx, by
    elif (len(x), len(y)) == (4, 5):
        grouped, p5, v, cp, cv, bp, bv = 1, y, x, cy[0], cx[0], by, bx
    else:
        return None
    if any(not 0 <= i < len(s) for s, ax in ((p5, (cp, *bp)), (v, (cv, *bv))) for i in ax):
        return None
    p_free, v_free = _free(5, (cp,), bp), _free(4, (cv,), bv)
    if len(p_free) != 2 or len(v_free) != 1 or p5[cp] != v[cv]:
        return None
    if any(p5[bp[j]] != v[bv[j]] for j in (0, 1)):
        return None
    for n in range(4):
        if _merge(p5, n) != p4 or n not in bp or n + 1 not in p_free:
            continue
        j, g = bp.index(n), p5[n + 1]

        def m(ax: int, n: int = n) -> int:  # p5's axes as p4's
            return ax - 1 if ax > n + 1 else ax

        expanded, dims, repeated = _repeat(v, bv[j], g)
        t_free = [i for i in p_free if i != n + 1]
        if grouped == 0:
            frame5 = _frame("p", p_free, "v", v_free, (0, 1))
            frame4 = _frame("p", t_free, "v", v_free, (0, 1))
        else:
            frame5 = _frame("v", v_free, "p", p_free, (0, 1))
            frame4 = _frame("v", v_free, "p", t_free, (0, 1))
        dn4 = _grouped_dn(grouped == 0, m(cp), tuple(m(i) for i in bp), cv, bv, (0, 1))
        sizes = {("b", i): p5[bp[i]] for i in (0, 1)}
        sizes.update({("p", i): p5[i] for i in p_free})
        sizes.update({("v", i): v[i] for i in v_free})
        at = frame4.index(("b", j)) + 1
        split_frame = [*frame4[:at], ("p", n + 1), *frame4[at:]]
        split = tuple(sizes[lab] for lab in split_frame)
        return (grouped, expanded, dims, repeated, dn4, split, _perm_to(split_frame, frame5))
    return None


# The pointwise operators the transpose-moving canonical rules re-apply (their results
# name each: a rule applies operators, not operator variables).
_MOVES_UNARY = frozenset({"tanh", "logistic", "exp", "neg"})
_MOVES_BINARY = frozenset({"mul", "div", "add", "sub"})


@guard_fn("rules.sinks_transpose")
def sinks_transpose(op: Any, moved_op: Any, rank: Any) -> bool:
    """May ``op(transpose(x))`` (``op`` pointwise, its other operands scalars) become
    ``transpose(op(x))``? For rank-4 ``x`` computed by a ``dot_general`` or pointwise from
    one (scores moved into a query-major layout: ``[B, T, N, S]``), so the scores chain runs
    in the contraction's own layout, the one the attention rules read. ``op`` is one the
    rules re-apply (a soft-cap's ``tanh``, scalar ``mul``/``div``/``add``/``sub``, ``exp``,
    ``logistic``, ``neg``, ``select_n``); ``moved_op`` is ``x``'s operator."""
    name, moved = (o if isinstance(o, str) else getattr(o, "name", None) for o in (op, moved_op))
    if rank != 4 or name not in _MOVES_UNARY | _MOVES_BINARY | {"select_n"}:
        return False
    return moved in _MOVES_UNARY | _MOVES_BINARY | {"dot_general", "select_n"}


def _merges(in_shape: Any, out_shape: Any) -> list[int]:
    """The axes ``i`` such that merging ``i`` and ``i + 1`` of rank-5 ``in_shape`` (row-major)
    gives rank-4 ``out_shape`` (several where size-1 axes make it ambiguous: the same
    reshape)."""
    a, b = _ints(in_shape), _ints(out_shape)
    if a is None or b is None or len(a) != 5 or len(b) != 4:
        return []
    return [i for i in range(4) if _merge(a, i) == b]


@guard_fn("rules.split_scores")
def split_scores(
    a_shape: Any, b_shape: Any, dn: Any, perm: Any, shape: Any
) -> tuple[int, ...] | None:
    """The rank-4 shape whose row-major split is ``transpose(dot_general(a, b), perm)``
    (of shape ``shape``): 5-D grouped scores whose (K, G) axes are adjacent, K first, so
    that they equal the 4-D scores of the merged query heads split back
    (``rules.grouped_scores_plan`` gives those; where several adjacent pairs read so, the
    innermost: a leading batch axis followed by the queries is not a head grouping). None
    otherwise."""
    out = _ints(shape)
    if out is None or len(out) != 5:
        return None
    for i in (3, 2, 1, 0):  # innermost first: never a batch axis merged with the queries
        merged = _merge(out, i)
        if grouped_scores_plan(a_shape, b_shape, dn, perm, merged, None) is not None:
            return merged
    return None


_SPLIT_SOURCES = _MOVES_UNARY | _MOVES_BINARY | {"dot_general", "select_n", "transpose"}


def _pair_after(perm: tuple[int, ...], i: int) -> int | None:
    """Where the adjacent axes ``i``, ``i + 1`` land, still adjacent and in order, after
    ``transpose(., perm)``; None if they do not."""
    at = perm.index(i)
    return at if at + 1 < len(perm) and perm[at + 1] == i + 1 else None


@guard_fn("rules.split_permutation")
def split_permutation(perm: Any, shape: Any, x_shape: Any, x_op: Any) -> tuple[int, ...] | None:
    """``transpose(reshape(x), perm)``, the reshape a row-major split of an axis of rank-4
    ``x`` into two (``shape``), as ``reshape(transpose(x, perm4))``: the permutation ``perm4``
    of ``x``'s axes, where the split pair stays adjacent and in order. Only for ``x``
    computed by a contraction, pointwise, ``select_n`` or a transpose (scores: a mask
    regrouped for ``jax.nn.dot_product_attention`` keeps its form). None otherwise."""
    p, out, x = _ints(perm), _ints(shape), _ints(x_shape)
    name = x_op if isinstance(x_op, str) else getattr(x_op, "name", None)
    if p is None or out is None or x is None or not _is_perm(p, 5) or name not in _SPLIT_SOURCES:
        return None
    for i in _merges(out, x):
        at = _pair_after(p, i)
        if at is None:
            continue
        kept = [a for a in p if a != i + 1]
        return tuple(a if a <= i else a - 1 for a in kept)
    return None


@guard_fn("rules.compose_permutations")
def compose_permutations(first: Any, then: Any) -> tuple[int, ...] | None:
    """The permutation of ``transpose(transpose(x, first), then)``, or None."""
    a, b = _ints(first), _ints(then)
    if a is None or b is None or len(a) != len(b) or not _is_perm(a, len(a)):
        return None
    if not _is_perm(b, len(b)):
        return None
    return tuple(a[i] for i in b)


def _split_frame(perm: tuple[int, ...], shape: tuple[int, ...], i: int) -> list[Any]:
    """Labels of the axes of ``reshape(transpose(w, perm))`` split at ``i``: w's axis, and
    the part of a split one, with its size."""
    out: list[Any] = []
    for k, a in enumerate(perm):
        if k == i:
            out += [(a, 0, shape[i]), (a, 1, shape[i + 1])]
        else:
            out.append((a, -1, shape[k if k < i else k + 1]))
    return out


@guard_fn("rules.moved_softmax_axis")
def moved_softmax_axis(
    x_perm: Any, x_shape: Any, t_shape: Any, u_perm: Any, u_shape: Any, s_shape: Any,
    sum_axes: Any, max_axes: Any, kept_shape: Any,
) -> tuple[int, ...] | None:  # fmt: skip
    """A softmax of ``x = reshape(transpose(w, x_perm))`` whose max is taken on another
    split of the same rank-4 ``w``, ``u = reshape(transpose(w, u_perm))`` (penzai's
    ``vmap``-form softmax, after the splits moved down): the axis of ``transpose(w, x_perm)``
    (shape ``t_shape``; ``s_shape`` is ``transpose(w, u_perm)``'s) it reduces, where the max
    reduces the same axis of ``w`` and keeps the others in x's order (both kept as
    ``kept_shape``: x's shape, 1 on the reduced axis; None: not asked). None otherwise."""
    px, pu = _ints(x_perm), _ints(u_perm)
    x, t, u, sh = _ints(x_shape), _ints(t_shape), _ints(u_shape), _ints(s_shape)
    kept = _ints(kept_shape)
    if px is None or pu is None or x is None or u is None or t is None or sh is None:
        return None
    if not _is_perm(px, 4) or not _is_perm(pu, 4) or len(x) != 5 or len(u) != 5:
        return None
    ax, au = _axis(sum_axes, 5), _axis(max_axes, 5)
    if ax is None or au is None:
        return None
    if kept_shape is not None and kept != tuple(1 if k == ax else d for k, d in enumerate(x)):
        return None
    for i in _merges(x, t):
        if ax in (i, i + 1):
            continue
        fx = _split_frame(px, x, i)
        for j in _merges(u, sh):
            fu = _split_frame(pu, u, j)
            if fx[ax] == fu[au] and [f for k, f in enumerate(fx) if k != ax] == [
                f for k, f in enumerate(fu) if k != au
            ]:
                return (ax if ax < i else ax - 1,)
    return None


@guard_fn("rules.merges_through")
def merges_through(op: Any, in_shape: Any, out_shape: Any) -> bool:
    """May ``op(reshape(x))`` (``op`` pointwise, its other operands scalars) become
    ``reshape(op(x))``? For a row-major reshape between rank-5 ``in_shape`` and rank-4
    ``out_shape`` merging (or, read the other way, splitting) two adjacent axes: grouped
    scores' (K, G) and the query heads. ``op`` is one the rules re-apply."""
    name = op if isinstance(op, str) else getattr(op, "name", None)
    return name in _MOVES_UNARY | _MOVES_BINARY and bool(_merges(in_shape, out_shape))


@guard_fn("rules.merged_axis")
def merged_axis(in_shape: Any, out_shape: Any, axes: Any) -> tuple[int, ...] | None:
    """A single reduced axis of rank-5 ``in_shape`` as an axis of its rank-4 merge
    ``out_shape``, where the merged pair is not reduced (or the reduced axis merges with a
    size-1 axis): a softmax over it commutes with the merge. None otherwise."""
    a = _ints(in_shape)
    for i in _merges(in_shape, out_shape):
        ax = _axis(axes, 5)
        if ax is None or a is None:
            return None
        if ax < i:
            return (ax,)
        if ax > i + 1:
            return (ax - 1,)
        if a[2 * i + 1 - ax] == 1:  # the other axis of the pair has size 1
            return (i,)
    return None


@guard_fn("rules.merged_broadcast")
def merged_broadcast(
    broadcast_dimensions: Any, in_shape: Any, shape: Any, out_shape: Any
) -> tuple[Any, ...] | None:
    """``reshape(broadcast_in_dim(x, shape, broadcast_dimensions), out_shape)`` merging two
    adjacent axes of a rank-5 ``shape``, as a broadcast: ``(split, x_shape, dims)`` where
    the result is ``broadcast_in_dim(x', out_shape, dims)``, ``x'`` being ``x`` (``split``
    0) or ``reshape(x, x_shape)`` (1: x's own axes on the pair merged too). For a broadcast
    mask or fill merged with the scores it masks. None where the merge mixes a broadcast
    axis with one of x's (``jnp.repeat``'s grouping: not a broadcast)."""
    dims, x, out5 = _ints(broadcast_dimensions), _ints(in_shape), _ints(shape)
    if dims is None or x is None or out5 is None or len(dims) != len(x):
        return None
    if any(not 0 <= d < len(out5) for d in dims) or list(dims) != sorted(set(dims)):
        return None
    if any(s not in (1, out5[d]) for s, d in zip(x, dims, strict=True)):
        return None
    for i in _merges(shape, out_shape):
        pair = [j for j, d in enumerate(dims) if d in (i, i + 1)]
        moved = tuple(d if d <= i else d - 1 for d in dims)
        if not pair:
            return (0, x, moved)
        if len(pair) == 1:
            j = pair[0]
            other = i + 1 if dims[j] == i else i
            if x[j] == 1 or out5[other] == 1:
                return (0, x, moved)
            continue
        j = pair[0]
        full = (x[j], x[j + 1]) == (out5[i], out5[i + 1])
        if (
            full
            or x[j] == x[j + 1] == 1
            or (out5[i] == 1 and x[j + 1] == out5[i + 1])
            or (out5[i + 1] == 1 and x[j] == out5[i])
        ):
            return (1, _merge(x, j), moved[: j + 1] + moved[j + 2 :])
    return None


@guard_fn("rules.inverse_of")
def inverse_of(perm: Any) -> tuple[int, ...] | None:
    """The permutation undoing ``perm``, or None."""
    p = _ints(perm)
    return _inverse(p) if p is not None and _is_perm(p, len(p)) else None


@guard_fn("rules.moved_axes")
def moved_axes(perm: Any, axes: Any) -> tuple[int, ...] | None:
    """A reduction's ``axes`` of ``transpose(u, perm)`` as axes of ``u``."""
    p, a = _ints(perm), _ints(axes)
    if p is None or a is None or not _is_perm(p, len(p)) or any(not 0 <= i < len(p) for i in a):
        return None
    return tuple(p[i] for i in a)


@guard_fn("rules.fold_operand_transpose")
def fold_operand_transpose(dn: Any, perm: Any, side: Any) -> tuple[Any, ...] | None:
    """``dimension_numbers`` of ``dot_general`` reading ``x`` itself where it read
    ``transpose(x, perm)`` as operand ``side`` (0: lhs, 1: rhs): the same result when the
    operand's free axes keep their order; else None."""
    d, p = _dn(dn), _ints(perm)
    if d is None or p is None or not _is_perm(p, len(p)) or side not in (0, 1):
        return None
    cx, cy, bx, by = d
    c, b = (cx, bx) if side == 0 else (cy, by)
    if any(not 0 <= i < len(p) for i in (*c, *b)):
        return None
    free = [p[i] for i in range(len(p)) if i not in c and i not in b]
    if free != sorted(free):
        return None
    c2, b2 = tuple(p[i] for i in c), tuple(p[i] for i in b)
    if side == 0:
        return ((c2, cy), (b2, by))
    return ((cx, c2), (bx, b2))


@guard_fn("rules.head_mask_identity")
def head_mask_identity(dimension_numbers: Any, permutation: Any, rank: Any) -> bool:
    """``transpose(dot_general(mask[h], p))`` multiplies each head of p by its entry of a
    rank-1 head mask and restores p's axis order (Hugging Face's ``einsum("...hqk,h->...hqk")``).
    """
    dn = _dn(dimension_numbers)
    perm = _ints(permutation)
    try:
        n = int(rank)
    except (TypeError, ValueError):
        return False
    if dn is None or perm is None or not _is_perm(perm, n):
        return False
    lc, rc, lb, rb = dn
    if lc or rc or lb != (0,) or len(rb) != 1:
        return False
    h = rb[0]
    produced = (h, *(i for i in range(n) if i != h))  # dot_general output: batch, then p's rest
    return _perm_apply(produced, perm) == tuple(range(n))


@guard_fn("rules.scale_kind")
def scale_kind(op: Any) -> int | None:
    """+1 for scores multiplied by a scalar, -1 for scores divided by one."""
    return {"mul": 1, "div": -1}.get(getattr(op, "name", None))


@guard_fn("rules.bias_sign")
def bias_sign(op: Any) -> int | None:
    """+1 for a bias added to the scores, -1 for one subtracted from them."""
    name = getattr(op, "name", None)
    return {"add": 1, "sub": -1}.get(name)


# ------------------------------------------------------------------------ attention


class AttentionPlan(NamedTuple):
    """How one matched attention runs on ``pallas_kernels.flash_attention``.

    The kernel node's inputs are ``(a, b, v, bias, mask, scale)``: ``a``/``b`` the operands of
    the scores ``dot_general`` in program order (``q_operand`` says which is the query), ``v``
    the values. Each is transposed by its ``perm_*`` into ``layout``; ``bias``/``mask`` (in the
    program's score layout) by ``perm_scores`` into ``[B, H, Sq, Skv]``; the kernel result by
    ``perm_out`` into the layout of the replaced value. ``scale`` is the scalar the program
    multiplies (or divides) the scores by, if ``scale_input``; the kernel's own scale is 1
    otherwise (a scale on q or k is already in the operands).
    """

    layout: str
    q_operand: int
    perm_q: tuple[int, ...]
    perm_k: tuple[int, ...]
    perm_v: tuple[int, ...]
    perm_scores: tuple[int, ...]
    perm_out: tuple[int, ...]
    scale_input: int  # 0: no scale input; 1: scores times it; -1: scores divided by it
    bias: int  # 0: none, 1: added, -1: subtracted
    mask: bool
    kernel_shapes: tuple[Any, ...]  # (q, k, v, bias | None, mask | None) in the kernel layout
    dtype: str
    out_shape: tuple[int, ...]
    out_dtype: str
    mask_is_causal: bool = False  # the kernel may skip blocks above the diagonal (causal_plan)
    causal: bool = False  # the kernel masks above the diagonal itself (causal_flag_plan)
    masked_rows: str = "uniform"  # "zero": a fully masked row gives 0 (zero_rows_plan)
    sinks: bool = False  # the node's last input is one extra logit per head (sinks_plan)


_LAYOUT_AXES = {"BHSD": ("B", "H", "S", "D"), "BSHD": ("B", "S", "H", "D")}


def _operand_perm(axes: dict[str, int], layout: str) -> tuple[int, ...]:
    return tuple(axes[label] for label in _LAYOUT_AXES[layout])


def _identity_count(perms: list[tuple[int, ...]]) -> int:
    return sum(p == tuple(range(len(p))) for p in perms)


@guard_fn("rules.attention_output")
def attention_output(dn: Any, rank: Any) -> bool:
    """Can a ``dot_general`` of these dimension numbers, of this rank, be an attention's
    output as :func:`attention_plan` reads one (rank 4, each operand contracting one axis
    over two batch axes)? A necessary condition of a plan, checked on the output before the
    pattern explores the softmax under it (Hugging Face's head-mask einsum contracts
    nothing)."""
    odn = _dn(dn)
    return rank == 4 and odn is not None and tuple(len(p) for p in odn) == (1, 1, 2, 2)


@guard_fn("rules.attention_plan")
def attention_plan(
    shapes: Any,
    dtypes: Any,
    scores: Any,
    output: Any,
    bias: Any = None,
    mask: Any = None,
    scaled: Any = 0,
    sign: Any = 1,
) -> AttentionPlan | None:
    """Plan for ``o = dot_general(softmax(f(dot_general(a, b))), v)`` (either operand order).

    ``shapes = (a, b, v)`` (``a``/``b`` may be kv heads *before* an interleaved repeat),
    ``dtypes = (a, b, v)``, ``scores = (dimension_numbers, shape, softmax axes)`` of the scores
    ``dot_general``, ``output = (dimension_numbers, shape, dtype)`` of the output
    ``dot_general``; ``bias``/``mask`` are ``(shape, dtype)`` in the scores' layout (rank 4,
    or a rank-0 bias: BEiT's default ``jnp.array(0.0)``) or None;
    ``scaled`` is 1 (-1) when the scores are multiplied (divided) by a scalar input; ``sign``
    is -1 for a subtracted bias.

    The scores must be rank 4: two batch axes (batch and heads, in any order), the query's
    free axis and the key's free axis, contracting one head-dim axis; the softmax runs over
    the key axis. The output contracts the probabilities' key axis with v's sequence axis
    and keeps the same batch axes. Returns None if anything else is matched, or if the
    output's operand order cannot be told from the dimension numbers and shapes.
    """
    try:
        a_shape, b_shape, v_shape = (_ints(s) for s in shapes)
        s_dn, s_shape, s_axes = scores
        o_dn, o_shape, o_dtype = output
        dts = tuple(_dtype_name(d) for d in dtypes)
    except (TypeError, ValueError):
        return None
    s_shape, o_shape = _ints(s_shape), _ints(o_shape)
    sdn, odn = _dn(s_dn), _dn(o_dn)
    if None in (a_shape, b_shape, v_shape, s_shape, o_shape, sdn, odn) or None in dts:
        return None
    if not (len(a_shape) == len(b_shape) == len(v_shape) == len(s_shape) == len(o_shape) == 4):
        return None
    ca, cb, ba, bb = sdn
    if len(ca) != 1 or len(cb) != 1 or len(ba) != 2 or len(bb) != 2:
        return None
    ax = _axis(s_axes, 4)
    if ax not in (2, 3):
        return None
    qpos = 5 - ax  # the query's free axis in the scores
    # the key is the operand whose free axis the softmax normalises over
    if ax == 3:
        q_op, q_shape, k_shape, cq, ck, bq, bk = 0, a_shape, b_shape, ca[0], cb[0], ba, bb
    else:
        q_op, q_shape, k_shape, cq, ck, bq, bk = 1, b_shape, a_shape, cb[0], ca[0], bb, ba
    q_free = [i for i in range(4) if i != cq and i not in bq]
    k_free = [i for i in range(4) if i != ck and i not in bk]
    if len(q_free) != 1 or len(k_free) != 1:
        return None
    sq, skv = s_shape[qpos], s_shape[ax]
    d = q_shape[cq]
    if q_shape[q_free[0]] != sq or k_shape[k_free[0]] != skv or k_shape[ck] != d:
        return None
    if any(q_shape[bq[j]] != s_shape[j] for j in (0, 1)):
        return None
    # grouped kv heads: k holds fewer heads than q on exactly one batch axis
    grouped = [j for j in (0, 1) if k_shape[bk[j]] != s_shape[j]]
    if len(grouped) > 1:
        return None
    for j in grouped:
        if k_shape[bk[j]] < 1 or s_shape[j] % k_shape[bk[j]]:
            return None
    h_label = grouped[0] if grouped else 1
    b_label = 1 - h_label
    kv_batch = {j: k_shape[bk[j]] for j in (0, 1)}

    # the output: which operand of o is the probabilities (frame = the scores' frame)?
    xc, yc, xb, yb = odn
    found = []
    for p_first in (True, False):
        pc, vc, pb, vb = (xc, yc, xb, yb) if p_first else (yc, xc, yb, xb)
        if pc != (ax,) or sorted(pb) != [0, 1] or len(vc) != 1 or len(vb) != 2:
            continue
        v_axes = {("b", pb[i]): vb[i] for i in (0, 1)}
        v_seq = vc[0]
        v_rest = [i for i in range(4) if i != v_seq and i not in vb]
        if len(v_rest) != 1:
            continue
        v_d = v_rest[0]
        if v_shape[v_seq] != skv or any(v_shape[v_axes[("b", j)]] != kv_batch[j] for j in (0, 1)):
            continue
        # output: batch axes in pair order (labelled by the probabilities' side), then the
        # first operand's free axis, then the second's
        batch_labels = [("b", j) for j in pb]
        labels = [*batch_labels, "q", "d"] if p_first else [*batch_labels, "d", "q"]
        sizes = {("b", 0): s_shape[0], ("b", 1): s_shape[1], "q": sq, "d": v_shape[v_d]}
        if tuple(sizes[lab] for lab in labels) != o_shape:
            continue
        found.append((labels, v_axes, v_seq, v_d))
    if len(found) != 1:
        return None  # not an attention output, or ambiguous operand order
    labels, v_axes, v_seq, v_d = found[0]

    q_axes = {"B": bq[b_label], "H": bq[h_label], "S": q_free[0], "D": cq}
    k_axes = {"B": bk[b_label], "H": bk[h_label], "S": k_free[0], "D": ck}
    vv_axes = {"B": v_axes[("b", b_label)], "H": v_axes[("b", h_label)], "S": v_seq, "D": v_d}
    best = None
    for layout in ("BSHD", "BHSD"):
        perms = [_operand_perm(ax_, layout) for ax_ in (q_axes, k_axes, vv_axes)]
        score = _identity_count(perms)
        if best is None or score > best[0]:
            best = (score, layout, perms)
    _, layout, (perm_q, perm_k, perm_v) = best
    # scores frame -> [B, H, Sq, Skv]
    perm_scores = (b_label, h_label, qpos, ax)
    # kernel output (layout) -> o's frame
    out_label = {("b", b_label): "B", ("b", h_label): "H", "q": "S", "d": "D"}
    kernel_axes = _LAYOUT_AXES[layout]
    perm_out = tuple(kernel_axes.index(out_label[lab]) for lab in labels)

    extras = []
    for rank0_ok, what in ((True, bias), (False, mask)):
        if what is None:
            extras.append(None)
            continue
        try:
            e_shape, _ = what
        except (TypeError, ValueError):
            return None
        e_shape = _ints(e_shape)
        if e_shape is None or len(e_shape) not in ((0, 4) if rank0_ok else (4,)):
            return None
        extras.append(_perm_apply(e_shape, perm_scores) if e_shape else ())
    if bias is not None and not str(_dtype_name(bias[1])).startswith(("float", "bfloat")):
        return None  # the kernel adds floating biases
    if mask is not None and not str(_dtype_name(mask[1])).startswith(("bool", "int", "uint")):
        return None  # and reads boolean or integer masks (nonzero: attend)
    try:
        scaled_i, sign_i = int(scaled), int(sign)
    except (TypeError, ValueError):
        return None
    if scaled_i not in (-1, 0, 1) or sign_i not in (1, -1):
        return None
    kernel_shapes = (
        _perm_apply(q_shape, perm_q),
        _perm_apply(k_shape, perm_k),
        _perm_apply(v_shape, perm_v),
        extras[0],
        extras[1],
    )
    dtype = _common_float(dts)
    if dtype is None or _dtype_name(o_dtype) is None:
        return None
    return AttentionPlan(
        layout=layout,
        q_operand=q_op,
        perm_q=perm_q,
        perm_k=perm_k,
        perm_v=perm_v,
        perm_scores=perm_scores,
        perm_out=perm_out,
        scale_input=scaled_i,
        bias=0 if bias is None else sign_i,
        mask=mask is not None,
        kernel_shapes=kernel_shapes,
        dtype=dtype,
        out_shape=o_shape,
        out_dtype=_dtype_name(o_dtype),
    )


def _common_float(dts: tuple[str, ...]) -> str | None:
    """The kernel's dtype for operands of these dtypes: their dtype when they agree; float32
    when floats are mixed (Flax's ``dot_product_attention_weights(dtype=f32)``, which Hugging
    Face Llama uses with bf16 weights, promotes q and k to f32 but not v: widening v is exact,
    and the kernel then keeps in f32 what the program rounded to bf16); else None."""
    if len(set(dts)) == 1:
        return dts[0]
    if all(d in ("float32", "bfloat16", "float16") for d in dts):
        return "float32"
    return None


@guard_fn("rules.dpa_plan")
def dpa_plan(
    shapes: Any,
    dtypes: Any,
    scores: Any,
    output: Any,
    mask: Any = None,
    bias: Any = None,
) -> AttentionPlan | None:
    """Plan for ``jax.nn.dot_product_attention``'s XLA implementation (``nnx.MultiHeadAttention``).

    That function reshapes q ``[B, T, N, H]`` to ``[B, T, K, G, H]`` (``N = K * G`` query
    heads per kv head), computes ``logits = einsum("BTKGH,BSKH->BKTGS")`` scaled by a
    constant, ``vmap`` s the softmax over G (which moves G to the front:
    ``transpose(logits, (3, 0, 1, 2, 4))``), ``encoded = einsum(v, probs) -> [B, K, H, G, T]``,
    and transposes/reshapes back to ``[B, T, N, H]``.

    ``shapes = (q, k, v)`` with q before its reshape, ``scores = (dimension_numbers, shape,
    logits permutation, softmax axes)`` of the logits ``dot_general``, ``output = (dimension_numbers, (perm1, perm2), shape,
    dtype)``, ``mask = (shape, dtype)`` of the ``[B, 1 | N, T, S]`` boolean mask or None
    (``is_causal``'s ``[1, 1, T, S]`` triangle is such a mask), ``bias`` likewise for an
    added floating bias. q/k/v are already in the kernel's BSHD layout, so the plan is all
    identities.
    """
    try:
        q, k, v = (_ints(s) for s in shapes)
        s_dn, s_shape, s_perm, s_axes = scores
        o_dn, (p1, p2), o_shape, o_dtype = output
        dts = tuple(_dtype_name(d) for d in dtypes)
    except (TypeError, ValueError):
        return None
    o_shape, s_shape = _ints(o_shape), _ints(s_shape)
    if None in (q, k, v, s_shape, o_shape) or None in dts or len(set(dts)) != 1:
        return None
    if len(q) != 4 or len(k) != 4 or k != v or len(s_shape) != 5:
        return None
    b, t, n, h = q
    _, s, kh, _ = k
    # logits [B, K, T, G, S] of q regrouped as [B, T, K, G, H]
    if n % kh or s_shape != (b, kh, t, n // kh, s) or k[0] != b or k[3] != h:
        return None
    if _dn(s_dn) != ((4,), (3,), (0, 2), (0, 2)) or _ints(s_perm) != (3, 0, 1, 2, 4):
        return None
    if _axis(s_axes, 5) != 4:
        return None
    if _dn(o_dn) != ((1,), (4,), (0, 2), (1, 2)):
        return None
    p1, p2 = _ints(p1), _ints(p2)
    if p1 is None or p2 is None or len(p1) != 5 or len(p2) != 5:
        return None
    # [B, K, H, G, T] --p1, p2--> must be [B, T, K, G, H], then reshaped to [B, T, N, H]
    if tuple(p1[i] for i in p2) != (0, 4, 1, 3, 2) or o_shape != q:
        return None
    mask_shape = bias_shape = None
    if mask is not None:
        m_shape, m_dtype = mask
        mask_shape = _ints(m_shape)
        if mask_shape is None or len(mask_shape) != 4:
            return None
        if not str(_dtype_name(m_dtype)).startswith(("bool", "int", "uint")):
            return None
    if bias is not None:
        b_shape, b_dtype = bias
        bias_shape = _ints(b_shape)
        if bias_shape is None or len(bias_shape) != 4:
            return None
        if not str(_dtype_name(b_dtype)).startswith(("float", "bfloat")):
            return None
    ident = (0, 1, 2, 3)
    return AttentionPlan(
        layout="BSHD",
        q_operand=0,
        perm_q=ident,
        perm_k=ident,
        perm_v=ident,
        perm_scores=ident,
        perm_out=ident,
        scale_input=1,
        bias=0 if bias is None else 1,
        mask=mask is not None,
        kernel_shapes=(q, k, v, bias_shape, mask_shape),
        dtype=dts[0],
        out_shape=o_shape,
        out_dtype=_dtype_name(o_dtype),
    )


@guard_fn("rules.attention_supported")
def attention_supported(plan: Any) -> bool | Refusal:
    """Does ``pallas_kernels.flash_attention`` take this plan's shapes and dtype? (A
    :class:`~pypm_jax.Refusal` saying why not, for ``pm.explain``.)"""
    if not isinstance(plan, AttentionPlan):
        return Refusal("no attention plan: the operands do not form [B, H, S, D] attention")
    from pallas_kernels import attention_unsupported  # pure Python; no JAX tracing

    q, k, v, bias, mask = plan.kernel_shapes
    why = attention_unsupported(
        q, k, v, plan.dtype, layout=plan.layout, bias_shape=bias, mask_shape=mask
    )
    return True if why is None else Refusal(f"the attention kernel does not take it: {why}")


@guard_fn("rules.zero_rows_plan")
def zero_rows_plan(plan: Any) -> AttentionPlan | None:
    """The plan with the kernel's ``masked_rows="zero"``: a row whose every key the mask
    hides gives 0 (and no gradient), as a program that re-zeroes its probabilities with the
    mask that masked its scores computes. None without a mask (nothing to re-zero by)."""
    if not isinstance(plan, AttentionPlan) or not plan.mask:
        return None
    return plan._replace(masked_rows="zero")


@guard_fn("rules.sink_axis")
def sink_axis(broadcast_dimensions: Any, src_shape: Any, sinks_shape: Any) -> int | None:
    """The axis of a broadcast sink column along which the ``[N]`` sinks lie: ``src`` (the
    broadcast's operand) is the sinks themselves, or the sinks reshaped to one non-unit axis
    (``sinks.reshape(1, -1, 1, 1)``); None otherwise."""
    dims, src, s = _ints(broadcast_dimensions), _ints(src_shape), _ints(sinks_shape)
    if dims is None or src is None or s is None or len(s) != 1 or len(dims) != len(src):
        return None
    big = [i for i, d in enumerate(src) if d != 1]
    if len(src) == 1 or (len(big) == 1 and src[big[0]] == s[0]):
        return dims[big[0]] if big else dims[0]
    return None


@guard_fn("rules.sinks_plan")
def sinks_plan(plan: Any, axis: Any, concat: Any, sliced: Any) -> AttentionPlan | None:
    """The plan with the kernel's ``sinks``: the logits were concatenated with a column of
    per-head sink logits (broadcast from ``[N]`` along the scores' ``axis``) on the softmax
    axis, after the logits, and the probabilities sliced back to the logits' keys.

    ``concat = (dimension, logits shape)``; ``sliced = (start, limit, strides)`` of the
    ``slice``. None unless the column lies along the heads and the slice keeps exactly the
    logits' entries."""
    if not isinstance(plan, AttentionPlan) or plan.sinks:
        return None
    try:
        dim, x_shape = concat
        start, limit, strides = sliced
        dim, axis = int(dim), int(axis)
    except (TypeError, ValueError):
        return None
    x, st, li = _ints(x_shape), _ints(start), _ints(limit)
    if x is None or st is None or li is None or len(x) != 4:
        return None
    if dim != plan.perm_scores[3] or axis != plan.perm_scores[1]:
        return None
    if any(st) or li != x or (strides is not None and any(d != 1 for d in _ints(strides) or (0,))):
        return None
    return plan._replace(sinks=True)


# --------------------------------------------------------------------- causal masks
#
# ``rules/causal.py`` proves that a mask is False above the diagonal of its last two axes
# (query row i, key column j > i) from how the program builds it: comparisons of iotas,
# then broadcasts, slices, casts and conjunctions that keep that property. These predicates
# say which of those ops keep it: they must leave the last two axes where they are, at the
# same sizes (or move an index axis exactly where the pattern says).


@guard_fn("rules.keeps_axes")
def keeps_axes(broadcast_dimensions: Any, in_shape: Any, out_shape: Any, n: Any) -> bool:
    """A ``broadcast_in_dim`` that maps the operand's last ``n`` axes onto the result's last
    ``n`` axes at the same sizes (other axes may be added or grown)."""
    dims, inp, out = _ints(broadcast_dimensions), _ints(in_shape), _ints(out_shape)
    try:
        n = int(n)
    except (TypeError, ValueError):
        return False
    if dims is None or inp is None or out is None or n < 1 or len(inp) < n or len(out) < n:
        return False
    if len(dims) != len(inp):
        return False
    r = len(out)
    return dims[-n:] == tuple(range(r - n, r)) and inp[-n:] == out[-n:]


@guard_fn("rules.moves_last_to_row")
def moves_last_to_row(broadcast_dimensions: Any, in_shape: Any, out_shape: Any) -> bool:
    """A ``broadcast_in_dim`` that puts the operand's last axis at the result's second-last
    axis, same size (Flax's ``expand_dims(idx, -1)`` of a key index makes a query index)."""
    dims, inp, out = _ints(broadcast_dimensions), _ints(in_shape), _ints(out_shape)
    if dims is None or inp is None or out is None or not inp or len(out) < 2:
        return False
    return len(dims) == len(inp) and dims[-1] == len(out) - 2 and inp[-1] == out[-2]


@guard_fn("rules.slice_keeps_origin")
def slice_keeps_origin(start_indices: Any, strides: Any, n: Any) -> bool:
    """A ``slice`` starting at 0 with stride 1 on the last ``n`` axes (``m[..., :T, :S]``):
    position (i, j) of the result is position (i, j) of the operand."""
    start = _ints(start_indices)
    try:
        n = int(n)
    except (TypeError, ValueError):
        return False
    if start is None or n < 1 or len(start) < n or any(start[-n:]):
        return False
    if strides is None:
        return True
    st = _ints(strides)
    return st is not None and len(st) == len(start) and all(x == 1 for x in st[-n:])


@guard_fn("rules.reshape_keeps_last_two")
def reshape_keeps_last_two(dimensions: Any, in_shape: Any, out_shape: Any) -> bool:
    """A row-major ``reshape`` (no ``dimensions``) that keeps the last two axes: it only
    merges, splits, adds or drops leading axes (``tril[None, None]``)."""
    inp, out = _ints(in_shape), _ints(out_shape)
    if dimensions is not None or inp is None or out is None or len(inp) < 2 or len(out) < 2:
        return False
    return inp[-2:] == out[-2:]


@guard_fn("rules.has_rows")
def has_rows(shape: Any) -> bool:
    """More than one row: a second-last axis longer than 1 (a mask that can be causal in a
    way worth promising; a padding mask broadcast over the queries has one row)."""
    s = _ints(shape)
    return s is not None and len(s) >= 2 and s[-2] > 1


@guard_fn("rules.tril_compare")
def tril_compare(row_shape: Any, col_shape: Any, out_shape: Any) -> bool:
    """``row >= col`` (or ``>``) of a query index and a key index: the query index must span
    the rows and the key index the columns (either may be size 1 on the other axis and
    broadcast by the comparison)."""
    r, c, o = _ints(row_shape), _ints(col_shape), _ints(out_shape)
    if r is None or c is None or o is None or len(o) < 2 or not len(r) == len(c) == len(o):
        return False
    return r[-2] == o[-2] and c[-1] == o[-1]


def _triangle_axes(plan: AttentionPlan, shape: Any) -> Any:
    """((rows, cols), (Sq, Skv)): the sizes of a rank-4 score-layout value's last two axes,
    when those are the kernel's (query, key) axes (its diagonal is top-left aligned there),
    and the kernel's lengths; None otherwise."""
    shape = _ints(shape)
    if shape is None or len(shape) != 4 or tuple(plan.perm_scores[2:]) != (2, 3):
        return None
    seq_axis = _LAYOUT_AXES[plan.layout].index("S")
    lengths = (plan.kernel_shapes[0][seq_axis], plan.kernel_shapes[1][seq_axis])
    return shape[2:], lengths


@guard_fn("rules.causal_plan")
def causal_plan(plan: Any, causal: Any, part: Any, bias_dtype: Any = None) -> Any:
    """The plan of a flash-attention node whose mask (``part="mask"``) or bias
    (``part="bias"``) is proven to mask every key above the diagonal, with the kernel's
    ``mask_is_causal`` promise on: it skips those blocks, and computes what it did before.

    ``causal = (shape, dtype)`` of the boolean array proven False above the diagonal of its
    last two axes, in the program's score layout: the mask itself, or the ``p`` of a bias
    ``where(p, 0, big_negative)`` (maybe plus another bias). Returns None when the plan
    already has the promise, has no such mask or added bias, or when those last two axes
    are not the kernel's (query, key) axes at the full key length -- the kernel's diagonal
    is top-left aligned in them. A bias must not be float16 (its big negative would not be).
    """
    if not isinstance(plan, AttentionPlan) or plan.mask_is_causal:
        return None
    try:
        c_shape, c_dtype = causal
    except (TypeError, ValueError):
        return None
    if not str(_dtype_name(c_dtype)).startswith(("bool", "int", "uint")):
        return None
    if part == "mask":
        if not plan.mask:
            return None
    elif part == "bias":
        if plan.bias != 1 or _dtype_name(bias_dtype) not in ("float32", "bfloat16"):
            return None
    else:
        return None
    found = _triangle_axes(plan, c_shape)
    if found is None:
        return None
    (rows, cols), (sq, skv) = found
    if cols != skv or rows not in (1, sq):
        return None
    return plan._replace(mask_is_causal=True)


@guard_fn("rules.causal_flag_plan")
def causal_flag_plan(plan: Any, triangle: Any) -> Any:
    """The plan with the kernel's own ``causal`` flag on, for a program that also masks with
    ``triangle`` (the shape of a value proven nonzero exactly on and below the diagonal of
    its last two axes: ``jax.nn.dot_product_attention(mask=..., is_causal=True)``). The
    triangle must be the kernel's whole ``[Sq, Skv]`` (top-left, as the kernel's flag), in
    the kernel's (query, key) axes; None otherwise, or when the flag is on already."""
    if not isinstance(plan, AttentionPlan) or plan.causal:
        return None
    found = _triangle_axes(plan, triangle)
    if found is None or found[0] != found[1]:
        return None
    return plan._replace(causal=True)


# ----------------------------------------------------------------------------- GEMM


class GemmPlan(NamedTuple):
    """How a matched ``act(dot_general(x, w) + b)`` runs on ``pallas_kernels.gemm_epilogue``."""

    activation: str
    transpose_w: bool  # w is stored [N, K]
    k: int
    n: int
    bias: bool
    dtype: str
    out_shape: tuple[int, ...]
    out_dtype: str


@guard_fn("rules.gemm_plan")
def gemm_plan(
    x_shape: Any,
    w_shape: Any,
    dtypes: Any,
    dimension_numbers: Any,
    out: Any,
    bias_shape: Any = None,
    activation: Any = "none",
) -> GemmPlan | None:
    """Plan for ``dot_general(x, w)`` contracting x's last axis with one axis of a matrix w
    (no batch axes), with an optional bias of N elements and an activation.

    ``dtypes = (x, w, dot result)``, ``out = (shape, dtype)`` of the replaced value. Mixed
    precision (a result dtype other than the operands') is not planned: the kernel returns
    the operands' dtype.
    """
    x, w = _ints(x_shape), _ints(w_shape)
    dn = _dn(dimension_numbers)
    try:
        dts = tuple(_dtype_name(d) for d in dtypes)
        o_shape, o_dtype = out
    except (TypeError, ValueError):
        return None
    o_shape = _ints(o_shape)
    if x is None or w is None or dn is None or o_shape is None or None in dts:
        return None
    if len(set(dts)) != 1 or _dtype_name(o_dtype) != dts[0] or len(x) < 1 or len(w) != 2:
        return None
    lc, rc, lb, rb = dn
    if lb or rb or lc != (len(x) - 1,) or len(rc) != 1:
        return None
    k = x[-1]
    if w[rc[0]] != k:
        return None
    n = w[1 - rc[0]]
    if o_shape != (*x[:-1], n):
        return None
    has_bias = bias_shape is not None
    if has_bias and not (
        bias_vector(bias_shape, n) and len(_ints(bias_shape) or ()) <= len(o_shape)
    ):
        return None
    if activation not in _ACTIVATION_NAMES:
        return None
    return GemmPlan(
        activation=str(activation),
        transpose_w=rc[0] == 1,
        k=k,
        n=n,
        bias=has_bias,
        dtype=dts[0],
        out_shape=o_shape,
        out_dtype=_dtype_name(o_dtype),
    )


@guard_fn("rules.gemm_supported")
def gemm_supported(plan: Any, x_shape: Any) -> bool | Refusal:
    """Does ``pallas_kernels.gemm_epilogue`` take this plan's shapes and dtype? (A
    :class:`~pypm_jax.Refusal` saying why not, for ``pm.explain``.)"""
    if not isinstance(plan, GemmPlan):
        return Refusal(
            "no GEMM plan: not x[..., K] @ w[K, N] with one dtype, no batch axes, a bias of N"
        )
    from pallas_kernels import gemm_unsupported

    x = _ints(x_shape)
    if x is None:
        return Refusal("x has no static shape")
    why = gemm_unsupported(
        x, (plan.k, plan.n), plan.dtype, bias_shape=(plan.n,) if plan.bias else None
    )
    return True if why is None else Refusal(f"the GEMM kernel does not take it: {why}")


@guard_fn("rules.bias_vector")
def bias_vector(shape: Any, n: Any) -> bool:
    """A bias of N elements laid out along the last axis (``[N]``, ``[1, 1, N]``...)."""
    s = _ints(shape)
    try:
        n = int(n)
    except (TypeError, ValueError):
        return False
    return s is not None and len(s) >= 1 and s[-1] == n and all(d == 1 for d in s[:-1])


# The activation an epilogue pattern matched, told by the operator at its root and the
# operator of its characteristic inner value (the "signature").
_ACTIVATIONS = {
    ("max", "max"): "relu",
    ("mul", "tanh"): "gelu_tanh",
    ("mul", "erfc"): "gelu",
    ("mul", "erf"): "gelu",
    ("mul", "logistic"): "silu",
    ("div", "exp"): "silu",
    ("logistic", "logistic"): "sigmoid",
    ("tanh", "tanh"): "tanh",
    ("mul", "mul"): "quick_gelu",
}
# pallas_kernels.ACTIVATIONS (not imported here: the rules load without the kernels)
_ACTIVATION_NAMES = frozenset({"none", *_ACTIVATIONS.values()})


@guard_fn("rules.activation_of")
def activation_of(root_op: Any, signature_op: Any) -> str | None:
    """Name (in ``pallas_kernels.ACTIVATIONS``) of the activation an epilogue matched."""
    key = (getattr(root_op, "name", None), getattr(signature_op, "name", None))
    return _ACTIVATIONS.get(key)


# ----------------------------------------------------------- attention score regions
#
# ``rules/attention_region.py`` takes the pointwise region between an attention's scores
# and its softmax into the kernel one operator at a time, from the softmax down to the
# scores, and the index expressions it reads (``iota`` comparisons) down to their iotas.
# A region is data, the pointwise region IR: a tuple of steps ``(prim, params, args)``,
# each arg ``("acc",)`` (the value below the region: the scores, once reached),
# ``("in", i)`` (captured operand i), ``("step", j)``, ``("lit", number)`` or
# ``("idx", "b" | "h" | "q" | "k")`` (a position in the kernel's scores); the last step is
# the logits. The empty region is the scores themselves.
#
# Each captured operand has a *frame*: the axis of the program's scores each of its axes
# lies along (numpy broadcasting aligns an operand with the last axes; a
# ``broadcast_in_dim`` may put them anywhere).

# The primitives a region may hold (each has a lowering in rules._region); the two with
# params have rules of their own.
REGION_UNARY = frozenset(
    n for n, k in PRIMS.items() if k == 1 and n not in ("integer_pow", "convert_element_type")
)
REGION_BINARY = frozenset(n for n, k in PRIMS.items() if k == 2)
MAX_CAPTURES = 6  # the AttentionRegion operator's capture inputs
SCORE_FRAME = (0, 1, 2, 3)
# Below this a select_n fill masks a key (as rules.attention.MASK_FILL_MAX).
MASK_FILL_MAX = -1e9


class RegionPlan(NamedTuple):
    """An ``AttentionRegion`` node: the attention's plan (no bias, mask or scale of its own:
    the region holds them), the region, the ``(shape, frame)`` of each captured operand,
    whether the node's ``x`` input is still a value to take into the region (``spine``),
    and, once it is done, the part of the region that masks keys (``mask``: steps whose
    value is True where a key is attended, the kernel's ``mask_mod``) and the kernel's
    ``band`` promise."""

    attention: AttentionPlan
    region: tuple[Any, ...]
    captures: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    spine: bool = True
    mask: tuple[Any, ...] = ()
    band: tuple[Any, Any] | None = None

    def describe(self) -> str:
        """One line for reports: ``logits = tanh(acc / 30.0) * 30.0; mask = ...; band = ...``
        (``acc`` the scores, ``in0``.. the captured operands, ``q``/``k``.. positions)."""
        parts = [f"logits = {describe(self.region) if self.region else 'acc'}"]
        if self.mask:
            parts.append(f"mask = {describe(self.mask)}")
        if self.band is not None:
            parts.append(f"band = {self.band}")
        return "; ".join(parts)


@guard_fn("rules.region_op")
def region_op(name: Any, arity: Any) -> bool:
    """Can a region hold this primitive (unary: ``arity`` 1, binary: 2)?"""
    return name in (REGION_UNARY if arity == 1 else REGION_BINARY if arity == 2 else ())


@guard_fn("rules.region_seed")
def region_seed(plan: Any, masked_rows: Any = "uniform") -> RegionPlan | None:
    """The plan of a region node for an attention planned without bias, mask or scale;
    ``masked_rows="zero"`` where the program re-zeroes the probabilities with the mask of
    the region's logits (``rules.region_finishes`` checks that it is that mask)."""
    if not isinstance(plan, AttentionPlan) or plan.bias or plan.mask or plan.scale_input:
        return None
    if masked_rows not in ("uniform", "zero"):
        return None
    plan = plan._replace(masked_rows=masked_rows)
    return RegionPlan(plan, (), ()) if attention_supported(plan) else None


@guard_fn("rules.region_cast")
def region_cast(dtype: Any) -> bool:
    """Can a region cast to this dtype (a ``convert_element_type`` the kernel lowers)?"""
    step = ("convert_element_type", (("new_dtype", _dtype_name(dtype)),), (("acc",),))
    return region_error((step,)) is None


def _literal(value: Any) -> Any:
    """A literal as a plain Python number (guards see numpy scalars and 0-d arrays)."""
    item = getattr(value, "item", None)
    value = item() if item is not None and getattr(value, "size", 1) == 1 else value
    return value if isinstance(value, bool | int | float) else None


def _param(name: str, value: Any) -> Any:
    """A step parameter as plain hashable data (dtypes by name)."""
    if name == "new_dtype":
        return _dtype_name(value) or str(value)
    return value


def _args(args: Any) -> tuple[Any, ...] | None:
    """Step arguments as plain data (a literal's value as a Python number)."""
    out = []
    for a in args:
        if a[0] == "lit":
            value = _literal(a[1])
            if value is None:
                return None
            a = ("lit", value)
        out.append(tuple(a))
    return tuple(out)


def _renumber(region: tuple[Any, ...], ref: Any) -> tuple[Any, ...]:
    """The region's steps with every argument ``a`` replaced by ``ref(a)``."""
    return tuple((p, ps, tuple(ref(a) for a in xs)) for p, ps, xs in region)


def _frames(shapes: Any, frame: tuple[int, ...]) -> tuple[Any, ...] | None:
    """(shape, frame) of operands aligned, as numpy broadcasts, with the last axes of a
    value whose axes lie along ``frame``."""
    out = []
    for s in shapes:
        s = _ints(s)
        if s is None or len(s) > len(frame):
            return None
        out.append((s, frame[len(frame) - len(s) :]))
    return tuple(out)


@guard_fn("rules.region_push")
def region_push(plan: Any, prim: Any, args: Any, params: Any = (), captured: Any = ()) -> Any:
    """``plan`` with the operator below its region taken in: the new step ``prim(args)``
    (``("acc",)`` now the value below it, ``("in", i)`` the i-th operand in ``captured``,
    their shapes, ``("lit", v)`` a literal's value) goes first, and the operands it
    captures go before the node's others. None when the plan is done, a literal is not a
    number or too many operands would be captured."""
    if not isinstance(plan, RegionPlan) or not plan.spine:
        return None
    new = _frames(captured, SCORE_FRAME)
    args = _args(args)
    if new is None or args is None or len(plan.captures) + len(new) > MAX_CAPTURES:
        return None
    n = len(new)

    def shift(a: Any) -> Any:
        if a[0] == "acc":
            return ("step", 0)
        if a[0] == "step":
            return ("step", a[1] + 1)
        return ("in", a[1] + n) if a[0] == "in" else a

    step = (str(getattr(prim, "name", prim)), _params(params), args)
    region = (step, *_renumber(plan.region, shift))
    return plan._replace(region=region, captures=(*new, *plan.captures))


def _params(params: Any) -> tuple[Any, ...]:
    return tuple(sorted((str(n), _param(n, v)) for n, v in params))


@guard_fn("rules.region_inline")
def region_inline(
    plan: Any, prim: Any, args: Any, params: Any = (), captured: Any = (), keep: Any = 1
) -> Any:
    """``plan`` with its first captured operand (``in0``, an index expression) computed in
    the region instead: the step ``prim(args)``, whose ``("in", i)`` are the operands in
    ``captured`` (shapes, aligned with in0's frame; the first ``keep`` replace in0, the
    rest go after them). None when the plan has no capture or too many would be captured."""
    if not isinstance(plan, RegionPlan) or not plan.spine or not plan.captures:
        return None
    frame = plan.captures[0][1]
    new = _frames(captured, frame)
    args = _args(args)
    if new is None or args is None or len(plan.captures) - 1 + len(new) > MAX_CAPTURES:
        return None
    n = len(new)

    def shift(a: Any) -> Any:
        if a == ("in", 0):
            return ("step", 0)
        if a[0] == "step":
            return ("step", a[1] + 1)
        return ("in", a[1] - 1 + n) if a[0] == "in" else a

    step = (str(getattr(prim, "name", prim)), _params(params), args)
    region = (step, *_renumber(plan.region, shift))
    return plan._replace(region=region, captures=(*new, *plan.captures[1:]))


@guard_fn("rules.region_index")
def region_index(plan: Any, dimension: Any, shape: Any) -> Any:
    """``plan`` with its first captured operand, an ``iota`` along ``dimension``, read as
    the kernel's position along the score axis that dimension lies along (the literal 0
    if it has size 1)."""
    if not isinstance(plan, RegionPlan) or not plan.spine or not plan.captures:
        return None
    s, frame = plan.captures[0]
    shape = _ints(shape)
    try:
        d = int(dimension)
    except (TypeError, ValueError):
        return None
    if shape is None or shape != s or not 0 <= d < len(s):
        return None
    if s[d] == 1:
        leaf: Any = ("lit", 0)
    else:
        leaf = ("idx", "bhqk"[plan.attention.perm_scores.index(frame[d])])

    def pop(a: Any) -> Any:
        if a == ("in", 0):
            return leaf
        return ("in", a[1] - 1) if a[0] == "in" else a

    return plan._replace(region=_renumber(plan.region, pop), captures=plan.captures[1:])


@guard_fn("rules.region_literal")
def region_literal(plan: Any, value: Any) -> Any:
    """``plan`` with its first captured operand, all one literal value, read as that."""
    value = _literal(value)
    if not isinstance(plan, RegionPlan) or not plan.spine or not plan.captures:
        return None
    if value is None:
        return None

    def pop(a: Any) -> Any:
        if a == ("in", 0):
            return ("lit", value)
        return ("in", a[1] - 1) if a[0] == "in" else a

    return plan._replace(region=_renumber(plan.region, pop), captures=plan.captures[1:])


@guard_fn("rules.is_literal")
def is_literal(value: Any) -> bool:
    """Is this a literal's value, a Python (or numpy) number?"""
    return _literal(value) is not None


@guard_fn("rules.region_reframe")
def region_reframe(plan: Any, kind: Any, attrs: Any, in_shape: Any) -> Any:
    """``plan`` with its first captured operand replaced by the operand of the layout op
    that made it (``kind``: ``broadcast_in_dim`` with its ``broadcast_dimensions``,
    ``reshape`` that only adds or drops size-1 axes, ``slice`` from the origin): same
    values at the same positions, in the frame that op says. None otherwise."""
    if not isinstance(plan, RegionPlan) or not plan.spine or not plan.captures:
        return None
    out_shape, frame = plan.captures[0]
    inp = _ints(in_shape)
    new_frame = _reframe(kind, attrs, inp, out_shape, frame)
    if inp is None or new_frame is None:
        return None
    return plan._replace(captures=((inp, new_frame), *plan.captures[1:]))


def _reframe(kind: Any, attrs: Any, inp: Any, out_shape: Any, frame: Any) -> Any:
    """The frame of the operand ``inp`` (a shape) of a layout op whose result (of shape
    ``out_shape``) lies along ``frame`` (see :func:`region_reframe`), or None."""
    if inp is None:
        return None
    if kind == "broadcast_in_dim":
        dims = _ints(attrs)
        if dims is None or len(dims) != len(inp):
            return None
        new_frame = tuple(frame[d] for d in dims)
    elif kind == "reshape":
        if attrs is not None or _drop_ones(inp) != _drop_ones(out_shape):
            return None
        kept = [frame[i] for i, d in enumerate(out_shape) if d != 1]
        it = iter(kept)
        new_frame = tuple(next(it) if d != 1 else -1 for d in inp)
        if -1 in new_frame:  # a size-1 axis of the operand: any axis it broadcasts along
            free = [a for a in SCORE_FRAME if a not in kept]
            fill = iter(free)
            new_frame = tuple(next(fill) if a == -1 else a for a in new_frame)
    elif kind == "slice":
        start, strides = attrs
        if not slice_keeps_origin(start, strides, len(inp)):
            return None
        new_frame = frame
    else:
        return None
    return new_frame


@guard_fn("rules.numpy_broadcast")
def numpy_broadcast(broadcast_dimensions: Any, in_shape: Any, out_shape: Any) -> bool:
    """A ``broadcast_in_dim`` as numpy broadcasts: the operand aligned with the result's
    last axes, each of its axes of size 1 or the result's size. Its operand can be captured
    instead (the kernel broadcasts captures itself)."""
    dims, inp, out = _ints(broadcast_dimensions), _ints(in_shape), _ints(out_shape)
    if dims is None or inp is None or out is None or len(inp) > len(out):
        return False
    if dims != tuple(range(len(out) - len(inp), len(out))):
        return False
    return all(i in (1, out[d]) for i, d in zip(inp, dims, strict=True))


# ------------------------------------------------------------- finishing a region


def _extract(steps: tuple[Any, ...], ref: Any) -> tuple[Any, ...]:
    """The steps computing ``ref`` (a step of ``steps``), alone and renumbered, ending in
    it."""
    need: set[int] = set()
    todo = [ref[1]]
    while todo:
        j = todo.pop()
        if j in need:
            continue
        need.add(j)
        todo.extend(a[1] for a in steps[j][2] if a[0] == "step")
    order = sorted(need)
    new = {j: i for i, j in enumerate(order)}
    return tuple(
        (p, ps, tuple(("step", new[a[1]]) if a[0] == "step" else a for a in xs))
        for p, ps, xs in (steps[j] for j in order)
    )


def _reads_acc(steps: tuple[Any, ...], ref: Any) -> bool:
    if ref[0] == "acc":
        return True
    if ref[0] != "step":
        return False
    return any(a[0] == "acc" for _, _, xs in _extract(steps, ref) for a in xs)


def _mask_split(region: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(score region, mask steps): the region's outer ``where(pred, s, fill)`` steps with a
    fill at most ``MASK_FILL_MAX`` and a predicate that does not read the scores become the
    kernel's mask (it replaces masked scores by ``finfo(f32).min``: the same softmax for
    every row with an attended key, uniform weights for a fully masked row, as the
    program's fill gives); the rest is its score_mod."""
    score, mask, _ = _split(region)
    return score, mask


def _split(region: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...], int]:
    """:func:`_mask_split` and the number of ``where`` steps its mask combines."""
    preds: list[tuple[Any, bool]] = []
    top: Any = ("step", len(region) - 1) if region else ("acc",)
    while top[0] == "step":
        prim, _, args = region[top[1]]
        if prim != "select_n" or len(args) != 3:
            break
        pred, no, yes = args
        if no[0] == "lit" and no[1] <= MASK_FILL_MAX:
            keep, polarity = yes, True
        elif yes[0] == "lit" and yes[1] <= MASK_FILL_MAX:
            keep, polarity = no, False
        else:
            break
        if _reads_acc(region, pred) or not _reads_acc(region, keep):
            break
        preds.append((pred, polarity))
        top = keep
    score = () if top == ("acc",) else _extract(region, top)
    if not preds:
        return score, (), 0
    mask: list[Any] = []
    for pred, polarity in preds:
        part = _extract(region, pred) if pred[0] == "step" else ()
        base = len(mask)
        mask.extend(
            (p, ps, tuple(("step", a[1] + base) if a[0] == "step" else a for a in xs))
            for p, ps, xs in part
        )
        value = ("step", len(mask) - 1) if part else pred
        mask.append(("ne", (), (value, ("lit", not polarity))))
        if base:
            mask.append(("and", (), (("step", base - 1), ("step", len(mask) - 1))))
    return score, tuple(mask), len(preds)


# A mask's band: from comparisons of linear forms of the query and key positions (q, k),
# which bound d = k - q. Values while reading the mask steps: ("lin", aq, ak, c) for
# aq*q + ak*k + c, ("abs", lin), and predicates ("cmp", op, x, y), ("and" | "or", x, y),
# ("not", x), read as a band (lo, hi) -- True only where lo <= d <= hi, None: unbounded --
# at the end. Chunks (Llama 4's local attention, ``q // C == k // C``): ("chunk", a, C) is
# floor(a / C) of a position a ("q" or "k", never negative) and a constant C > 0, which
# ``div`` computes (it truncates: the same for a >= 0), and also jnp's floor division, whose
# rounding correction ``where((sign(a) != sign(C)) & (rem(a, C) != 0), a / C - 1, a / C)``
# never applies to a >= 0: ("sign", a) and ("rem", a, C) name the parts it reads.
_MIRROR = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}
_NEGATE = {"lt": "ge", "le": "gt", "gt": "le", "ge": "lt", "eq": "ne", "ne": "eq"}


def _lin_of(v: Any) -> tuple[int, int, int] | None:
    return v[1:] if v is not None and v[0] == "lin" else None


def _position(lin: Any) -> str | None:
    """The position ``lin`` is (``q`` or ``k`` itself), or None."""
    return {(1, 0, 0): "q", (0, 1, 0): "k"}.get(lin)


def _chunk_compare(op: str, x: Any, y: Any) -> tuple[Any, Any] | None:
    """The band of ``x op y`` for chunks ``K = k // C`` and ``Q = q // C`` (either order)."""
    if x[2] != y[2] or {x[1], y[1]} != {"q", "k"}:
        return None
    if x[1] == "q":
        op = _MIRROR[op]  # now K op Q
    c = x[2]
    # K == Q: |k - q| < C; K <= Q: k <= C*Q + C - 1 <= q + C - 1; K < Q: k <= C*Q - 1 <= q - 1;
    # K >= Q: k >= C*Q >= q - (C - 1); K > Q: k >= C*Q + C > q
    bounds = {"eq": (1 - c, c - 1), "le": (None, c - 1), "lt": (None, -1),
              "ge": (1 - c, None), "gt": (1, None)}  # fmt: skip
    return bounds.get(op)


def _never(v: Any) -> bool:
    """Is the predicate ``v`` false at every (non-negative) position: jnp's floor-division
    correction ``(sign(a) != sign(C)) & (rem(a, C) != 0)`` for ``a >= 0``, ``C > 0``?"""
    if v is None or v[0] != "and":
        return False
    parts = {}
    for p in v[1:]:
        if p is None or p[0] != "cmp" or p[1] != "ne":
            return False
        x, y = p[2], p[3]
        if x is not None and x[0] == "sign" and y == ("lin", 0, 0, 1):
            parts["sign"] = x[1]  # sign(a) != 1: a == 0
        elif x is not None and x[0] == "rem" and y == ("lin", 0, 0, 0):
            parts["rem"] = x[1]  # rem(a, C) != 0: never where a == 0
    return len(parts) == 2 and parts["sign"] == parts["rem"]


def _compare(op: str, x: Any, y: Any) -> tuple[Any, Any] | None:
    """The band of ``x op y``, or None."""
    if x is not None and y is not None and x[0] == "chunk" and y[0] == "chunk":
        return _chunk_compare(op, x, y)
    ly = _lin_of(y)
    if x is not None and x[0] == "abs" and ly is not None and ly[:2] == (0, 0):
        aq, ak, c = x[1]
        w = ly[2]
        if (aq, ak) == (1, -1):
            c = -c  # |q - k + c| = |d - c|
        elif (aq, ak) != (-1, 1):
            return None
        if op == "lt":
            return (-w - c + 1, w - c - 1)
        return (-w - c, w - c) if op == "le" else None
    if y is not None and y[0] == "abs":
        return _compare(_MIRROR[op], y, x)
    lx = _lin_of(x)
    if lx is None or ly is None:
        return None
    aq, ak, c = (lx[0] - ly[0], lx[1] - ly[1], lx[2] - ly[2])  # (x - y) op 0
    if (aq, ak) == (1, -1):  # -(d - c) op 0, i.e. d - c mirrored-op 0
        op, c = _MIRROR[op], -c
    elif (aq, ak) != (-1, 1):
        return None
    bounds = {"lt": (None, -c - 1), "le": (None, -c), "gt": (-c + 1, None),
              "ge": (-c, None), "eq": (-c, -c)}  # fmt: skip
    return bounds.get(op)


def _meet(x: Any, y: Any) -> Any:
    """Both hold: within both bands (one unknown: within the other)."""
    if x is None or y is None:
        return x if y is None else y
    lo = x[0] if y[0] is None else y[0] if x[0] is None else max(x[0], y[0])
    hi = x[1] if y[1] is None else y[1] if x[1] is None else min(x[1], y[1])
    return (lo, hi)


def _join(x: Any, y: Any) -> Any:
    """Either holds: within the hull of both bands (one unknown: none)."""
    if x is None or y is None:
        return None
    lo = None if x[0] is None or y[0] is None else min(x[0], y[0])
    hi = None if x[1] is None or y[1] is None else max(x[1], y[1])
    return (lo, hi)


def _band_of(v: Any, negate: bool = False) -> Any:
    """The band a predicate value (or its negation) keeps keys in, or None."""
    if v is None:
        return None
    kind = v[0]
    if kind == "cmp":
        _, op, x, y = v
        return _compare(_NEGATE[op] if negate else op, x, y)
    if kind == "not":
        return _band_of(v[1], not negate)
    if kind in ("and", "or"):
        x, y = _band_of(v[1], negate), _band_of(v[2], negate)
        return _meet(x, y) if (kind == "and") != negate else _join(x, y)
    return None


def _band_step(prim: str, xs: list[Any], args: Any) -> Any:
    lins = [_lin_of(x) for x in xs]
    if prim in ("div", "rem") and None not in lins and len(lins) == 2:
        pos, c = _position(lins[0]), lins[1]
        if pos is not None and c[:2] == (0, 0) and c[2] > 0:
            return ("chunk", pos, c[2]) if prim == "div" else ("rem", pos, c[2])
        return None
    if prim == "sign" and lins[0] is not None:
        pos = _position(lins[0])
        if pos is not None:
            return ("sign", pos)
        c = lins[0]
        return ("lin", 0, 0, (c[2] > 0) - (c[2] < 0)) if c[:2] == (0, 0) else None
    if prim == "select_n" and len(xs) == 3:
        return xs[1] if _never(xs[0]) else None
    if prim in ("add", "sub") and None not in lins:
        sign = 1 if prim == "add" else -1
        return ("lin", *(a + sign * b for a, b in zip(lins[0], lins[1], strict=True)))
    if prim == "mul" and None not in lins:
        x, y = lins
        if y[:2] == (0, 0):
            return ("lin", *(y[2] * a for a in x))
        return ("lin", *(x[2] * a for a in y)) if x[:2] == (0, 0) else None
    if prim == "neg" and lins[0] is not None:
        return ("lin", *(-a for a in lins[0]))
    if prim == "abs" and lins[0] is not None:
        return ("abs", lins[0])
    if prim == "convert_element_type":
        return xs[0]
    if prim in ("ne", "eq") and args[1][0] == "lit" and isinstance(args[1][1], bool):
        keep = (prim == "ne") != args[1][1]  # x != False, x == True: x
        return xs[0] if keep else ("not", xs[0])
    if prim == "not":
        return ("not", xs[0])
    if prim in _MIRROR:
        return ("cmp", prim, xs[0], xs[1])
    if prim in ("and", "or"):
        return (prim, xs[0], xs[1])
    return None


def _band(mask: tuple[Any, ...]) -> tuple[Any, Any] | None:
    """The diagonal band ``(lo, hi)`` outside which the mask steps are False (keys k with
    ``q + lo <= k <= q + hi`` may be attended), or None when they prove none."""
    values: list[Any] = []

    def ref(a: Any) -> Any:
        if a[0] == "step":
            return values[a[1]]
        if a == ("idx", "q"):
            return ("lin", 1, 0, 0)
        if a == ("idx", "k"):
            return ("lin", 0, 1, 0)
        if a[0] == "lit" and isinstance(a[1], int) and not isinstance(a[1], bool):
            return ("lin", 0, 0, a[1])
        return None

    for prim, _, args in mask:
        values.append(_band_step(prim, [ref(a) for a in args], args))
    band = _band_of(values[-1]) if values else None
    return None if band is None or band == (None, None) else band


@guard_fn("rules.region_done")
def region_done(plan: Any) -> Any:
    """``plan`` once its region reaches the scores: the outer masking steps split off as
    the kernel's mask (:func:`_mask_split`) with the band they prove (:func:`_band`),
    checked against the kernel's support. None where the kernel cannot take it
    (:func:`region_done_or_why` says why)."""
    done = region_done_or_why(plan)
    return done if isinstance(done, RegionPlan) else None


def region_done_or_why(plan: Any) -> RegionPlan | str:
    """:func:`region_done`'s plan, or why there is none, in words."""
    if not isinstance(plan, RegionPlan) or not plan.spine:
        return "not a region node still open"
    region, mask, n_preds = _split(plan.region)
    n = len(plan.captures)
    for name, part in (("logits", region), ("mask", mask)):
        err = region_error(part, n, index_refs=True) if part else None
        if err is not None:
            return f"the kernel cannot compute its {name}: {err}"
    if plan.attention.masked_rows == "zero" and n_preds != 1:
        return (
            f"the probabilities are re-zeroed by one mask, the logits are masked by "
            f"{n_preds} where steps: rows the logits' masks empty would differ"
        )
    done = plan._replace(region=region, mask=mask, spine=False, band=_band(mask))
    why = _unsupported(done)
    return done if why is None else f"the attention kernel does not take it: {why}"


def _unsupported(plan: RegionPlan) -> str | None:
    """Why the kernel does not take the attention with these captures, or None."""
    from pallas_kernels._attention import _kernel_error

    att = plan.attention
    captures = []
    for i, (shape, frame) in enumerate(plan.captures):
        kernel_shape = [1, 1, 1, 1]
        for size, axis in zip(shape, frame, strict=True):
            kernel_shape[att.perm_scores.index(axis)] = size
        captures.append((f"captured operand {i}", tuple(kernel_shape)))
    q, k, v, _, _ = att.kernel_shapes
    return _kernel_error(q, k, v, att.dtype, att.layout, None, None, tuple(captures))
