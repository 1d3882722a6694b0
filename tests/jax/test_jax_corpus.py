"""Lifting then lowering with no rules is the identity, on a corpus of real models.

For every model: the optimized program (no rules) computes the original's outputs, and
``jax.grad`` of a scalar loss through it matches the original's gradient.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pypm_jax.jax import optimize
from pypm_jax.jax.report import OptimizationFallbackWarning
from pypm_testing.corpus import ALL_MODELS, HF_MODELS, MORE_HF_MODELS, has_transformers


def _model(name):
    if (name in HF_MODELS or name in MORE_HF_MODELS) and not has_transformers():
        pytest.skip("transformers is not installed")
    return {**ALL_MODELS, **MORE_HF_MODELS}[name]()


def _loss(out):
    leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
    return sum(jnp.mean(x.astype(jnp.float32) ** 2) for x in leaves)


def _assert_close(a, b, rtol, atol, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, what
        np.testing.assert_allclose(
            np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=rtol, atol=atol, err_msg=what
        )


# Hugging Face models, scans and NNX attention take 5-20 s each: `make test` runs them, `make test-fast`
# the other Flax models.
SLOW = {*HF_MODELS, *MORE_HF_MODELS, "linen_scan", "linen_scan_remat", "nnx_mha"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n
        for n in [*ALL_MODELS, *MORE_HF_MODELS]
    ],
)
def test_lift_lower_is_identity(name):
    apply, inputs, desc = _model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)
        fast = optimize(apply, rules=[])
        got = fast(*inputs)
    report = fast.report(*inputs)
    assert list(report) == [] and report.fallback is None
    assert fast.traces == 1

    params, rest = inputs[0], inputs[1:]

    def loss(f):
        def value(p):
            out = f(p, *rest)
            return _loss(out), out

        return jax.jit(jax.value_and_grad(value, has_aux=True))

    # the original's outputs come from its gradient program (one compile for both)
    (_, want), g_want = loss(apply)(params)
    leaves = [x for x in jax.tree.leaves(want) if x.size > 1]
    assert all(float(jnp.std(x)) > 0 for x in leaves), "degenerate model output"
    _assert_close(want, got, 1e-6, 1e-6, f"{desc}: outputs")
    (_, got_under_grad), g_got = loss(fast)(params)
    _assert_close(want, got_under_grad, 1e-6, 1e-6, f"{desc}: outputs under grad")
    _assert_close(g_want, g_got, 1e-5, 1e-6, f"{desc}: gradients")
