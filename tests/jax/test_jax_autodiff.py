"""Autodiff through optimized programs with the kernels in place (interpret mode): jvp,
jacfwd, linearize and hessian give ``jax.jit``'s results; nnx.grad through ``nnx_optimize``;
a failure under a transformation falls back for that call only."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import OptimizationFallbackWarning, optimize, prims, register_impl
from pypm_testing.corpus import Size, linen_mha


@pytest.fixture(scope="module")
def attention(monkeypatch_module):
    """A linen attention block, optimized with the kernels run by the Pallas interpreter."""
    monkeypatch_module.setenv("PYPM_KERNEL_IMPL", "interpret")
    apply, (variables, x), _ = linen_mha(size=Size(batch=1, seq=8, hidden=64, heads=2))
    fast = pm.optimize(apply)
    assert fast.report(variables, x).counts()["attention"] == 1
    return fast, apply, variables, x


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_jvp_linearize_and_jacfwd_equal_jits(attention):
    fast, apply, variables, x = attention
    f, g = functools.partial(fast, variables), jax.jit(functools.partial(apply, variables))
    t = jnp.cos(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)  # kernels stay in place
        close(jax.jvp(f, (x,), (t,)), jax.jvp(g, (x,), (t,)))
        close(jax.linearize(f, x)[1](t), jax.jvp(g, (x,), (t,))[1])
        pick = lambda h: lambda c: h(x * c)[0, :2, :3]  # noqa: E731 - a small Jacobian
        c = jnp.ones(x.shape[-1])
        close(jax.jacfwd(pick(f))(c), jax.jacfwd(pick(g))(c))
    assert "pallas_call" in str(jax.make_jaxpr(lambda t: jax.jvp(f, (x,), (t,)))(t))


@pytest.mark.slow
def test_hessian_equals_jits(attention):
    fast, apply, variables, x = attention

    def loss(h):  # of two coefficients: a 2 x 2 Hessian
        return lambda c: jnp.sum(h(variables, x * c[0] + c[1]) ** 2)

    c = jnp.array([1.0, 0.1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)
        close(jax.hessian(loss(fast))(c), jax.hessian(loss(jax.jit(apply)))(c))
        # the forward kernel and both backward kernels run inside the Hessian
        assert str(jax.make_jaxpr(jax.hessian(loss(fast)))(c)).count("pallas_call") == 3


# ------------------------------------------------------------------------------ fallbacks


@pm.pattern
def Exp(x):
    return prims.exp(x)


@jax.custom_vjp
def exp_without_jvp(x):
    return jnp.exp(x)


exp_without_jvp.defvjp(lambda x: (jnp.exp(x), jnp.exp(x)), lambda e, g: (g * e,))


@pm.op(op_class="kernel")
def VjpOnlyExp(x):
    return 1


register_impl(VjpOnlyExp, exp_without_jvp)


@pm.rule(Exp)
def vjp_only_exp(x):
    return VjpOnlyExp(x)


def test_a_failure_under_a_transformation_falls_back_for_that_call_only():
    fast = optimize(lambda x: jnp.sin(jnp.exp(x)), rules=[vjp_only_exp])
    x = jnp.linspace(-1.0, 1.0, 4)
    want = jax.jvp(lambda x: jnp.sin(jnp.exp(x)), (x,), (x,))
    with pytest.warns(OptimizationFallbackWarning, match="for this call"):
        got = jax.jvp(fast, (x,), (x,))  # the kernel has no jvp: the original runs
    close(got, want)
    # the signature keeps its kernel: plain calls and grad still run it
    report = fast.report(x)
    assert report.fallback is None and len(report) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)
        np.testing.assert_allclose(fast(x), jnp.sin(jnp.exp(x)), rtol=1e-6)
        grad = jax.grad(lambda x: jnp.sum(fast(x)))(x)
    np.testing.assert_allclose(grad, jnp.cos(jnp.exp(x)) * jnp.exp(x), rtol=1e-6)
    assert "custom_vjp_call" in str(jax.make_jaxpr(fast)(x))


def test_the_original_programs_own_error_under_a_transformation_propagates():
    @jax.custom_vjp
    def user_op(x):
        return x * 2.0

    user_op.defvjp(lambda x: (x * 2.0, None), lambda _, g: (g * 2.0,))
    fast = optimize(lambda x: jnp.exp(user_op(x)), rules=[vjp_only_exp])
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(fast, (jnp.ones(3),), (jnp.ones(3),))


# ------------------------------------------------------------------------------ nnx


def test_nnx_grad_and_value_and_grad_through_nnx_optimize():
    from flax import nnx

    from pypm_jax.jax import nnx_optimize

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            return jnp.exp(self.linear(x))

    x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)
    model = Model(nnx.Rngs(0))
    fast = nnx_optimize(nnx.clone(model), rules=[vjp_only_exp])
    want = nnx.grad(lambda m: jnp.sum(m(x)))(model)
    grads = nnx.grad(lambda f: jnp.sum(f(x)))(fast)
    close(grads["module"], want)
    value, grads = nnx.value_and_grad(lambda f: jnp.sum(f(x)))(fast)
    np.testing.assert_allclose(value, jnp.sum(model(x)), rtol=1e-6)
    close(grads["module"], want)
    assert [r.rule for r in fast.report(x)] == ["vjp_only_exp"]
    assert fast.optimized.traces == 1  # the copies nnx.grad makes share one cache
