"""Lifting a jaxpr into a pm :class:`Graph`: one node per equation, driven by the op table.

What each equation becomes is decided by its primitive's table entry
(:mod:`pypm_jax.vocab.primitives`): a plain node whose attrs are the params; an inlined body
(``jit``); an inlined body remembered as a :class:`Region` (``custom_jvp_call``,
``custom_vjp_call``, ``remat2``) so lowering can re-emit the original call, with its custom
derivative rule, when no rewrite touched the region; a node holding lifted sub-programs
(``scan``, ``while``, ``cond``, ``shard_map``) that rewriting reaches into; or an opaque, impure node for
unknown or effectful primitives.

Every node carries the user's source line (``node.loc``, JAX/Flax/pypm frames skipped; found
in the equation's traceback when first read) and its Flax module path
(``node.meta["module_path"]``, from the name stack). Literals and
constants become ``pypm.const`` nodes (a Python scalar ``value`` for scalars and splats), or
graph inputs bound at lowering when they are large arrays.
"""

from __future__ import annotations

__all__ = [
    "LiftedProgram",
    "Region",
    "EqnInfo",
    "eqn_info",
    "lift",
    "lift_jaxpr",
    "module_path",
    "NESTED_PARAMS",
]

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.dtypes import DType, as_dtype
from ..core.errors import PyPMError, SourceLoc
from ..core.graph import NO_ATTRS, Graph, node_type
from ..vocab.primitives import lift_attrs, op_for, opaque_op, spec_for
from . import _compat

# Non-splat constant arrays up to this many elements become const nodes; larger ones are
# graph inputs fed at lowering (hashing megabytes of weights into the graph helps nobody).
SMALL_CONST_ELEMENTS = 64

# Arrays above this size are never scanned for splats (they stay device arrays).
SPLAT_CHECK_ELEMENTS = 1 << 16

# For nested primitives: the params that hold bodies, lifted into sub-programs.
NESTED_PARAMS: dict[str, tuple[str, ...]] = {
    "scan": ("jaxpr",),
    "while": ("cond_jaxpr", "body_jaxpr"),
    "cond": ("branches",),
    "shard_map": ("jaxpr",),
}

# Where a region's body is in its params, and whether it is closed (has consts).
_REGION_BODY = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "remat2": "jaxpr"}
_INLINE_BODY = {"jit": "jaxpr", "closed_call": "call_jaxpr"}


@dataclass(eq=False, slots=True)
class EqnInfo:
    """What lowering needs from the equation a node was lifted from (``node.meta["jax_eqn"]``).

    The rewrite driver copies a replaced root's meta onto the nodes a rule builds; ``owner``
    (the id of the lifted node) tells the lifted node from those copies: see :func:`eqn_info`.
    """

    primitive: Any
    params: dict[str, Any]
    source_info: Any
    ctx: Any
    avals: tuple[Any, ...]
    kind: str
    owner: int | None = None
    in_avals: tuple[Any, ...] = ()  # the operands' types (lowering re-emits the equation
    # as recorded while its operands have them)


def eqn_info(node: Any) -> EqnInfo | None:
    """The equation ``node`` was lifted from; None for a node a rule built."""
    info = node.meta.get("jax_eqn")
    return info if isinstance(info, EqnInfo) and info.owner == node.id else None


@dataclass(eq=False)
class Region:
    """An inlined call whose original equation lowering can re-emit while it is intact.

    ``nodes`` pairs every node lifted from the body with its inputs at lifting time: lowering
    compares them with the current inputs to know whether a rewrite reached inside.
    """

    id: int
    primitive: Any
    params: dict[str, Any]
    source_info: Any
    ctx: Any
    ins: tuple[Any, ...]
    outs: tuple[Any, ...] = ()
    nodes: list[tuple[Any, tuple[Any, ...]]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.primitive.name


@dataclass(eq=False)
class LiftedProgram:
    """A lifted (closed) jaxpr: the graph plus what lowering needs to run it again.

    ``inputs`` are the graph inputs standing for the jaxpr's parameters, in order;
    ``hoisted`` pairs the graph inputs standing for large constants with their values.
    """

    graph: Any
    inputs: tuple[Any, ...]
    in_avals: tuple[Any, ...]
    out_avals: tuple[Any, ...]
    hoisted: list[tuple[Any, Any]] = field(default_factory=list)
    regions: dict[int, Region] = field(default_factory=dict)

    def __repr__(self) -> str:
        g = self.graph
        return f"<lifted body: {len(g.inputs)} inputs, {len(g)} nodes>"

    def nested(self) -> list[tuple[Any, str, LiftedProgram]]:
        """(node, param name, body) for every sub-program of a scan/while/cond node."""
        out = []
        for node in self.graph.nodes():
            names = NESTED_PARAMS.get(node.op.name)
            if not names or node.op.namespace != "jax":
                continue
            for name in names:
                body = node.attrs.get(name)
                items = body if isinstance(body, tuple) else (body,)
                out.extend((node, name, b) for b in items if isinstance(b, LiftedProgram))
        return out


class _Where:
    """Where an equation is in the user's code, found when a node's ``loc`` is first asked
    for (most never are: a report or an error asks about a few): the innermost user frame of
    its traceback, else its caller's (for bodies JAX traced once and cached)."""

    __slots__ = ("source_info", "outer", "found")

    def __init__(self, source_info: Any, outer: SourceLoc | _Where | None):
        self.source_info = source_info
        self.outer = outer
        self.found: Any = self

    def __call__(self) -> SourceLoc | None:
        found = self.found
        if found is self:
            found = _compat.user_frame(self.source_info)
            if found is None:
                outer = self.outer
                found = outer() if isinstance(outer, _Where) else outer
            self.found = found
        return found


def lift(closed_jaxpr: Any, *, in_names: Sequence[str] | None = None) -> LiftedProgram:
    """Lift a ``ClosedJaxpr`` (from ``jax.make_jaxpr``) into a :class:`LiftedProgram`."""
    jaxpr, consts = _compat.body_parts(closed_jaxpr)
    return _Lifter().program(jaxpr, consts, None, in_names)


def lift_jaxpr(jaxpr: Any, consts: Sequence[Any] = ()) -> LiftedProgram:
    """Lift an open ``Jaxpr`` with explicit consts (the values of its constvars)."""
    body = _compat.closed_jaxpr(jaxpr, consts) if len(consts) else jaxpr
    jaxpr, consts = _compat.body_parts(body)
    return _Lifter().program(jaxpr, consts, None, None)


def module_path(stack: Any) -> str:
    """The Flax module path of a name stack: its scopes, minus the ones JAX adds itself.

    ``jnp.einsum`` names its scope after the subscripts (``...qhd,...khd->...hqk``); such
    scopes are not modules and are dropped. Transforms (``jvp(...)``) are not scopes.
    """
    scopes = _compat.name_stack_scopes(stack)
    return "/".join(s for s in scopes if "->" not in s and "," not in s)


def pm_dtype(dtype: Any) -> DType | None:
    """A JAX dtype as a pm dtype; None for extended dtypes (PRNG keys) pm has no name for."""
    try:
        return _PM_DTYPES[dtype]
    except (KeyError, TypeError):  # (TypeError: an unhashable dtype-like)
        pass
    out = _pm_dtype(dtype)
    try:
        _PM_DTYPES[dtype] = out
    except TypeError:
        pass
    return out


# dtype -> pm dtype: a model's avals have a handful of dtypes, asked about once per value
_PM_DTYPES: dict[Any, DType | None] = {}


def _is_extended(dtype: Any) -> bool:
    """:func:`_compat.is_extended_dtype`, remembered per dtype (asked once per constant)."""
    try:
        return _EXTENDED[dtype]
    except KeyError:
        pass
    except TypeError:  # (unhashable)
        return _compat.is_extended_dtype(dtype)
    out = _EXTENDED[dtype] = _compat.is_extended_dtype(dtype)
    return out


_EXTENDED: dict[Any, bool] = {}


def _pm_dtype(dtype: Any) -> DType | None:
    if _compat.is_extended_dtype(dtype):
        return None
    try:
        return as_dtype(np.dtype(dtype))
    except TypeError:
        return None


def _type(aval: Any) -> tuple[tuple[int, ...] | None, DType | None]:
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    return (
        None if shape is None else tuple(map(int, shape)),
        None if dtype is None else pm_dtype(dtype),
    )


def _python_scalar(arr: np.ndarray) -> Any:
    x = arr.reshape(-1)[0]
    kind = arr.dtype.kind
    if kind == "b":
        return bool(x)
    if kind in "iu":
        return int(x)
    if kind == "c":
        return complex(x)
    return float(x)


def _is_splat(arr: np.ndarray) -> bool:
    """All elements bitwise equal (so -0.0 and 0.0, or NaN payloads, are not merged)."""
    if arr.size <= 1:
        return True
    flat = arr.reshape(-1)
    first = flat[:1].tobytes()
    if flat[-1:].tobytes() != first or flat[arr.size // 2 : arr.size // 2 + 1].tobytes() != first:
        return False
    return flat.tobytes() == first * arr.size


class _Lifter:
    """One lifting run: owns the region counter shared by all graphs it builds, and what
    it found about the avals and name stacks equations share (keyed by their ids, each
    kept alive beside what was found about it)."""

    def __init__(self) -> None:
        self._next_region = 0
        self._types: dict[int, tuple[Any, Any]] = {}  # id(aval) -> (aval, its node type)
        self._paths: dict[int, tuple[Any, str]] = {}  # id(stack) -> (stack, module path)

    def _type_of(self, aval: Any) -> Any:
        """An aval's type as nodes keep it (a model's equations share a few dozen avals)."""
        found = self._types.get(id(aval))
        if found is None:
            found = self._types[id(aval)] = (aval, node_type(*_type(aval)))
        return found[1]

    def _module_path(self, stack: Any) -> str:
        found = self._paths.get(id(stack))
        if found is None:
            found = self._paths[id(stack)] = (stack, module_path(stack))
        return found[1]

    # -------------------------------------------------------------- programs

    def program(
        self,
        jaxpr: Any,
        consts: Sequence[Any],
        prefix: Any,
        in_names: Sequence[str] | None,
        loc: SourceLoc | _Where | None = None,
    ) -> LiftedProgram:
        g = Graph()
        inputs = []
        for i, var in enumerate(jaxpr.invars):
            name = in_names[i] if in_names is not None and i < len(in_names) else f"in{i}"
            shape, dtype = _type(var.aval)
            inputs.append(g.add_input(name, shape, dtype))
        prog = LiftedProgram(
            graph=g,
            inputs=tuple(inputs),
            in_avals=tuple(v.aval for v in jaxpr.invars),
            out_avals=tuple(v.aval for v in jaxpr.outvars),
        )
        env: dict[Any, Any] = dict(zip(jaxpr.invars, inputs, strict=True))
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self._constant(prog, value, var.aval)
        self._eqns(prog, jaxpr.eqns, env, prefix, [], loc)
        g.set_outputs([self._read(prog, env, v) for v in jaxpr.outvars])
        # what no output reads (and has no effect) is not the program: JAX's lowering drops
        # it too. Rewriting it would be wasted, and reported sites that never run.
        g.dce()
        g.compact()  # matching then reads the graph's memory in order
        return prog

    def _constant(self, prog: LiftedProgram, value: Any, aval: Any) -> Any:
        """A const node for scalars, splats and small arrays; a graph input otherwise.

        Values of an enclosing trace (a closure over tracers) and large arrays are fed at
        lowering; large arrays are not even scanned for splats (no device-to-host copy).
        """
        if _is_extended(getattr(aval, "dtype", None)) or _compat.is_tracer(value):
            return self._hoist(prog, value, aval)
        size = int(math.prod(getattr(aval, "shape", ()) or ()))
        if size == 0 or size > SPLAT_CHECK_ELEMENTS:
            return self._hoist(prog, value, aval)
        arr = np.asarray(value)
        shape, dtype = self._type_of(aval)
        if _is_splat(arr):
            return prog.graph.add_const(_python_scalar(arr), shape=shape, dtype=dtype)
        if arr.size <= SMALL_CONST_ELEMENTS:
            return prog.graph.add_const(arr.copy(), shape=shape, dtype=dtype)
        return self._hoist(prog, value, aval)

    def _hoist(self, prog: LiftedProgram, value: Any, aval: Any) -> Any:
        shape, dtype = _type(aval)
        v = prog.graph.add_input(f"const{len(prog.hoisted)}", shape, dtype)
        prog.hoisted.append((v, value))
        return v

    def _read(self, prog: LiftedProgram, env: dict[Any, Any], var: Any) -> Any:
        if isinstance(var, _compat.Literal):
            return self._constant(prog, _compat.literal_value(var), var.aval)
        return env[var]

    # -------------------------------------------------------------- equations

    def _eqns(
        self,
        prog: LiftedProgram,
        eqns: Sequence[Any],
        env: dict[Any, Any],
        prefix: Any,
        regions: list[Region],
        outer_loc: SourceLoc | _Where | None,
    ) -> None:
        """Lift equations; ``outer_loc`` is the call site's line, for bodies JAX traced once
        and cached (their own tracebacks may lack the user's frame)."""
        literal = _compat.Literal
        for eqn in eqns:
            prim = eqn.primitive
            _compat.remember_primitive(prim)
            stack = _compat.join_name_stacks(prefix, _compat.name_stack(eqn.source_info))
            ins = [
                self._constant(prog, _compat.literal_value(v), v.aval)
                if isinstance(v, literal)
                else env[v]
                for v in eqn.invars
            ]
            loc = _Where(eqn.source_info, outer_loc)
            spec = spec_for(prim.name)
            kind = spec.kind if spec is not None else "opaque"
            if eqn.effects and kind != "inline":
                # effects are never rewritten through; an inlined call's effectful
                # equations become opaque one by one, the rest of its body stays matchable
                kind = "opaque"
            if kind == "inline":
                jaxpr, consts = _compat.body_parts(eqn.params[_INLINE_BODY[prim.name]])
                outs = self._inline(prog, jaxpr, consts, ins, stack, regions, loc)
            elif kind == "retype":  # pvary: the same values, re-typed
                outs = ins
            elif kind == "region":
                outs = self._region(prog, eqn, ins, stack, regions, loc)
            else:
                outs = self._node(prog, eqn, kind, spec, ins, stack, regions, loc)
            for var, value in zip(eqn.outvars, outs, strict=True):
                env[var] = value

    def _inline(
        self,
        prog: LiftedProgram,
        jaxpr: Any,
        consts: Sequence[Any],
        ins: Sequence[Any],
        stack: Any,
        regions: list[Region],
        loc: _Where,
    ) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.invars, ins, strict=True))
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self._constant(prog, value, var.aval)
        self._eqns(prog, jaxpr.eqns, env, stack, regions, loc)
        return [self._read(prog, env, v) for v in jaxpr.outvars]

    def _region(
        self,
        prog: LiftedProgram,
        eqn: Any,
        ins: Sequence[Any],
        stack: Any,
        regions: list[Region],
        loc: _Where,
    ) -> list[Any]:
        jaxpr, consts = _compat.body_parts(eqn.params[_REGION_BODY[eqn.primitive.name]])
        region = Region(
            id=self._next_region,
            primitive=eqn.primitive,
            params=dict(eqn.params),
            source_info=_compat.with_name_stack(eqn.source_info, stack),
            ctx=eqn.ctx,
            ins=tuple(ins),
        )
        self._next_region += 1
        prog.regions[region.id] = region
        outs = self._inline(prog, jaxpr, consts, ins, stack, [*regions, region], loc)
        region.outs = tuple(outs)
        return outs

    def _node(
        self,
        prog: LiftedProgram,
        eqn: Any,
        kind: str,
        spec: Any,
        ins: Sequence[Any],
        stack: Any,
        regions: list[Region],
        loc: _Where,
    ) -> tuple[Any, ...]:
        prim = eqn.primitive
        # an equation with no results (debug_print) gets one placeholder output: operators
        # have at least one; lowering knows it from ``EqnInfo.avals == ()``
        avals = tuple([v.aval for v in eqn.outvars])
        n_out = max(1, len(avals))
        out_types = tuple([self._type_of(a) for a in avals]) or ((None, None),)
        source_info = eqn.source_info
        if stack is not _compat.name_stack(source_info):  # (inlined: the caller's too)
            source_info = _compat.with_name_stack(source_info, stack)
        if kind == "opaque" and (spec is None or spec.kind != "opaque"):
            # unknown, or a table primitive met with effects: one impure node, params in meta
            op = opaque_op(prim.name, n_out)
            attrs: dict[str, Any] = {}
        else:
            op = op_for(prim.name, n_out)
            if kind == "nested":
                # the version-independent params (jax 0.11 changed scan's)
                attrs = lift_attrs(_compat.control_params(prim.name, eqn.params))
                for name in NESTED_PARAMS[prim.name]:
                    attrs[name] = self._bodies(attrs[name], stack, loc)
            else:
                attrs = lift_attrs(eqn.params)
        info = EqnInfo(
            primitive=prim,
            params=dict(eqn.params),
            source_info=source_info,
            ctx=eqn.ctx,
            avals=avals,
            kind=kind,
            in_avals=tuple([v.aval for v in eqn.invars]),
        )
        meta: dict[str, Any] = {"jax_eqn": info, "module_path": self._module_path(stack)}
        if regions:
            meta["region"] = regions[-1].id
        if op.n_in is not None and len(ins) != op.n_in:
            raise PyPMError(f"{op.name} takes {op.n_in} inputs, got {len(ins)}")
        # (add_node's checks hold: ``ins`` are values of this graph, made while lifting it;
        # the types are normalized; the op has as many outputs as there are types)
        node = prog.graph.add_unchecked(op, tuple(ins), attrs or NO_ATTRS, out_types, loc, meta)
        mine = node.meta.get("jax_eqn")
        if mine is not None and mine.owner is None:
            mine.owner = node.id  # a new node (not an equal one found by hash-consing)
        for r in regions:
            r.nodes.append((node, tuple(node.inputs)))
        return node.outputs[: len(avals)]

    def _bodies(self, value: Any, stack: Any, loc: _Where) -> Any:
        if isinstance(value, tuple):
            return tuple(self._bodies(v, stack, loc) for v in value)
        jaxpr, consts = _compat.body_parts(value)
        return self.program(jaxpr, consts, stack, None, loc)
