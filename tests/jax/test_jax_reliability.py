"""``pm.optimize`` when things go wrong: effects run once, rewrites keep types, a broken
rule is disabled alone, and printed reports cannot be forged by names."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import pypm_jax as pm
from pypm_jax.jax import OptimizationFallbackWarning, prims, register_impl
from pypm_jax.rules import default_rules

X = jnp.linspace(-1.0, 1.0, 6, dtype=jnp.float32).reshape(2, 3)


@pm.pattern
def Exp(x):
    return prims.exp(x)


@pm.op(op_class="kernel")
def ExpKernel(x):
    return 1


register_impl(ExpKernel, lambda x: jnp.exp(x))


@pm.rule(Exp)
def exp_kernel(x):
    return ExpKernel(x)


# ------------------------------------------------------------------------ effects run once


def _effectful(log: list[float], fail: list[bool]):
    def callback(s):
        log.append(float(s))
        if fail[0]:
            raise ValueError("the user's callback failed")
        return np.float32(0)

    def f(x):
        io_callback(callback, jax.ShapeDtypeStruct((), jnp.float32), x.sum(), ordered=True)
        return jnp.exp(x) * 2

    return f


@pytest.mark.parametrize("rules", [[], [exp_kernel]], ids=["no rules", "a rule"])
def test_an_error_while_the_program_runs_propagates_and_its_effects_happen_once(rules):
    log: list[float] = []
    fail = [True]
    f = _effectful(log, fail)
    with pytest.raises(Exception) as under_jit:
        jax.jit(f)(X)
    assert len(log) == 1
    log.clear()

    fast = pm.optimize(f, rules=rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)
        with pytest.raises(type(under_jit.value), match="the user's callback failed"):
            fast(X)
    assert len(log) == 1  # the program ran once: no second run of the original
    report = fast.report(X)
    assert report.fallback is None  # rewriting stays on for this signature
    assert len(report) == len(rules)

    fail[0] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)
        out = fast(X)
    np.testing.assert_allclose(out, np.exp(np.asarray(X)) * 2, rtol=1e-6)
    assert len(log) == 2
    assert fast.report(X).fallback is None
    assert fast.traces == 1


# ------------------------------------------------------------- rewrites preserve types


@pm.pattern
def Tanh(x):
    return prims.tanh(x)


@pm.op(op_class="kernel")
def TanhKernel(x):
    return 1


register_impl(TanhKernel, lambda x: jnp.tanh(x))


@pm.rule(Tanh)
def tanh_kernel(x):
    return TanhKernel(x)


@pm.rule(Exp)
def exp_transposed(x):  # wrong: (2, 3) becomes (3, 2)
    return prims.transpose(prims.exp(x), permutation=(1, 0))


def _sliced(x):
    return jnp.exp(x)[:2, :2] + jnp.tanh(x)[:2, :2]  # the slice reads (2, 3) and (3, 2) alike


def test_a_rule_changing_a_shape_is_left_out_and_the_others_still_apply():
    fast = pm.optimize(_sliced, rules=[exp_transposed, tanh_kernel])
    with pytest.warns(pm.jax.RuleDisabledWarning, match="exp_transposed") as record:
        out = fast(X)
    np.testing.assert_allclose(out, _sliced(X), rtol=1e-6)
    (w,) = [w for w in record if issubclass(w.category, pm.jax.RuleDisabledWarning)]
    assert f"{__file__}:{exp_transposed.definition.loc.line}" in str(w.message)
    assert "shape" in str(w.message) and "f32[3,2]" in str(w.message)
    report = fast.report(X)
    assert report.fallback is None
    assert [r.rule for r in report] == ["tanh_kernel"]  # the other rule still fired
    assert len(report.disabled) == 1 and "exp_transposed" in report.disabled[0]


@pm.rule(Exp)
def exp_in_half(x):  # wrong: f32 becomes f16
    return prims.convert_element_type(prims.exp(x), new_dtype=pm.f16)


def test_a_rule_changing_a_dtype_is_left_out():
    def g(x):
        return jnp.exp(x) * 2

    fast = pm.optimize(g, rules=[exp_in_half])
    with pytest.warns(pm.jax.RuleDisabledWarning, match="exp_in_half.*dtype"):
        out = fast(X)
    np.testing.assert_array_equal(out, jax.jit(g)(X))
    assert len(fast.report(X)) == 0 and fast.report(X).fallback is None


# ------------------------------------------------------------ a broken rule alone is off


@pm.rule(Exp)
def wrong_arity(x):
    return prims.add(x)  # add takes two inputs


@pm.pattern
def Binary(x, y, f: pm.Op):
    return f(x, y)


@pm.rule(Binary)
def returns_operator(x, y, f):
    return f


def _exp_tanh(x):
    return jnp.exp(x) + jnp.tanh(x)


@pytest.mark.parametrize("broken", [wrong_arity, returns_operator], ids=lambda r: r.name)
def test_a_rule_that_cannot_be_compiled_is_left_out_alone(broken):
    fast = pm.optimize(_exp_tanh, rules=[broken, tanh_kernel, exp_kernel])
    with pytest.warns(pm.jax.RuleDisabledWarning, match=broken.name) as record:
        out = fast(X)
    np.testing.assert_allclose(out, _exp_tanh(X), rtol=1e-6)
    (w,) = [w for w in record if issubclass(w.category, pm.jax.RuleDisabledWarning)]
    assert f"{__file__}:{broken.fn.__code__.co_firstlineno + 1}" in str(w.message)  # its def
    assert w.filename == __file__  # the warning points at the caller
    report = fast.report(X)
    assert report.fallback is None
    assert sorted(r.rule for r in report) == ["exp_kernel", "tanh_kernel"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast(X + 1)  # another signature: no second warning for the same rule


def test_a_broken_rule_does_not_switch_the_default_rules_off():
    def attention(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    q = jnp.ones((1, 16, 2, 64), jnp.float32)
    fast = pm.optimize(attention, rules=[wrong_arity, *default_rules()])
    with pytest.warns(pm.jax.RuleDisabledWarning, match="wrong_arity"):
        fast(q, q, q)
    report = fast.report(q, q, q)
    assert report.fallback is None and len(report) >= 1


def test_a_pattern_given_as_a_rule_is_a_type_error_at_optimize_time():
    with pytest.raises(TypeError, match=r"rules\[1\] is the pattern Exp .*test_jax_reliability"):
        pm.optimize(_exp_tanh, rules=[tanh_kernel, Exp])


# -------------------------------------------------------------------- names are data


@pm.rule(Exp, name="exp\nkernel")
def oddly_named(x):
    return ExpKernel(x)


@pm.rule(Exp, name="evil\n#  rule\u2028\ud800")
def evil_transposed(x):
    return prims.transpose(prims.exp(x), permutation=(1, 0))


def test_printed_reports_and_warnings_keep_one_line_per_item_whatever_the_names():
    fast = pm.optimize(_exp_tanh, rules=[oddly_named])
    fast(X)
    text = str(fast.report(X))
    assert len(text.splitlines()) == 2 and "exp\\nkernel" in text

    fast = pm.optimize(_sliced, rules=[evil_transposed])
    with pytest.warns(pm.jax.RuleDisabledWarning) as record:
        fast(X)
    message = str(record[0].message)
    assert "\n" not in message and "\u2028" not in message and "evil\\n#  rule" in message
    text = str(fast.report(X))
    assert text.splitlines() == [text.splitlines()[0], "no rewrites"]
    assert text.startswith("rule left out: rule evil\\n#  rule\\u2028\\ud800 (")
    text.encode("utf-8")  # no lone surrogate left


@pm.pattern
def Convert(x):
    return prims.convert_element_type(x)


@pm.rule(Convert)
def drop_convert(x):  # wrong for f32 -> f32 from a weak value: the result becomes weak
    return x


def test_a_rule_changing_a_weak_type_is_left_out():
    def g(x, w):
        return (x.sum() + w) * x  # w, a Python float, is made strong by a convert

    fast = pm.optimize(g, rules=[drop_convert])
    with pytest.warns(pm.jax.RuleDisabledWarning, match=r"drop_convert.*weak type"):
        out = fast(X, 2.0)
    np.testing.assert_allclose(out, g(X, 2.0), rtol=1e-6)
    assert len(fast.report(X, 2.0)) == 0
