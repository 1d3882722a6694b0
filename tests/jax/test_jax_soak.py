"""Soak: one optimized function called from 8 threads over 500 call signatures.

Every signature is traced, lifted, rewritten and lowered once (the per-signature cache is
shared by the threads), the user's rule fires in each, and every result is the program's (computed in NumPy).
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import prims, register_impl
from pypm_jax.rules import default_rules

SHAPES = 500
THREADS = 8


@pm.pattern
def ScaledExp(x):
    return prims.exp(prims.div(x, 8.0))


@pm.op(op_class="kernel")
def SoakScaledExp(x):
    return 1


register_impl(SoakScaledExp, lambda x: jnp.exp(x * 0.125))


@pm.rule(ScaledExp)
def soak_scaled_exp(x):
    return SoakScaledExp(x)


def program(x):
    return jnp.tanh(jnp.exp(x / 8.0)).sum(axis=-1)


@pytest.mark.slow
def test_eight_threads_five_hundred_shapes():
    fast = pm.optimize(program, rules=[*default_rules(), soak_scaled_exp])
    shapes = [(1 + i % 25, 1 + i // 25) for i in range(SHAPES)]  # 500 distinct signatures
    order = shapes * 2  # each signature twice: the second call is a cache hit
    rng = np.random.default_rng(0)
    rng.shuffle(order)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def call(shape):
        x = np.linspace(-2.0, 2.0, shape[0] * shape[1], dtype=np.float32).reshape(shape)
        try:
            got = np.asarray(fast(x))
            want = np.tanh(np.exp(x / 8.0)).sum(axis=-1)  # the program, in NumPy
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
            report = fast.report(x)
            assert report.fallback is None, report.fallback
            assert [r.rule for r in report] == ["soak_scaled_exp"]
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
            with lock:
                errors.append(exc)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(call, order))
    assert not errors, f"{len(errors)} failures, first: {errors[0]!r}"
    assert fast.traces == SHAPES  # one trace per signature, though 8 threads race for it
