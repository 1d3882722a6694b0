"""Guard functions of the weight-slice canonical rules (:mod:`pypm_jax.rules.canonical`).

A fused projection computes one ``dot_general`` and slices its result: gemma's gate/up
einsum to ``[..., 2, F]`` (weight ``[2, H, F]``) indexed ``h[..., 0, :]`` and
``h[..., 1, :]``, or ``x @ w`` with ``w`` ``[H, 2F]`` cut into two halves of the last axis.
A static slice that narrows only axes the *weight* contributes to the result is the
``dot_general`` of the weight sliced the same way, element for element; a ``squeeze`` of
such an axis (size 1) is the ``dot_general`` of the squeezed weight. These guards compute
the weight's slice (or squeeze) and the new dimension numbers, looking through one
``transpose`` (the einsum's output order), and say when two operands may swap so that the
activation's operand comes first (``transpose(dot_general(w, x))``, the weight-first form
``jnp.einsum`` writes for some output orders).

Which operand is the weight: the gemm rules read ``dot_general(x, w)`` contracting x's last
axis, so ``x`` is the lhs when the lhs contracts its last axis, else the rhs when the rhs
does; the other is the weight. A slice of x's (row) axes or a batched ``dot_general`` is
left alone. The result is read only by such narrowings (``slice``, or ``transpose`` read
only by them), so once each is rewritten the full GEMM is dead: nothing is computed twice.

Pure Python over terms and attribute values; total (``None`` where a rule must not fire).
"""

from __future__ import annotations

__all__ = [
    "weight_side",
    "weight_slice",
    "weight_split",
    "weight_squeeze",
    "squeezed_permutation",
    "swapped_dot",
]

from typing import Any

from ..core.graph import _readers
from ..lang.registry import guard_fn
from ..vocab.primitives import is_table_op

_Frame = tuple[int, tuple[int, ...], dict[int, int]]  # (weight side, dot shape, out axis -> w axis)


def _ints(xs: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in xs)
    except (TypeError, ValueError):
        return None


def _dn(dn: Any) -> tuple[tuple[int, ...], ...] | None:
    try:
        (lc, rc), (lb, rb) = dn
    except (TypeError, ValueError):
        return None
    parts = (_ints(lc), _ints(rc), _ints(lb), _ints(rb))
    return None if any(p is None for p in parts) else parts  # type: ignore[return-value]


def _is(term: Any, name: str) -> bool:
    op = getattr(term, "op", None)
    return op is not None and op.name == name and is_table_op(op)


def _free(rank: int, contracted: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(a for a in range(rank) if a not in contracted)


def _frame(dot: Any) -> _Frame | None:
    """The weight's side (0: lhs, 1: rhs), the result's shape, and which result axis comes
    from which weight axis; None for a batched ``dot_general`` or one with no activation
    operand contracting its last axis."""
    if not _is(dot, "dot_general") or len(dot.inputs) != 2:
        return None
    shapes = [_ints(getattr(i, "shape", None) or ()) for i in dot.inputs]
    out = _ints(getattr(dot, "shape", None) or ())
    dn = _dn(dot.attrs.get("dimension_numbers"))
    if dn is None or out is None or any(s is None or not s for s in shapes):
        return None
    lc, rc, lb, rb = dn
    lhs, rhs = shapes
    if lb or rb or len(lc) != 1 or len(rc) != 1:
        return None
    if lc == (len(lhs) - 1,):
        side = 1
    elif rc == (len(rhs) - 1,):
        side = 0
    else:
        return None
    lfree, rfree = _free(len(lhs), lc), _free(len(rhs), rc)
    if len(out) != len(lfree) + len(rfree):
        return None
    if side == 1:
        axes = {len(lfree) + j: a for j, a in enumerate(rfree)}
    else:
        axes = dict(enumerate(lfree))
    return side, out, axes


def _perm(perm: Any, rank: int) -> tuple[int, ...] | None:
    if perm is None:
        return tuple(range(rank))
    p = _ints(perm)
    return p if p is not None and sorted(p) == list(range(rank)) else None


def _slice_in_frame(
    frame: _Frame, w_shape: tuple[int, ...], sl: Any, perm: Any
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """The weight's (start, limit, strides) equal to slice ``sl`` of the result (seen
    through ``transpose(perm)``), or None if it narrows anything but weight axes."""
    _, out, axes = frame
    p = _perm(perm, len(out))
    start = _ints(sl.attrs.get("start_indices"))
    limit = _ints(sl.attrs.get("limit_indices"))
    raw = sl.attrs.get("strides")
    strides = (1,) * len(out) if raw is None else _ints(raw)
    if p is None or start is None or limit is None or strides is None:
        return None
    if not len(start) == len(limit) == len(strides) == len(out):
        return None
    w_start, w_limit, w_strides = [0] * len(w_shape), list(w_shape), [1] * len(w_shape)
    narrowed = False
    for i, a in enumerate(p):  # result axis i of the slice's operand is dot axis a
        if (start[i], limit[i], strides[i]) == (0, out[a], 1):
            continue
        if a not in axes:
            return None  # a row (activation) axis
        wa = axes[a]
        w_start[wa], w_limit[wa], w_strides[wa] = start[i], limit[i], strides[i]
        narrowed = True
    if not narrowed:
        return None
    return tuple(w_start), tuple(w_limit), tuple(w_strides)


def _split_in_frame(
    frame: _Frame, w_shape: tuple[int, ...], node: Any, index: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
    """The weight's (start, limit, strides) equal to output ``index`` of ``split`` node
    ``node`` of the result, or None if it splits anything but a weight axis."""
    _, out, axes = frame
    sizes = _ints(node.attrs.get("sizes") or ())
    try:
        axis = int(node.attrs.get("axis"))
    except (TypeError, ValueError):
        return None
    if sizes is None or not 0 <= index < len(sizes) or not -len(out) <= axis < len(out):
        return None
    axis %= len(out)
    if axis not in axes or sum(sizes) != out[axis]:
        return None
    wa = axes[axis]
    start, limit = [0] * len(w_shape), list(w_shape)
    start[wa], limit[wa] = sum(sizes[:index]), sum(sizes[: index + 1])
    return tuple(start), tuple(limit), (1,) * len(w_shape)


def _only_narrowed(dot: Any, frame: _Frame, w_shape: tuple[int, ...]) -> bool:
    """Is the result read only by weight-axis slices (directly or through a transpose read
    only by them), and not a program output? Then slicing the weight instead for each of
    them leaves the full GEMM dead."""

    def outputs(v: Any) -> bool:
        node = getattr(v, "node", None)
        g = getattr(node, "_graph", None)
        return g is None or g.is_output(v)

    def ok(v: Any, perm: Any, depth: int) -> bool:
        if not hasattr(v, "readers") or outputs(v) or depth > 1:
            return False  # (a term outside a graph: its readers are unknown)
        readers = _readers(v)
        if not readers:
            return False
        for n in readers:
            if _is(n, "split") and perm is None and len(n.outputs) == 2:
                if any(_split_in_frame(frame, w_shape, n, i) is None for i in range(2)):
                    return False
                continue
            if len(n.outputs) != 1:
                return False
            r = n.outputs[0]
            if _is(r, "slice"):
                if _slice_in_frame(frame, w_shape, r, perm) is None:
                    return False
            elif _is(r, "transpose") and perm is None:
                if not ok(r, r.attrs.get("permutation"), depth + 1):
                    return False
            else:
                return False
        return True

    return ok(dot, None, 0)


@guard_fn("rules.weight_side")
def weight_side(dot: Any) -> int | None:
    """Which operand of ``dot`` is the weight: 0 (lhs), 1 (rhs), or None."""
    frame = _frame(dot)
    return None if frame is None else frame[0]


@guard_fn("rules.weight_slice")
def weight_slice(dot: Any, sl: Any, perm: Any) -> Any:
    """``(start, limit, strides)`` slicing the weight of ``dot`` so that ``dot_general(x,
    slice(w))`` equals ``slice(dot)`` (``sl``, seen through ``transpose(perm)`` when
    ``perm`` is not None), or None: the slice narrows a row axis, the ``dot_general`` is
    batched, or something else reads the full result."""
    frame = _frame(dot)
    if frame is None or not _is(sl, "slice"):
        return None
    w_shape = _ints(getattr(dot.inputs[frame[0]], "shape", None) or ())
    if not w_shape:
        return None
    plan = _slice_in_frame(frame, w_shape, sl, perm)
    if plan is None or not _only_narrowed(dot, frame, w_shape):
        return None
    return plan


@guard_fn("rules.weight_split")
def weight_split(dot: Any, out: Any) -> Any:
    """``(start, limit, strides)`` slicing the weight of ``dot`` so that ``dot_general(x,
    slice(w))`` equals ``out``, one output of a ``split`` of ``dot`` along a weight axis
    (``jnp.split(x @ w, 2, axis=-1)``); None as :func:`weight_slice`."""
    frame = _frame(dot)
    node = getattr(out, "node", None)
    if frame is None or node is None or not _is(node, "split"):
        return None
    w_shape = _ints(getattr(dot.inputs[frame[0]], "shape", None) or ())
    if not w_shape:
        return None
    plan = _split_in_frame(frame, w_shape, node, int(getattr(out, "index", -1)))
    if plan is None or not _only_narrowed(dot, frame, w_shape):
        return None
    return plan


@guard_fn("rules.weight_squeeze")
def weight_squeeze(dot: Any, dimensions: Any, perm: Any) -> Any:
    """``(weight axes, dimension_numbers)``: ``squeeze(dot, dimensions)`` (seen through
    ``transpose(perm)``) is ``dot_general(x, squeeze(w, weight axes), dimension_numbers)``
    when every squeezed axis comes from the weight; else None."""
    frame = _frame(dot)
    dims = _ints(dimensions)
    if frame is None or dims is None or not dims:
        return None
    side, out, axes = frame
    p = _perm(perm, len(out))
    if p is None or any(not 0 <= d < len(out) for d in dims):
        return None
    w_axes = []
    for d in dims:
        a = p[d]
        if a not in axes or out[a] != 1:
            return None
        w_axes.append(axes[a])
    lc, rc, _, _ = _dn(dot.attrs["dimension_numbers"])  # type: ignore[misc]
    wc = (lc, rc)[side][0]
    if wc in w_axes:
        return None
    new_wc = wc - sum(1 for a in w_axes if a < wc)
    dn = (((lc[0],), (new_wc,)) if side == 1 else ((new_wc,), (rc[0],)), ((), ()))
    return tuple(sorted(w_axes)), dn


@guard_fn("rules.squeezed_permutation")
def squeezed_permutation(perm: Any, dimensions: Any) -> tuple[int, ...] | None:
    """``transpose(perm)`` then ``squeeze(dimensions)`` as ``squeeze`` (of the axes
    ``perm`` moved there) then this permutation."""
    p, dims = _ints(perm), _ints(dimensions)
    if p is None or dims is None:
        return None
    gone = {p[d] for d in dims}
    kept = [a for i, a in enumerate(p) if i not in dims]
    return tuple(a - sum(1 for g in gone if g < a) for a in kept)


@guard_fn("rules.swapped_dot")
def swapped_dot(dot: Any, perm: Any) -> Any:
    """The dimension numbers of ``dot_general(rhs, lhs)`` when ``transpose(dot, perm)``
    is exactly it (the permutation puts the rhs's axes first) and the rhs contracts its
    last axis (so the activation operand comes first, as the gemm rules read it); else
    None. No batch axes."""
    if not _is(dot, "dot_general") or len(dot.inputs) != 2:
        return None
    dn = _dn(dot.attrs.get("dimension_numbers"))
    shapes = [_ints(getattr(i, "shape", None) or ()) for i in dot.inputs]
    p = _ints(perm)
    if dn is None or p is None or any(s is None for s in shapes):
        return None
    lc, rc, lb, rb = dn
    lhs, rhs = shapes
    if lb or rb or len(rc) != 1 or rc != (len(rhs) - 1,):  # type: ignore[arg-type]
        return None
    nl, nr = len(lhs) - len(lc), len(rhs) - len(rc)  # type: ignore[arg-type]
    if p != tuple(range(nl, nl + nr)) + tuple(range(nl)):
        return None
    return ((rc, lc), ((), ()))
