"""``pypm_jax.testing.assert_equivalent`` and the pytest plugin (``--pypm-verify``, the
``pypm_verify`` fixture)."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import pypm_jax as pm
from pypm_jax.jax import VerificationError, prims, register_impl
from pypm_jax.testing import assert_equivalent

pytest_plugins = ["pytester"]

X = jax.random.normal(jax.random.key(0), (8, 16))
W = jax.random.normal(jax.random.key(1), (16, 32))


def _mlp(x, w):
    return jax.nn.gelu(x @ w), jnp.argmax(x, -1)


def test_assert_equivalent_checks_values_and_gradients_and_returns_the_report():
    report = assert_equivalent(_mlp, X, W)
    assert report.counts() == {"gemm_epilogue_no_bias": 1}


@pm.pattern
def Exp(x):
    return prims.exp(x)


@pm.op(op_class="kernel")
def WrongExp(x):
    return 1


register_impl(WrongExp, lambda x: jnp.exp(x) * (1 + 1e-3))  # off by 0.1%


@pm.rule(Exp)
def wrong_exp(x):
    return WrongExp(x)


@pm.op(op_class="kernel")
def BadGradExp(x):
    return 1


@jax.custom_jvp
def _bad_grad_exp(x):
    return jnp.exp(x)


_bad_grad_exp.defjvp(lambda primals, tangents: (jnp.exp(primals[0]), 2 * tangents[0]))
register_impl(BadGradExp, _bad_grad_exp)


@pm.rule(Exp)
def bad_grad_exp(x):
    return BadGradExp(x)


def _exp(x):
    return jnp.exp(x) + 1.0


def test_a_wrong_rewrite_fails_naming_the_output_and_the_rule():
    with pytest.raises(AssertionError, match=r"(?s)output \(the only leaf\).*wrong_exp"):
        assert_equivalent(_exp, X, rules=[wrong_exp])
    # right values, wrong derivative: only the gradient check sees it
    assert_equivalent(_exp, X, rules=[bad_grad_exp], grads=False)
    with pytest.raises(AssertionError, match=r"gradient \[0\] of the optimized program"):
        assert_equivalent(_exp, X, rules=[bad_grad_exp])


def test_a_program_nothing_rewrites_fails_unless_allowed():
    with pytest.raises(AssertionError, match="no rule rewrote"):
        assert_equivalent(jnp.sin, X)
    assert len(assert_equivalent(jnp.sin, X, require_rewrite=False)) == 0


def test_the_fixture_turns_verification_on_for_one_test(pypm_verify):
    fast = pm.optimize(_exp, rules=[wrong_exp])  # no verify=True given
    with pytest.raises(VerificationError, match="wrong_exp"):
        fast(X)


def test_pypm_verify_turns_verification_on_for_a_whole_run(pytester):
    pytester.makepyfile(
        test_inner="""
        import jax.numpy as jnp
        import pypm_jax as pm
        from pypm_jax.jax import prims, register_impl

        @pm.pattern
        def Exp(x):
            return prims.exp(x)

        @pm.op(op_class="kernel")
        def Twice(x):
            return 1

        register_impl(Twice, lambda x: 2 * jnp.exp(x))

        @pm.rule(Exp)
        def twice(x):
            return Twice(x)

        def test_it():
            pm.optimize(jnp.exp, rules=[twice])(jnp.ones(3))
        """
    )
    import importlib

    optimize_module = importlib.import_module("pypm_jax.jax.optimize")
    assert pytester.runpytest("-p", "pypm_jax.pytest_plugin").ret == 0
    result = pytester.runpytest("-p", "pypm_jax.pytest_plugin", "--pypm-verify")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*VerificationError: the rewritten program differs*", "*twice (Exp)*"]
    )
    assert optimize_module.VERIFY_ALL is False  # the inner run left the outer as it was


def test_pypm_verify_in_the_environment_turns_verification_on():
    import subprocess
    import sys

    code = "import importlib; print(importlib.import_module('pypm_jax.jax.optimize').VERIFY_ALL)"
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env = {**os.environ, "PYPM_VERIFY": "1", "PYTHONPATH": os.path.abspath(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True"
