"""The per-primitive table: every entry's attrs are exactly the params JAX gives it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pypm_jax as pm
from pypm_jax.jax import OPS, _compat, prims
from pypm_jax.vocab.primitives import SPECS, lift_attrs, op_for, opaque_op

REQUIRED = """dot_general add sub mul div max exp log tanh logistic erf rsqrt sqrt integer_pow pow neg
reduce_max reduce_sum reduce_min argmax broadcast_in_dim reshape transpose squeeze
convert_element_type select_n eq ne lt le gt ge and or not stop_gradient concatenate slice
dynamic_slice dynamic_update_slice gather scatter-add iota cumsum sort clamp abs sign exp2 log1p
square copy jit custom_jvp_call custom_vjp_call remat2 scan while cond random_bits""".split()


def test_required_primitives_are_in_the_table():
    missing = [n for n in REQUIRED if n not in OPS]
    assert not missing


def test_ops_are_namespaced_objects():
    assert prims.dot_general is OPS["dot_general"]
    assert prims.scatter_add is OPS["scatter-add"] and prims.and_ is OPS["and"]
    assert prims.exp.namespace == "jax" and prims.exp.op_class.name == "unary_pointwise"
    assert prims.dot_general.op_class.name == "contraction"
    assert prims.transpose.op_class.name == "layout"
    assert prims.concatenate.n_in is None  # variadic
    assert not prims.random_bits.pure


def test_variants_and_opaque_ops():
    assert op_for("sort", 1) is prims.sort
    two = op_for("sort", 2)
    assert two.n_out == 2 and two.name == "sort" and op_for("sort", 2) is two
    o = opaque_op("some_custom_call", 3)
    assert not o.pure and o.n_out == 3 and o.op_class.name == "opaque"
    assert op_for("some_custom_call", 3) is o


def test_dtype_params_become_pm_dtypes():
    attrs = lift_attrs({"new_dtype": np.dtype("float32"), "weak_type": False})
    assert attrs["new_dtype"] is pm.f32


def test_rule_built_jax_ops_infer_types():
    a = pm.leaf("a", shape=(4, 8), dtype="f32")
    b = pm.leaf("b", shape=(8, 3), dtype="f32")
    t = prims.dot_general(a, b, dimension_numbers=(((1,), (0,)), ((), ())))
    assert t.shape == (4, 3) and t.dtype is pm.f32
    assert prims.transpose(t, permutation=(1, 0)).shape == (3, 4)
    with pytest.raises(TypeError, match="dot_general"):
        prims.dot_general(a, a, dimension_numbers=(((1,), (0,)), ((), ())))


def _eqn_params(fn, *args):
    seen = {}

    def walk(jaxpr):
        for e in jaxpr.eqns:
            seen.setdefault(e.primitive.name, dict(e.params))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return seen


def test_table_attrs_match_jax_params():
    """Fails loudly when a JAX upgrade renames or adds a primitive's params."""
    x = jnp.ones((4, 4))
    i = jnp.ones((4,), jnp.int32)

    def f(x, i):
        return [
            lax.dot_general(x, x, (((1,), (0,)), ((), ()))),
            lax.exp(x), lax.tanh(x), lax.logistic(x), lax.rsqrt(x), lax.integer_pow(x, 2),
            lax.mul(x, x), lax.add(x, x), lax.max(x, x), lax.erf(x), lax.neg(x),
            lax.reduce_sum(x, (0,)), lax.reduce_max(x, (0,)), lax.argmax(x, 0, jnp.int32),
            lax.broadcast_in_dim(i, (4, 4), (0,)), lax.reshape(x, (16,)),
            lax.transpose(x, (1, 0)), lax.squeeze(x[None], (0,)),
            lax.convert_element_type(x, jnp.bfloat16), lax.select_n(x > 0, x, x),
            lax.concatenate([x, x], 0), lax.slice(x, (0, 0), (2, 2)),
            lax.dynamic_slice(x, (1, 1), (2, 2)), lax.dynamic_update_slice(x, x[:2], (0, 0)),
            x[i], x.at[i].add(1.0), lax.iota(jnp.int32, 4), lax.cumsum(x, 0), lax.sort(x),
            lax.clamp(0.0, x, 1.0),
        ]  # fmt: skip

    @jax.custom_vjp
    def cv(x):
        return jnp.sin(x)

    cv.defvjp(lambda x: (jnp.sin(x), x), lambda r, g: (g * jnp.cos(r),))

    def g(x):  # the call and control-flow primitives whose params lifting reads
        y = jax.nn.relu(x) + cv(x) + jax.checkpoint(jnp.sin)(x) + jax.jit(jnp.cos)(x)
        y = lax.scan(lambda c, a: (c + a, c * a), y[0], y)[1]
        y = lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * 2), (0, y))[1]
        return lax.cond(y.sum() > 0, lambda a: a + 1, lambda a: a - 1, y)

    seen = _eqn_params(f, x, i)
    seen.update(_eqn_params(g, x))
    assert {"scan", "while", "cond", "custom_jvp_call", "custom_vjp_call", "remat2"} <= set(seen)
    for name, raw in seen.items():
        spec = SPECS.get(name)
        assert spec is not None, f"primitive {name} is not in the table"
        # control flow: the version-independent form lifting gives nodes; others: the params
        # of the installed JAX (the table also lists those of other supported versions)
        params = set(_compat.control_params(name, raw) if spec.kind == "nested" else raw)
        attrs = set(spec.op.attrs) - _compat.absent_params(name)
        assert attrs == params, (name, attrs, params)
