"""Guard functions of the GEMM epilogue region rules (:mod:`pypm_jax.rules.epilogue`).

The region pattern matches the structure (pointwise operators over one GEMM, literals and
at most one new operand); :func:`region_plan` reads the matched terms (``x.term``) and turns
them into a :data:`~pypm_jax.rules._region.Region` and a :class:`GemmRegionPlan`: which
operand kinds the kernel tiles, the result's type, and whether XLA already fuses the same
epilogue into its own GEMM (the fuse policy of :mod:`pypm_jax.rules._kernels`). Pure Python
over terms and attribute values, never JAX; total: a site it cannot plan is ``None``.
"""

from __future__ import annotations

__all__ = [
    "GemmRegionPlan",
    "MAX_STEPS",
    "MAX_OPERANDS",
    "region_prim",
    "computed_from_literals",
    "region_plan",
    "gemm_has_bias",
    "reads_gemm",
    "beyond_linear",
    "activation_steps",
    "experts_gemm",
    "pair_plan",
]

import math
from typing import Any, NamedTuple

from ..core.graph import Value
from ..core.terms import CONST
from ..lang.registry import guard_fn
from ..vocab.primitives import is_table_op
from ._plans import GemmPlan, gemm_plan
from ._region import PRIMS, Region, Step, region_error, step

MAX_STEPS = 64  # a longer region is left alone (its pattern still matched: explain says so)
MAX_OPERANDS = 8

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)
_QUICK_GELU_SCALE = 1.702  # pallas_kernels.QUICK_GELU_SCALE

# attributes a lifted pointwise equation carries that do not change what it computes when
# they have these values (``accuracy=None``: the default approximation)
_NEUTRAL = {"accuracy": None, "out_dtype": None, "weak_type": None, "sharding": None}
_KEPT = {"integer_pow": ("y",), "convert_element_type": ("new_dtype",)}


class GemmRegionPlan(NamedTuple):
    """How a ``GemmRegion`` node runs on ``pallas_kernels.gemm_fused``.

    ``operands`` is the kind of each operand the region reads (``"col"``, ``"row"``,
    ``"full"``, ``"scalar"``: see ``pallas_kernels.operand_kind``; ``"ecol"``, a column
    per expert ``[E, 1, .., N]``), in the order of the node's operand pack; ``xla_fuses``
    says the region is one XLA:GPU fuses into its own GEMM (a bias or residual add, then at
    most a ReLU or tanh-GELU). ``experts`` is ``E`` for MoE experts run densely (the weight
    ``[E, K, N]``, the result ``[E, *lead, N]``: ``pallas_kernels.gemm_fused_experts``),
    else 0. A ``GemmPairRegion``'s plan has ``pair_at``, the operand that is the second
    GEMM ``x @ w2`` (kind ``"pair"``, computed by the kernel), and ``transpose_w2``.
    """

    transpose_w: bool  # w is stored [N, K]
    k: int
    n: int
    dtype: str
    out_shape: tuple[int, ...]
    out_dtype: str
    operands: tuple[str, ...]
    xla_fuses: bool
    experts: int = 0
    pair_at: int = -1
    transpose_w2: bool = False


def _dense_dot(t: Any) -> bool:
    """A ``dot_general`` contracting x's last axis with one axis of a matrix, no batch axes
    (what ``gemm_plan`` can plan; attention's batched dots are not)."""
    if t.op.name != "dot_general" or not is_table_op(t.op) or len(t.inputs) != 2:
        return False
    x, w = (getattr(i, "shape", None) for i in t.inputs)
    try:
        (lc, rc), (lb, rb) = t.attrs["dimension_numbers"]
    except (KeyError, TypeError, ValueError):
        return False
    return (
        x is not None
        and w is not None
        and len(w) == 2
        and not lb
        and not rb
        and tuple(lc) == (len(x) - 1,)
        and len(rc) == 1
    )


def _ints(xs: Any) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in xs)
    except (TypeError, ValueError):
        return None


def _experts(t: Any) -> tuple[int, int, int, bool, int] | None:
    """``(E, K, N, transpose_w, weight side)`` of MoE experts run densely: ``transpose(
    dot_general(...))`` of an activation ``x[*lead, K]`` (shared by every expert, no batch
    axes) and a weight ``w[E, K, N]`` (or ``[E, N, K]``) into ``[E, *lead, N]`` -- what
    ``einsum("th,ehm->etm", x, w)`` (keras-hub's Mixtral) traces to, in either operand
    order; else None."""
    op = getattr(t, "op", None)
    if op is None or op.name != "transpose" or not is_table_op(op) or not t.inputs:
        return None
    d = t.inputs[0]
    dop = getattr(d, "op", None)
    if dop is None or dop.name != "dot_general" or not is_table_op(dop) or len(d.inputs) != 2:
        return None
    perm = _ints(t.attrs.get("permutation") or ())
    shapes = [_ints(getattr(i, "shape", None) or ()) for i in d.inputs]
    try:
        (lc, rc), (lb, rb) = d.attrs["dimension_numbers"]
        lc, rc = _ints(lc), _ints(rc)
    except (KeyError, TypeError, ValueError):
        return None
    if perm is None or lc is None or rc is None or lb or rb or None in shapes:
        return None
    if len(lc) != 1 or len(rc) != 1:
        return None
    for side in (0, 1):  # side: which operand is the weight
        w, x = shapes[side], shapes[1 - side]
        wc, xc = (lc, rc)[side][0], (lc, rc)[1 - side][0]
        if len(w) != 3 or wc not in (1, 2) or not x or xc != len(x) - 1:
            continue
        lead = len(x) - 1
        # the dot's axes: weight-first [E, N, *lead], activation-first [*lead, E, N]
        if side == 0:
            want = (0, *range(2, 2 + lead), 1)
        else:
            want = (lead, *range(lead), lead + 1)
        if perm == want:
            return w[0], w[wc], w[3 - wc], wc == 2, side
    return None


@guard_fn("rules.experts_gemm")
def experts_gemm(term: Any) -> int | None:
    """Is ``term`` MoE experts run densely (:func:`_experts`)? The weight's side (0: the
    ``dot_general``'s lhs, 1: its rhs), or None."""
    e = _experts(term)
    return None if e is None else e[4]


def _is_gemm(t: Any, memo: dict[int, bool]) -> bool:
    """Is ``t`` a GEMM a region grows on: a GEMM kernel node, a dense ``dot_general``, a
    ``transpose`` of experts run densely? ``memo``: where the verdicts on ``dot_general``
    and ``transpose`` values are kept (``_memo(term, _is_gemm)``; the other operators
    decide at once)."""
    op = t.op
    cls = op.op_class
    if cls is not None and cls.name == "gemm":
        return True
    name = op.name  # (what _dense_dot and _experts look at first)
    if name != "dot_general" and name != "transpose":
        return False
    known = memo.get(id(t))
    if known is None:
        known = memo[id(t)] = _dense_dot(t) if name == "dot_general" else _experts(t) is not None
    return known


def _pointwise(t: Any) -> bool:
    op = t.op
    known = _POINTWISE.get(id(op))
    if known is not None and known[0] is op:
        return known[1]
    found = is_table_op(op) and (op.name in PRIMS or op.name == "broadcast_in_dim")
    if len(_POINTWISE) >= 4096:
        _POINTWISE.clear()
    _POINTWISE[id(op)] = (op, found)
    return found


# id(operator) -> (the operator, is it a region's step: ``_pointwise``); it holds the key
# object, so its id is not reused while its entry lives (a few hundred operators in all)
_POINTWISE: dict[int, tuple[Any, bool]] = {}


@guard_fn("rules.reads_gemm")
def reads_gemm(term: Any) -> bool:
    """Could ``term`` be a region's root: computed by pointwise operators from one GEMM (a
    dense ``dot_general`` or a GEMM kernel node), literals and at most one operand applied
    to the GEMM directly? A linear walk (each value once, at most :data:`MAX_STEPS` deep)
    before the region pattern explores ``term``'s inputs with backtracking."""
    if getattr(term, "op", None) is None or not _pointwise(term):
        return False
    if type(term) is Value and term.node.alive:  # (what the walk below would find, remembered)
        graph = term.node.graph
        blocked, gm = graph.memo(_blocked), graph.memo(_is_gemm)
        if _ends_false(term, blocked, graph.memo(_ends_false), 0, gm):
            return False  # (asked first: False wherever the walk is, computed from literals or not)
    else:
        blocked, gm = {}, {}
    if _from_literals(term, blocked):
        return False
    gemms: set[int] = set()
    operands: set[int] = set()
    stack, seen = [(term, 0)], set()
    while stack:
        t, depth = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if depth > MAX_STEPS or getattr(t, "op", None) is None:
            return False
        if _is_gemm(t, gm):
            gemms.add(id(t))
            continue
        if not _pointwise(t):
            if _number(t) is None:  # (else a literal; nothing else but a step is one)
                return False
            continue
        if _from_literals(t, blocked):
            continue
        ins = t.inputs
        if (
            len(ins) == 2
            and ins[0] is not ins[1]
            and (_is_gemm(ins[0], gm) or _is_gemm(ins[1], gm))
        ):
            other = ins[1] if _is_gemm(ins[0], gm) else ins[0]
            if not _from_literals(other, blocked):
                # the operand candidate (or, in ``y * logistic(y)``, part of the region):
                # not walked, so a permissive test; the pattern decides
                operands.add(id(other))
                seen.add(id(other))
        stack.extend((i, depth + 1) for i in ins if id(i) not in seen)
    return len(gemms) == 1 and len(operands) <= 2


# How deep ``_ends_false`` looks (deeper: it does not know, and the walk decides).
_ENDS_DEPTH = 256


def _ends_false(
    t: Value, blocked: dict[int, bool], memo: dict[int, bool], depth: int, gm: dict[int, bool]
) -> bool:
    """Does :func:`reads_gemm`'s walk, once it reaches ``t``, surely return False? Where
    ``t`` is a value it stops at with False (no operator, or neither a GEMM, a step nor a
    literal), or a step it walks past (pointwise, not computed from literals, no GEMM) with
    an input that does the same and that the walk cannot skip as the operand (no node
    reads it beside a GEMM: ``_skippable``). Every value the walk reaches it pops, so it
    meets that input and returns False (or returns False before). True only where the walk
    is False; False says nothing. A graph value's readers are read, so ``memo`` is the
    graph's (emptied when inputs or readers change); each value once, at most
    ``_ENDS_DEPTH`` levels."""
    known = memo.get(id(t))
    if known is not None:
        return known
    if depth > _ENDS_DEPTH:
        return False  # (not known: not remembered)
    op = getattr(t, "op", None)
    if op is None:
        found = True
    elif _is_gemm(t, gm):
        found = False
    elif not _pointwise(t):
        found = _number(t) is None
    elif _from_literals(t, blocked):
        found = False
    else:
        found = False
        for i in reversed(t.inputs):  # (the walk's order: its stack pops the last first)
            if _ends_false(i, blocked, memo, depth + 1, gm) and not _skippable(i, gm):
                found = True
                break
    memo[id(t)] = found
    return found


def _skippable(t: Value, gm: dict[int, bool]) -> bool:
    """Can :func:`reads_gemm`'s walk skip ``t`` as the operand? (A node reads it beside a
    GEMM, ``g(t, gemm)`` or ``g(gemm, t)``: read wider than the walk's own rule.)"""
    for p in t.readers:
        ins = p.inputs
        if (
            len(ins) == 2
            and ins[0] is not ins[1]
            and _is_gemm(ins[1] if ins[0] is t else ins[0], gm)
        ):
            return True
    return False


def _operand_only(t: Any) -> bool:
    """Can a region read ``t`` only as its operand? Not a GEMM the region pattern takes
    (a ``dot_general``, a ``transpose`` of one, a GEMM kernel node), not computed from
    literals, and not a value a region computes (a step's primitive, a broadcast of one
    element): ``_Walk`` gives it no reference unless it is the operand."""
    op = getattr(t, "op", None)
    if op is None:
        return False
    cls = op.op_class
    if cls is not None and cls.name == "gemm":
        return False
    if not is_table_op(op):
        return _number(t) is None  # (a literal is a region's own)
    name = op.name
    if name in PRIMS or name in ("dot_general", "transpose"):
        return False
    # (a broadcast of one element: a step's value or a literal; any other table operator:
    # ``_Walk`` gives it no reference)
    return name != "broadcast_in_dim" or bool(t.inputs) and not _one_element(t.inputs[0])


def _linear_operand(t: Any, out_shape: tuple[int, ...]) -> bool:
    """Is ``t`` read only as the operand, and one whose add is linear (``_linear``: a
    column, a full tile, a column per expert) or no region at all? (Read as experts' with
    ``E = out_shape[0]``: on a dense GEMM's result such a column per expert is a full tile
    or an operand the kernel cannot tile.)"""
    kind = operand_kind_of(t, out_shape, out_shape[0] if out_shape else 0)
    return kind in ("col", "ecol", "full") and _operand_only(t)


@guard_fn("rules.beyond_linear")
def beyond_linear(term: Any) -> bool:
    """Could a region rooted at ``term`` be one :func:`region_plan` takes, as far as
    linearity goes? False only where every region the pattern can match there grows on a
    bare GEMM (no GEMM kernel node below ``term``) and each of its steps is constant or
    linear (``_linear``: a cast, an add of a column or full-tile operand, a scaling by a
    constant), which ``region_plan`` leaves to XLA. A walk over the values a region's steps
    can be (each once; a value read only as the operand is not walked), checked at the root
    before the pattern's recursion explores it with backtracking."""
    shape = getattr(term, "shape", None)
    if shape is None:
        return True
    out_shape = tuple(shape)
    blocked = _memo(term, _blocked)
    stack, seen = [term], set()
    while stack:
        t = stack.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        if len(seen) > 4 * MAX_STEPS:
            return True  # (a region that long is refused anyway; no need to know why)
        op = getattr(t, "op", None)
        if op is None:
            continue
        cls = op.op_class
        if cls is not None and cls.name == "gemm":
            return True  # a kernel node a region can grow on
        if not is_table_op(op):
            continue  # (no step: the GEMM, the operand, or no region)
        name, ins = op.name, t.inputs
        if name == "broadcast_in_dim":
            if ins and _one_element(ins[0]):
                stack.append(ins[0])  # (steps broadcast like numbers)
            continue
        if name not in PRIMS or _from_literals(t, blocked):
            continue  # no step, or a constant one
        if name in ("convert_element_type", "copy"):
            stack.extend(ins)
        elif name in ("mul", "div") and len(ins) == 2 and _from_literals(ins[1], blocked):
            stack.append(ins[0])
        elif name == "mul" and len(ins) == 2 and _from_literals(ins[0], blocked):
            stack.append(ins[1])
        elif name == "add" and len(ins) == 2 and _linear_operand(ins[1], out_shape):
            stack.append(ins[0])
        elif name == "add" and len(ins) == 2 and _linear_operand(ins[0], out_shape):
            stack.append(ins[1])
        else:
            return True  # a step that is not linear (where it is a step at all)
    return False


@guard_fn("rules.gemm_has_bias")
def gemm_has_bias(plan: Any) -> bool:
    """Does a ``GemmEpilogue``'s plan read its bias input?"""
    return isinstance(plan, GemmPlan) and plan.bias


@guard_fn("rules.region_prim")
def region_prim(name: Any) -> bool:
    """Can a region step be this primitive (does the kernel's epilogue lower it)?"""
    return name in PRIMS


def _number(term: Any) -> Any:
    """The Python number a literal term holds, or None."""
    if getattr(term, "op", None) is not CONST:
        return None
    v = term.attrs.get("value")
    if isinstance(v, bool | int | float) and not (isinstance(v, float) and math.isnan(v)):
        return v
    return None


@guard_fn("rules.computed_from_literals")
def computed_from_literals(term: Any) -> bool:
    """Is ``term`` computed from literals alone (``0.5``, ``float32(sqrt(32.0))``, a
    broadcast ``0.0``), so that a region computes it in its steps?"""
    return _from_literals(term, _memo(term, _blocked))


def _memo(term: Any, key: Any) -> dict[int, Any]:
    """Where a walk from ``term`` remembers the facts ``key`` (:func:`_blocked`,
    :func:`_is_gemm`) finds: for a live graph value its graph's memo (what a value is
    computed from decides them, so they hold until the graph changes, across the region
    pattern's starts in a rewrite pass), else one walk's own."""
    if type(term) is Value and term.node.alive:
        return term.node.graph.memo(key)
    return {}


def _from_literals(term: Any, blocked: dict[int, bool]) -> bool:
    """:func:`computed_from_literals`, ``blocked`` remembering :func:`_blocked` across the
    calls of walks over a graph that does not change meanwhile (:func:`_memo`)."""
    return not _blocked(term, blocked, 0) and _Walk((), None, ("acc",), {}).ref(term) is not None


def _blocked(term: Any, memo: dict[int, bool], depth: int) -> bool:
    """Does ``_Walk.ref``'s recursion from ``term`` reach a value whose reference is None
    wherever it is reached (not a literal, not a step: a GEMM, an input, a reshape...)?
    Then no walk computes ``term`` from literals, so ``computed_from_literals`` is False
    without building steps; False says nothing (the walk decides: its step and depth
    limits too). The same recursion as ``_Walk.ref``, each value once (``memo``, by id), at
    most ``MAX_STEPS + 1`` levels (deeper: False), so a chain of pointwise operators is
    walked once, not once per value of it."""
    known = memo.get(id(term))
    if known is not None:
        return known
    if _number(term) is not None:
        return False
    op = getattr(term, "op", None)
    if op is None or not is_table_op(op):
        found = True
    elif depth > MAX_STEPS or op.name in ("broadcast_in_dim", "copy") and not term.inputs:
        return False  # (not looked at: the walk decides, or raises as before)
    elif op.name == "broadcast_in_dim" and _one_element(term.inputs[0]):
        found = _blocked(term.inputs[0], memo, depth + 1)
    elif op.name not in PRIMS:
        found = True
    elif op.name == "copy":
        found = not _plain_params(term) or _blocked(term.inputs[0], memo, depth + 1)
    else:
        for t in term.inputs:  # (a loop, not any(): this runs at every step of every walk)
            if _blocked(t, memo, depth + 1):
                found = True
                break
        else:
            found = not _plain_params(term)
    memo[id(term)] = found
    return found


# -------------------------------------------------------------------------- operands


def _varying_axes(term: Any, rank: int) -> set[int] | None:
    """The axes of a ``[*lead, N]`` result along which an operand's value can change,
    looking through ``broadcast_in_dim`` (so a broadcast bias varies along N only)."""
    shape = getattr(term, "shape", None)
    if shape is None or len(shape) > rank:
        return None
    op = getattr(term, "op", None)
    if op is not None and op.name == "broadcast_in_dim" and is_table_op(op) and term.inputs:
        src = term.inputs[0].shape
        dims = term.attrs.get("broadcast_dimensions")
        if src is not None and dims is not None and len(shape) == rank:
            return {int(d) for d, s in zip(dims, src, strict=True) if s != 1}
    offset = rank - len(shape)
    return {offset + i for i, d in enumerate(shape) if d != 1}


def operand_kind_of(term: Any, out_shape: tuple[int, ...], experts: int = 0) -> str | None:
    """How the kernel tiles ``term`` read against the ``out_shape`` result, or None.

    JAX broadcasts size-1 axes of a binary operator's operands, and ``jnp`` writes a
    ``broadcast_in_dim``: the kind comes from the axes the value varies along; a row or a
    full tile must also have the result's leading axes (a per-batch ``[B, 1, N]`` bias of a
    ``[B, S, N]`` result does not: no tile of it lines up with the result's)."""
    axes = _varying_axes(term, len(out_shape))
    if axes is None:
        return None
    rank = len(out_shape)
    shape = (1,) * (rank - len(term.shape)) + tuple(term.shape)
    last = rank - 1
    if not axes:
        return "scalar"
    if axes == {last}:
        return "col"
    if experts and rank > 2 and axes == {0, last} and shape[0] == experts:
        return "ecol"  # a column per expert (a per-expert bias)
    if last not in axes:
        return "row" if shape[:-1] == tuple(out_shape[:-1]) else None
    return "full" if shape == tuple(out_shape) else None


# ---------------------------------------------------------------------------- walking


def _params(term: Any) -> tuple[tuple[str, Any], ...] | None:
    """The step params of a lifted pointwise equation, or None if one changes its meaning
    in a way a region cannot say (a non-default ``accuracy``, a sharding...)."""
    kept = _KEPT.get(term.op.name, ())
    out: dict[str, Any] = {}
    for name, value in term.attrs.items():
        if name in kept:
            out[name] = getattr(value, "numpy_name", value)
        elif name not in _NEUTRAL or (value is not None and value is not False):
            return None
    return tuple(sorted(out.items()))


def _plain_params(term: Any) -> bool:
    """``_params(term) is not None``, without building the params."""
    kept = _KEPT.get(term.op.name, ())
    for name, value in term.attrs.items():
        if name not in kept and (
            name not in _NEUTRAL or (value is not None and value is not False)
        ):
            return False
    return True


def _one_element(term: Any) -> bool:
    shape = getattr(term, "shape", None)
    return shape is not None and all(d == 1 for d in shape)


class _Walk:
    """Steps computing ``root`` from the base value, the operands and literals."""

    def __init__(self, prefix: Region, base: Any, base_ref: tuple[Any, ...], operands: dict):
        self.steps: list[Step] = list(prefix)
        self.refs: dict[int, tuple[Any, ...]] = {id(base): base_ref}
        for term, ref in operands.items():
            self.refs[id(term)] = ref
        self.operands = operands

    def ref(self, term: Any, depth: int = 0) -> tuple[Any, ...] | None:
        known = self.refs.get(id(term))
        if known is not None:
            return known
        value = _number(term)
        if value is not None:
            return ("lit", value)
        op = getattr(term, "op", None)
        if op is None or not is_table_op(op) or depth > MAX_STEPS:
            return None
        if op.name == "broadcast_in_dim" and _one_element(term.inputs[0]):
            return self.ref(term.inputs[0], depth + 1)  # steps broadcast like numbers
        if op.name not in PRIMS:
            return None
        params = _params(term)
        if params is None:
            return None
        if op.name == "copy":  # no step: a region that only copies adds nothing
            return self.ref(term.inputs[0], depth + 1)
        args = []
        for t in term.inputs:
            r = self.ref(t, depth + 1)
            if r is None:
                return None
            args.append(r)
        if len(self.steps) >= MAX_STEPS:
            return None
        self.steps.append((op.name, params, tuple(args)))
        ref = ("step", len(self.steps) - 1)
        self.refs[id(term)] = ref
        return ref


# ------------------------------------------------------------------ activations as steps

_ACT = ("step", -1)  # placeholder: the activation's input, resolved by activation_steps


def activation_steps(activation: str, bias: bool) -> Region | None:
    """The steps of ``pallas_kernels.gemm_epilogue``'s kernel epilogue (its formulas),
    so a region can grow over a ``GemmEpilogue`` node a dense + activation rule built."""
    steps: list[Step] = []

    def put(prim: str, *args: Any, **params: Any) -> tuple[str, int]:
        steps.append(step(prim, tuple(args), **params))
        return ("step", len(steps) - 1)

    a: tuple[Any, ...] = put("add", ("acc",), ("in", 0)) if bias else ("acc",)

    def lit(v: float) -> tuple[str, float]:
        return ("lit", v)

    if activation == "none":
        pass
    elif activation == "relu":
        put("max", a, lit(0.0))
    elif activation == "gelu_tanh":
        cube = put("integer_pow", a, y=3)
        inner = put("add", a, put("mul", lit(0.044715), cube))
        t = put("tanh", put("mul", lit(_SQRT_2_OVER_PI), inner))
        put("mul", put("mul", lit(0.5), a), put("add", lit(1.0), t))
    elif activation == "gelu":
        e = put("erf", put("mul", a, lit(_INV_SQRT2)))
        put("mul", put("mul", lit(0.5), a), put("add", lit(1.0), e))
    elif activation == "silu":
        put("mul", a, put("logistic", a))
    elif activation == "sigmoid":
        put("logistic", a)
    elif activation == "tanh":
        put("tanh", a)
    elif activation == "quick_gelu":
        put("mul", a, put("logistic", put("mul", lit(_QUICK_GELU_SCALE), a)))
    else:
        return None
    return tuple(steps)


# ----------------------------------------------------------------------------- plans


def _kernel_takes(x_shape: Any, gp: Any) -> bool:
    """Does ``pallas_kernels.gemm_fused`` take the GEMM (shapes, a float dtype)?"""
    from pallas_kernels import supports_gemm

    try:
        x = tuple(int(d) for d in x_shape)
    except (TypeError, ValueError):
        return False
    return supports_gemm(x, (gp.k, gp.n), gp.dtype)


def _constant_steps(region: Region) -> set[int]:
    """The steps computed from literals alone (``float32(sqrt(32.0))``)."""
    out: set[int] = set()
    for j, (_, _, args) in enumerate(region):
        if all(r[0] == "lit" or (r[0] == "step" and r[1] in out) for r in args):
            out.add(j)
    return out


def _linear(s: Step, kinds: tuple[str, ...], constant: set[int]) -> bool:
    """A step XLA folds into its own GEMM: a cast, a bias or residual add, a scaling by a
    constant (cuBLAS's bias, C and alpha)."""
    prim, _, args = s

    def const(r: tuple[Any, ...]) -> bool:
        return r[0] == "lit" or (r[0] == "step" and r[1] in constant)

    if prim == "convert_element_type":
        return True
    if prim == "add":
        return any(r[0] == "in" and kinds[r[1]] in ("col", "ecol", "full") for r in args)
    return (prim in ("mul", "div") and const(args[1])) or (prim == "mul" and const(args[0]))


def _xla_fuses(region: Region, kinds: tuple[str, ...]) -> bool:
    """Is ``region`` an epilogue XLA:GPU already fuses into its GEMM (cuBLASLt): casts, a
    bias or residual add, a constant scale, then at most one ReLU?  (tanh-GELU sites come
    from the dense + activation rule, whose plan says so.)"""
    constant = _constant_steps(region)
    rest = [s for j, s in enumerate(region) if j not in constant]
    while rest and _linear(rest[0], kinds, constant):
        rest.pop(0)
    return len(rest) <= 1 and all(s[0] == "max" and ("lit", 0.0) in s[2] for s in rest)


def _experts_plan(base: Any, dtypes: Any) -> GemmPlan | None:
    """A ``GemmPlan`` (no bias, no activation) of MoE experts run densely, or None."""
    e = _experts(base)
    if e is None:
        return None
    try:
        dts = tuple(getattr(d, "numpy_name", d) for d in dtypes)
    except TypeError:
        return None
    out = _ints(getattr(base, "shape", None) or ())
    out_dtype = getattr(base.dtype, "numpy_name", None)
    if len(set(dts)) != 1 or out_dtype != dts[0] or not out:
        return None
    _, k, n, transpose_w, _ = e
    return GemmPlan("none", transpose_w, k, n, False, dts[0], out, out_dtype)


def _base(base: Any, x_shape: Any, w_shape: Any, dtypes: Any) -> Any:
    """(prefix steps, operand kinds, GemmPlan-like, experts) of the value the region grows
    on: no prefix on a bare ``dot_general`` (or experts' ``transpose(dot_general)``), else
    the region the kernel node already has."""
    name = base.op.name
    if name == "dot_general" and is_table_op(base.op):
        dn = base.attrs.get("dimension_numbers")
        gp = gemm_plan(x_shape, w_shape, dtypes, dn, (base.shape, base.dtype))
        return None if gp is None else (None, (), gp, 0)
    if name == "transpose" and is_table_op(base.op):
        gp = _experts_plan(base, dtypes)
        return None if gp is None else (None, (), gp, int(_ints(w_shape)[0]))  # type: ignore[index]
    plan = base.attrs.get("plan")
    if name == "GemmRegion" and isinstance(plan, GemmRegionPlan):
        return base.attrs.get("region"), plan.operands, plan, plan.experts
    if name == "GemmEpilogue" and isinstance(plan, GemmPlan):
        prefix = activation_steps(plan.activation, plan.bias)
        return None if prefix is None else (prefix, ("col",) * plan.bias, plan, 0)
    return None


@guard_fn("rules.gemm_region_plan")
def region_plan(
    root: Any, base: Any, operand: Any, x_shape: Any, w_shape: Any, dtypes: Any
) -> tuple[Region, GemmRegionPlan] | None:
    """The region computing ``root`` from ``base`` (a ``dot_general`` contracting x's last
    axis with a matrix, or a ``GemmRegion`` / ``GemmEpilogue`` node to grow), literals and
    ``operand`` (None: none), with its plan; None where the kernel cannot take it.

    A region on a bare ``dot_general`` that only adds a bias or residual (and casts) is
    left to XLA, which folds it into its own GEMM (``gemm_epilogue_linear`` is the opt-in
    rule for it).
    """
    b = _base(base, x_shape, w_shape, dtypes)
    if b is None or getattr(root, "shape", None) is None:
        return None
    prefix, kinds, gp, experts = b
    bare = prefix is None
    prefix = prefix or ()
    out_shape = tuple(root.shape)
    if out_shape != tuple(gp.out_shape) or (prefix and region_error(prefix) is not None):
        return None
    operands: dict[Any, Any] = {}
    if operand is not None:
        if _Walk((), base, ("acc",), {}).ref(operand) is not None:
            return None  # computed from literals (and the GEMM): region steps, no operand
        kind = operand_kind_of(operand, out_shape, experts)
        if kind is None or len(kinds) >= MAX_OPERANDS or operand is base:
            return None
        operands[operand] = ("in", len(kinds))
        kinds = (*kinds, kind)
    base_ref = ("step", len(prefix) - 1) if prefix else ("acc",)
    walk = _Walk(prefix, base, base_ref, operands)
    if walk.ref(root) is None or len(walk.steps) == len(prefix):
        return None
    region = tuple(walk.steps)
    if operand is not None and not any(("in", len(kinds) - 1) in s[2] for s in region):
        return None
    out_dtype = getattr(root.dtype, "numpy_name", None)
    if out_dtype is None or region_error(region, len(kinds)) is not None:
        return None
    if not _kernel_takes(x_shape, gp):
        return None
    constant = _constant_steps(region)
    linear = all(j in constant or _linear(s, kinds, constant) for j, s in enumerate(region))
    if bare and linear:
        return None  # a bias / residual add, a scale on a bare GEMM: XLA's own
    plan = GemmRegionPlan(
        transpose_w=gp.transpose_w,
        k=gp.k,
        n=gp.n,
        dtype=gp.dtype,
        out_shape=out_shape,
        out_dtype=out_dtype,
        operands=kinds,
        xla_fuses=_xla_fuses(region, kinds),
        experts=experts,
    )
    return region, plan


@guard_fn("rules.gemm_pair_plan")
def pair_plan(node: Any, dot: Any) -> GemmRegionPlan | None:
    """The plan of one kernel computing both GEMMs of a gated pair: ``node`` is a
    ``GemmRegion`` whose last operand, a full tile, is ``dot``, a dense ``dot_general`` of
    the region's own x and a weight of w's K, N and dtype (``act(x @ w1) * (x @ w2)``,
    either weight stored ``[N, K]``); None where it is not."""
    plan = node.attrs.get("plan") if getattr(node, "op", None) is not None else None
    if not isinstance(plan, GemmRegionPlan) or plan.experts or plan.pair_at >= 0:
        return None
    if not plan.operands or plan.operands[-1] != "full" or not _dense_dot(dot):
        return None
    x, w = node.inputs[0], node.inputs[1]
    if dot.inputs[0] is not x:
        return None
    w2 = dot.inputs[1]
    if w2.dtype != w.dtype:
        return None
    dts = (x.dtype, w2.dtype, dot.dtype)
    gp = gemm_plan(
        x.shape, w2.shape, dts, dot.attrs.get("dimension_numbers"), (dot.shape, dot.dtype)
    )
    if gp is None or (gp.k, gp.n, gp.dtype) != (plan.k, plan.n, plan.dtype):
        return None
    if tuple(gp.out_shape) != tuple(plan.out_shape):
        return None
    return plan._replace(
        operands=(*plan.operands[:-1], "pair"),
        pair_at=len(plan.operands) - 1,
        transpose_w2=gp.transpose_w,
        xla_fuses=False,
    )
