"""A sharded training step on 8 host CPU devices (loss, ``jax.value_and_grad`` through the
optimized forward, an optax update (SGD with momentum), donated state) under ``pm.optimize(...,
donate_argnums=0, in_shardings=..., out_shardings=...)`` matches ``jax.jit``'s step for 3
steps, with jit's output shardings; docs/JAX.md's multi-process example runs as two
processes (``jax.distributed`` on localhost, two CPU devices each).

``XLA_FLAGS=--xla_force_host_platform_device_count=...`` must be set before JAX starts, so
each program runs in subprocesses of its own."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STEP = r"""
import json
import re
import socket
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P
import pypm_jax as pm

assert jax.device_count() == 8
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=128, name="attn")(x)
        return nn.Dense(32, name="out")(nn.gelu(y))


model = Block()
x = jax.random.normal(jax.random.PRNGKey(1), (4, 8, 32))
y = jax.random.normal(jax.random.PRNGKey(2), (4, 8, 32))
params = model.init(jax.random.PRNGKey(0), x)


def spec(leaf):  # heads and columns on "model" where they divide, else replicated
    if leaf.ndim >= 2 and leaf.shape[1] % 4 == 0:
        return NamedSharding(mesh, P(None, "model"))
    return NamedSharding(mesh, P())


tx = optax.sgd(0.05, momentum=0.9)
param_sh = jax.tree.map(spec, params)
state_sh = (param_sh, jax.tree.map(spec, tx.init(params)))
batch_sh = NamedSharding(mesh, P("data"))


# the forward is optimized on its own: inside the step, its probabilities are also residuals
# of the backward pass, and the single-use attention rules leave such sites alone
forward = pm.optimize(model.apply)


def train_step(state, x, y, apply):
    params, opt_state = state
    loss_fn = lambda p: jnp.mean((apply(p, x) - y) ** 2)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


options = dict(
    donate_argnums=0, in_shardings=(state_sh, batch_sh, batch_sh), out_shardings=(state_sh, None)
)
fast = pm.optimize(lambda state, x, y: train_step(state, x, y, forward), **options)
ref = jax.jit(lambda state, x, y: train_step(state, x, y, model.apply), **options)


def fresh():  # from host copies: the steps donate (delete) the state they are given
    state = jax.tree.map(np.asarray, (params, tx.init(params)))
    return jax.device_put(state, state_sh)


xs, ys = jax.device_put((x, y), (batch_sh, batch_sh))
counts = forward.report(params, xs).counts()
results = {}
for name, step in (("fast", fast), ("jit", ref)):
    state, losses, donated = fresh(), [], []
    for _ in range(3):
        before = jax.tree.leaves(state)
        state, loss = step(state, xs, ys)
        donated.append(all(b.is_deleted() for b in before))
        losses.append(float(loss))
    results[name] = (state, losses, donated)

(s_fast, l_fast, d_fast), (s_jit, l_jit, d_jit) = results["fast"], results["jit"]
diff = max(
    float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-12))
    for a, b in zip(jax.tree.leaves(s_fast), jax.tree.leaves(s_jit))
)
shardings_equal = all(
    a.sharding.is_equivalent_to(b.sharding, a.ndim)
    for a, b in zip(jax.tree.leaves(s_fast), jax.tree.leaves(s_jit))
)
print("RESULT " + json.dumps(dict(
    counts=counts, losses_fast=l_fast, losses_jit=l_jit, donated_fast=d_fast, donated_jit=d_jit,
    state_rel_diff=diff, shardings_equal=shardings_equal,
    model_sharded=sum("model" in str(a.sharding.spec) for a in jax.tree.leaves(s_fast)),
)))
"""


@pytest.mark.slow
def test_sharded_training_step_with_donation_matches_jit():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    env.pop("PYPM_KERNEL_IMPL", None)
    run = subprocess.run(
        [sys.executable, "-c", STEP], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    r = json.loads(line[len("RESULT ") :])
    assert r["counts"].get("attention") == 1, r["counts"]  # the forward is rewritten
    assert r["donated_fast"] == r["donated_jit"] == [True, True, True]
    for got, want in zip(r["losses_fast"], r["losses_jit"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (r["losses_fast"], r["losses_jit"])
    assert r["state_rel_diff"] <= 1e-5, r["state_rel_diff"]
    assert r["shardings_equal"] and r["model_sharded"] >= 4  # q/k/v/out kernels and more


def _many_processes_block() -> str:
    """The python block of docs/JAX.md's "Many processes" section."""
    with open(os.path.join(ROOT, "docs", "JAX.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text[text.index("### Many processes") :]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


@pytest.mark.slow
def test_the_many_processes_example_runs_as_two_processes():
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = _many_processes_block() + (
        "\nverified = all(e.verified for e in scores._cache.values())"
        "\nprint('RESULT', jax.process_count(), jax.device_count(), gathered.shape, verified)\n"
    )
    procs = []
    for pid in range(2):
        env = dict(os.environ)
        env.update(
            XLA_FLAGS=(
                env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
            ).strip(),
            PYTHONPATH=ROOT,
            JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            NUM_PROCESSES="2",
            PROCESS_ID=str(pid),
        )
        env.pop("PYPM_KERNEL_IMPL", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )
        )  # fmt: skip
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err[-4000:]
        # 2 processes, 4 devices, every process sees the global result (8 rows) and
        # verified it (an output spread over both processes, gathered to compare)
        assert "RESULT 2 4 (8, 4) True" in out, out
