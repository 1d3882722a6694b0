"""Rewrite-pass benchmark: µs per node where one node in nine is rewritten, 10⁴-10⁵ nodes.

The graph is a stack of transformer blocks (layer norms, Q/K/V projections with bias,
rotary embedding of Q and K, attention with a softmax, output projection, a gated MLP
with a ReLU-like ``max``, residual adds), all f32, with spellings varied from block to block
(bias before or after the product, stable or plain softmax, ``/ √d`` or ``* 1/√d``). Two
rules, written with the pattern language (``pypm_jax`` frontend) as a user writes them:

* ``fuse_projection``: a GEMM + bias, with two alternates (``x @ w + b`` and
  ``b + x @ w``) and guards on ranks, dtypes and shapes (square weights: the attention
  projections, not the MLP's) -> one fused node; single use;
* ``pointwise_kernel``: ``f(x)`` where ``f`` is an operator variable with an op-class guard
  (``f.op_class == opclass("unary_pointwise")``: the softmax's ``exp``, the layer norms'
  ``rsqrt``) -> one kernel node naming ``f``. Its root can be any operator, so every node
  is a candidate for it.

Per block: 4 projections and 3 unary pointwise nodes rewritten, 7 rewrites among 62-66
nodes (one in nine on average; the program prints the measured ratio).

Each of ``--repeat`` rounds (default 7) builds a fresh graph of each size (not timed) and
times one :func:`pypm_jax.engine.rewrite.rewrite` of it: the whole pass, matching and
rewriting, with the garbage collector off, by the wall clock and by the thread's CPU time
(the machine's cores are shared). Printed: the medians in µs per node of the graph as
built, the rewrites per node, and the per-node growth per decade of graph size (the
ratio between the largest and the smallest size, scaled to a factor of ten). ``--profile``
instead runs cProfile over one pass on the largest size and prints the top functions.

Run from the repository root: ``python benchmarks/synthetic.py`` (sizes 1e4 3e4 1e5).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import math
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pypm_jax as pm  # noqa: E402
from pypm_jax.core.graph import Graph, Value  # noqa: E402
from pypm_jax.core.terms import Operator  # noqa: E402
from pypm_jax.engine.fast import Matcher  # noqa: E402
from pypm_jax.engine.rewrite import guarded_pattern, rewrite  # noqa: E402

F32 = pm.f32
UNARY = "unary_pointwise"


def _op(name: str, n_in: int, attrs: tuple[str, ...] = (), op_class: str | None = None):
    return Operator(name, n_in, attrs=attrs, op_class=op_class, namespace="synthetic")


DOT = _op("dot_general", 2, ("dimension_numbers",))
ADD, SUB, MUL, DIV, MAX = (_op(n, 2) for n in ("add", "sub", "mul", "div", "max"))
EXP, RSQRT = _op("exp", 1, op_class=UNARY), _op("rsqrt", 1, op_class=UNARY)
RSUM, RMAX = _op("reduce_sum", 1, ("axes",)), _op("reduce_max", 1, ("axes",))
TRANSPOSE, RESHAPE = _op("transpose", 1, ("permutation",)), _op("reshape", 1, ("shape",))
ROLL = _op("roll", 1, ("shift", "axis"))
GEMM_BIAS = _op("gemm_bias", 3, op_class="kernel")
POINTWISE = Operator("pointwise", 1, attrs=("fn",), op_class="kernel", namespace="synthetic")

# ------------------------------------------------------------------------------- the rules


@pm.pattern
def Projection(x, w, b):
    assert w.rank == 2 and b.rank == 1 and w.shape[0] == w.shape[1]
    assert x.dtype == pm.f32 or x.dtype == pm.bf16
    return ADD(DOT(x, w), b)


@pm.pattern
def Projection(x, w, b):  # noqa: F811 (an alternate: the bias first)
    assert w.rank == 2 and b.rank == 1 and w.shape[0] == w.shape[1]
    assert x.dtype == pm.f32 or x.dtype == pm.bf16
    return ADD(b, DOT(x, w))


@pm.rule(Projection, single_use=True)
def fuse_projection(x, w, b):
    return GEMM_BIAS(x, w, b)


@pm.pattern
def Pointwise(x, f):
    assert f.op_class == pm.opclass(UNARY)
    return f(x)


@pm.rule(Pointwise)
def pointwise_kernel(x, f):
    assert x.rank >= 3
    return POINTWISE(x, fn=f.name)


RULES = [fuse_projection, pointwise_kernel]


def rule_defs() -> list[Any]:
    """The core rules (what ``pm.rewrite`` hands the driver)."""
    return [r.definition for r in RULES]


# ------------------------------------------------------------------------------- the graph


def block(g: Graph, x: Value, i: int, *, b: int = 2, s: int = 128, h: int = 4, d: int = 64):
    """One transformer block on ``x`` [b, s, h·d]; spellings vary with ``i``."""

    def n(op: Operator, ins: Sequence[Value], out: Sequence[int], **attrs: Any) -> Value:
        return g.add_node(op, ins, attrs or None, [(tuple(out), F32)]).outputs[0]

    def const(value: float) -> Value:
        return g.add_const(value, (), F32)

    dm, dff = h * d, 4 * h * d
    bsd, bhsd, bhss = (b, s, dm), (b, h, s, d), (b, h, s, s)
    w = {
        name: g.add_input(f"l{i}.{name}", shape, F32)
        for name, shape in [
            ("ln1.g", (dm,)), ("ln1.b", (dm,)), ("wq", (dm, dm)), ("bq", (dm,)),
            ("wk", (dm, dm)), ("bk", (dm,)), ("wv", (dm, dm)), ("bv", (dm,)),
            ("wo", (dm, dm)), ("bo", (dm,)), ("ln2.g", (dm,)), ("ln2.b", (dm,)),
            ("w1", (dm, dff)), ("b1", (dff,)), ("w2", (dff, dm)), ("b2", (dm,)),
            ("w3", (dm, dff)), ("b3", (dff,)), ("cos", (s, dm)), ("sin", (s, dm)),
        ]
    }  # fmt: skip

    def layer_norm(v: Value, gamma: Value, beta: Value) -> Value:
        size = const(float(dm))
        mean = n(DIV, [n(RSUM, [v], (b, s, 1), axes=(2,)), size], (b, s, 1))
        xc = n(SUB, [v, mean], bsd)
        var = n(DIV, [n(RSUM, [n(MUL, [xc, xc], bsd)], (b, s, 1), axes=(2,)), size], (b, s, 1))
        rstd = n(RSQRT, [n(ADD, [var, const(1e-6)], (b, s, 1))], (b, s, 1))
        return n(ADD, [n(MUL, [n(MUL, [xc, rstd], bsd), gamma], bsd), beta], bsd)

    def dense(v: Value, wname: str, bname: str, out: int) -> Value:
        y = n(DOT, [v, w[wname]], (b, s, out), dimension_numbers=(((2,), (0,)), ((), ())))
        if i % 2:
            return n(ADD, [w[bname], y], (b, s, out))
        return n(ADD, [y, w[bname]], (b, s, out))

    def rotary(v: Value) -> Value:
        rolled = n(ROLL, [v], bsd, shift=dm // 2, axis=2)
        return n(ADD, [n(MUL, [v, w["cos"]], bsd), n(MUL, [rolled, w["sin"]], bsd)], bsd)

    def heads(v: Value) -> Value:
        r = n(RESHAPE, [v], (b, s, h, d), shape=(b, s, h, d))
        return n(TRANSPOSE, [r], bhsd, permutation=(0, 2, 1, 3))

    y = layer_norm(x, w["ln1.g"], w["ln1.b"])
    q = heads(rotary(dense(y, "wq", "bq", dm)))
    k = heads(rotary(dense(y, "wk", "bk", dm)))
    v = heads(dense(y, "wv", "bv", dm))
    scores = n(DOT, [q, k], bhss, dimension_numbers=(((3,), (3,)), ((0, 1), (0, 1))))
    if i % 2:
        scores = n(DIV, [scores, const(8.0)], bhss)
    else:
        scores = n(MUL, [scores, const(0.125)], bhss)
    if i % 3:
        shifted = n(SUB, [scores, n(RMAX, [scores], (b, h, s, 1), axes=(3,))], bhss)
        e = n(EXP, [shifted], bhss)
    else:
        e = n(EXP, [scores], bhss)
    p = n(DIV, [e, n(RSUM, [e], (b, h, s, 1), axes=(3,))], bhss)
    o = n(DOT, [p, v], bhsd, dimension_numbers=(((3,), (2,)), ((0, 1), (0, 1))))
    o = n(RESHAPE, [n(TRANSPOSE, [o], (b, s, h, d), permutation=(0, 2, 1, 3))], bsd, shape=bsd)
    x = n(ADD, [x, dense(o, "wo", "bo", dm)], bsd)
    y = layer_norm(x, w["ln2.g"], w["ln2.b"])
    act = n(MAX, [dense(y, "w1", "b1", dff), const(0.0)], (b, s, dff))
    act = n(MUL, [act, dense(y, "w3", "b3", dff)], (b, s, dff))  # a gated MLP
    return n(ADD, [x, dense(act, "w2", "b2", dm)], bsd)


def transformer(n_nodes: int) -> Graph:
    """Blocks until the graph has at least ``n_nodes`` nodes, compacted as lifters do."""
    g = Graph()
    x = g.add_input("x", (2, 128, 256), F32)
    i = 0
    while len(g) < n_nodes:
        x = block(g, x, i)
        i += 1
    g.set_outputs([x])
    g.compact()
    return g


# ----------------------------------------------------------------------------- measuring


def once(g: Graph, rules: list[Any]) -> tuple[float, float, Any]:
    """Wall-clock and thread CPU seconds of one rewrite pass (gc off), and its result."""
    gc.collect()
    gc.disable()
    try:
        w0, c0 = time.perf_counter(), time.thread_time()
        result = rewrite(g, rules)
        c1, w1 = time.thread_time(), time.perf_counter()
    finally:
        gc.enable()
    return w1 - w0, c1 - c0, result


def growth_per_decade(sizes: list[int], per_node: list[float]) -> float:
    """Per-node cost growth for a tenfold size, from the smallest and the largest size."""
    decades = math.log10(sizes[-1] / sizes[0])
    return (per_node[-1] / per_node[0]) ** (1 / decades) if decades > 0 else 1.0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e4, 3e4, 1e5])
    ap.add_argument("--repeat", type=int, default=7, help="rounds (median)")
    ap.add_argument("--profile", action="store_true", help="cProfile one pass, largest size")
    args = ap.parse_args(argv)
    sizes = sorted(int(s) for s in args.sizes)
    rules = rule_defs()
    Matcher([guarded_pattern(r) for r in rules])  # what rewrite() compiles, compiled now

    if args.profile:
        g = transformer(sizes[-1])
        prof = cProfile.Profile()
        gc.collect()
        gc.disable()  # (as when timing)
        prof.enable()
        result = rewrite(g, rules)
        prof.disable()
        gc.enable()
        print(f"{sizes[-1]} nodes, {len(result.report)} rewrites")
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return 0

    wall: dict[int, list[float]] = {s: [] for s in sizes}
    cpu: dict[int, list[float]] = {s: [] for s in sizes}
    nodes: dict[int, int] = {}
    counts: dict[int, dict[str, int]] = {}
    for _ in range(args.repeat):  # sizes interleaved: each round sees the same load
        for size in sizes:
            g = transformer(size)
            nodes[size] = len(g)
            t_wall, t_cpu, result = once(g, rules)
            wall[size].append(t_wall)
            cpu[size].append(t_cpu)
            counts[size] = result.report.counts()
            del g, result
    print(
        f"python {sys.version.split()[0]}; median of {args.repeat} rounds; whole pass "
        "(match + rewrite), gc off"
    )
    print(f"{'nodes':>9} {'rewrites':>9} {'nodes/rewrite':>13} {'wall µs/node':>12} "
          f"{'CPU µs/node':>12}")  # fmt: skip
    per_node: dict[str, list[float]] = {"wall": [], "cpu": []}
    for size in sizes:
        n = nodes[size]
        fired = sum(counts[size].values())
        w = statistics.median(wall[size]) / n * 1e6
        c = statistics.median(cpu[size]) / n * 1e6
        per_node["wall"].append(w)
        per_node["cpu"].append(c)
        print(f"{n:>9} {fired:>9} {n / fired:>13.2f} {w:>12.3f} {c:>12.3f}")
    print(f"rewrites by rule (largest graph): {counts[sizes[-1]]}")
    n_sizes = [nodes[s] for s in sizes]
    for clock, col in per_node.items():
        grow = growth_per_decade(n_sizes, col)
        print(
            f"{clock}: ≤ 2 µs/node at every size: {max(col) <= 2.0} (max {max(col):.3f}); "
            f"per-node growth per decade {grow:.2f}x (≤ 1.2x: {grow <= 1.2})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
