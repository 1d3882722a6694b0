"""Optimized programs on 8 host CPU devices keep ``jax.jit``'s SPMD partitioning.

The cases run in one subprocess (``sharded_cases.py``: the device count is fixed when JAX
starts), with the Pallas kernels in interpret mode. For a linen attention block, a GQA
Llama-style block and Hugging Face FlaxBert, on data, tensor and data x tensor meshes: the
rules fire, outputs and gradients equal ``jax.jit``'s, output and gradient shardings are
``jax.jit``'s, and the compiled forward and gradient programs have no more all-gather /
all-to-all / collective-permute instructions than ``jax.jit``'s. A ``shard_map`` body's
attention and GEMM epilogue are rewritten and run per device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

MODELS = ("mha", "gqa", "bert")
MESHES = ("data", "tensor", "both")
CASES = [f"{m}/{k}" for m in MODELS for k in MESHES]
SCRIPT = Path(__file__).with_name("sharded_cases.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    env["PYPM_KERNEL_IMPL"] = "interpret"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *CASES, "shard_map"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in rows}


@pytest.mark.parametrize("case", CASES)
def test_sharded_program_partitions_like_jit(results: dict[str, dict], case: str) -> None:
    r = results[case]
    assert any(rule.startswith("attention") for rule in r["rules"]), r["rules"]
    assert "gemm_epilogue" in r["rules"]
    assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r
    assert r["out_sharding"] and r["grad_sharding"], r
    for prog in ("", "_grad"):
        for kind, n in r["opt" + prog].items():
            assert n <= r["jit" + prog][kind], (prog or "forward", kind, r)


def test_shard_map_body_is_rewritten(results: dict[str, dict]) -> None:
    r = results["shard_map"]
    assert "gemm_epilogue" in r["rules"] and any(x.startswith("attention") for x in r["rules"])
    assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r
    assert r["out_sharding"]
