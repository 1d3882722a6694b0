"""Lifting a StableHLO module into a pm :class:`~pypm_jax.Graph`, in JAX's vocabulary.

The entry function (``main``, or the one public function) is walked op by op; calls to
private functions (``func.call``: what ``jax.jit`` of an inner function, ``jnp.where`` or a
``custom_jvp`` lower to) are inlined. Each op becomes one node (one output per result) of
the operator the jaxpr lifter uses for the corresponding JAX primitive, with the same
attributes (:mod:`hlo._ops`); ops without one become opaque, impure nodes named by the op,
holding the lifted bodies of their regions (``while``, ``case``, ``sort``...) in
``attrs["regions"]`` so rules can be run inside them too.

What the lowering of a jaxpr added is taken back out, so a program lifted from StableHLO
looks like the same program lifted from its jaxpr and the same patterns match:

* JAX's binary primitives take a rank-0 operand (``div x 8.0``) and size-1 axes
  (``x[2,4,3] / s[2,4,1]``); lowering makes both explicit with a ``broadcast_in_dim``. An
  operand of a binary op that is such a broadcast (to no axes of a rank-0 value, or keeping
  every axis in place and only growing size-1 axes) is read through, and a splat constant
  operand is read as its rank-0 scalar: ``div(x, broadcast_in_dim(8.0))`` is lifted as
  ``div(x, 8.0)``.
* ``reduce`` with one of ``add``/``maximum``/... as its body is ``reduce_sum``/
  ``reduce_max``/...; an init value that is not the body's identity is applied after it
  (``max(init, reduce_max(x))``), which is what the reduction computes.
* Constants (``stablehlo.constant``) are ``pypm.const`` nodes with a Python scalar value
  for scalars and splats, the array for small arrays (≤ 64 elements), or graph inputs
  (``const<i>``) for large ones, as the jaxpr lifter does.

Every node has ``node.loc`` (the innermost frame of the op's MLIR location outside JAX,
Flax and pypm: the user's ``file:line``) and ``node.meta["module_path"]`` (the name-stack
part of its ``NameLoc``, without transforms, ``jit(...)`` scopes, ``jnp.einsum``'s
subscripts and the trailing primitive name: ``Model/encoder/layer_0/attention``), plus
``meta["hlo_op"]``, the op's name. Ops of an inlined function without a location of their
own take the call's.
"""

from __future__ import annotations

__all__ = ["lift", "HloError", "SMALL_CONST_ELEMENTS", "module_path", "nested_graphs"]

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from pypm_jax import PyPMError, SourceLoc, as_dtype
from pypm_jax.core.source import is_library_file, source_loc
from pypm_jax.jax import primitives as P

from . import _reader, _snapshot
from ._ops import REDUCERS, opaque_op, spec_for

# Non-splat constant arrays up to this many elements become const nodes (as in the jaxpr
# lifter); larger ones are graph inputs.
SMALL_CONST_ELEMENTS = 64


# Where a block is, from the entry function's body: the ``func.call`` ops whose callee bodies
# were inlined and the region blocks entered on the way (see ``_Lifter.defs``).
Path = tuple["_snapshot.Op | _snapshot.Block", ...]


class HloError(PyPMError):
    """A readable MLIR module that cannot be lifted (no such function, no entry point)."""


# ---------------------------------------------------------------------------- locations


# Scopes that are transforms of what they wrap (``jvp(MLP)`` is the scope MLP) and scopes JAX
# adds itself at lowering (``jit(apply)``, ``jit(_where)``), dropped.
_WRAPPER = re.compile(r"^(\w+)\((.*)\)$")
_TRANSFORMS = frozenset({"jvp", "transpose", "vmap", "pmap", "remat", "checkpoint", "shard_map"})


def _scope(part: str) -> str | None:
    while True:
        m = _WRAPPER.match(part)
        if m is None:
            break
        if m.group(1) not in _TRANSFORMS:
            return None  # jit(...), pjit(...) and other call scopes
        part = m.group(2)
    if not part or "->" in part or "," in part:  # jnp.einsum names its scope by subscripts
        return None
    return part


# Scopes JAX's lowering adds inside control flow (``while/body``, ``cond/branch_0_fun``; jax
# 0.11 also wraps a scan body in ``eval_jaxpr``) and remat (``checkpoint``): not in a jaxpr's
# name stacks, so not in its module paths either.
_LOWERING_SCOPES = re.compile(
    r"^(while/(body|cond|body_pred)|cond/branch_\d+_fun|checkpoint|eval_jaxpr)$"
)


def module_path(name: str) -> str:
    """The Flax module path of a JAX name-stack location name.

    ``jit(apply)/Attn/attention/query/dot_general`` → ``Attn/attention/query``: JAX names an
    op's location ``<name stack>/<primitive>``; the primitive (a last part that is not a
    call scope) and the scopes JAX adds (``jit(...)``, einsum subscripts, ``while/body``,
    ``cond/branch_<i>_fun``, ``checkpoint``) are dropped.
    """
    parts = name.split("/")
    if parts and _WRAPPER.match(parts[-1]) is None:
        parts = parts[:-1]
    scopes = [s for s in (_scope(p) for p in parts) if s]
    out: list[str] = []
    i = 0
    while i < len(scopes):
        if i + 1 < len(scopes) and _LOWERING_SCOPES.match(f"{scopes[i]}/{scopes[i + 1]}"):
            i += 2
        elif _LOWERING_SCOPES.match(scopes[i]):
            i += 1
        else:
            out.append(scopes[i])
            i += 1
    return "/".join(out)


def call_scope(name: str) -> str:
    """The name stack the ops of a call's callee are named relative to: the call op's name
    without its primitive (``jit(f)/Stack/while/body/closed_call`` → ``jit(f)/Stack/while/body``;
    ``jit(f)/jit(g)`` stays). ``module_path`` of ``call_scope(call) + "/" + op`` is the path
    lifting gives an op of the inlined callee."""
    parts = name.split("/")
    if parts and _WRAPPER.match(parts[-1]) is None:
        parts = parts[:-1]
    return "/".join(parts)


@dataclass(frozen=True, slots=True)
class _Site:
    """Where the ops being lifted are: in a function body inlined at a call (whose ops JAX
    names relative to the call: ``relative``), or in a region of an op (named in full).
    ``path`` and ``loc`` are the call's or the op's, for ops that have none of their own."""

    path: str = ""
    loc: SourceLoc | None = None
    relative: bool = True


def nested_graphs(graph: Any) -> Iterator[Any]:
    """The lifted region bodies of the opaque nodes of ``graph`` (depth first, in order)."""
    for node in graph.nodes():
        for body in node.attrs.get("regions", ()) if node.op.namespace == "hlo.opaque" else ():
            yield body
            yield from nested_graphs(body)


# ---------------------------------------------------------------------------- lifting


def lift(module: Any, *, function: str | None = None) -> Any:
    """Lift a StableHLO module into a pm :class:`~pypm_jax.Graph` (see the module docstring).

    ``module`` is a ``jax.stages.Lowered`` (``jax.jit(f).lower(*args)``), an MLIR
    ``ir.Module``, StableHLO text (``lowered.as_text(debug_info=True)`` keeps source lines),
    MLIR bytecode or a portable artifact, or a path to a file holding one. ``function``
    names the function to lift (default ``main``, or the module's only public function).

    Raises :class:`~pypm_jax.FormatError` for input that is not an MLIR module and
    :class:`HloError` for a module without the function asked for.
    """
    mod = _reader.load(module, small=SMALL_CONST_ELEMENTS)
    return _Lifter(mod).function(_entry(mod, function))


def _entry(mod: _snapshot.Module, function: str | None) -> _snapshot.Func:
    if function is not None:
        fn = mod.funcs.get(function)
        if fn is None:
            have = ", ".join(sorted(mod.funcs)) or "none"
            raise HloError(f"module has no function {function!r} (functions: {have})")
        return fn
    if "main" in mod.funcs:
        return mod.funcs["main"]
    public = [f for f in mod.funcs.values() if f.public]
    if len(public) == 1:
        return public[0]
    have = ", ".join(sorted(mod.funcs)) or "none"
    raise HloError(f"module has no function 'main' and no single public function ({have})")


def _is_const(v: Any) -> bool:
    return v.op.name == "const" and v.op.namespace == "pypm"


def _identity(binop: str, dtype: str | None) -> Any:
    """The value a reduction's init must have to be no-op for ``binop``, or None."""
    if dtype is None:
        return None
    if dtype == "bool":
        return {"add": False, "or": False, "xor": False, "and": True, "max": False,
                "min": True, "mul": True}.get(binop)  # fmt: skip
    if binop in ("add", "or", "xor"):
        return 0
    if binop == "mul":
        return 1
    kind = dtype[0]
    if kind in "iu":
        info = np.iinfo(as_dtype(dtype).numpy_name)
        return {"and": -1 if kind == "i" else info.max, "max": info.min, "min": info.max}.get(binop)
    return {"max": -math.inf, "min": math.inf}.get(binop)


class _Lifter:
    """One lifting run over a snapshot module."""

    def __init__(self, mod: _snapshot.Module, *, track: bool = False) -> None:
        self.mod = mod
        self.track = track  # keep what an editor of the module needs (hlo.emit)
        # graph value -> (path, id) of the MLIR value it was first lifted from: the value
        # ``id`` of the block that ``path`` leads to from the entry function's body, through
        # inlined calls (the call op) and region bodies (the region's block). A region's
        # captured value has the region's path (it is defined in a block around it).
        self.defs: dict[Any, tuple[Path, int]] = {}
        self.wheres: dict[tuple[_snapshot.Loc, _Site], tuple[SourceLoc | None, str]] = {}
        self.producers: dict[int, _snapshot.Op] = {}

    # ---------------------------------------------------------------- graphs

    def function(self, fn: _snapshot.Func) -> Any:
        from pypm_jax import Graph

        g = Graph()
        env: dict[int, Any] = {}
        used: set[str] = set()
        body = fn.body
        for i, (vid, t, name) in enumerate(
            zip(body.args, body.arg_types, body.arg_names, strict=True)
        ):
            env[vid] = g.add_input(self._input_name(name, f"arg{i}", used), *t)
            self.defs[env[vid]] = ((), vid)
        outs = self._block(g, body, env, _Site(), (fn.name,), None, ())
        g.set_outputs(outs)
        g.compact()  # matching then reads the graph's memory in order
        g.dce()  # broadcasts read through and unused reduction inits
        return g

    def _region(
        self, block: _snapshot.Block, site: _Site, stack: tuple[str, ...], path: Path
    ) -> Any:
        """A region's body as a graph of its own; values it captures become inputs."""
        from pypm_jax import Graph

        g = Graph()
        env: dict[int, Any] = {}
        used: set[str] = set()
        for i, (vid, t, name) in enumerate(
            zip(block.args, block.arg_types, block.arg_names, strict=True)
        ):
            env[vid] = g.add_input(self._input_name(name, f"arg{i}", used), *t)
            if self.track:
                self.defs[env[vid]] = (path, vid)
        types = self._value_types(block)

        def capture(vid: int) -> Any:
            v = g.add_input(self._input_name(None, f"captured{vid}", used), *types(vid))
            env[vid] = v
            if self.track:
                self.defs[v] = (path, vid)
            return v

        g.set_outputs(self._block(g, block, env, site, stack, capture, path))
        g.compact()
        g.dce()
        return g

    @staticmethod
    def _value_types(block: _snapshot.Block) -> Callable[[int], _snapshot.TypeSpec]:
        """Types of values a block reads but does not define (from their readers)."""
        found: dict[int, _snapshot.TypeSpec] = {}

        def walk(b: _snapshot.Block) -> None:
            for op in b.ops:
                for vid, t in zip(op.operands, op.operand_types, strict=True):
                    found.setdefault(vid, t)
                for r in op.regions:
                    if r is not None:
                        walk(r)

        walk(block)
        return lambda vid: found.get(vid, (None, None))

    @staticmethod
    def _input_name(name: str | None, default: str, used: set[str]) -> str:
        # JAX names region arguments after the op (``while:``): not a name worth keeping
        base = name if name and not name.endswith(":") else default
        out, i = base, 1
        while out in used:
            out = f"{base}#{i}"
            i += 1
        used.add(out)
        return out

    def _block(
        self,
        g: Any,
        block: _snapshot.Block,
        env: dict[int, Any],
        site: _Site,
        stack: tuple[str, ...],
        capture: Callable[[int], Any] | None,
        path: Path,
    ) -> list[Any]:
        def read(vid: int) -> Any:
            v = env.get(vid)
            if v is None:
                if capture is None:
                    raise HloError(f"value %{vid} used before it is defined")
                v = capture(vid)
            return v

        for op in block.ops:
            for r in op.results:
                self.producers[r] = op
            outs = self._op(g, op, read, site, stack, path)
            for vid, v in zip(op.results, outs, strict=False):
                env[vid] = v
                if self.track:
                    self.defs.setdefault(v, (path, vid))
        return [read(v) for v in block.returns]

    # ---------------------------------------------------------------- sources

    def _where(self, loc: _snapshot.Loc, site: _Site) -> tuple[SourceLoc | None, str]:
        key = (loc, site)
        found = self.wheres.get(key)
        if found is None:
            source = None
            for file, line in loc.frames:
                if not is_library_file(file):
                    source = source_loc(file, line)
                    break
            name = next((n for n in loc.names if not n.endswith(":")), "")
            own = module_path(name)
            if site.relative:
                path = "/".join(p for p in (site.path, own) if p)
            else:
                path = own or site.path
            found = self.wheres[key] = (source or site.loc, path)
        return found

    # ---------------------------------------------------------------- ops

    def _op(
        self,
        g: Any,
        op: _snapshot.Op,
        read: Callable[[int], Any],
        site: _Site,
        stack: tuple[str, ...],
        path: Path,
    ) -> tuple[Any, ...] | list[Any]:
        source, where = self._where(op.loc, site)
        meta = {"module_path": where, "hlo_op": op.name}
        if op.name == "stablehlo.constant":
            value = op.attrs.get("value")
            if isinstance(value, _snapshot.Dense) and len(op.results) == 1:
                return [self._constant(g, value, op.types[0])]
        elif op.name == "func.call":
            outs = self._call(g, op, read, _Site(where, source), stack, path)
            if outs is not None:
                return outs
        elif op.name == "stablehlo.reduce":
            outs = self._reduce(g, op, read, source, meta)
            if outs is not None:
                return outs
        spec = spec_for(op)
        if spec is not None:
            try:
                attrs = spec.attrs(op)
                if attrs is not None:
                    ids = spec.operands(op) if spec.operands is not None else op.operands
                    ins = [read(i) for i in ids]
                    if spec.broadcasting:
                        ins = [self._unbroadcast(g, v) for v in ins]
                    elif spec.prim == "dot_general":
                        ins = self._unconvert(op, ids, ins)
                    node = g.add_node(
                        P.op_for(spec.prim, len(op.results)),
                        ins,
                        attrs=attrs,
                        out_types=list(op.types),
                        loc=source,
                        meta=meta,
                    )
                    return node.outputs
            except (KeyError, TypeError, ValueError, AttributeError, PyPMError):
                pass  # an instance the table cannot express: opaque below
        return self._opaque(g, op, read, meta, source, _Site(where, source, False), stack, path)

    def _opaque(
        self,
        g: Any,
        op: _snapshot.Op,
        read: Callable[[int], Any],
        meta: dict[str, Any],
        source: SourceLoc | None,
        site: _Site,
        stack: tuple[str, ...],
        path: Path,
    ) -> tuple[Any, ...]:
        attrs: dict[str, Any] = {}
        regions = tuple(
            self._region(b, site, stack, (*path, b)) for b in op.regions if b is not None
        )
        if regions:
            attrs["regions"] = regions
        types = list(op.types) or [(None, None)]  # a node has at least one output
        node = g.add_node(
            opaque_op(op.name, len(types)),
            [read(i) for i in op.operands],
            attrs=attrs,
            out_types=types,
            loc=source,
            meta={**meta, "hlo_attrs": op.attrs},
        )
        return node.outputs[: len(op.results)]

    def _call(
        self,
        g: Any,
        op: _snapshot.Op,
        read: Callable[[int], Any],
        site: _Site,
        stack: tuple[str, ...],
        path: Path,
    ) -> list[Any] | None:
        """Inline a private function's body; None (opaque) if it cannot be."""
        callee = self.mod.funcs.get(str(op.attrs.get("callee", "")))
        if callee is None or callee.name in stack or len(callee.body.args) != len(op.operands):
            return None
        if len(callee.body.returns) != len(op.results):
            return None
        env = {a: read(o) for a, o in zip(callee.body.args, op.operands, strict=True)}
        return self._block(g, callee.body, env, site, (*stack, callee.name), None, (*path, op))

    def _constant(self, g: Any, dense: _snapshot.Dense, t: _snapshot.TypeSpec) -> Any:
        shape, dtype = t
        if dense.splat:
            return g.add_const(dense.value, shape=shape, dtype=dtype)
        if dense.array is not None and dense.array.size:
            return g.add_const(dense.array, shape=shape, dtype=dtype)
        name = self._input_name(None, f"const{len(g.inputs)}", {v.name for v in g.inputs})
        return g.add_input(name, shape, dtype)

    def _reduce(
        self,
        g: Any,
        op: _snapshot.Op,
        read: Callable[[int], Any],
        source: SourceLoc | None,
        meta: dict[str, Any],
    ) -> list[Any] | None:
        """``reduce(x, init) applies f`` → ``reduce_f(x)`` (then ``f(init, .)`` if init is
        not f's identity); None when the body is not a single known binary op."""
        body = op.regions[0] if len(op.regions) == 1 else None
        if body is None or len(op.operands) != 2 or len(op.results) != 1:
            return None
        if len(body.ops) != 1 or len(body.args) != 2:
            return None
        inner = body.ops[0]
        found = REDUCERS.get(inner.name)
        if found is None or sorted(inner.operands) != sorted(body.args):
            return None
        if body.returns != inner.results:
            return None
        prim, binop = found
        t = op.types[0]
        attrs: dict[str, Any] = {"axes": tuple(op.attrs.get("dimensions", ()))}
        if prim == "reduce_sum":
            attrs["out_sharding"] = None
        x, init = read(op.operands[0]), read(op.operands[1])
        r = g.add_node(P.op_for(prim, 1), [x], attrs=attrs, out_types=[t], loc=source, meta=meta)
        out = r.outputs[0]
        identity = _identity(binop, t[1])
        if not (_is_const(init) and identity is not None and _equal(init, identity)):
            extra = {"out_dtype": None} if binop == "mul" else {}
            out = g.add_node(
                P.op_for(binop, 1), [init, out], attrs=extra, out_types=[t], loc=source, meta=meta
            ).outputs[0]
        return [out]

    def _unconvert(self, op: _snapshot.Op, ids: Any, ins: list[Any]) -> list[Any]:
        """The operands of a ``dot_general`` of mixed element types before lowering cast both
        to the result type (JAX does on CPU and GPU). Only casts made by that lowering (at
        the dot's own location) are read through: a cast the program wrote stays."""
        producers = [self.producers.get(i) for i in ids]
        if len(ins) != 2 or any(
            p is None or p.name != "stablehlo.convert" or p.loc != op.loc for p in producers
        ):
            return ins
        out_dtype = op.types[0][1]
        inner = [v.inputs[0] for v in ins]
        if any(v.dtype is None or v.dtype.name != out_dtype for v in ins):
            return ins
        if inner[0].dtype is inner[1].dtype:
            return ins
        return inner

    def _unbroadcast(self, g: Any, v: Any) -> Any:
        """The operand a JAX binary primitive had before lowering broadcast it."""
        if v.op is P.broadcast_in_dim and v.shape is not None:
            x = v.inputs[0]
            dims = tuple(v.attrs.get("broadcast_dimensions", ()))
            if x.shape is not None:
                if len(x.shape) == 0 and dims == ():
                    v = x
                elif (
                    len(x.shape) == len(v.shape)
                    and dims == tuple(range(len(x.shape)))
                    and all(a == b or a == 1 for a, b in zip(x.shape, v.shape, strict=True))
                ):
                    return x
        if _is_const(v) and v.shape and not isinstance(v.attrs["value"], np.ndarray):
            return g.add_const(v.attrs["value"], shape=(), dtype=v.dtype)
        return v


def _equal(v: Any, want: Any) -> bool:
    value = v.attrs["value"]
    if isinstance(value, np.ndarray):
        return False
    try:
        return bool(value == want)
    except (TypeError, ValueError):
        return False
