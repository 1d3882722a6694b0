"""Editing a parsed StableHLO module in place (calls inserted, inlined, uses replaced) and
running one: what ``hlo.emit`` writes with. With hlo._reader, the only modules that touch
MLIR's Python bindings."""

from __future__ import annotations

__all__ = ["Editor", "load_for_editing", "execute"]

import re
from collections.abc import Callable
from typing import Any

import numpy as np
from jaxlib.mlir import ir

from pypm_jax import FormatError

from ._reader import MLIRError, _diagnostic, _ir_module, _parse_text, _Reader, _same, context
from ._snapshot import Block, Module, Op


def load_for_editing(source: Any, *, small: int = 64) -> tuple[Module, Editor]:
    """A snapshot of a private copy of ``source`` and an :class:`Editor` of that copy (the
    caller's module, e.g. a ``Lowered``'s, is never changed)."""
    original = _ir_module(source)
    ctx = context()
    module = _parse_text(original.operation.get_asm(enable_debug_info=True), "module")
    with ctx:
        reader = _Reader(small)
        snapshot = reader.module(module)
    return snapshot, Editor(module, reader.handles, reader.operations)


# ----------------------------------------------------------------------------- editing


class Editor:
    """Edits a parsed module in place: calls inserted before ops, calls inlined, uses
    replaced, functions imported, dead pure ops erased. Values are the snapshot's ids (and
    ids the editor hands out for the values it makes); ops are the snapshot's :class:`Op`s
    or, for copies the editor made, the ids :meth:`inline` hands out."""

    def __init__(self, module: Any, handles: list[Any], operations: dict[Op, Any]) -> None:
        self.module = module
        self.handles = handles
        self.ctx = module.context
        self._names: set[str] = set()
        self._ops: list[Any] = []  # the ir operations of the op ids handed out
        self._operations = operations  # snapshot op -> its ir operation
        self.inlined: set[str] = set()  # callees inlined somewhere

    def _value(self, v: Any) -> int:
        self.handles.append(v)
        return len(self.handles) - 1

    def op_id(self, op: Op) -> int:
        """The id of a snapshot op of the module (for :meth:`inline`)."""
        self._ops.append(self._operations[op])
        return len(self._ops) - 1

    def inline(
        self, call: int, callee: Block, scope: Callable[[str], str] = lambda name: ""
    ) -> tuple[dict[int, int], dict[Op, int]]:
        """Replace the ``func.call`` op ``call`` (an op id) by copies of the ops of its
        callee's body ``callee`` (the snapshot of that body), placed where the call was.

        Returns what the copy made of the callee's values and ops: snapshot value id -> new
        value id (the callee's arguments map to the call's operands; values inside regions
        too) and snapshot op -> new op id. Values a copied region captured from the callee
        read the copies. The copies' locations say they were called there: a name gets the
        prefix ``scope(the call's name)`` (JAX names a callee's ops relative to the call),
        and the call's location is fused in (for the frames of ops without their own).
        Raises :class:`FormatError` (and changes nothing) for a callee with a region that
        has not one block."""
        op = self._ops[call]
        if not _snapshotted(callee):
            raise FormatError("the callee has a region without exactly one block")
        name = op.attributes["callee"].value
        body = ir.SymbolTable(self.module.operation)[name].regions[0].blocks[0]
        values: dict[int, int] = {
            vid: self._value(v) for vid, v in zip(callee.args, op.operands, strict=True)
        }
        ops: dict[Op, int] = {}
        originals = list(body.operations)
        with self.ctx:
            where = op.location
            prefix = scope(ir.NameLoc(where).name_str) if _same(where, ir.NameLoc) else ""

            def relocate(o: Any) -> None:
                loc = o.location
                if _same(loc, ir.NameLoc) and prefix:
                    n = ir.NameLoc(loc)
                    child = ir.Location.fused([n.child_loc, where])
                    o.location = ir.Location.name(f"{prefix}/{n.name_str}", childLoc=child)
                else:
                    o.location = ir.Location.fused([loc, where])

            for snap, original in zip(callee.ops, originals, strict=False):
                copy = original.operation.clone(ip=ir.InsertionPoint(op))
                self._map(snap, copy, values, ops, relocate)
            for j, vid in enumerate(callee.returns):
                op.results[j].replace_all_uses_with(self.handles[values[vid]])
            op.erase()
        self._ops[call] = None
        self.inlined.add(name)
        return values, ops

    def _map(
        self,
        snap: Op,
        copy: Any,
        values: dict[int, int],
        ops: dict[Op, int],
        relocate: Callable[[Any], None],
    ) -> None:
        """Walk an op's copy beside its snapshot: record its values and ops, make its
        operands (and its regions' captures) read the copies of the callee's values."""
        relocate(copy)
        for i, vid in enumerate(snap.operands):
            if vid in values:
                copy.operands[i] = self.handles[values[vid]]
        self._ops.append(copy)
        ops[snap] = len(self._ops) - 1
        for vid, r in zip(snap.results, copy.results, strict=True):
            values[vid] = self._value(r)
        for block, region in zip(snap.regions, copy.regions, strict=True):
            assert block is not None  # checked by _snapshotted
            (b,) = region.blocks
            for vid, a in zip(block.args, b.arguments, strict=True):
                values[vid] = self._value(a)
            inner = list(b.operations)
            for s, o in zip(block.ops, inner, strict=False):
                self._map(s, o.operation, values, ops, relocate)
            if len(inner) > len(block.ops):  # the terminator
                term = inner[-1].operation
                for i, vid in enumerate(block.returns):
                    if vid in values:
                        term.operands[i] = self.handles[values[vid]]

    def _fresh(self, base: str) -> str:
        table = ir.SymbolTable(self.module.operation)
        name, i = base, 0
        while name in self._names or _has_symbol(table, name):
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def import_functions(self, text: str, base: str) -> str:
        """Add the functions of the module ``text`` (its ``main`` made private and renamed
        ``base``, the others prefixed alike); returns the new name of its ``main``."""
        with self.ctx:
            other = _parse_text(text, "kernel module")
            funcs = [
                op.operation for op in other.body.operations if op.operation.name == "func.func"
            ]
            renames = {}
            for f in funcs:
                old = f.attributes["sym_name"].value
                renames[old] = self._fresh(base if old == "main" else f"{base}__{old}")
            for old, new in renames.items():
                ir.SymbolTable.replace_all_symbol_uses(old, new, other.operation)
            for f in funcs:
                ir.SymbolTable.set_symbol_name(f, renames[f.attributes["sym_name"].value])
                ir.SymbolTable.set_visibility(f, "private")
                f.detach_from_parent()
                self.module.body.append(f)
            return renames["main"]

    def call(self, before: int, callee: str, args: list[int], result_like: int) -> int:
        """``func.call @callee(args)`` inserted before the op defining ``before``, with the
        type and location of value ``result_like``; returns the new value's id."""
        anchor = self.handles[before].owner
        like = self.handles[result_like]
        with self.ctx, ir.InsertionPoint(anchor):
            op = ir.Operation.create(
                "func.call",
                results=[like.type],
                operands=[self.handles[a] for a in args],
                attributes={"callee": ir.FlatSymbolRefAttr.get(callee)},
                loc=anchor.location,
            )
        self.handles.append(op.results[0])
        return len(self.handles) - 1

    def clone(self, result: int, before: int, operands: list[int]) -> list[int]:
        """A copy of the op defining value ``result`` (regions included), inserted before the
        op defining ``before``, reading ``operands``; returns the ids of its results."""
        source = self.handles[result].owner
        anchor = self.handles[before].owner
        with self.ctx:
            copy = source.operation.clone(ip=ir.InsertionPoint(anchor))
            for i, a in enumerate(operands):
                copy.operands[i] = self.handles[a]
        first = len(self.handles)
        self.handles.extend(copy.results)
        return list(range(first, len(self.handles)))

    def replace_uses(self, old: int, new: int) -> None:
        self.handles[old].replace_all_uses_with(self.handles[new])

    def undo_call(self, call: int, old: int) -> None:
        """Take back a call made by :meth:`call` whose uses replaced ``old``'s."""
        self.handles[call].replace_all_uses_with(self.handles[old])
        self.handles[call].owner.erase()

    def verify(self) -> str | None:
        """None if the module verifies, else MLIR's diagnostic."""
        with self.ctx:
            try:
                if self.module.operation.verify():
                    return None
                return "the module does not verify"  # pragma: no cover - older bindings
            except MLIRError as exc:
                return _diagnostic(exc)

    def erase_dead(self, function: str, pure: Callable[[str], bool]) -> int:
        """Erase ops of ``function``'s body, and of the regions inside it, whose results
        nothing reads and whose names ``pure`` accepts (calls: if their callee is pure), to a
        fixpoint; then the private functions :meth:`inline` inlined that nothing calls any
        more. Returns how many ops were erased."""
        funcs = {
            f.operation.attributes["sym_name"].value: f.operation
            for f in self.module.body.operations
            if f.operation.name == "func.func"
        }
        memo: dict[str, bool] = {}

        def pure_func(name: str) -> bool:
            if name not in memo:
                memo[name] = False  # recursion: not pure
                f = funcs.get(name)
                memo[name] = f is not None and all(
                    o.operation.name in ("func.return", "stablehlo.return") or pure_op(o.operation)
                    for r in f.regions
                    for b in r.blocks
                    for o in b.operations
                )
            return memo[name]

        def pure_op(o: Any) -> bool:
            if o.name == "func.call":
                return pure_func(o.attributes["callee"].value)
            return pure(o.name) and all(
                pure_op(x.operation) or x.operation.name == "stablehlo.return"
                for r in o.regions
                for b in r.blocks
                for x in b.operations
            )

        def blocks(op: Any) -> Any:
            """The blocks inside ``op``, inner ones before the block holding them."""
            for r in op.regions:
                for b in r.blocks:
                    for o in b.operations:
                        yield from blocks(o.operation)
                    yield b

        erased = 0
        changed = True
        while changed:
            changed = False
            for body in list(blocks(funcs[function])):
                for o in reversed(list(body.operations)):
                    o = o.operation
                    if not o.results or o.name in ("func.return", "stablehlo.return"):
                        continue
                    if any(next(iter(r.uses), None) is not None for r in o.results):
                        continue
                    if pure_op(o):
                        o.erase()
                        erased += 1
                        changed = True  # (blocks inside it were listed before body)
        self._erase_uncalled(funcs)
        return erased

    def _erase_uncalled(self, funcs: dict[str, Any]) -> None:
        """Erase the private functions inlined somewhere that no symbol names any more."""
        names = [n for n in self.inlined if n in funcs]
        if not names:
            return
        with self.ctx:
            text = self.module.operation.get_asm()
        for name in names:
            f = funcs[name]
            private = (
                "sym_visibility" in f.attributes
                and f.attributes["sym_visibility"].value == "private"
            )
            uses = re.findall(rf"@{re.escape(name)}(?![\w$.\-])", text)
            if private and len(uses) == 1:  # its own definition
                f.erase()

    def text(self) -> str:
        """The module, verified, printed with its locations."""
        with self.ctx:
            if not self.module.operation.verify():
                raise FormatError("the edited module does not verify")
            return self.module.operation.get_asm(enable_debug_info=True)


def _snapshotted(block: Block) -> bool:
    """Does the snapshot of ``block`` hold every region inside it (one block each)?"""
    return all(r is not None and _snapshotted(r) for op in block.ops for r in op.regions)


def _has_symbol(table: Any, name: str) -> bool:
    try:
        table[name]
    except KeyError:
        return False
    return True


# ----------------------------------------------------------------------------- running


def execute(module: Any, args: list[Any]) -> list[Any]:
    """Compile a StableHLO module for the default device and run it on ``args`` (arrays in
    the order of ``main``'s parameters); the outputs as numpy arrays. For checking what an
    edited module computes: XLA's own compile path, through jaxlib's client."""
    import jax
    from jax.extend import backend

    try:
        from jaxlib._jax import CompileOptions
    except ImportError:  # pragma: no cover - older layouts
        from jax._src.lib.xla_client import CompileOptions

    if isinstance(module, str):
        text = module
    else:
        text = _ir_module(module).operation.get_asm(enable_debug_info=True)
    client = backend.get_backend()
    device = client.local_devices()[0]  # this process's (devices()[0] may be another's)
    executable = client.compile_and_load(text, [device], CompileOptions())
    outs = executable.execute([jax.device_put(a, device) for a in args])
    return [np.asarray(o) for o in outs]
