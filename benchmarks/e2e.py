#!/usr/bin/env python3
"""End-to-end: ``pm.optimize`` (default rules) vs ``jax.jit`` on the model corpus.

For each model of ``tests/jax/corpus.py`` at the chosen size it reports:

* which rules fired (counts) and whether the optimized program fell back;
* the one-time cost of optimizing: tracing + lifting + rewriting + lowering (``optimize``)
  and the first call (compile), beside ``jax.jit``'s first call;
* steady-state time per forward call (median of samples after warm-up, the two programs
  interleaved round-robin so load drift hits both), and the speedup;
* the largest absolute difference between the two programs' outputs.

Usage:  python benchmarks/e2e.py [--size small|cpu|gpu] [--only bert,gpt2] [--samples N]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # the test helpers (pypm_testing)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import pypm_jax as pm  # noqa: E402
from pypm_jax.jax import OptimizationFallbackWarning  # noqa: E402
from pypm_testing.corpus import ALL_MODELS, SMALL, Size  # noqa: E402

SIZES = {
    "small": SMALL,
    "cpu": Size(batch=2, seq=128, hidden=128, heads=4, ffn=512, layers=2),
    "gpu": Size(batch=8, seq=512, hidden=768, heads=12, ffn=3072, layers=4, dtype="bfloat16"),
}


def _block(x: Any) -> Any:
    return jax.block_until_ready(x)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = _block(fn())
    return out, time.perf_counter() - t0


def _loop(fn: Callable[[], Any], n: int) -> float:
    """Seconds for ``n`` back-to-back calls (blocking on the last)."""
    t0 = time.perf_counter()
    out = None
    for _ in range(n):
        out = fn()
    _block(out)
    return time.perf_counter() - t0


def bench_pair(a: Callable[[], Any], b: Callable[[], Any], samples: int) -> tuple[float, float]:
    """Median seconds per call of ``a`` and ``b``, interleaved; calls per sample adapt."""
    inner = 1
    while _loop(a, inner) < 20e-3 and inner < 256:
        inner *= 2
    ta, tb = [], []
    for _ in range(samples):
        ta.append(_loop(a, inner) / inner)
        tb.append(_loop(b, inner) / inner)
    return statistics.median(ta), statistics.median(tb)


def max_abs_diff(x: Any, y: Any) -> float:
    worst = 0.0
    for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a64.size:
            worst = max(worst, float(np.max(np.abs(a64 - b64))))
    return worst


def run_model(name: str, size: Size, samples: int) -> dict[str, Any]:
    apply, inputs, desc = ALL_MODELS[name](size=size)
    jitted = jax.jit(apply)
    want, t_jit_first = _timed(lambda: jitted(*inputs))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", OptimizationFallbackWarning)
        t0 = time.perf_counter()
        fast = pm.optimize(apply)
        report = fast.report(*inputs)  # trace + lift + rewrite + lower
        t_optimize = time.perf_counter() - t0
        got, t_fast_first = _timed(lambda: fast(*inputs))
    t_jit, t_fast = bench_pair(lambda: jitted(*inputs), lambda: fast(*inputs), samples)
    return {
        "model": name,
        "description": desc,
        "rewrites": report.counts(),
        "fallback": report.fallback,
        "warnings": [str(w.message) for w in caught],
        "optimize_s": t_optimize,
        "first_call_jit_s": t_jit_first,
        "first_call_optimized_s": t_fast_first,
        "jit_ms": t_jit * 1e3,
        "optimized_ms": t_fast * 1e3,
        "speedup": t_jit / t_fast if t_fast else float("nan"),
        "max_abs_diff": max_abs_diff(want, got),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default=None)
    ap.add_argument("--only", default="", help="comma-separated model names")
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    size = SIZES[args.size or ("gpu" if on_gpu else "small")]
    names = [n for n in ALL_MODELS if not args.only or n in args.only.split(",")]
    print(f"backend {jax.default_backend()} ({jax.devices()[0].device_kind}), size {size}")
    rows = []
    for name in names:
        try:
            row = run_model(name, size, args.samples)
        except ImportError as exc:  # transformers missing: say so, go on
            print(f"{name}: skipped ({exc})")
            continue
        rows.append(row)
        fired = ", ".join(f"{k}×{v}" for k, v in row["rewrites"].items()) or "-"
        print(
            f"{name:18s} jit {row['jit_ms']:9.3f} ms  optimized {row['optimized_ms']:9.3f} ms  "
            f"x{row['speedup']:5.2f}  optimize {row['optimize_s']:5.2f}s  "
            f"diff {row['max_abs_diff']:.2e}  rules: {fired}"
            + (f"  FELL BACK: {row['fallback']}" if row["fallback"] else "")
        )
    if args.json:
        meta = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind,
                "size": size.__dict__, "jax": jax.__version__}  # fmt: skip
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
