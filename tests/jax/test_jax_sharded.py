"""Optimized programs on 8 host CPU devices keep ``jax.jit``'s SPMD partitioning.

The cases run in one subprocess (``sharded_cases.py``: the device count is fixed when JAX
starts). For a linen attention block, a GQA Llama-style block, Hugging Face FlaxBert,
Hugging Face FlaxLlama (2 kv heads: fewer than the model axis) and attnax's decoder (living
model code, when the ``zoo`` extra is installed), on data, tensor and data x tensor meshes,
and for the linen block with and without a causal mask, the GQA block and a Gemma-2-style
sliding-window block with the sequence split across devices, under Shardy (and some cases
under GSPMD): the rules fire, outputs and gradients equal ``jax.jit``'s, output and
gradient shardings are ``jax.jit``'s, and the compiled forward and gradient programs have
no more all-gather / all-to-all / collective-permute instructions than ``jax.jit``'s. A
``shard_map`` body's attention and GEMM epilogue are rewritten and run per device;
``jax.vmap`` of an optimized function splits the vmapped kernel along the mapped axis.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pypm_testing import zoo

pytestmark = pytest.mark.slow

MODELS = ("mha", "gqa", "bert", "attnax")
# The linen and GQA blocks on the data x tensor mesh run the Pallas kernels in the
# interpreter; the other cases run the same partitioned calls around the kernels' plain-JAX
# reference (half the compile time).
CASES = [
    "mha/both",
    "gqa/both",
    "bert/both/xla",
    "attnax/both/xla",
    *(f"{m}/{k}/xla" for m in MODELS for k in ("data", "tensor")),
    "mha/both/gspmd/xla",
    # Hugging Face FlaxLlama: 8 query heads over 2 kv heads, fewer than the model axis (4)
    "llama/tensor/xla",
    "llama/both/xla",
    "llama/both/gspmd/xla",
    # the sequence split 4 ways (parameters replicated): the kernels split the queries, each
    # device's block at its offset; the interpreted ones skip key blocks by position
    "mha/seq/xla",
    "mha_causal/seq",
    "mha_causal/seq/gspmd/xla",
    "gqa/seq/xla",
    "gqa/seq/gspmd/xla",
    "window/seq",
]
SCRIPT = Path(__file__).with_name("sharded_cases.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    cases = [c for c in CASES if zoo.has("attnax") or not c.startswith("attnax")]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *cases, "shard_map", "shard_map/vma/xla", "vmap/xla",
         "counter"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in rows}


def test_the_collective_count_sees_an_all_gather(results: dict[str, dict]) -> None:
    assert results["counter"]["gather"]["all-gather"] >= 1


@pytest.mark.parametrize("case", CASES)
def test_sharded_program_partitions_like_jit(results: dict[str, dict], case: str) -> None:
    if case.startswith("attnax") and not zoo.has("attnax"):
        pytest.skip("attnax is not installed (make zoo)")
    r = results[case]
    assert any(rule.startswith("attention") for rule in r["rules"]), r["rules"]
    assert any(rule.startswith("gemm_epilogue") for rule in r["rules"]), r["rules"]
    assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r
    assert r["out_sharding"] and r["grad_sharding"], r
    for prog in ("", "_grad"):
        for kind, n in r["opt" + prog].items():
            assert n <= r["jit" + prog][kind], (prog or "forward", kind, r)


@pytest.mark.parametrize("case", ["shard_map", "shard_map/vma/xla"])
def test_shard_map_body_is_rewritten(results: dict[str, dict], case: str) -> None:
    """With ``check_vma=False`` (kernels in the Pallas interpreter) and ``check_vma=True``
    (shard_map's default; the kernels' plain-JAX reference: JAX's Pallas interpreter cannot
    evaluate a kernel whose loops carry values that vary across the mesh, see
    ``tests/pallas_kernels/test_kernels_vma.py`` for the kernels' own types)."""
    r = results[case]
    assert "gemm_epilogue" in r["rules"] and any(x.startswith("attention") for x in r["rules"])
    assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r
    assert r["out_sharding"]


def test_vmap_of_a_partitioned_kernel_splits_the_mapped_axis(results: dict[str, dict]) -> None:
    r = results["vmap"]
    assert any(x.startswith("attention") for x in r["rules"])
    assert r["out_rel"] < 1e-5 and r["grad_rel"] < 1e-5, r
    assert r["out_sharding"]
    assert all(n <= r["jit"][kind] for kind, n in r["opt"].items()), r
