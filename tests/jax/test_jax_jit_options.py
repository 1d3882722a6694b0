"""``pm.optimize`` takes every ``jax.jit`` option with jit's meaning (static and donated
arguments by position and name, keep_unused, backend, ...); an unknown option is a TypeError
when ``pm.optimize`` is called. Shardings on 8 devices: ``test_jax_many_devices.py``."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import optimize, prims, register_impl
from pypm_jax.jax.optimize import JIT_OPTIONS


@pm.pattern
def Exp(x):
    return prims.exp(x)


@pm.op(op_class="kernel")
def KernelExp(x):
    return 1


register_impl(KernelExp, lambda x: jnp.exp(x))


@pm.rule(Exp)
def exp_kernel(x):
    return KernelExp(x)


X = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)


def step(x, n, scale=1.0, *, mode="exp"):
    y = x
    for _ in range(n):
        y = jnp.exp(y * scale) if mode == "exp" else jnp.tanh(y)
    return y


def test_every_jit_option_is_taken():
    """Every keyword option of this JAX's jit is passed on (an option a newer jit adds fails
    here; one it drops is jit's own TypeError when given)."""
    params = inspect.signature(jax.jit).parameters
    jits = {name for name, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert jits <= set(JIT_OPTIONS), jits - set(JIT_OPTIONS)


def test_an_unknown_option_is_a_type_error_at_optimize_time():
    with pytest.raises(TypeError, match="unexpected keyword argument 'donate_argnum'"):
        pm.optimize(step, donate_argnum=0)
    with pytest.raises(ValueError, match="static_argnames"):  # jit's own check, at once
        pm.optimize(step, static_argnames=("nope",))


def test_static_arguments_by_position_and_by_name():
    fast = optimize(step, rules=[exp_kernel], static_argnames=("n", "mode"))
    want = step(X, 2)
    # n positionally or by name: static either way (jit infers one from the other)
    np.testing.assert_allclose(fast(X, 2), want, rtol=1e-6)
    np.testing.assert_allclose(fast(X, n=2), want, rtol=1e-6)
    np.testing.assert_allclose(fast(X, 2, mode="tanh"), step(X, 2, mode="tanh"), rtol=1e-6)
    assert len(fast.report(X, 2)) == 2 and len(fast.report(X, 2, mode="tanh")) == 0
    by_num = optimize(step, rules=[exp_kernel], static_argnums=1)
    np.testing.assert_allclose(by_num(X, n=3), step(X, 3), rtol=1e-6)


def test_donated_arguments_are_deleted_as_under_jit():
    fast = optimize(step, rules=[exp_kernel], static_argnums=1, donate_argnums=0)
    x = X + 0.0
    out = fast(x, 1)
    assert x.is_deleted()
    np.testing.assert_allclose(out, jnp.exp(X), rtol=1e-6)
    assert len(fast.report(X, 1)) == 1
    by_name = optimize(step, rules=[exp_kernel], static_argnums=1, donate_argnames="x")
    x = X + 0.0
    by_name(x, 1)
    assert x.is_deleted()


def test_verification_with_donated_arguments():
    fast = optimize(step, rules=[exp_kernel], static_argnums=1, donate_argnums=0, verify=True)
    x = X + 0.0
    np.testing.assert_allclose(fast(x, 1), jnp.exp(X), rtol=1e-6)
    assert x.is_deleted()


def _main_args(lowered) -> int:
    main = next(line for line in lowered.as_text().splitlines() if "@main(" in line)
    return main.count("%arg")


def test_keep_unused_and_backend():
    def g(x, unused):
        return jnp.exp(x)

    kept = optimize(g, rules=[exp_kernel], keep_unused=True)
    np.testing.assert_allclose(kept(X, X), jnp.exp(X), rtol=1e-6)
    assert _main_args(kept._jitted.lower(X, X)) == 2  # as jax.jit(g, keep_unused=True)
    assert _main_args(optimize(g, rules=[exp_kernel])._jitted.lower(X, X)) == 1
    assert _main_args(jax.jit(g).lower(X, X)) == 1
    with pytest.warns(DeprecationWarning, match="backend"):  # jit's own deprecation
        on_cpu = optimize(g, rules=[exp_kernel], backend="cpu")
    np.testing.assert_allclose(on_cpu(X, X), jnp.exp(X), rtol=1e-6)
