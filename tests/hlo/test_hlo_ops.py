"""The op table: StableHLO ops become the jaxpr lifter's operators with JAX's attributes.

The differential tests lift the same function from its jaxpr and from its StableHLO and
require the same graph (operators, output types, the attributes guards read, structure).
Where lowering changes the program, ``test_known_differences`` says exactly how, so a JAX
release that changes its lowering fails here with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import hlo
import pypm_jax as pm
from pypm_jax.jax import primitives, prims
from pypm_testing.hlo import both, op_names, same_graph

X = jnp.linspace(-1.0, 1.0, 24, dtype=jnp.float32).reshape(2, 3, 4)
I = jnp.arange(24, dtype=jnp.int32).reshape(2, 3, 4)  # noqa: E741
Q = jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32).reshape(2, 4, 2, 8)


def _layernorm(x):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)


def _unary(x):
    return (
        jnp.tanh(x), jnp.exp(x), jnp.log1p(x * x), jnp.sqrt(x * x), jnp.abs(x), -x,
        jnp.sign(x), jnp.floor(x), jnp.ceil(x), jnp.round(x), jnp.sin(x), jnp.cos(x),
        jnp.expm1(x), jnp.log(x * x + 1), lax.erf(x), lax.erfc(x), jnp.isfinite(x), x * x,
        lax.rsqrt(x * x + 1.0), jnp.square(x),
    )  # fmt: skip


SAME = {
    "softmax": (lambda x: jax.nn.softmax(x, axis=-1), X),
    "log_softmax": (jax.nn.log_softmax, X),
    "gelu_exact": (lambda x: jax.nn.gelu(x, approximate=False), X),
    "relu": (jax.nn.relu, X),
    "layernorm": (_layernorm, X),
    "dense": (lambda x, w, b: x @ w + b, X, jnp.ones((4, 5)), jnp.ones(5)),
    "einsum": (lambda q, k: jnp.einsum("bqd,bkd->bqk", q, k), X, X),
    "attention": (_attention, Q, Q, Q),
    "where": (lambda x: jnp.where(x > 0, x, -1e9), X),
    "layout": (
        lambda x: jnp.concatenate([x.T.reshape(4, 6)[:, ::2], jnp.flip(x.reshape(4, 6), 0)], 1),
        X,
    ),
    "pad": (lambda x: jnp.pad(x, ((0, 1), (2, 0), (1, 1))), X),
    "reductions": (
        lambda x: (x.max(0), x.min(1), x.sum(), x.prod(2), (x > 0).any(0), (x > 0).all(1)),
        X,
    ),
    "unary": (_unary, X),
    "ints": (
        lambda i: (i >> 1, i << 2, i & 3, i | 4, i ^ 5, i % 3, ~i, lax.population_count(i)),
        I,
    ),
    "convert": (lambda x: (x.astype(jnp.bfloat16), x.astype(jnp.int32), x > 0), X),
    "clamp": (lambda x: jnp.clip(x, -0.5, 0.5), X),
    "select_n": (lambda x: lax.select_n(x > 0, x, 2 * x), X),
    "iota": (lambda x: x + jnp.arange(4, dtype=jnp.float32), X),
    "dynamic_slice": (
        lambda x, s: lax.dynamic_update_slice(
            x, lax.dynamic_slice(x, (0, s, 0), (2, 1, 4)) * 2, (0, s, 1)
        ),
        X,
        jnp.int32(1),
    ),
    "minmax": (lambda x: (jnp.maximum(x, 0.5), jnp.minimum(0.5, x)), X),
    "top_k": (lambda x: lax.top_k(x, 2), X),
    "scalar_operands": (lambda x, s: x * s + s, X, jnp.float32(3.0)),
}


@pytest.mark.parametrize("name", sorted(SAME))
def test_stablehlo_lifts_to_the_jaxpr_graph(name):
    fn, *args = SAME[name]
    g_jaxpr, g_hlo = both(fn, *args)
    assert same_graph(g_jaxpr, g_hlo), f"{name}:\n{g_jaxpr}\n---\n{g_hlo}"


def test_known_differences():
    """What lowering does that lifting does not undo (rules already allow for each)."""
    # integer_pow is lowered to multiplies (the Cube pattern has both spellings)
    g_jaxpr, g_hlo = both(lambda x: x**3, X)
    assert op_names(g_jaxpr) == ["integer_pow"] and op_names(g_hlo) == ["mul", "mul"]
    # logistic is lowered to 1 / (1 + exp(-x)); find()'s normalization rules take it back
    g_jaxpr, g_hlo = both(jax.nn.silu, X)
    assert op_names(g_jaxpr) == ["logistic", "mul"]
    assert op_names(g_hlo) == ["add", "div", "exp", "mul", "neg"]
    result = pm.rewrite(g_hlo, hlo.normalize_rules())
    assert result.report.counts() == {"raise_logistic": 1}
    assert same_graph(g_jaxpr, result.graph)
    # argmax is a reduce of two operands with a comparison body: opaque
    g_jaxpr, g_hlo = both(lambda x: jnp.argmax(x, -1), X)
    assert op_names(g_jaxpr) == ["argmax"]
    assert op_names(g_hlo) == ["iota", "stablehlo.reduce"]


def test_every_table_entry_is_a_jax_primitive_operator():
    for name, spec in hlo.TABLE.items():
        assert spec.prim in primitives.SPECS, name
        assert primitives.op_for(spec.prim, primitives.SPECS[spec.prim].op.n_out).namespace == "jax"


def _lift_one(body: str, args: str, result: str) -> tuple:
    text = f"func.func @main({args}) -> {result} {{\n{body}\n}}"
    return tuple(hlo.lift(text).outputs)


def test_select_operand_order():
    (out,) = _lift_one(
        "%0 = stablehlo.select %p, %a, %b : tensor<3xi1>, tensor<3xf32>\nreturn %0 : tensor<3xf32>",
        "%p: tensor<3xi1>, %a: tensor<3xf32>, %b: tensor<3xf32>",
        "tensor<3xf32>",
    )
    pred, case0, case1 = out.inputs
    assert out.op is prims.select_n
    # SSA names are not kept (inputs are named by their locations): %p, %a, %b are arg0..2
    assert [v.name for v in (pred, case0, case1)] == ["arg0", "arg2", "arg1"]  # case 0: false


@pytest.mark.parametrize("direction", ["EQ", "NE", "LT", "LE", "GT", "GE"])
def test_compare_directions(direction):
    (out,) = _lift_one(
        f"%0 = stablehlo.compare {direction}, %a, %b, FLOAT : "
        "(tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>\nreturn %0 : tensor<3xi1>",
        "%a: tensor<3xf32>, %b: tensor<3xf32>",
        "tensor<3xi1>",
    )
    assert out.op is getattr(prims, direction.lower()) and out.dtype is pm.bool_


def test_legacy_dot_and_broadcast():
    dot, bc = _lift_one(
        "%0 = stablehlo.dot %a, %b : (tensor<2x3xf32>, tensor<3x4xf32>) -> tensor<2x4xf32>\n"
        "%1 = stablehlo.broadcast %c, sizes = [5] : (tensor<3xf32>) -> tensor<5x3xf32>\n"
        "return %0, %1 : tensor<2x4xf32>, tensor<5x3xf32>",
        "%a: tensor<2x3xf32>, %b: tensor<3x4xf32>, %c: tensor<3xf32>",
        "(tensor<2x4xf32>, tensor<5x3xf32>)",
    )
    assert dot.op is prims.dot_general
    assert dot.attrs["dimension_numbers"] == (((1,), (0,)), ((), ()))
    assert bc.op is prims.broadcast_in_dim and bc.attrs["broadcast_dimensions"] == (1,)
    assert bc.attrs["shape"] == (5, 3)


def test_chlo_broadcasting_ops_and_splat_operands():
    """TensorFlow-style ``chlo.broadcast_*`` and full-shape splat constants read as JAX's
    binary primitive with a scalar literal."""
    (out,) = _lift_one(
        "%c = stablehlo.constant dense<8.0> : tensor<2x3xf32>\n"
        "%0 = chlo.broadcast_divide %a, %c : (tensor<2x3xf32>, tensor<2x3xf32>) -> tensor<2x3xf32>\n"
        "return %0 : tensor<2x3xf32>",
        "%a: tensor<2x3xf32>",
        "tensor<2x3xf32>",
    )
    x, c = out.inputs
    assert out.op is prims.div and c.attrs["value"] == 8.0 and tuple(c.shape) == ()


def test_mixed_precision_dot_reads_through_the_lowering_casts():
    """On CPU/GPU JAX casts both operands of a mixed-type dot_general to the result type; the
    jaxpr's dot_general reads the uncast operands."""
    fn = lambda a, b: lax.dot_general(  # noqa: E731
        a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
    )
    args = (jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4), jnp.float32))
    g_jaxpr, g_hlo = both(fn, *args)
    assert "stablehlo.convert" in jax.jit(fn).lower(*args).as_text()
    assert same_graph(g_jaxpr, g_hlo)
    # a cast the program wrote itself stays
    g_jaxpr, g_hlo = both(lambda a, b: a.astype(jnp.float32) @ b, *args)
    assert "convert_element_type" in op_names(g_hlo) and same_graph(g_jaxpr, g_hlo)
