"""What ``pm.optimize``'s first call does once: imports, and traces of the rewritten program."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import optimize, prims, register_impl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Run in a fresh interpreter: the test process has imported Pallas long ago.
_NO_PALLAS_ON_CPU = """
import json, sys
import jax, jax.numpy as jnp
seen = {}
import pypm_jax.jax, pypm_jax.rules, pallas_kernels
seen["import"] = "jax.experimental.pallas" in sys.modules
import pypm_jax as pm

def attention(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)

def dense(x, w, b):
    return jax.nn.relu(x @ w + b)

q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 2, 32))
x, w, b = jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64,))
rewrites = []
for fn, args in ((attention, (q, q, q)), (dense, (x, w, b))):
    fast = pm.optimize(fn)
    jax.block_until_ready(fast(*args))
    rewrites += [r.rule for r in fast.report(*args)]
seen["xla fallback"] = "jax.experimental.pallas" in sys.modules
pallas_kernels.flash_attention(q, q, q, impl="interpret")
seen["interpret"] = "jax.experimental.pallas" in sys.modules
print(json.dumps({"seen": seen, "rewrites": rewrites}))
"""


@pytest.mark.slow
def test_pallas_is_imported_only_when_a_pallas_kernel_is_built():
    env = {k: v for k, v in os.environ.items() if k != "PYPM_KERNEL_IMPL"}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", _NO_PALLAS_ON_CPU],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    ).stdout
    got = json.loads(out.strip().splitlines()[-1])
    # the rules fired, their kernels ran on the plain-XLA fallback, and Pallas stayed out
    assert any(r.startswith("attention") for r in got["rewrites"]), got
    assert any(r.startswith("gemm") for r in got["rewrites"]), got
    assert got["seen"] == {"import": False, "xla fallback": False, "interpret": True}


@pm.pattern
def Exp(x):
    return prims.exp(x)


@pm.op(op_class="kernel")
def CountedExp(x):
    return 1


KERNEL_TRACES: list[tuple[int, ...]] = []
GC_ON_WHILE_TRACED: list[bool] = []


@register_impl(CountedExp)
def _counted_exp(x):
    KERNEL_TRACES.append(tuple(x.shape))
    GC_ON_WHILE_TRACED.append(gc.isenabled())
    return jnp.exp(x)


@pm.rule(Exp)
def counted_exp(x):
    return CountedExp(x)


def test_the_rewritten_program_is_traced_once_per_signature():
    def f(x, y):
        return jnp.exp(x) * y

    KERNEL_TRACES.clear()
    fast = optimize(f, rules=[counted_exp])
    x, y = jnp.arange(6.0).reshape(2, 3) / 6, jnp.ones((2, 3))
    np.testing.assert_allclose(fast(x, y), f(x, y), rtol=1e-6)
    fast(x + 1, y)
    assert KERNEL_TRACES == [(2, 3)]
    assert [r.rule for r in fast.report(x, y)] == ["counted_exp"]
    # a new signature built outside the jit (report first), then called: still one trace
    z = jnp.ones((4,))
    assert len(fast.report(z, z)) == 1
    np.testing.assert_allclose(fast(z, z), f(z, z), rtol=1e-6)
    assert KERNEL_TRACES == [(2, 3), (4,)]
    # the checked program, called as one jit equation, is differentiable; no retrace
    grad = jax.grad(lambda a: fast(a, y).sum())(x)
    np.testing.assert_allclose(grad, jnp.exp(x), rtol=1e-6)
    assert KERNEL_TRACES == [(2, 3), (4,)]


@pm.op(op_class="kernel")
def FailingExp(x):
    return 1


@register_impl(FailingExp)
def _failing_exp(x):
    raise RuntimeError("kernel exploded")


@pm.rule(Exp)
def failing_exp(x):
    return FailingExp(x)


def test_the_collector_is_paused_while_rewriting_and_resumed_after():
    def f(x):
        return jnp.exp(x) + 1

    x = jnp.ones((3,))
    assert gc.isenabled()
    GC_ON_WHILE_TRACED.clear()
    np.testing.assert_allclose(optimize(f, rules=[counted_exp])(x), f(x), rtol=1e-6)
    assert GC_ON_WHILE_TRACED == [False] and gc.isenabled()
    # a rewritten program that fails: the original runs, and the collector is back on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        np.testing.assert_allclose(optimize(f, rules=[failing_exp])(x), f(x), rtol=1e-6)
    assert any("kernel exploded" in str(w.message) for w in caught)
    assert gc.isenabled()
    # a caller that turned it off keeps it off
    gc.disable()
    try:
        GC_ON_WHILE_TRACED.clear()
        optimize(f, rules=[counted_exp])(x)
        assert GC_ON_WHILE_TRACED == [False] and not gc.isenabled()
    finally:
        gc.enable()
