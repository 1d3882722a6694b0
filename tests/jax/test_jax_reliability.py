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
