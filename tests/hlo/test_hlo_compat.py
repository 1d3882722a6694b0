"""The MLIR Python bindings ``hlo`` relies on (``hlo._reader``, ``hlo._editor``) still work.

If one of these fails after a jaxlib upgrade, fix ``hlo/_reader.py`` or ``hlo/_editor.py``
(the only modules that touch ``jaxlib.mlir``) rather than the lifter.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from hlo import _editor, _reader

HERE = os.path.abspath(__file__)


def _f(x, w):
    y = jnp.dot(x, w)  # the line the test expects
    return jnp.exp(y / 8.0), jnp.max(y, axis=-1)


def _lowered():
    return jax.jit(_f).lower(jnp.ones((2, 4), jnp.float32), jnp.ones((4, 3), jnp.float32))


def test_binding_names_exist():
    """Every binding the compat module names: fails loudly when jaxlib moves one."""
    from jaxlib.mlir import ir
    from jaxlib.mlir._mlir_libs import _jax_mlir_ext
    from jaxlib.mlir.dialects import chlo, stablehlo

    for name in (
        "Context", "Module", "DialectRegistry", "MLIRError", "Location", "NameLoc",
        "CallSiteLoc", "FileLineColLoc", "FusedLoc", "RankedTensorType", "UnrankedTensorType",
        "BoolAttr", "IntegerAttr", "FloatAttr", "StringAttr", "FlatSymbolRefAttr", "ArrayAttr",
        "DictAttr", "DenseElementsAttr", "DenseIntElementsAttr", "DenseResourceElementsAttr",
        "DenseI64ArrayAttr", "DenseBoolArrayAttr",
    ):  # fmt: skip
        assert hasattr(ir, name), f"jaxlib.mlir.ir.{name} is gone"
    for name in (
        "register_dialect", "DotDimensionNumbers", "ComparisonDirectionAttr",
        "ComparisonTypeAttr", "PrecisionAttr", "deserialize_portable_artifact",
        "serialize_portable_artifact",
    ):  # fmt: skip
        assert hasattr(stablehlo, name), f"jaxlib.mlir.dialects.stablehlo.{name} is gone"
    assert hasattr(chlo, "register_dialect")
    assert hasattr(_jax_mlir_ext, "register_dialects")
    # editing (hlo.emit) and running (hlo.execute)
    for name in ("replace_all_symbol_uses", "set_symbol_name", "set_visibility"):
        assert hasattr(ir.SymbolTable, name), f"jaxlib.mlir.ir.SymbolTable.{name} is gone"
    for name in ("clone", "create", "erase", "detach_from_parent", "verify", "get_asm"):
        assert hasattr(ir.Operation, name), f"jaxlib.mlir.ir.Operation.{name} is gone"
    assert hasattr(ir, "InsertionPoint") and hasattr(ir.Value, "replace_all_uses_with")
    for name in ("fused", "name", "unknown"):  # inlined ops' locations
        assert hasattr(ir.Location, name), f"jaxlib.mlir.ir.Location.{name} is gone"
    assert ir.Operation.location.fset is not None, "an op's location cannot be set any more"
    from jax.extend import backend
    from jaxlib._jax import CompileOptions  # noqa: F401

    assert hasattr(backend.get_backend(), "compile_and_load")


def test_context_parses_stablehlo_chlo_func_and_unknown_dialects():
    text = """
    func.func @main(%x: tensor<3xf32>) -> tensor<3xf32> {
      %0 = chlo.erf %x : tensor<3xf32> -> tensor<3xf32>
      %1 = "mydialect.thing"(%0) : (tensor<3xf32>) -> tensor<3xf32>
      %2 = stablehlo.add %1, %x : tensor<3xf32>
      return %2 : tensor<3xf32>
    }
    """
    mod = _reader.load(text)
    assert [op.name for op in mod.funcs["main"].body.ops] == [
        "chlo.erf",
        "mydialect.thing",
        "stablehlo.add",
    ]


def test_snapshot_of_a_lowered_function():
    mod = _reader.load(_lowered())
    main = mod.funcs["main"]
    assert main.public and main.body.arg_types == (((2, 4), "f32"), ((4, 3), "f32"))
    assert main.body.arg_names == ("x", "w")
    assert main.result_names == ("result[0]", "result[1]")
    dot = next(op for op in main.body.ops if op.name == "stablehlo.dot_general")
    assert dot.attrs["dot_dimension_numbers"] == {
        "lhs_batching_dimensions": (),
        "rhs_batching_dimensions": (),
        "lhs_contracting_dimensions": (1,),
        "rhs_contracting_dimensions": (0,),
    }
    assert dot.attrs["precision_config"] == ("DEFAULT", "DEFAULT")
    assert dot.types == (((2, 3), "f32"),) and dot.operand_types[1] == ((4, 3), "f32")
    # locations: the name stack and the user's frame
    assert dot.loc.names[0].endswith("/dot_general")
    line = next(i for i, t in enumerate(open(HERE), 1) if "the line the test expects" in t)
    assert (HERE, line) in dot.loc.frames
    red = next(op for op in main.body.ops if op.name == "stablehlo.reduce")
    assert red.attrs["dimensions"] == (1,)
    (body,) = red.regions
    assert [op.name for op in body.ops] == ["stablehlo.maximum"] and len(body.args) == 2


def test_dense_constants():
    text = """
    func.func @main() -> (tensor<3xbf16>, tensor<2x2xi1>, tensor<3xui8>, tensor<f32>, tensor<100xf32>) {
      %a = stablehlo.constant dense<[1.0, 2.0, 3.0]> : tensor<3xbf16>
      %b = stablehlo.constant dense<true> : tensor<2x2xi1>
      %c = stablehlo.constant dense<[1, 2, 255]> : tensor<3xui8>
      %d = stablehlo.constant dense<0xFF800000> : tensor<f32>
      %e = stablehlo.constant dense<[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0, 19.0, 20.0, 21.0, 22.0, 23.0, 24.0, 25.0, 26.0, 27.0, 28.0, 29.0, 30.0, 31.0, 32.0, 33.0, 34.0, 35.0, 36.0, 37.0, 38.0, 39.0, 40.0, 41.0, 42.0, 43.0, 44.0, 45.0, 46.0, 47.0, 48.0, 49.0, 50.0, 51.0, 52.0, 53.0, 54.0, 55.0, 56.0, 57.0, 58.0, 59.0, 60.0, 61.0, 62.0, 63.0, 64.0, 65.0, 66.0, 67.0, 68.0, 69.0, 70.0, 71.0, 72.0, 73.0, 74.0, 75.0, 76.0, 77.0, 78.0, 79.0, 80.0, 81.0, 82.0, 83.0, 84.0, 85.0, 86.0, 87.0, 88.0, 89.0, 90.0, 91.0, 92.0, 93.0, 94.0, 95.0, 96.0, 97.0, 98.0, 99.0]> : tensor<100xf32>
      return %a, %b, %c, %d, %e : tensor<3xbf16>, tensor<2x2xi1>, tensor<3xui8>, tensor<f32>, tensor<100xf32>
    }
    """
    a, b, c, d, e = (op.attrs["value"] for op in _reader.load(text).funcs["main"].body.ops)
    assert not a.splat and a.dtype == "bf16" and list(a.array.astype(np.float32)) == [1, 2, 3]
    assert b.splat and b.value is True and b.shape == (2, 2) and b.dtype == "bool"
    assert c.dtype == "u8" and list(c.array) == [1, 2, 255]
    assert d.splat and d.value == float("-inf") and d.shape == ()
    assert not e.splat and e.array is None and e.shape == (100,)  # too large to read


@pytest.mark.parametrize(
    "element, name",
    [("i1", "bool"), ("i32", "i32"), ("ui8", "u8"), ("bf16", "bf16"), ("f8E4M3FN", "f8e4m3"),
     ("complex<f32>", "c64"), ("index", None)],
)  # fmt: skip
def test_element_types(element, name):
    assert _reader.dtype_name(element) == name
    if name is not None:
        assert pm.as_dtype(name).name == name


def test_portable_artifact_bytes():
    """A versioned StableHLO artifact (what jax.export serializes) loads like text."""
    exported = jax.export.export(jax.jit(_f))(
        jax.ShapeDtypeStruct((2, 4), jnp.float32), jax.ShapeDtypeStruct((4, 3), jnp.float32)
    )
    blob = exported.mlir_module_serialized
    assert bytes(blob[:4]) == b"ML\xefR"
    mod = _reader.load(bytes(blob))
    assert "stablehlo.dot_general" in [op.name for op in mod.funcs["main"].body.ops]


def test_parse_errors_are_format_errors():
    with pytest.raises(pm.FormatError, match="not a valid MLIR module"):
        _reader.load("func.func @main( this is not MLIR")


def test_editor_imports_calls_erases_and_the_result_runs():
    text = """
    func.func @main(%x: tensor<3xf32>) -> tensor<3xf32> {
      %0 = stablehlo.exponential %x : tensor<3xf32>
      %1 = stablehlo.tanh %0 : tensor<3xf32>
      return %1 : tensor<3xf32>
    }
    """
    mod, editor = _editor.load_for_editing(text)
    exp, tanh = mod.funcs["main"].body.ops
    kernel = jax.jit(lambda a: jnp.sin(a) + 1.0).lower(jnp.ones(3, jnp.float32)).as_text()
    name = editor.import_functions(kernel, "k")
    (copy,) = editor.clone(exp.results[0], tanh.results[0], [mod.funcs["main"].body.args[0]])
    new = editor.call(tanh.results[0], name, [copy], tanh.results[0])
    editor.replace_uses(tanh.results[0], new)
    assert editor.erase_dead("main", lambda op: op.startswith("stablehlo.")) == 2  # tanh, exp
    out = editor.text()
    assert [op.name for op in _reader.load(out).funcs["main"].body.ops] == [
        "stablehlo.exponential",
        "func.call",
    ]
    x = np.linspace(0.0, 1.0, 3, dtype=np.float32)
    (got,) = _editor.execute(out, [x])
    np.testing.assert_allclose(got, np.sin(np.exp(x)) + 1.0, rtol=1e-6)


def test_editor_inlines_a_call_whose_callee_regions_capture_its_values():
    """A copied region that read the callee's values (implicitly, as ``case`` branches do)
    reads the copies; the other call of the callee stays until it is inlined too."""
    text = """
    func.func @main(%p: tensor<i32>, %x: tensor<3xf32>) -> tensor<3xf32> {
      %0 = func.call @f(%p, %x) : (tensor<i32>, tensor<3xf32>) -> tensor<3xf32>
      %1 = func.call @f(%p, %0) : (tensor<i32>, tensor<3xf32>) -> tensor<3xf32>
      return %1 : tensor<3xf32>
    }
    func.func private @f(%p: tensor<i32>, %x: tensor<3xf32>) -> tensor<3xf32> {
      %e = stablehlo.exponential %x : tensor<3xf32>
      %r = "stablehlo.case"(%p) ({
        stablehlo.return %e : tensor<3xf32>
      }, {
        %n = stablehlo.negate %x : tensor<3xf32>
        %s = stablehlo.add %n, %e : tensor<3xf32>
        stablehlo.return %s : tensor<3xf32>
      }) : (tensor<i32>) -> tensor<3xf32>
      return %r : tensor<3xf32>
    }
    """
    mod, editor = _editor.load_for_editing(text)
    first, second = mod.funcs["main"].body.ops
    callee = mod.funcs["f"].body
    values, ops = editor.inline(editor.op_id(first), callee)
    assert set(ops) >= set(callee.ops) and set(values) >= set(callee.args)
    assert editor.verify() is None
    out = editor.text()
    assert [op.name for op in _reader.load(out).funcs["main"].body.ops] == [
        "stablehlo.exponential",
        "stablehlo.case",
        "func.call",
    ]
    editor.inline(editor.op_id(second), callee)
    editor.erase_dead("main", lambda op: op.startswith("stablehlo."))
    out = editor.text()
    assert "f" not in _reader.load(out).funcs  # no call of it is left
    x = np.linspace(0.0, 1.0, 3, dtype=np.float32)
    for p in (0, 1):
        (got,) = _editor.execute(out, [np.int32(p), x])
        (want,) = _editor.execute(text, [np.int32(p), x])
        np.testing.assert_allclose(got, want, rtol=1e-6)
