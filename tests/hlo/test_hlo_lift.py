"""Lifting StableHLO: types, input names, sources, module paths, constants, calls, opaque ops,
regions, every input form, and bad input (a typed error, never a crash)."""

from __future__ import annotations

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import hlo
import pypm_jax as pm
from pypm_jax.jax import prims

HERE = os.path.abspath(__file__)


def _line(marker: str) -> int:
    return next(i for i, t in enumerate(open(HERE), 1) if marker in t and "_line(" not in t)


def _nodes(g, name):
    return [n for n in g.nodes() if n.op.name == name]


def _f(x, w):
    y = jnp.dot(x, w)  # marker: dot
    return jnp.exp(y / 8.0), jnp.max(y, axis=-1)  # marker: exp


X = jnp.ones((2, 4), jnp.float32)
W = jnp.ones((4, 3), jnp.float32)


@pytest.fixture(scope="module")
def lowered():
    return jax.jit(_f).lower(X, W)


# ----------------------------------------------------------------------------- types


def test_inputs_outputs_shapes_and_dtypes(lowered):
    g = hlo.lift(lowered)
    assert isinstance(g, pm.Graph)
    assert [v.name for v in g.inputs] == ["x", "w"]  # from the arguments' MLIR locations
    assert [(tuple(v.shape), v.dtype) for v in g.inputs] == [((2, 4), pm.f32), ((4, 3), pm.f32)]
    exp, mx = g.outputs
    assert exp.op is prims.exp and tuple(exp.shape) == (2, 3) and exp.dtype is pm.f32
    assert mx.op is prims.reduce_max and mx.attrs["axes"] == (1,) and tuple(mx.shape) == (2,)
    (dot,) = _nodes(g, "dot_general")
    assert dot.op is prims.dot_general
    assert dot.attrs["dimension_numbers"] == (((1,), (0,)), ((), ()))
    assert dot.attrs["preferred_element_type"] is pm.f32 and dot.attrs["precision"] is None


@pytest.mark.parametrize(
    "dtype, name",
    [(jnp.bfloat16, "bf16"), (jnp.float16, "f16"), (jnp.int8, "i8"), (jnp.uint32, "u32"),
     (jnp.bool_, "bool")],
)  # fmt: skip
def test_dtypes(dtype, name):
    g = hlo.lift(jax.jit(lambda a: (a, jnp.zeros_like(a))).lower(jnp.ones((3,), dtype)))
    assert g.inputs[0].dtype is pm.as_dtype(name)
    assert all(v.dtype is pm.as_dtype(name) for v in g.outputs)


def test_convert_carries_pm_dtype():
    g = hlo.lift(jax.jit(lambda a: a.astype(jnp.bfloat16)).lower(X))
    (cvt,) = g.outputs
    assert cvt.op is prims.convert_element_type and cvt.attrs["new_dtype"] is pm.bf16
    assert cvt.attrs["new_dtype"] == pm.bf16 and cvt.dtype is pm.bf16


def test_multi_result_op_is_one_node():
    g = hlo.lift(jax.jit(lambda a: lax.top_k(a, 2)).lower(jnp.ones((3, 5))))
    values, indices = g.outputs
    assert values.node is indices.node and values.op.name == "top_k" and values.op.n_out == 2
    assert values.attrs["k"] == 2 and values.attrs["axis"] == 1
    assert (values.dtype, indices.dtype) == (pm.f32, pm.i32)


# ----------------------------------------------------------------------------- sources


def test_source_lines_and_text(lowered):
    g = hlo.lift(lowered)
    (dot,) = _nodes(g, "dot_general")
    assert dot.loc.file == HERE and dot.loc.line == _line("marker: dot")
    assert "jnp.dot(x, w)" in dot.loc.text and str(dot.loc) == f"{HERE}:{dot.loc.line}"
    (exp,) = _nodes(g, "exp")
    assert exp.loc.line == _line("marker: exp")
    assert exp.meta["hlo_op"] == "stablehlo.exponential"


def test_module_path_from_name_stack():
    def f(x):
        with jax.named_scope("block"):
            with jax.named_scope("inner"):
                return jnp.tanh(x)

    g = hlo.lift(jax.jit(f).lower(X))
    assert g.outputs[0].node.meta["module_path"] == "block/inner"


def test_flax_module_path_and_user_line():
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.relu(nn.Dense(8, name="fc1")(x))  # marker: flax

    model = MLP()
    variables = model.init(jax.random.PRNGKey(0), X)
    g = hlo.lift(jax.jit(model.apply).lower(variables, X))
    (dot,) = _nodes(g, "dot_general")
    assert dot.meta["module_path"] == "MLP/fc1"
    assert dot.loc.file == HERE and dot.loc.line == _line("marker: flax")  # not Flax's line
    (relu,) = _nodes(g, "max")  # jax.nn.relu is a private function: inlined
    assert relu.loc.line == _line("marker: flax") and relu.meta["module_path"] == "MLP"


@pytest.mark.parametrize(
    "name, path",
    [
        ("jit(apply)/Attn/attention/query/dot_general", "Attn/attention/query"),
        ("jit(apply)/Attn/attention/...qhd,...khd->...hqk/dot_general", "Attn/attention"),
        ("jit(apply)/Attn/attention/jit(_where)", "Attn/attention"),
        ("jit(apply)/Stack/while/body/layers/attention/exp", "Stack/layers/attention"),
        # jax 0.11 lowers a scan body inside an eval_jaxpr scope
        ("jit(apply)/Stack/while/body/eval_jaxpr/layers/attention/exp", "Stack/layers/attention"),
        ("jit(f)/cond/branch_1_fun/blk/exp", "blk"),
        ("jit(f)/jvp(MLP)/fc1/dot_general", "MLP/fc1"),
        ("jit(f)/checkpoint/blk/exp", "blk"),
        ("select_n", ""),
        ("", ""),
    ],
)
def test_module_path(name, path):
    assert hlo.module_path(name) == path


def test_private_functions_are_inlined_with_the_call_site():
    def f(x):
        return jnp.where(x > 0, x, -1.0)  # marker: where

    low = jax.jit(f).lower(X)
    assert "call @_where" in low.as_text()
    g = hlo.lift(low)
    assert not [n for n in g.nodes() if n.op.namespace == "hlo.opaque"]
    (sel,) = g.outputs
    # stablehlo.select(pred, on_true, on_false) is select_n(pred, on_false, on_true)
    pred, on_false, on_true = sel.inputs
    assert sel.op is prims.select_n and pred.op is prims.gt and on_true is g.inputs[0]
    assert on_false.op is prims.broadcast_in_dim
    assert sel.loc.line == _line("marker: where")  # the callee's ops have no line: the call's


# ----------------------------------------------------------------------------- constants


def test_literal_scalar_as_in_the_jaxpr(lowered):
    """``y / 8.0`` lowers to ``divide(y, broadcast_in_dim(8.0))``; it is lifted as the jaxpr
    has it, ``div(y, 8.0)``, so ``prims.div(x, 8.0)`` matches."""

    @pm.pattern
    def DivBy8(x):
        return prims.div(x, 8.0)

    g = hlo.lift(lowered)
    (div,) = _nodes(g, "div")
    y, c = div.inputs
    assert y.op is prims.dot_general
    assert c.op.name == "const" and c.attrs["value"] == 8.0 and tuple(c.shape) == ()
    m = pm.match(DivBy8, div.outputs[0])
    assert m is not None and m["x"] is y
    assert not _nodes(g, "broadcast_in_dim")  # read through, then removed


def test_splat_small_and_large_constants():
    small = np.arange(6, dtype=np.float32).reshape(2, 3)
    large = np.arange(300, dtype=np.float32)

    def f(x):
        return x + small, jnp.full((2, 3), 7.0) * x, jnp.sum(large) + x

    g = hlo.lift(jax.jit(f, keep_unused=True).lower(jnp.ones((2, 3))))
    consts = {n.attrs["value"] if np.ndim(n.attrs["value"]) == 0 else "array": n
              for n in _nodes(g, "const")}  # fmt: skip
    arr = consts["array"].attrs["value"]
    np.testing.assert_array_equal(arr, small)
    assert tuple(consts["array"].outputs[0].shape) == (2, 3)
    assert 7.0 in consts  # jnp.full: a splat, scalar-valued
    hoisted = [v for v in g.inputs if v.name.startswith("const")]
    assert len(hoisted) == 1 and tuple(hoisted[0].shape) == (300,)


def test_reduce_with_a_non_identity_init_keeps_it():
    text = """
    func.func @main(%x: tensor<2x3xf32>) -> tensor<2xf32> {
      %init = stablehlo.constant dense<5.0> : tensor<f32>
      %r = stablehlo.reduce(%x init: %init) applies stablehlo.maximum across dimensions = [1]
           : (tensor<2x3xf32>, tensor<f32>) -> tensor<2xf32>
      return %r : tensor<2xf32>
    }
    """
    (out,) = hlo.lift(text).outputs
    init, red = out.inputs
    assert out.op is prims.max and init.attrs["value"] == 5.0
    assert red.op is prims.reduce_max and red.attrs["axes"] == (1,)


# ----------------------------------------------------------------------------- opaque


def test_custom_call_and_unknown_ops_are_opaque():
    text = """
    func.func @main(%x: tensor<3xf32>) -> tensor<3xf32> {
      %0 = stablehlo.custom_call @my_kernel(%x) : (tensor<3xf32>) -> tensor<3xf32>
      %1 = "mydialect.frob"(%0) {level = 3 : i64} : (tensor<3xf32>) -> tensor<3xf32>
      %2 = stablehlo.exponential %1 : tensor<3xf32>
      return %2 : tensor<3xf32>
    }
    """
    g = hlo.lift(text)
    cc, frob, exp = g.nodes()
    assert cc.op.name == "stablehlo.custom_call" and not cc.op.pure
    assert (
        cc.op.namespace == "hlo.opaque" and cc.meta["hlo_attrs"]["call_target_name"] == "my_kernel"
    )
    assert frob.op.name == "mydialect.frob" and frob.meta["hlo_attrs"]["level"] == 3
    assert exp.op is prims.exp and exp.inputs[0] is frob.outputs[0]


def test_opaque_ops_are_never_merged():
    text = """
    func.func @main(%x: tensor<3xf32>) -> (tensor<3xf32>, tensor<3xf32>) {
      %0 = stablehlo.custom_call @rng(%x) : (tensor<3xf32>) -> tensor<3xf32>
      %1 = stablehlo.custom_call @rng(%x) : (tensor<3xf32>) -> tensor<3xf32>
      return %0, %1 : tensor<3xf32>, tensor<3xf32>
    }
    """
    a, b = hlo.lift(text).outputs
    assert a.node is not b.node


def test_while_bodies_are_lifted_as_nested_graphs():
    def f(x):
        return lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c) * 2.0, x)

    g = hlo.lift(jax.jit(f).lower(X))
    (loop,) = [n for n in g.nodes() if n.op.name == "stablehlo.while"]
    cond, body = loop.attrs["regions"]
    assert isinstance(body, pm.Graph) and [v.name for v in body.inputs][:2] == ["arg0", "arg1"]
    assert any(n.op is prims.tanh for n in body.nodes())  # the loop body, inlined call included
    assert any(n.op is prims.lt for n in cond.nodes())
    assert list(hlo.nested_graphs(g)) == [cond, body]


def test_dynamic_shapes_do_not_crash():
    text = """
    func.func @main(%x: tensor<?x3xf32>) -> tensor<?x3xf32> {
      %0 = stablehlo.exponential %x : tensor<?x3xf32>
      return %0 : tensor<?x3xf32>
    }
    """
    (out,) = hlo.lift(text).outputs
    assert out.op is prims.exp and tuple(out.shape) == (None, 3)


# ----------------------------------------------------------------------------- inputs


def _structure(g):
    return [(n.op.name, tuple(tuple(v.shape) for v in n.outputs)) for n in g.nodes()]


def test_every_input_form_gives_the_same_graph(lowered, tmp_path):
    want = _structure(hlo.lift(lowered))
    text = lowered.as_text(debug_info=True)
    path = tmp_path / "f.mlir"
    path.write_text(text)
    assert _structure(hlo.lift(text)) == want
    assert _structure(hlo.lift(str(path))) == want
    assert _structure(hlo.lift(path)) == want
    assert _structure(hlo.lift(text.encode())) == want
    assert _structure(hlo.lift(lowered.compiler_ir("stablehlo"))) == want
    # without debug info there are no locations, but the same graph
    g = hlo.lift(lowered.as_text())
    assert _structure(g) == want and all(n.loc is None for n in g.nodes())
    assert [v.name for v in g.inputs] == ["arg0", "arg1"]


def test_lift_of_an_exported_artifact():
    exported = jax.export.export(jax.jit(_f))(
        jax.ShapeDtypeStruct((2, 4), jnp.float32), jax.ShapeDtypeStruct((4, 3), jnp.float32)
    )
    g = hlo.lift(exported)
    assert _nodes(g, "dot_general") and _nodes(g, "exp")
    g2 = hlo.lift(bytes(exported.mlir_module_serialized))
    assert _structure(g2) == _structure(g)


def test_function_selection():
    text = """
    func.func public @first(%x: tensor<3xf32>) -> tensor<3xf32> {
      %0 = stablehlo.exponential %x : tensor<3xf32>
      return %0 : tensor<3xf32>
    }
    func.func public @second(%x: tensor<3xf32>) -> tensor<3xf32> {
      %0 = stablehlo.tanh %x : tensor<3xf32>
      return %0 : tensor<3xf32>
    }
    """
    assert hlo.lift(text, function="second").outputs[0].op is prims.tanh
    with pytest.raises(hlo.HloError, match="no function 'main'"):
        hlo.lift(text)
    with pytest.raises(hlo.HloError, match="no function 'third'.*first, second"):
        hlo.lift(text, function="third")


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "bad",
    [
        "this is not MLIR",
        "func.func @main(%x: tensor<3xf32>) -> tensor<3xf32> { return %y : tensor<3xf32> }",
        "",
        "   \n",
        b"\x00\x01\x02\xff\xfe garbage",
        b"ML\xefR truncated bytecode",
    ],
)
def test_garbage_is_a_format_error(bad):
    with pytest.raises(pm.FormatError):
        hlo.lift(bad)


def test_wrong_files_are_format_errors(tmp_path):
    with pytest.raises(pm.FormatError, match="not a valid MLIR module"):
        hlo.lift(HERE)  # a Python file
    with pytest.raises(pm.FormatError, match="cannot read"):
        hlo.lift(str(tmp_path / "missing.mlir"))
    with pytest.raises(pm.FormatError, match="cannot read"):
        hlo.lift(pathlib.Path(tmp_path / "missing.mlir"))
    with pytest.raises(pm.FormatError, match="cannot read"):
        hlo.lift(tmp_path)  # a directory
    png = tmp_path / "img.mlir"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    with pytest.raises(pm.FormatError):
        hlo.lift(png)


def test_a_module_without_functions_is_an_hlo_error():
    with pytest.raises(hlo.HloError, match="no function 'main'") as info:
        hlo.lift("module {}")
    assert isinstance(info.value, pm.PyPMError)


def test_wrong_python_types_are_type_errors():
    with pytest.raises(TypeError, match="expected a jax.stages.Lowered"):
        hlo.lift(42)


def test_mutated_modules_lift_or_raise_a_typed_error(lowered):
    """Random edits of a real module: each one lifts, or raises a pm error; none crashes."""
    import random

    text = lowered.as_text(debug_info=True)
    rng = random.Random(0)
    outcomes = {"lifted": 0, "error": 0}
    for _ in range(60):
        chars = list(text)
        for _ in range(rng.randint(1, 4)):
            j = rng.randrange(len(chars))
            r = rng.random()
            if r < 0.4:
                del chars[j]
            elif r < 0.7:
                chars[j] = rng.choice('0123456789%[]{}()<>x,:@"# ')
            else:
                chars.insert(j, rng.choice("0123456789%x, "))
        try:
            hlo.lift("".join(chars))
            outcomes["lifted"] += 1
        except pm.PyPMError:
            outcomes["error"] += 1
    assert outcomes["error"] > 0 and sum(outcomes.values()) == 60
