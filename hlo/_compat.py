"""The one place that touches MLIR's Python bindings (a test fails loudly when MLIR moves them).

jaxlib ships the MLIR Python bindings with the ``stablehlo`` and ``chlo`` dialects
(``jaxlib.mlir``); they parse and verify modules for us, but they are semi-internal: names
move between releases. Everything this package needs from them is here, and
``tests/hlo/test_hlo_compat.py`` exercises each piece, so a jaxlib upgrade that moves one
fails loudly in one test instead of silently degrading lifting.

:func:`load` parses whatever it is given (a ``jax.stages.Lowered``, an ``ir.Module``, MLIR
text, MLIR bytecode or a StableHLO portable artifact, a path to a file holding one of them)
and returns a *snapshot*: plain frozen Python data (:class:`Module`, :class:`Func`,
:class:`Block`, :class:`Op`, :class:`Loc`) with attributes converted to Python values. The
lifter reads only the snapshot, never MLIR objects.

Used here: ``jaxlib.mlir.ir`` (Context, Module, DialectRegistry, the builtin attribute,
type and location classes), ``jaxlib.mlir.dialects.stablehlo`` / ``chlo`` / ``mhlo`` /
``sdy`` (``register_dialect``, ``DotDimensionNumbers``, ``ComparisonDirectionAttr``, ...,
``deserialize_portable_artifact``) and ``jaxlib.mlir._mlir_libs._jax_mlir_ext``
(``register_dialects``: the upstream ``func``/``arith``/... dialects; JAX's own
``make_ir_context`` is the fallback).
"""

from __future__ import annotations

__all__ = [
    "Module",
    "Func",
    "Block",
    "Op",
    "Loc",
    "Dense",
    "TypeSpec",
    "load",
    "load_for_editing",
    "Editor",
    "execute",
    "context",
    "dtype_name",
    "MLIRError",
]

import math
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import chlo, stablehlo

from pypm_jax import FormatError

MLIRError = ir.MLIRError

# (shape, pm dtype name) of a value; shape None for non-tensor types (tokens, tuples), a
# dimension None where it is dynamic.
TypeSpec = tuple[tuple[int | None, ...] | None, str | None]


# ----------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class Loc:
    """An op's MLIR location, flattened: ``NameLoc`` names (outermost first) and
    ``FileLineColLoc`` frames ``(file, line)`` (innermost call first, as ``callsite``
    nests them)."""

    names: tuple[str, ...] = ()
    frames: tuple[tuple[str, int], ...] = ()


UNKNOWN = Loc()


@dataclass(frozen=True, slots=True)
class Dense:
    """The value of a dense constant: ``splat`` with a Python scalar ``value``, a small numpy
    ``array``, or neither (too large to read, or of an element type numpy lacks)."""

    shape: tuple[int, ...]
    dtype: str | None
    splat: bool
    value: Any = None  # Python scalar when splat
    array: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Op:
    """One operation: its name (``stablehlo.add``), operand and result value ids, result
    and operand types, attributes as Python values, the entry blocks of its regions."""

    name: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    types: tuple[TypeSpec, ...]
    operand_types: tuple[TypeSpec, ...]
    attrs: dict[str, Any]
    regions: tuple[Block | None, ...]
    loc: Loc


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """A region's (single) block: arguments, operations, and the terminator's operands."""

    args: tuple[int, ...]
    arg_types: tuple[TypeSpec, ...]
    arg_names: tuple[str | None, ...]
    ops: tuple[Op, ...]
    returns: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Func:
    name: str
    public: bool
    body: Block
    result_names: tuple[str | None, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Module:
    name: str | None
    funcs: dict[str, Func] = field(default_factory=dict)


# ----------------------------------------------------------------------------- context

_LOCK = threading.Lock()
_CONTEXT: Any = None


def _make_context() -> Any:
    """An MLIR context that knows StableHLO, CHLO, MHLO, Shardy and the upstream dialects
    JAX emits (``func``, ...), and accepts ops of any other dialect (lifted as opaque)."""
    try:
        from jaxlib.mlir._mlir_libs import _jax_mlir_ext

        registry = ir.DialectRegistry()
        _jax_mlir_ext.register_dialects(registry)
        ctx = ir.Context()
        ctx.append_dialect_registry(registry)
        ctx.load_all_available_dialects()
    except (ImportError, AttributeError):  # pragma: no cover - the fallback for a moved ext
        from jax._src.interpreters import mlir as _jax_mlir

        return _jax_mlir.make_ir_context()
    stablehlo.register_dialect(ctx)
    chlo.register_dialect(ctx)
    try:
        from jaxlib.mlir.dialects import mhlo, sdy

        mhlo.register_mhlo_dialect(ctx)
        sdy.register_dialect(ctx)
    except (ImportError, AttributeError):  # pragma: no cover - optional dialects
        pass
    ctx.allow_unregistered_dialects = True
    return ctx


def context() -> Any:
    """The shared parsing context (made on first use)."""
    global _CONTEXT
    with _LOCK:
        if _CONTEXT is None:
            _CONTEXT = _make_context()
        return _CONTEXT


# ----------------------------------------------------------------------------- loading

_BYTECODE_MAGIC = b"ML\xefR"


def _diagnostic(exc: Exception, limit: int = 600) -> str:
    text = str(exc).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _parse_text(text: str, what: str) -> Any:
    if not text.strip():
        raise FormatError(f"{what}: empty input, expected a StableHLO (MLIR) module")
    ctx = context()
    try:
        with ctx:
            return ir.Module.parse(text, ctx)
    except MLIRError as exc:
        raise FormatError(f"{what}: not a valid MLIR module: {_diagnostic(exc)}") from None


def _parse_bytes(data: bytes, what: str) -> Any:
    if data.startswith(_BYTECODE_MAGIC):
        ctx = context()
        errors = []
        try:  # a versioned StableHLO portable artifact (jax.export, TF, torch_xla)
            with ctx:
                return stablehlo.deserialize_portable_artifact(ctx, data)
        except (MLIRError, ValueError, RuntimeError) as exc:
            errors.append(_diagnostic(exc))
        try:  # plain MLIR bytecode
            with ctx:
                return ir.Module.parse(data, ctx)
        except (MLIRError, ValueError, RuntimeError) as exc:
            errors.append(_diagnostic(exc))
        raise FormatError(f"{what}: unreadable MLIR bytecode: {'; '.join(errors)}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what}: neither MLIR text (not UTF-8) nor MLIR bytecode") from None
    return _parse_text(text, what)


def _read_file(path: str | os.PathLike[str]) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise FormatError(f"cannot read {os.fspath(path)!r}: {exc.strerror or exc}") from None
    return _parse_bytes(data, os.fspath(path))


def _looks_like_path(s: str) -> bool:
    return "\n" not in s and len(s) < 4096 and ("{" not in s or os.path.exists(s))


def _ir_module(source: Any) -> Any:
    if isinstance(source, ir.Module):
        return source
    if isinstance(source, os.PathLike):
        return _read_file(source)
    if isinstance(source, str):
        if _looks_like_path(source) and (
            os.path.exists(source) or source.endswith((".mlir", ".mlirbc", ".bc"))
        ):
            return _read_file(source)
        return _parse_text(source, "MLIR text")
    if isinstance(source, bytes | bytearray | memoryview):
        return _parse_bytes(bytes(source), "MLIR bytes")
    compiler_ir = getattr(source, "compiler_ir", None)
    if callable(compiler_ir):  # jax.stages.Lowered
        try:
            module = compiler_ir("stablehlo")
        except Exception:  # noqa: BLE001 - fall back to JAX's printed form
            module = None
        if isinstance(module, ir.Module):
            return module
        as_text = getattr(source, "as_text", None)
        if callable(as_text):
            return _parse_text(as_text(debug_info=True), type(source).__name__)
    mlir_module = getattr(source, "mlir_module", None)
    if callable(mlir_module):  # jax.export.Exported
        return _parse_text(mlir_module(), type(source).__name__)
    raise TypeError(
        "expected a jax.stages.Lowered, an MLIR module, MLIR text or bytes, or a path to a "
        f".mlir file; got {type(source).__name__}"
    )


def load(source: Any, *, small: int = 64) -> Module:
    """Parse ``source`` and snapshot it (see the module docstring).

    Dense constants of at most ``small`` elements are read into numpy; splats of any size
    are read as their scalar. Raises :class:`~pypm_jax.FormatError` for input that is not
    a readable MLIR module.
    """
    module = _ir_module(source)
    with module.context:
        return _Reader(small).module(module)


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


# ----------------------------------------------------------------------------- types

_DTYPES = {
    "i1": "bool",
    "bf16": "bf16",
    "f16": "f16",
    "f32": "f32",
    "f64": "f64",
    "f8E4M3FN": "f8e4m3",
    "f8E5M2": "f8e5m2",
    "complex<f32>": "c64",
    "complex<f64>": "c128",
}
for _w in (4, 8, 16, 32, 64):
    _DTYPES[f"i{_w}"] = f"i{_w}"
    _DTYPES[f"si{_w}"] = f"i{_w}"
    _DTYPES[f"ui{_w}"] = f"u{_w}"


def dtype_name(element_type: str) -> str | None:
    """The pm dtype name of an MLIR element type (``i1`` → ``bool``, ``ui8`` → ``u8``)."""
    return _DTYPES.get(element_type)


def _type(t: Any) -> TypeSpec:
    if not isinstance(t, ir.RankedTensorType | ir.UnrankedTensorType):
        t = t.maybe_downcast() if hasattr(t, "maybe_downcast") else t
    if isinstance(t, ir.RankedTensorType):
        shape = tuple(None if t.is_dynamic_dim(i) else int(d) for i, d in enumerate(t.shape))
        return shape, dtype_name(str(t.element_type))
    if isinstance(t, ir.UnrankedTensorType):
        return None, dtype_name(str(t.element_type))
    return None, None


# ----------------------------------------------------------------------------- attributes


def _dot_dims(a: Any) -> dict[str, tuple[int, ...]]:
    d = stablehlo.DotDimensionNumbers(a)
    return {
        "lhs_batching_dimensions": tuple(d.lhs_batching_dimensions),
        "rhs_batching_dimensions": tuple(d.rhs_batching_dimensions),
        "lhs_contracting_dimensions": tuple(d.lhs_contracting_dimensions),
        "rhs_contracting_dimensions": tuple(d.rhs_contracting_dimensions),
    }


_DIALECT_ATTRS: list[tuple[Any, Callable[[Any], Any]]] = [
    (stablehlo.DotDimensionNumbers, _dot_dims),
    (stablehlo.ComparisonDirectionAttr, lambda a: stablehlo.ComparisonDirectionAttr(a).value),
    (stablehlo.ComparisonTypeAttr, lambda a: stablehlo.ComparisonTypeAttr(a).value),
    (stablehlo.PrecisionAttr, lambda a: stablehlo.PrecisionAttr(a).value),
]

_ARRAYS = (
    ir.DenseI64ArrayAttr,
    ir.DenseI32ArrayAttr,
    ir.DenseI16ArrayAttr,
    ir.DenseI8ArrayAttr,
    ir.DenseBoolArrayAttr,
    ir.DenseF32ArrayAttr,
    ir.DenseF64ArrayAttr,
)


def _attr(a: Any) -> Any:
    """An attribute as a Python value; dialect attributes we do not read print as text."""
    if isinstance(a, ir.BoolAttr):
        return bool(a.value)
    if isinstance(a, ir.IntegerAttr):
        return int(a.value)
    if isinstance(a, ir.FloatAttr):
        return float(a.value)
    if isinstance(a, ir.StringAttr):
        return a.value
    if isinstance(a, ir.FlatSymbolRefAttr):
        return a.value
    if isinstance(a, _ARRAYS):
        return tuple(a)
    if isinstance(a, ir.ArrayAttr):
        return tuple(_attr(x) for x in a)
    if isinstance(a, ir.DenseIntElementsAttr) and not a.is_splat:
        try:  # old-style index lists: dense<[0, 1]> : tensor<2xi64>
            return tuple(int(x) for x in np.array(a).reshape(-1))
        except (TypeError, ValueError, RuntimeError):
            return str(a)
    for cls, read in _DIALECT_ATTRS:
        if cls.isinstance(a):
            return read(a)
    return str(a)


def _scalar(a: Any, dtype: str | None) -> Any:
    """A splat's element as a Python scalar of the dtype's kind, or None."""
    if isinstance(a, ir.BoolAttr):
        v: Any = bool(a.value)
    elif isinstance(a, ir.IntegerAttr):
        v = int(a.value)
        if dtype is not None and dtype.startswith("u") and v < 0:
            v += 1 << int(dtype[1:])
    elif isinstance(a, ir.FloatAttr):
        v = float(a.value)
    else:
        return None
    if dtype == "bool":
        return bool(v)
    if dtype is not None and dtype[0] in "iu":
        return int(v)
    if dtype is not None and dtype[0] in "fb":
        return float(v)
    return v


def _numpy_dtype(dtype: str | None) -> Any:
    from pypm_jax import as_dtype

    d = as_dtype(dtype)
    if d.name == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if d.name.startswith("f8"):
        import ml_dtypes

        return getattr(ml_dtypes, d.numpy_name)
    return np.dtype(d.numpy_name)


def _dense(a: Any, small: int) -> Dense:
    shape, dtype = _type(a.type)
    shape = tuple(int(d) for d in (shape or ()))  # constants are statically shaped
    if isinstance(a, ir.DenseElementsAttr) and a.is_splat:
        value = _scalar(a.get_splat_value(), dtype)
        if value is not None:
            return Dense(shape, dtype, True, value)
    if not isinstance(a, ir.DenseElementsAttr) or dtype is None:
        return Dense(shape, dtype, False)  # dense_resource<...>, sparse, unknown types
    size = math.prod(shape)
    if size > small:
        return Dense(shape, dtype, False)
    try:
        arr = np.array(a).reshape(shape)
    except (TypeError, ValueError, RuntimeError):
        # element types the bindings give no buffer for (bf16, f8): from the printed form
        arr = _dense_from_text(str(a), dtype, shape)
        if arr is None:
            return Dense(shape, dtype, False)
    if arr.dtype.kind == "b" or dtype == "bool":
        arr = arr.astype(bool)
    return Dense(shape, dtype, False, None, arr)


_HEX = re.compile(r'^dense<"0x([0-9A-Fa-f]*)">')
_LIST = re.compile(r"^dense<(\[.*\])>", re.S)
_NUMBER = re.compile(r"[-+]?(?:0x[0-9A-Fa-f]+|(?:\d+\.?\d*(?:[eE][-+]?\d+)?)|inf|nan)")


def _dense_from_text(text: str, dtype: str | None, shape: tuple[int, ...]) -> Any:
    """A floating dense literal's array from MLIR's printed form (``dense<[1.0, 2.0]>`` or
    its raw hex blob), for element types without a buffer protocol; None if unreadable."""
    try:
        np_dtype = _numpy_dtype(dtype)
        size = math.prod(shape)
        m = _HEX.match(text)
        if m is not None:
            raw = np.frombuffer(bytes.fromhex(m.group(1)), np_dtype)
            return raw.reshape(shape).copy() if raw.size == size else None
        m = _LIST.match(text)
        if m is None or "0x" in m.group(1):  # per-element hex floats: not worth guessing
            return None
        values = [float(x) for x in _NUMBER.findall(m.group(1))]
        if len(values) != size:
            return None
        return np.array(values, np.float64).astype(np_dtype).reshape(shape)
    except (TypeError, ValueError):
        return None


# ----------------------------------------------------------------------------- locations


# The file name MLIR's parser gives the locations it makes up for ops printed without one.
_PARSED_TEXT = "-"


def _same(loc: Any, cls: Any) -> bool:
    return loc.typeid == cls.static_typeid


class _Reader:
    """Snapshots one module: value ids, types, attributes, locations (memoized)."""

    def __init__(self, small: int) -> None:
        self.small = small
        self.ids: dict[Any, int] = {}
        self.handles: list[Any] = []  # the ir.Value of each id (for the editor)
        self.types: dict[int, TypeSpec] = {}
        self.locs: dict[Any, Loc] = {}
        self.operations: dict[Op, Any] = {}  # the ir operation of each op (for the editor)

    # ------------------------------------------------------------------ locations

    def loc(self, location: Any) -> Loc:
        key = location.attr
        found = self.locs.get(key)
        if found is None:
            names: list[str] = []
            frames: list[tuple[str, int]] = []
            self._walk(location, names, frames, 0)
            found = self.locs[key] = Loc(tuple(names), tuple(frames))
        return found

    def _walk(self, loc: Any, names: list[str], frames: list[tuple[str, int]], depth: int) -> None:
        if depth > 200:  # pathological nesting; the outer parts are enough
            return
        if _same(loc, ir.NameLoc):
            n = ir.NameLoc(loc)
            names.append(n.name_str)
            self._walk(n.child_loc, names, frames, depth + 1)
        elif _same(loc, ir.CallSiteLoc):
            c = ir.CallSiteLoc(loc)
            self._walk(c.callee, names, frames, depth + 1)
            self._walk(c.caller, names, frames, depth + 1)
        elif _same(loc, ir.FileLineColLoc):
            f = ir.FileLineColLoc(loc)
            if f.filename != _PARSED_TEXT:  # not a place in the MLIR text itself
                frames.append((f.filename, int(f.start_line)))
        elif _same(loc, ir.FusedLoc):
            for sub in ir.FusedLoc(loc).locations:
                self._walk(sub, names, frames, depth + 1)

    # ------------------------------------------------------------------ values

    def value(self, v: Any) -> int:
        i = self.ids.get(v)
        if i is None:
            i = self.ids[v] = len(self.ids)
            self.handles.append(v)
            self.types[i] = _type(v.type)
        return i

    # ------------------------------------------------------------------ structure

    def module(self, module: Any) -> Module:
        op = module.operation
        name = op.attributes["sym_name"].value if "sym_name" in op.attributes else None
        funcs: dict[str, Func] = {}
        for f in module.body.operations:
            f = f.operation
            if f.name != "func.func" or not f.regions or not len(f.regions[0].blocks):
                continue
            fname = f.attributes["sym_name"].value
            vis = f.attributes["sym_visibility"].value if "sym_visibility" in f.attributes else ""
            body = self.block(f.regions[0], fname)
            if body is None:
                continue
            funcs[fname] = Func(fname, vis != "private", body, self._result_names(f))
        return Module(name, funcs)

    def _result_names(self, f: Any) -> tuple[str | None, ...]:
        if "res_attrs" not in f.attributes:
            return ()
        out = []
        for d in ir.ArrayAttr(f.attributes["res_attrs"]):
            d = ir.DictAttr(d)
            out.append(d["jax.result_info"].value if "jax.result_info" in d else None)
        return tuple(out)

    def block(self, region: Any, where: str) -> Block | None:
        """The region's block; None for an empty region or one with several blocks (an
        unstructured control-flow graph, which StableHLO does not produce)."""
        blocks = list(region.blocks)
        if len(blocks) != 1:
            return None
        blk = blocks[0]
        args = tuple(self.value(a) for a in blk.arguments)
        names = []
        for a in blk.arguments:
            loc = a.location
            names.append(ir.NameLoc(loc).name_str if _same(loc, ir.NameLoc) else None)
        ops = []
        returns: tuple[int, ...] = ()
        operations = list(blk.operations)
        for i, o in enumerate(operations):
            o = o.operation
            if i == len(operations) - 1 and o.name in ("func.return", "stablehlo.return"):
                returns = tuple(self.value(v) for v in o.operands)
                break
            ops.append(self.op(o, where))
        return Block(args, tuple(self.types[a] for a in args), tuple(names), tuple(ops), returns)

    def op(self, o: Any, where: str) -> Op:
        operands = tuple(self.value(v) for v in o.operands)
        results = tuple(self.value(v) for v in o.results)
        attrs: dict[str, Any] = {}
        for k in o.attributes:
            a = o.attributes[k]
            if k == "value" and isinstance(a, ir.DenseElementsAttr | ir.DenseResourceElementsAttr):
                attrs[k] = _dense(a, self.small)
            else:
                attrs[k] = _attr(a)
        regions = tuple(self.block(r, where) for r in o.regions)
        snap = Op(
            name=o.name,
            operands=operands,
            results=results,
            types=tuple(self.types[r] for r in results),
            operand_types=tuple(self.types[v] for v in operands),
            attrs=attrs,
            regions=regions,
            loc=self.loc(o.location),
        )
        self.operations[snap] = o
        return snap
