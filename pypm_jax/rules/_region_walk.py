"""Whether the attention region rules can finish a region, decided before the first fires.

The region rules (:mod:`pypm_jax.rules.attention_region`) take an attention's logits into
one ``AttentionRegion`` node an operator at a time. Once the first rule has fired the
attention is gone from the program; a node the later rules cannot finish (it would need
more captured operands at once than the node has inputs, or the kernel does not take what
it ends with) could not be lowered. :func:`finish_region` therefore replays, on the
matched terms, what the later rules will do -- the same rules in the same order, with the
same plan functions -- and the first rule's guard :func:`region_finishes` refuses a match
whose replay does not end in a finished plan, saying why (``pm.explain`` shows it). The
attention is then left as the program wrote it.

Pure Python over terms (``x.term``) and the plan functions of :mod:`._plans`, never JAX;
total: it answers a plan or a :class:`~pypm_jax.Refusal`, never raises on odd terms.
"""

from __future__ import annotations

__all__ = ["finish_region", "region_finishes", "region_index_expr"]

from typing import Any

from ..core.terms import CONST
from ..lang.frontend import opclass
from ..lang.registry import guard_fn
from ..semantics.guards import Refusal
from ._plans import (
    MASK_FILL_MAX,
    MAX_CAPTURES,
    RegionPlan,
    _frames,
    _ints,
    _literal,
    _params,
    _reframe,
    _renumber,
    numpy_broadcast,
    region_cast,
    region_done_or_why,
    region_index,
    region_inline,
    region_literal,
    region_op,
    region_push,
    region_reframe,
)

LAYOUT = opclass("layout")
MAX_WALK = 512  # rule applications; a longer region is left alone


def _name(t: Any) -> str | None:
    op = getattr(t, "op", None)
    return None if op is None else op.name


def _inputs(t: Any) -> tuple[Any, ...]:
    return tuple(getattr(t, "inputs", ()) or ())


def _attr(t: Any, name: str) -> Any:
    return (getattr(t, "attrs", None) or {}).get(name)


def _shape(t: Any) -> Any:
    return getattr(t, "shape", None)


def _value(t: Any) -> Any:
    """A literal term's value as a number (what ``c.value`` reads and ``_literal`` keeps)."""
    if getattr(t, "op", None) is not CONST:
        return None
    return _literal(_attr(t, "value"))


def _splat(t: Any) -> Any:
    """``Splat(c)``: the value of the literal under layout ops, casts and copies, or None."""
    for _ in range(64):
        if getattr(t, "op", None) is CONST:
            return _value(t)
        ins = _inputs(t)
        op = getattr(t, "op", None)
        if op is None or len(ins) != 1:
            return None
        if not (op.op_class == LAYOUT or op.name in ("convert_element_type", "copy")):
            return None
        t = ins[0]
    return None


def _captured(t: Any) -> tuple[Any, ...]:
    """``Captured(w)``'s solutions in the matcher's order: a numpy-style broadcast's
    operand, then the value itself."""
    if _name(t) == "broadcast_in_dim" and len(_inputs(t)) == 1:
        w = _inputs(t)[0]
        if numpy_broadcast(_attr(t, "broadcast_dimensions"), _shape(w), _shape(t)):
            return (w, t)
    return (t,)


class _Walk:
    """The region rules' moves on terms (their patterns, in Python)."""

    def __init__(self, s: Any):
        self.s = s
        self.chain: dict[int, bool] = {}
        self.index: dict[int, bool] = {}

    def on_chain(self, t: Any, depth: int = 0) -> bool:
        """``Spine(t, a, b)``: t reaches the scores through operators a region holds."""
        if t is self.s:
            return True
        key = id(t)
        if key in self.chain:
            return self.chain[key]
        self.chain[key] = False  # (a cycle cannot reach the scores)
        name, ins = _name(t), _inputs(t)
        if name is None or depth > MAX_WALK:
            ok = False
        elif len(ins) == 1 and (
            region_op(name, 1)
            or name == "integer_pow"
            or (name == "convert_element_type" and region_cast(getattr(t, "dtype", None)))
        ):
            ok = self.on_chain(ins[0], depth + 1)
        elif len(ins) == 2 and region_op(name, 2):
            ok = self.on_chain(ins[0], depth + 1) or self.on_chain(ins[1], depth + 1)
        elif name == "select_n" and len(ins) == 3:
            ok = self.on_chain(ins[2], depth + 1) or self.on_chain(ins[1], depth + 1)
        else:
            ok = False
        self.chain[key] = ok
        return ok

    def index_only(self, t: Any, depth: int = 0) -> bool:
        """``IndexOnly()``: t is computed from iotas and literals alone."""
        key = id(t)
        if key in self.index:
            return self.index[key]
        self.index[key] = False
        name, ins = _name(t), _inputs(t)
        if name is None or depth > MAX_WALK:
            ok = False
        elif name == "iota" and not ins:
            ok = True
        elif getattr(t, "op", None) is CONST:
            ok = _value(t) is not None
        elif len(ins) == 1 and (
            region_op(name, 1) or name in ("convert_element_type", "broadcast_in_dim")
        ):
            ok = self.index_only(ins[0], depth + 1)
        elif name == "reshape" and len(ins) == 1:
            ok = _attr(t, "dimensions") is None and self.index_only(ins[0], depth + 1)
        elif name == "slice" and len(ins) == 1:
            ok = self.index_only(ins[0], depth + 1)
        elif len(ins) == 2 and region_op(name, 2):
            ok = self.index_only(ins[0], depth + 1) and self.index_only(ins[1], depth + 1)
        elif name == "select_n" and len(ins) == 3:
            ok = all(self.index_only(i, depth + 1) for i in ins)
        else:
            ok = False
        self.index[key] = ok
        return ok


# ------------------------------------------------------- index expressions, whole


class _IndexSteps:
    """Region steps computing an index expression (iotas and literals through the region's
    operators and layout ops) at the score positions, given the frame it lies along."""

    def __init__(self, perm_scores: tuple[int, ...]):
        self.perm = perm_scores
        self.steps: list[Any] = []
        self.memo: dict[tuple[int, Any], Any] = {}

    def ref(self, t: Any, frame: Any, depth: int = 0) -> Any:
        key = (id(t), frame)
        if key in self.memo:
            return self.memo[key]
        r = self._ref(t, frame, depth)
        self.memo[key] = r
        return r

    def _ref(self, t: Any, frame: Any, depth: int) -> Any:
        shape = _ints(_shape(t))
        if shape is None or frame is None or len(shape) != len(frame) or depth > MAX_WALK:
            return None
        name, ins = _name(t), _inputs(t)
        if name == "iota" and not ins:
            try:
                d = int(_attr(t, "dimension"))
            except (TypeError, ValueError):
                return None
            if not 0 <= d < len(shape) or frame[d] not in self.perm:
                return None
            return ("lit", 0) if shape[d] == 1 else ("idx", "bhqk"[self.perm.index(frame[d])])
        if getattr(t, "op", None) is CONST:
            v = _value(t)
            return None if v is None else ("lit", v)
        if name in ("broadcast_in_dim", "reshape", "slice") and len(ins) == 1:
            attrs = {
                "broadcast_in_dim": lambda: _attr(t, "broadcast_dimensions"),
                "reshape": lambda: _attr(t, "dimensions"),
                "slice": lambda: (_attr(t, "start_indices"), _attr(t, "strides")),
            }[name]()
            if name == "reshape" and attrs is not None:
                return None
            try:
                inner = _reframe(name, attrs, _ints(_shape(ins[0])), shape, frame)
            except StopIteration:  # (a reshape with more unit axes than free score axes)
                return None
            return None if inner is None else self.ref(ins[0], inner, depth + 1)
        params: Any = ()
        if name == "convert_element_type" and len(ins) == 1:
            params = _params((("new_dtype", getattr(t, "dtype", None)),))
        elif not (
            (len(ins) == 1 and region_op(name, 1))
            or (len(ins) == 2 and region_op(name, 2))
            or (name == "select_n" and len(ins) == 3)
        ):
            return None
        frames = _frames(tuple(_shape(i) for i in ins), frame)
        if frames is None:
            return None
        args = []
        for i, (_, f) in zip(ins, frames, strict=True):
            a = self.ref(i, f, depth + 1)
            if a is None:
                return None
            args.append(a)
        if len(self.steps) >= MAX_WALK:
            return None
        self.steps.append((name, params, tuple(args)))
        return ("step", len(self.steps) - 1)


@guard_fn("rules.region_index_expr")
def region_index_expr(plan: Any, term: Any) -> Any:
    """``plan`` with its first captured operand, the index expression ``term``, computed in
    the region whole (its iotas read as the kernel's positions), or None. One rewrite for
    the whole expression: taken in an operator at a time, a deep one (jnp's floor division,
    ``where(..)`` of comparisons) would need more captures at once than the node has."""
    if not isinstance(plan, RegionPlan) or not plan.spine or not plan.captures:
        return None
    shape, frame = plan.captures[0]
    if _ints(_shape(term)) != tuple(shape):
        return None
    walk = _IndexSteps(plan.attention.perm_scores)
    ref = walk.ref(term, tuple(frame))
    if ref is None:
        return None
    k = len(walk.steps)

    def shift(a: Any) -> Any:
        if a == ("in", 0):
            return ref
        if a[0] == "step":
            return ("step", a[1] + k)
        return ("in", a[1] - 1) if a[0] == "in" else a

    region = (*walk.steps, *_renumber(plan.region, shift))
    return plan._replace(region=region, captures=plan.captures[1:])


def _index_move(w: _Walk, plan: RegionPlan, caps: list[Any]) -> tuple[Any, list[Any]] | None:
    """What the ``attention_region_index*`` rules do with the first capture, in their
    order: (plan, captures) after the first that fires, or None when none does."""
    c0 = caps[0]
    name, ins = _name(c0), _inputs(c0)
    first = w.index_only(c0)
    if first:
        new = region_index_expr(plan, c0)
        if new is not None:
            return new, caps[1:]
    if first and name == "iota":
        new = region_index(plan, _attr(c0, "dimension"), _shape(c0))
        if new is not None:
            return new, caps[1:]
    elif first and getattr(c0, "op", None) is CONST:
        new = region_literal(plan, _attr(c0, "value"))
        if new is not None:
            return new, caps[1:]
    if first and len(ins) == 1:
        u = ins[0]
        new = None
        if name == "broadcast_in_dim":
            new = region_reframe(plan, name, _attr(c0, "broadcast_dimensions"), _shape(u))
        elif name == "reshape":
            new = region_reframe(plan, name, _attr(c0, "dimensions"), _shape(u))
        elif name == "slice":
            attrs = (_attr(c0, "start_indices"), _attr(c0, "strides"))
            new = region_reframe(plan, name, attrs, _shape(u))
        elif name == "convert_element_type":
            params = (("new_dtype", getattr(c0, "dtype", None)),)
            new = region_inline(plan, name, (("in", 0),), params, (_shape(u),))
        elif region_op(name, 1):
            new = region_inline(plan, name, (("in", 0),), (), (_shape(u),))
        if new is not None:
            return new, [u, *caps[1:]]
    if len(ins) == 2 and region_op(name, 2):
        for lit, u, args in (
            (_splat(ins[1]), ins[0], (("in", 0), ("lit", None))),
            (_splat(ins[0]), ins[1], (("lit", None), ("in", 0))),
        ):
            if lit is None:
                continue
            args = tuple(("lit", lit) if a[0] == "lit" else a for a in args)
            new = region_inline(plan, name, args, (), (_shape(u),))
            if new is not None:
                return new, [u, *caps[1:]]
        for u, other, args in (
            (ins[0], ins[1], (("in", 0), ("in", 1))),
            (ins[1], ins[0], (("in", 1), ("in", 0))),
        ):
            if not w.index_only(u):
                continue
            for cw in _captured(other):
                new = region_inline(plan, name, args, (), (_shape(u), _shape(cw)))
                if new is not None:
                    return new, [u, cw, *caps[1:]]
    if first and name == "select_n" and len(ins) == 3:
        shapes = tuple(_shape(i) for i in ins)
        args = (("in", 0), ("in", 1), ("in", 2))
        new = region_inline(plan, "select_n", args, (), shapes)
        if new is not None:
            return new, [*ins, *caps[1:]]
    return None


def _spine_move(
    w: _Walk, plan: RegionPlan, x: Any, caps: list[Any]
) -> tuple[Any, Any, list[Any]] | str:
    """What the rules that take the operator computing ``x`` do, in their order:
    (plan, the new x, captures), or why none fires."""
    name, ins = _name(x), _inputs(x)
    new: Any = None
    if len(ins) == 1 and region_op(name, 1):
        new = region_push(plan, name, (("acc",),))
    elif len(ins) == 1 and name == "convert_element_type":
        new = region_push(plan, name, (("acc",),), (("new_dtype", getattr(x, "dtype", None)),))
    elif len(ins) == 1 and name == "integer_pow":
        new = region_push(plan, name, (("acc",),), (("y", _attr(x, "y")),))
    if new is not None:
        return new, ins[0], caps
    wanted = 0  # captures a rule of the right shape asked for, where it found no room
    if len(ins) == 2 and region_op(name, 2):
        for lit, y, args in (
            (_splat(ins[1]), ins[0], (("acc",), ("lit", None))),
            (_splat(ins[0]), ins[1], (("lit", None), ("acc",))),
        ):
            if lit is not None:
                args = tuple(("lit", lit) if a[0] == "lit" else a for a in args)
                new = region_push(plan, name, args)
                if new is not None:
                    return new, y, caps
        for y, other, args in (
            (ins[0], ins[1], (("acc",), ("in", 0))),
            (ins[1], ins[0], (("in", 0), ("acc",))),
        ):
            if not w.on_chain(y):
                continue
            for cw in _captured(other):
                new = region_push(plan, name, args, (), (_shape(cw),))
                if new is not None:
                    return new, y, [cw, *caps]
            wanted = max(wanted, 1)
    if name == "select_n" and len(ins) == 3:
        p = ins[0]
        for fill, y, args in (
            (_splat(ins[1]), ins[2], (("in", 0), ("lit", None), ("acc",))),
            (_splat(ins[2]), ins[1], (("in", 0), ("acc",), ("lit", None))),
        ):
            if fill is None:
                continue
            args = tuple(("lit", fill) if a[0] == "lit" else a for a in args)
            for cp in _captured(p):
                new = region_push(plan, "select_n", args, (), (_shape(cp),))
                if new is not None:
                    return new, y, [cp, *caps]
            wanted = max(wanted, 1)
        for y, other, args in (
            (ins[2], ins[1], (("in", 0), ("in", 1), ("acc",))),
            (ins[1], ins[2], (("in", 0), ("acc",), ("in", 1))),
        ):
            if not w.on_chain(y):
                continue
            for cp in _captured(p):
                for cw in _captured(other):
                    new = region_push(plan, "select_n", args, (), (_shape(cp), _shape(cw)))
                    if new is not None:
                        return new, y, [cp, cw, *caps]
            wanted = max(wanted, 2)
    if wanted and len(plan.captures) + wanted > MAX_CAPTURES:
        return (
            f"the region captures {len(plan.captures) + wanted} operands at {name}; "
            f"the kernel takes at most {MAX_CAPTURES}"
        )
    shapes = ", ".join(str(tuple(_shape(i) or ())) for i in ins)
    return f"the region cannot take {name} (operands of shapes {shapes})"


def _same_value(p: Any, m: Any) -> bool:
    """Is ``p`` the value ``m``, maybe broadcast as the kernel broadcasts masks (a
    ``broadcast_in_dim`` of ``m`` itself, or an equal broadcast of the same value)?"""
    if p is m:
        return True
    if _name(p) != "broadcast_in_dim" or len(_inputs(p)) != 1:
        return False
    src = _inputs(p)[0]
    if src is m:  # m broadcast as numpy broadcasts it (aligned with the last axes)
        dims = tuple(_attr(p, "broadcast_dimensions") or ())
        rank, out = len(_shape(m) or ()), len(_shape(p) or ())
        return dims == tuple(range(out - rank, out))
    return (
        _name(m) == "broadcast_in_dim"
        and len(_inputs(m)) == 1
        and _inputs(m)[0] is src
        and tuple(_attr(p, "broadcast_dimensions") or ())
        == tuple(_attr(m, "broadcast_dimensions") or ())
        and tuple(_shape(p) or ()) == tuple(_shape(m) or ())
    )


def _masks_logits(x: Any, mask: Any) -> str | None:
    """Why ``x``, the logits, are not ``where(mask, ., fill)`` with a fill at most
    ``MASK_FILL_MAX`` (or ``where(mask == 0, fill, .)``) as their outermost step, or None."""
    if str(getattr(mask, "dtype", "")) != "bool":
        return "the probabilities are re-zeroed by a mask that is not boolean"
    ins = _inputs(x)
    if _name(x) == "select_n" and len(ins) == 3:
        p, no, yes = ins
        fill = _splat(no)
        if fill is not None and fill <= MASK_FILL_MAX and _same_value(p, mask):
            return None
        fill = _splat(yes)
        eq = _captured(p)[0]  # (a numpy-style broadcast of) mask == 0
        ins = _inputs(eq)
        if fill is not None and fill <= MASK_FILL_MAX and _name(eq) == "eq" and len(ins) == 2:
            m = ins[0]
            if _name(m) == "convert_element_type" and len(_inputs(m)) == 1:
                m = _inputs(m)[0]  # (a boolean mask cast to compare it with 0)
            if _splat(ins[1]) in (0, False) and _same_value(m, mask):
                return None
    return (
        "the probabilities are re-zeroed by a mask that is not the outermost mask of the "
        "logits (where(mask, logits, fill) with fill <= -1e9)"
    )


def finish_region(seed: Any, x: Any, s: Any, zero_mask: Any = None) -> RegionPlan | Refusal:
    """The finished plan the region rules will build from a node with plan ``seed`` and
    input ``x`` (a term, the logits) down to the scores ``s``, or a :class:`Refusal`
    saying why they cannot finish it. ``zero_mask``: the mask that re-zeroes the
    probabilities, which must be the logits' outermost and only mask."""
    if not isinstance(seed, RegionPlan) or not seed.spine:
        return Refusal("no region plan to finish")
    if zero_mask is not None:
        why = _masks_logits(x, zero_mask)
        if why is not None:
            return Refusal(why)
    w = _Walk(s)
    plan, caps = seed, []
    for _ in range(MAX_WALK):
        if caps:
            moved = _index_move(w, plan, caps)
            if moved is not None:
                plan, caps = moved
                continue
        if x is s:
            done = region_done_or_why(plan)
            return done if isinstance(done, RegionPlan) else Refusal(done)
        step = _spine_move(w, plan, x, caps)
        if isinstance(step, str):
            return Refusal(step)
        plan, x, caps = step
    return Refusal(f"the region takes more than {MAX_WALK} steps")


@guard_fn("rules.region_finishes")
def region_finishes(seed: Any, x: Any, s: Any, zero_mask: Any = None) -> bool | Refusal:
    """Will the region rules finish a region node planned ``seed`` whose logits are the
    term ``x`` over the scores ``s`` (:func:`finish_region`)? A Refusal says why not."""
    done = finish_region(seed, x, s, zero_mask)
    return done if isinstance(done, Refusal) else True
