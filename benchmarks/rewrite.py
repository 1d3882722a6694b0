"""Rewrite benchmark: rewriting a 10⁵-node graph where 1,000 rewrites fire vs matching alone.

The graph is the synthetic transformer of ``benchmarks/matcher.py`` (every layer in f32),
with GELU in the MLP of exactly 1,000 layers and a ReLU-like ``max`` in the others. The
rules are the benchmark's four patterns with a replacement each; only the GEMM + GELU
rule's guard passes on this model (the others are written for shapes or dtypes it does not
have: bf16 attention, 2-D GEMMs, bf16 layer norm), so exactly 1,000 rewrites fire — each
replacing a dot, a bias add and the spelled-out GELU by one fused node.

* ``matching alone``: :meth:`pypm_jax._fast.Matcher.scan` of the graph with the four patterns
  (the first match of each value);
* ``rewriting``: :func:`pypm_jax._rewrite.rewrite` of a fresh copy of the graph (same sweep,
  plus the rule guards, the 1,000 rewrites, dead-code removal and the report).

Each of ``--repeat`` rounds (default 11) builds a fresh graph (not timed), scans it, then
rewrites it, so both measurements see the same machine load; printed are the medians and
the median of the per-round ratios. The garbage collector is off while timing. Run: ``python benchmarks/rewrite.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matcher as bench  # noqa: E402

from pypm_jax._calculus import (  # noqa: E402
    EAttr,
    ECmp,
    EConst,
    RApp,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax._fast import Matcher  # noqa: E402
from pypm_jax._rewrite import rewrite  # noqa: E402
from pypm_jax._terms import Operator  # noqa: E402

FUSED_ATTENTION = Operator("fused_attention", 3, namespace="bench")
FUSED_GEMM_GELU = Operator("fused_gemm_gelu", 3, namespace="bench")
GEMM2D_BIAS = Operator("gemm2d_bias", 3, namespace="bench")
FUSED_LAYER_NORM = Operator("fused_layer_norm", 3, namespace="bench")


def rules() -> list[RuleDef]:
    attention, gemm_gelu, gemm_bias, layer_norm = bench.rules()

    def one(name, pdef, guard, op, params):
        branch = RuleBranch(guard, RApp(op, tuple(RVar(p) for p in params)))
        return RuleDef(name, pdef, (branch,), single_use=True)

    def dtype_is(var, dt):
        return ECmp("==", EAttr(var, "dtype"), EConst(dt))

    return [
        one("attention_bf16", attention, dtype_is("q", bench.BF16), FUSED_ATTENTION, "qkv"),
        one("gemm_gelu", gemm_gelu, EConst(True), FUSED_GEMM_GELU, "xwb"),
        one("gemm2d_bias", gemm_bias, bench.rank("x", 2), GEMM2D_BIAS, "xwb"),
        one("layer_norm_bf16", layer_norm, dtype_is("x", bench.BF16), FUSED_LAYER_NORM,
            ("x", "gamma", "beta")),
    ]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=float, default=1e5)
    ap.add_argument("--rewrites", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=11)
    args = ap.parse_args(argv)

    def build():
        return bench.transformer(int(args.nodes), gelu_layers=args.rewrites, mixed=False)

    rs = rules()
    matcher = Matcher([r.pattern for r in rs])
    t_match, t_rewrite, ratios, report, n, n_found = [], [], [], None, 0, 0
    for _ in range(args.repeat):  # interleaved, so both see the same machine load
        g = build()
        n = len(g)
        t_m, found = bench.timed(lambda: matcher.scan(g), 1, min_time=0)  # noqa: B023
        t_r, result = bench.timed(lambda: rewrite(g, rs), 1, min_time=0)  # noqa: B023
        t_match.append(t_m)
        t_rewrite.append(t_r)
        ratios.append(t_r / t_m)
        report, n_found = result.report, len(found)
    t_match_med = statistics.median(t_match)
    t_rewrite_med = statistics.median(t_rewrite)
    ratio = statistics.median(ratios)
    fired = report.counts() if report is not None else {}
    print(f"graph: {n} nodes; {n_found} values matched; rewrites fired: {fired}")
    print(f"matching alone: {t_match_med * 1e3:8.1f} ms  ({t_match_med / n * 1e6:.3f} µs/node)")
    print(f"rewriting:      {t_rewrite_med * 1e3:8.1f} ms  ({t_rewrite_med / n * 1e6:.3f} µs/node)")
    print(
        f"rewriting / matching = {ratio:.2f}x (median of {args.repeat} paired runs; "
        f"range {min(ratios):.2f}-{max(ratios):.2f})  target ≤ 2x: {ratio <= 2.0}"
    )
    if sum(fired.values()) != args.rewrites:
        print(f"expected {args.rewrites} rewrites")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
