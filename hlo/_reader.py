"""Reading StableHLO through MLIR's Python bindings into a snapshot (hlo._snapshot).

With hlo._editor, the only modules that touch MLIR's Python bindings (a test fails loudly
when MLIR moves them).

jaxlib ships the MLIR Python bindings with the ``stablehlo`` and ``chlo`` dialects
(``jaxlib.mlir``); they parse and verify modules for us, but they are semi-internal: names
move between releases. Everything this package needs from them is here, and
``tests/hlo/test_hlo_compat.py`` exercises each piece (of both), so a jaxlib upgrade that moves one
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

__all__ = ["load", "context", "dtype_name", "MLIRError"]

import math
import os
import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import chlo, stablehlo

from pypm_jax import FormatError

from ._snapshot import Block, Dense, Func, Loc, Module, Op, TypeSpec

MLIRError = ir.MLIRError

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
