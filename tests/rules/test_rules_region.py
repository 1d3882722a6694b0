"""The pointwise region IR (``pypm_jax.rules._region``): validation, compiling, printing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.rules._region import describe, region_error, region_fn, region_inputs, step

ACC, IN0, IN1 = ("acc",), ("in", 0), ("in", 1)


def lit(v):
    return ("lit", v)


def at(j):
    return ("step", j)


SOFTCAP = (step("div", (ACC, lit(30.0))), step("tanh", (at(0),)), step("mul", (at(1), lit(30.0))))
BIAS_SILU = (
    step("add", (ACC, IN0)),
    step("logistic", (at(0),)),
    step("mul", (at(0), at(1))),
)


def test_describe_inlines_single_uses_and_names_shared_steps():
    assert describe(SOFTCAP) == "tanh(acc / 30.0) * 30.0"
    assert describe(BIAS_SILU) == "t0 = acc + in0; t0 * logistic(t0)"
    cast = (step("convert_element_type", (ACC,), new_dtype="bfloat16"),)
    assert describe(cast) == "bfloat16(acc)"
    relu2 = (step("max", (ACC, lit(0.0))), step("integer_pow", (at(0),), y=2))
    assert describe(relu2) == "max(acc, 0.0) ** 2"


def test_region_fn_computes_the_steps():
    acc = jnp.linspace(-3.0, 3.0, 12).reshape(3, 4)
    b = jnp.arange(4.0)
    np.testing.assert_allclose(region_fn(SOFTCAP)(acc), jnp.tanh(acc / 30.0) * 30.0, rtol=1e-6)
    h = acc + b
    np.testing.assert_allclose(region_fn(BIAS_SILU)(acc, b), jax.nn.silu(h), rtol=1e-6)
    kernel = region_fn(BIAS_SILU, "kernel")(acc, b)
    np.testing.assert_allclose(kernel, jax.nn.silu(h), rtol=1e-6)


def test_kernel_target_replaces_erf_by_its_approximation():
    region = (step("erf", (ACC,)),)
    x = jnp.linspace(-4.0, 4.0, 101)
    ref, ker = region_fn(region)(x), region_fn(region, "kernel")(x)
    np.testing.assert_array_equal(ref, jax.lax.erf(x))
    assert (
        float(jnp.max(jnp.abs(ker - ref))) < 3e-7
    )  # 1.5e-7 and f32 rounding and not bool(jnp.all(ker == ref))


def test_region_fn_is_memoized_by_value_and_literal_type():
    same = tuple(tuple(s) for s in SOFTCAP)
    assert region_fn(same) is region_fn(SOFTCAP)
    assert region_fn(SOFTCAP, "kernel") is not region_fn(SOFTCAP)
    as_int = (step("mul", (ACC, lit(1))),)
    as_bool = (step("mul", (ACC, lit(True))),)
    assert region_fn(as_int) is not region_fn(as_bool)
    neg_zero = (step("max", (ACC, lit(-0.0))),)
    assert region_fn(neg_zero) is not region_fn((step("max", (ACC, lit(0.0))),))


def test_region_fn_is_differentiable_and_traceable():
    def loss(acc, b):
        return jnp.sum(jax.jit(region_fn(BIAS_SILU))(acc, b))

    acc, b = jnp.ones((2, 3)), jnp.arange(3.0)
    ga, gb = jax.grad(loss, (0, 1))(acc, b)
    wa, wb = jax.grad(lambda a, c: jnp.sum(jax.nn.silu(a + c)), (0, 1))(acc, b)
    np.testing.assert_allclose(ga, wa, rtol=1e-6)
    np.testing.assert_allclose(gb, wb, rtol=1e-6)


def test_select_clamp_and_comparisons():
    region = (
        step("gt", (ACC, lit(0.0))),
        step("select_n", (at(0), lit(0.0), ACC)),
        step("clamp", (lit(-1.0), at(1), IN1)),
    )
    acc = jnp.linspace(-2.0, 2.0, 8)
    got = region_fn(region)(acc, None, 1.5)
    np.testing.assert_allclose(got, jnp.clip(jax.nn.relu(acc), -1.0, 1.5))
    assert region_inputs(region) == 2
    assert describe(region) == "clamp(-1.0, where(acc > 0.0, acc, 0.0), in1)"


@pytest.mark.parametrize(
    ("region", "why"),
    [
        ((), "non-empty"),
        ("add", "non-empty"),
        ((step("cumsum", (ACC,)),), "no kernel lowering"),
        ((step("add", (ACC,)),), "takes 2 arguments"),
        ((step("add", (ACC, at(0))),), "not a reference"),
        ((step("add", (ACC, ("in", -1))),), "not a reference"),
        ((step("add", (ACC, lit("x"))),), "not a reference"),
        ((step("add", (ACC, lit(float("nan")))),), "not a reference"),
        ((step("exp", (ACC,), accuracy="high"),), "takes no param"),
        ((("exp", (("b", 1), ("a", 2)), (ACC,)),), "sorted"),
        ((step("integer_pow", (ACC,), y=2.5),), "int y"),
        ((step("convert_element_type", (ACC,), new_dtype="complex64"),), "cannot cast"),
        ((step("select_n", (ACC, ACC, ACC, ACC)),), "two-way"),
    ],
)
def test_bad_regions_are_refused_with_a_reason(region, why):
    err = region_error(region)
    assert err is not None and why in err, err
    with pytest.raises(ValueError, match="not a region"):
        region_fn(region)
    assert describe(region).startswith("<not a region")


def test_operand_bound_and_index_refs():
    region = (step("add", (ACC, IN1)),)
    assert region_error(region, n_inputs=2) is None
    assert "has 1" in region_error(region, n_inputs=1)
    pos = (step("ge", (("idx", "q"), ("idx", "k"))), step("select_n", (at(0), lit(-1e9), ACC)))
    assert "not available" in region_error(pos)
    assert region_error(pos, index_refs=True) is None
    q, k = jnp.arange(3)[:, None], jnp.arange(4)[None, :]
    got = region_fn(pos)(jnp.ones((3, 4)), b=0, h=0, q=q, k=k)
    np.testing.assert_array_equal(got, jnp.where(q >= k, 1.0, -1e9))


def test_a_region_in_a_rule_survives_serialize():
    """A region is plain data: a rule whose result carries one round-trips the format."""

    @pm.op(attrs=("region",))
    def Carrier(x):  # noqa: N802
        return 1

    @pm.op
    def Src(x):  # noqa: N802
        return 1

    @pm.pattern
    def P(x):
        return Src(x)

    @pm.rule(P)
    def to_carrier(x):
        return Carrier(x, region=BIAS_SILU)

    (loaded,) = pm.deserialize(pm.serialize([to_carrier]))
    t = Src(pm.leaf("a", shape=(2,), dtype="f32"))
    out = pm.rewrite(pm.Graph([t]), [loaded]).graph
    (node,) = [n for n in out.nodes() if n.op.name == "Carrier"]
    assert node.attrs["region"] == BIAS_SILU and region_error(node.attrs["region"]) is None
