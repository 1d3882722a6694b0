"""``optimize``: jit-like calling, caching, reports, fallback on failure, verification, Flax."""

from __future__ import annotations

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import (
    OptimizationFallbackWarning,
    Optimized,
    VerificationError,
    optimize,
    prims,
    register_impl,
)
from pypm_testing.corpus import linen_mha, nnx_mha

HERE = os.path.abspath(__file__)


@pm.pattern
def Exp(x):
    return prims.exp(x)


@pm.op(op_class="kernel")
def GoodExp(x):
    return 1


register_impl(GoodExp, lambda x: jnp.exp(x))


@pm.rule(Exp)
def exp_kernel(x):
    return GoodExp(x)


@pm.op(op_class="kernel")
def BrokenExp(x):
    return 1


def _broken(x):
    raise RuntimeError("kernel exploded")


register_impl(BrokenExp, _broken)


@pm.rule(Exp)
def broken_exp(x):
    return BrokenExp(x)


@pm.op(op_class="kernel")
def UnregisteredExp(x):
    return 1


@pm.rule(Exp)
def unregistered_exp(x):
    return UnregisteredExp(x)


@pm.op(op_class="kernel")
def WrongShapeExp(x):
    return 1


register_impl(WrongShapeExp, lambda x: jnp.exp(x).reshape(-1))


@pm.rule(Exp)
def wrong_shape_exp(x):
    return WrongShapeExp(x)


@pm.op(op_class="kernel")
def Exp2(x):
    return 1


register_impl(Exp2, lambda x: jnp.exp2(x))


@pm.rule(Exp)
def wrong_exp(x):
    return Exp2(x)


@pm.pattern
def Tanh(x):
    return prims.tanh(x)


@pm.rule(Tanh)
def tanh_identity(x):  # harmless: tanh(x) stays tanh(x), but through a new node
    return prims.tanh(x)


def f(x, y):
    return jnp.exp(x) * y


X = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
Y = jnp.full((2, 3), 2.0)


# ------------------------------------------------------------------------------ calling


def test_decorator_forms_and_reports():
    @optimize(rules=[exp_kernel])
    def g(x, y):
        return jnp.exp(x) * y

    assert isinstance(g, Optimized) and g.__name__ == "g"
    np.testing.assert_allclose(g(X, Y), f(X, Y), rtol=1e-6)
    report = g.report(X, Y)
    assert [r.rule for r in report] == ["exp_kernel"]
    (r,) = report
    assert r.pattern == "Exp" and r.source.file == HERE
    assert r.source.line == g.__wrapped__.__code__.co_firstlineno + 2
    text = str(report)
    assert "exp_kernel" in text and "test_jax_optimize.py" in text and "rule" in text

    h = optimize(f, rules=[exp_kernel])
    np.testing.assert_allclose(h(X, Y), f(X, Y), rtol=1e-6)


def test_default_rules_are_used_when_none_given():
    from pypm_jax.rules import default_rules

    g = pm.optimize(f)
    assert [getattr(r, "name", None) for r in g.rules] == [
        getattr(r, "name", None) for r in default_rules()
    ]
    np.testing.assert_allclose(g(X, Y), f(X, Y), rtol=1e-6)


def test_the_bridge_takes_its_default_rules_from_its_caller():
    """``pypm_jax.jax.optimize`` names no rule library: without rules it needs the caller's
    ``default_rules``, asked once, when the rules are first needed."""
    with pytest.raises(TypeError, match="rules= or default_rules="):
        optimize(f)
    with pytest.raises(TypeError, match="default_rules must be a function"):
        optimize(f, default_rules=[exp_kernel])
    asked = []

    def defaults():
        asked.append(1)
        return [exp_kernel]

    g = optimize(f, default_rules=defaults)
    assert asked == []  # not before the rules are needed
    np.testing.assert_allclose(g(X, Y), f(X, Y), rtol=1e-6)
    assert [r.rule for r in g.report(X, Y)] == ["exp_kernel"] and asked == [1]
    h = optimize(f, rules=[], default_rules=defaults)  # given rules win
    assert not h.report(X, Y) and asked == [1]


def test_cache_traces_once_per_signature():
    traces = []

    def g(x, y):
        traces.append(1)
        return jnp.exp(x) * y

    fast = optimize(g, rules=[exp_kernel])
    fast(X, Y)
    fast(X + 1, Y)
    fast.report(X, Y)
    assert len(traces) == 1 and fast.traces == 1
    fast(jnp.ones((3, 3)), jnp.ones((3, 3)))  # new shapes: one more trace
    fast(X.astype(jnp.bfloat16), Y.astype(jnp.bfloat16))  # new dtypes: one more
    assert len(traces) == 3
    fast(X, Y)
    assert len(traces) == 3


def test_each_signature_logs_what_it_did(caplog):
    """Logger ``pypm_jax.optimize`` (INFO): one line per signature rewritten, naming the
    function, its argument types, the nodes lifted and the rewrites, with the phases' times."""
    import logging

    def g(x, y):
        return jnp.exp(x) * y

    fast = optimize(g, rules=[exp_kernel])
    with caplog.at_level(logging.INFO, logger="pypm_jax.optimize"):
        fast(X, Y)
        fast(X + 1, Y)  # the same signature: nothing new
        fast(jnp.ones(4), jnp.ones(4))
    lines = [r.getMessage() for r in caplog.records if r.name == "pypm_jax.optimize"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("pm.optimize(test_each_signature_logs_what_it_did.<locals>.g)")
    assert "for (f32[2,3], f32[2,3])" in lines[0] and "for (f32[4], f32[4])" in lines[1]
    for line in lines:
        assert "1 rewrite (exp_kernel x1)" in line and " nodes in " in line, line


def test_pytrees_in_and_out_and_kwargs():
    def g(params, batch, *, scale):
        h = jnp.exp(batch["x"] @ params["w"]) * scale
        return {"h": h, "stats": (jnp.mean(h), [jnp.max(h)])}

    params = {"w": jnp.ones((3, 4)) * 0.1}
    batch = {"x": X}
    fast = optimize(g, rules=[exp_kernel])
    got = fast(params, batch, scale=2.0)
    want = g(params, batch, scale=2.0)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert len(fast.report(params, batch, scale=2.0)) == 1


def test_static_argnums():
    traces = []

    def g(x, n, mode):
        traces.append((n, mode))
        y = x
        for _ in range(n):
            y = jnp.exp(y) if mode == "exp" else jnp.tanh(y)
        return y

    want_exp, want_tanh = g(X, 2, "exp"), g(X, 2, "tanh")
    traces.clear()
    fast = optimize(g, rules=[exp_kernel], static_argnums=(1, -1))
    np.testing.assert_allclose(fast(X, 2, "exp"), want_exp, rtol=1e-6)
    np.testing.assert_allclose(fast(X, 2, "tanh"), want_tanh, rtol=1e-6)
    fast(X, 2, "exp")
    assert traces == [(2, "exp"), (2, "tanh")]
    assert len(fast.report(X, 2, "exp")) == 2 and len(fast.report(X, 2, "tanh")) == 0
    with pytest.raises((TypeError, ValueError), match="hashable"):
        fast(X, 2, ["unhashable"])


def test_works_under_jit_grad_and_vmap():
    fast = optimize(f, rules=[exp_kernel])
    loss = lambda x: jnp.sum(fast(x, Y))  # noqa: E731
    np.testing.assert_allclose(jax.grad(loss)(X), jax.grad(lambda x: jnp.sum(f(x, Y)))(X))
    np.testing.assert_allclose(jax.jit(fast)(X, Y), f(X, Y), rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(fast)(X, Y), f(X, Y), rtol=1e-6)


def test_closure_over_tracers_is_not_cached():
    def outer(w):
        fast = optimize(lambda x: jnp.exp(x * w), rules=[exp_kernel])
        return jnp.sum(fast(X))

    g = jax.grad(outer)(2.0)
    want = jax.grad(lambda w: jnp.sum(jnp.exp(X * w)))(2.0)
    np.testing.assert_allclose(g, want, rtol=1e-5)


# ------------------------------------------------------------------------------ failures


@pytest.mark.parametrize(
    "rule, cause",
    [
        (broken_exp, "kernel exploded"),
        (unregistered_exp, "no implementation"),
        (wrong_shape_exp, "shape"),
    ],
)
def test_failing_rules_fall_back_to_the_original_with_a_warning(rule, cause):
    fast = optimize(f, rules=[rule])
    with pytest.warns(OptimizationFallbackWarning, match=cause) as record:
        out = fast(X, Y)
    assert record[0].filename == HERE  # the warning points at the user's call
    np.testing.assert_array_equal(out, jax.jit(f)(X, Y))
    report = fast.report(X, Y)
    assert report.fallback is not None and cause in report.fallback
    assert "fell back" in str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast(X, Y)  # warned once per signature


def test_a_program_that_fails_to_compile_falls_back():
    """Tracing the rewritten program succeeds; compiling it does not (no lowering rule)."""
    from jax.extend.core import Primitive

    no_lowering_p = Primitive("pypm_test_no_lowering")
    no_lowering_p.def_abstract_eval(lambda x: x)

    @pm.op(op_class="kernel")
    def Uncompilable(x):
        return 1

    register_impl(Uncompilable, lambda x: no_lowering_p.bind(jnp.exp(x)))

    @pm.rule(Exp)
    def uncompilable(x):
        return Uncompilable(x)

    fast = optimize(f, rules=[uncompilable])
    assert fast.report(X, Y).fallback is None  # rewriting and tracing went fine
    with pytest.warns(OptimizationFallbackWarning, match="rewritten program failed") as record:
        out = fast(X, Y)
    assert record[0].filename == HERE
    np.testing.assert_array_equal(out, jax.jit(f)(X, Y))
    assert "pypm_test_no_lowering" in fast.report(X, Y).fallback
    np.testing.assert_array_equal(fast(X, Y), jax.jit(f)(X, Y))
    assert fast.traces == 1


def test_a_rule_list_that_cannot_settle_falls_back():
    @pm.pattern
    def Kernel(x):
        return GoodExp(x)

    @pm.rule(Kernel)
    def back_to_exp(x):
        return prims.exp(x)

    def g(x):
        return jnp.exp(x)

    fast = optimize(g, rules=[exp_kernel, back_to_exp], max_iterations=50)
    with pytest.warns(OptimizationFallbackWarning, match="RewriteLimitError"):
        np.testing.assert_array_equal(fast(X), jax.jit(g)(X))


# ------------------------------------------------------------------------------ verify


def test_verify_passes_correct_rewrites():
    fast = optimize(f, rules=[exp_kernel, tanh_identity], verify=True)
    np.testing.assert_allclose(fast(X, Y), f(X, Y), rtol=1e-6)


def test_verify_names_the_offending_rewrite():
    def g(x):
        return jnp.tanh(x) + jnp.exp(x)  # line reported

    fast = optimize(g, rules=[tanh_identity, wrong_exp], verify=True)
    with pytest.raises(VerificationError, match="wrong_exp") as info:
        fast(X)
    (record,) = info.value.records
    assert record.rule == "wrong_exp"
    assert record.source.file == HERE
    assert record.source.line == g.__code__.co_firstlineno + 1
    assert "test_jax_optimize.py" in str(info.value)


def test_verify_tolerates_low_precision_differences():
    @pm.op(op_class="kernel")
    def ExpViaF32(x):
        return 1

    register_impl(ExpViaF32, lambda x: jnp.exp(x.astype(jnp.float32)).astype(x.dtype))

    @pm.rule(Exp)
    def exp_f32(x):
        return ExpViaF32(x)

    x = jnp.linspace(-3.0, 3.0, 64, dtype=jnp.bfloat16)
    fast = optimize(lambda x: jnp.exp(x), rules=[exp_f32], verify=True)
    fast(x)


# ------------------------------------------------------------------------------ Flax


def test_linen_apply_and_module_helper():
    from pypm_jax.jax import optimize_module

    apply, (variables, x), _ = linen_mha(False)
    want = jax.jit(apply)(variables, x)
    np.testing.assert_allclose(optimize(apply, rules=[exp_kernel])(variables, x), want, rtol=1e-6)
    module = apply.__self__
    fast = optimize_module(module, rules=[exp_kernel])
    np.testing.assert_allclose(fast(variables, x), want, rtol=1e-6)
    (r,) = fast.report(variables, x)
    assert r.rule == "exp_kernel" and r.module_path == "Attn/attention"


@pytest.mark.slow
def test_nnx_module_wrapper():
    from flax import nnx

    from pypm_jax.jax import nnx_optimize

    module = nnx.MultiHeadAttention(
        num_heads=4, in_features=32, decode=False, dropout_rate=0.0, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 32))
    want = module(x)
    fast = nnx_optimize(module, rules=[exp_kernel])
    np.testing.assert_allclose(fast(x), want, rtol=1e-5, atol=1e-6)
    assert [r.rule for r in fast.report(x)] == ["exp_kernel"]
    fast(x)
    assert fast.optimized.traces == 1
    # the wrapper reads the module's current state: a weight update is seen
    module.out.kernel[...] = module.out.kernel[...] * 2.0
    np.testing.assert_allclose(fast(x), module(x), rtol=1e-5, atol=1e-6)
    assert fast.optimized.traces == 1


def test_nnx_pure_apply_optimizes():
    apply, inputs, _ = nnx_mha(True)
    fast = optimize(apply, rules=[exp_kernel])
    np.testing.assert_allclose(fast(*inputs), jax.jit(apply)(*inputs), rtol=1e-6)
    assert len(fast.report(*inputs)) == 1
