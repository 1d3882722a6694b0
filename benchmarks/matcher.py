"""Matcher benchmark: µs per node on synthetic transformer graphs, side by side.

For each size (about 10³ … 10⁶ nodes) one graph of stacked transformer layers is built
(layer norms, Q/K/V projections with bias, attention with a softmax, output projection,
an MLP whose GELU is spelled out, residual adds), with the spellings varied from layer to
layer (``h / 2`` vs ``h * 0.5``, stable vs plain softmax, ``/ √d`` vs ``* 1/√d``) and some
layers in bf16, so that the rule set's alternates and dtype guards all get exercised and
some candidates fail late.

The rule set is what a kernel library would load: attention (with Scale and Softmax
sub-patterns), a GEMM + GELU epilogue (with Half and Gelu sub-patterns), GEMM + bias, and
layer norm, with guards on ranks and dtypes. Its patterns are core-calculus data, written
here the way the frontend emits them (a sub-pattern call is ``μ`` with a match constraint
for a pattern argument).

Measured in one run, on the same list of values, each the median of ``--repeat`` samples
(default 9; 5 for the reference machine), a sample lasting at least 50 ms (small graphs are
matched several times per sample), with the garbage collector off during a sample (as
``timeit`` does):

* ``fast``       — :class:`pypm_jax.engine.fast.Matcher` (root-operator index + compiled code):
  the first matching pattern of each value, with its :class:`~pypm_jax.core.match.Match`;
* ``fast cold``  — the same, one pass per sample, with the CPU caches flushed before it
  (a graph of 10³ nodes otherwise sits in L2 across samples, 10⁶ never does);
* ``not compact`` — ``fast`` on the same graph before :meth:`Graph.compact` laid its
  values' input tuples out in order (as built by ``add_node`` calls, whose temporaries
  scatter them; the lifters compact every graph they build);
* ``reference``  — the paper's machine (:mod:`pypm_jax.semantics.machine`): every pattern tried at
  every value, in order, as a matcher without an index would;
* ``ref+index``  — the reference machine behind the same root-operator index (to show how
  much of the gap is the index and how much the compiled code);
* ``bare loop``  — ``for n in nodes: pass``.

Run from the repository root: ``python benchmarks/matcher.py`` (sizes 1e3 1e4 1e5 1e6;
the reference machine on sizes up to ``--reference-max``, default 1e5: at about 200 µs per
node it would take minutes per run at 1e6; ``--reference-max 1e6`` runs it there too).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pypm_jax.core.calculus import (  # noqa: E402
    EAnd,
    EAttr,
    ECmp,
    EConst,
    ETuple,
    PAlt,
    PApp,
    Param,
    Pattern,
    PatternDef,
    PConst,
    PConstr,
    PExists,
    PGuard,
    PMu,
    PVar,
)
from pypm_jax.core.dtypes import as_dtype  # noqa: E402
from pypm_jax.core.graph import Graph, Value  # noqa: E402
from pypm_jax.core.terms import Operator  # noqa: E402
from pypm_jax.engine.fast import Matcher  # noqa: E402
from pypm_jax.semantics import machine as _machine  # noqa: E402

F32, BF16 = as_dtype("f32"), as_dtype("bf16")


def _op(name: str, n_in: int, attrs: tuple[str, ...] = ()) -> Operator:
    return Operator(name, n_in, attrs=attrs, namespace="bench")


DOT = _op("dot_general", 2, ("dimension_numbers",))
ADD, SUB, MUL, DIV = _op("add", 2), _op("sub", 2), _op("mul", 2), _op("div", 2)
MAX = _op("max", 2)
EXP, ERF, RSQRT = _op("exp", 1), _op("erf", 1), _op("rsqrt", 1)
RSUM, RMAX = _op("reduce_sum", 1, ("axes",)), _op("reduce_max", 1, ("axes",))
TRANSPOSE, RESHAPE = _op("transpose", 1, ("permutation",)), _op("reshape", 1, ("shape",))

# -------------------------------------------------------------------------------- graphs


class _Builder:
    """Adds typed nodes to a graph (types given, so no inference runs)."""

    def __init__(self, g: Graph, dtype: Any):
        self.g, self.dtype = g, dtype

    def __call__(self, op: Operator, ins: Sequence[Value], out: Sequence[int], **attrs: Any):
        return self.g.add_node(op, ins, attrs or None, [(tuple(out), self.dtype)]).outputs[0]

    def const(self, value: float) -> Value:
        return self.g.add_const(value, (), self.dtype)


def layer(
    g: Graph,
    x: Value,
    i: int,
    *,
    gelu: bool = True,
    mixed: bool = True,
    b: int = 2,
    s: int = 128,
    h: int = 4,
    d: int = 64,
) -> Value:
    """One transformer block on ``x`` [b, s, h·d]; spellings vary with ``i``.

    ``gelu=False`` puts a ReLU-like ``max(h, 0)`` in the MLP instead; ``mixed=False`` keeps
    every layer in f32 (else every seventh is bf16)."""
    dtype = BF16 if mixed and i % 7 == 3 else F32
    n = _Builder(g, dtype)
    dm, dff = h * d, 4 * h * d
    bsd, bhsd, bhss = (b, s, dm), (b, h, s, d), (b, h, s, s)
    w = {
        name: g.add_input(f"l{i}.{name}", shape, dtype)
        for name, shape in [
            ("ln1.g", (dm,)), ("ln1.b", (dm,)), ("wq", (dm, dm)), ("bq", (dm,)),
            ("wk", (dm, dm)), ("bk", (dm,)), ("wv", (dm, dm)), ("bv", (dm,)),
            ("wo", (dm, dm)), ("bo", (dm,)), ("ln2.g", (dm,)), ("ln2.b", (dm,)),
            ("w1", (dm, dff)), ("b1", (dff,)), ("w2", (dff, dm)), ("b2", (dm,)),
        ]
    }  # fmt: skip

    def layer_norm(v: Value, gamma: Value, beta: Value) -> Value:
        size = n.const(float(dm))
        mean = n(DIV, [n(RSUM, [v], (b, s, 1), axes=(2,)), size], (b, s, 1))
        xc = n(SUB, [v, mean], bsd)
        var = n(DIV, [n(RSUM, [n(MUL, [xc, xc], bsd)], (b, s, 1), axes=(2,)), size], (b, s, 1))
        rstd = n(RSQRT, [n(ADD, [var, n.const(1e-6)], (b, s, 1))], (b, s, 1))
        return n(ADD, [n(MUL, [n(MUL, [xc, rstd], bsd), gamma], bsd), beta], bsd)

    def dense(v: Value, wname: str, bname: str, out: int) -> Value:
        y = n(DOT, [v, w[wname]], (b, s, out), dimension_numbers=(((2,), (0,)), ((), ())))
        return n(ADD, [y, w[bname]], (b, s, out))

    def heads(v: Value) -> Value:
        r = n(RESHAPE, [v], (b, s, h, d), shape=(b, s, h, d))
        return n(TRANSPOSE, [r], bhsd, permutation=(0, 2, 1, 3))

    y = layer_norm(x, w["ln1.g"], w["ln1.b"])
    q, k, v = (heads(dense(y, f"w{c}", f"b{c}", dm)) for c in "qkv")
    scores = n(DOT, [q, k], bhss, dimension_numbers=(((3,), (3,)), ((0, 1), (0, 1))))
    if i % 2:
        scores = n(DIV, [scores, n.const(8.0)], bhss)
    else:
        scores = n(MUL, [scores, n.const(0.125)], bhss)
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
    hid = dense(y, "w1", "b1", dff)
    bff = (b, s, dff)
    if gelu:
        half = n(DIV, [hid, n.const(2.0)], bff) if i % 2 else n(MUL, [hid, n.const(0.5)], bff)
        if i % 5 == 1:
            scaled = n(MUL, [hid, n.const(0.7071067811865476)], bff)
        else:
            scaled = n(DIV, [hid, n.const(1.4142135623730951)], bff)
        act = n(MUL, [half, n(ADD, [n.const(1.0), n(ERF, [scaled], bff)], bff)], bff)
    else:
        act = n(MAX, [hid, n.const(0.0)], bff)
    return n(ADD, [x, dense(act, "w2", "b2", dm)], bsd)


def transformer(
    n_nodes: int, *, gelu_layers: int | None = None, mixed: bool = True, compact: bool = True
) -> Graph:
    """A stack of layers with about ``n_nodes`` nodes; the first ``gelu_layers`` (default:
    all) use GELU in their MLP, the others a ReLU-like max. Finished with
    :meth:`Graph.compact`, as the JAX and StableHLO lifters finish theirs."""
    g = Graph()
    x = g.add_input("x", (2, 128, 256), F32)
    i = 0
    while len(g) < n_nodes:
        gelu = gelu_layers is None or i < gelu_layers
        x = layer(g, x, i, gelu=gelu, mixed=mixed)
        i += 1
    g.set_outputs([x])
    if compact:
        g.compact()
    return g


# ----------------------------------------------------------------------------- the rules


def call(name: str, params: Sequence[str], args: Sequence[Pattern], body: Pattern) -> Pattern:
    """A sub-pattern call as the frontend emits it: μ over fresh argument variables, each
    constrained to match its argument pattern."""
    names = [f"{name.lower()}_arg{j}" for j in range(len(args))]
    pat: Pattern = PMu(name, tuple(Param(p) for p in params), tuple(names), body)
    for v, a in zip(names, args, strict=True):
        pat = PConstr(pat, v, a)
    for v in reversed(names):
        pat = PExists(v, pat)
    return pat


def v(name: str) -> PVar:
    return PVar(name)


def rank(var: str, r: int) -> ECmp:
    return ECmp("==", EAttr(var, "rank"), EConst(r))


def dtype_in(var: str, *dts: Any) -> ECmp:
    return ECmp("in", EAttr(var, "dtype"), ETuple(tuple(EConst(d) for d in dts)))


def rules() -> list[PatternDef]:
    """Attention, GEMM + GELU, GEMM + bias, layer norm: sub-patterns, alternates, guards."""
    scale_body = PExists(
        "c",
        PGuard(PAlt(PApp(DIV, (v("s"), v("c"))), PApp(MUL, (v("s"), v("c")))), rank("c", 0)),
    )
    softmax_body = PExists(
        "e",
        PConstr(
            PApp(DIV, (v("e"), PApp(RSUM, (v("e"),)))),
            "e",
            PAlt(
                PApp(EXP, (PApp(SUB, (v("z"), PApp(RMAX, (v("z"),)))),)),
                PApp(EXP, (v("z"),)),
            ),
        ),
    )
    scores = call("Scale", ["s"], [PApp(DOT, (v("q"), v("k")))], scale_body)
    attention = PatternDef(
        "Attention",
        (Param("q"), Param("k"), Param("v")),
        PGuard(
            PApp(DOT, (call("Softmax", ["z"], [scores], softmax_body), v("v"))),
            EAnd((rank("q", 4), rank("k", 4), dtype_in("q", F32, BF16))),
        ),
    )

    half_body = PAlt(PApp(DIV, (v("h"), PConst(2.0))), PApp(MUL, (v("h"), PConst(0.5))))
    erf_arg = PAlt(
        PApp(DIV, (v("h"), PConst(1.4142135623730951))),
        PApp(MUL, (v("h"), PConst(0.7071067811865476))),
    )
    gelu_body = PApp(
        MUL,
        (call("Half", ["h"], [v("h")], half_body), PApp(ADD, (PConst(1.0), PApp(ERF, (erf_arg,))))),
    )
    gemm = PApp(ADD, (PApp(DOT, (v("x"), v("w"))), v("b")))
    gemm_gelu = PatternDef(
        "GemmGelu",
        (Param("x"), Param("w"), Param("b")),
        PGuard(
            call("Gelu", ["h"], [gemm], gelu_body),
            EAnd((rank("w", 2), rank("b", 1), dtype_in("x", F32))),
        ),
    )
    gemm_bias = PatternDef(
        "GemmBias",
        (Param("x"), Param("w"), Param("b")),
        PGuard(gemm, EAnd((rank("w", 2), rank("b", 1)))),
    )
    xc = PApp(SUB, (v("x"), PApp(DIV, (PApp(RSUM, (v("x"),)), v("n")))))
    var = PApp(DIV, (PApp(RSUM, (PApp(MUL, (v("xc"), v("xc"))),)), v("n")))
    norm = PApp(MUL, (v("xc"), PApp(RSQRT, (PApp(ADD, (var, v("eps"))),))))
    layer_norm = PatternDef(
        "LayerNorm",
        (Param("x"), Param("gamma"), Param("beta")),
        PExists(
            "xc",
            PGuard(
                PConstr(PApp(ADD, (PApp(MUL, (norm, v("gamma"))), v("beta"))), "xc", xc),
                EAnd((rank("gamma", 1), rank("beta", 1), rank("eps", 0))),
            ),
        ),
    )
    return [attention, gemm_gelu, gemm_bias, layer_norm]


# ----------------------------------------------------------------------------- measuring


def timed(fn: Callable[[], Any], repeat: int, min_time: float = 0.05) -> tuple[float, Any]:
    """Median seconds per call over ``repeat`` samples, and the last result.

    A sample calls ``fn`` often enough to last ``min_time`` (as ``timeit`` autoranges),
    so that small graphs are not timed at the resolution of the scheduler. The garbage
    collector is off during a sample.
    """
    loops, result = 1, None
    if min_time > 0:  # one untimed call to see how many make a sample
        start = time.perf_counter()
        result = fn()
        loops = max(1, int(min_time / max(time.perf_counter() - start, 1e-9)))
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            for _ in range(loops):
                result = fn()
            times.append((time.perf_counter() - start) / loops)
        finally:
            gc.enable()
    return statistics.median(times), result


_EVICT = bytearray(64 << 20)
_FILL = (b"\x5a" * 4096) * (len(_EVICT) // 4096)


def timed_cold(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of single calls, each after 64 MiB of writes have pushed the graph
    out of the CPU caches: a pass over a graph that is not already cache-resident."""
    times = []
    for _ in range(repeat):
        gc.collect()
        _EVICT[:] = _FILL
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return statistics.median(times)


def found_by(scanned: list[tuple[Value, int, Any]]) -> list[tuple[Value, int]]:
    """(value, pattern index) per match: what the matchers' results are compared on (made
    after timing ``Matcher.scan``: the conversion is not the matcher's work)."""
    return [(val, i) for val, i, _ in scanned]


def reference_scan(pdefs: list[PatternDef], values: list[Value]) -> list[tuple[Value, int]]:
    found = []
    for val in values:
        for i, p in enumerate(pdefs):
            if _machine.match_first(p, val) is not None:
                found.append((val, i))
                break
    return found


def reference_indexed_scan(matcher: Matcher, values: list[Value]) -> list[tuple[Value, int]]:
    found = []
    for val in values:
        for i, p, _ in matcher.candidates(val.op):
            if _machine.match_first(p, val) is not None:
                found.append((val, i))
                break
    return found


def bare_loop(nodes: list[Any]) -> int:
    count = 0
    for _ in nodes:
        pass
    return count


def measure(
    size: int, pdefs: list[PatternDef], matcher: Matcher, args: argparse.Namespace
) -> tuple[int, float, float, float | None] | None:
    """Time every matcher on one graph and print its row; None if results differ."""
    g = transformer(size, compact=False)
    values = g.values()
    t_loose, _ = timed(lambda: matcher.scan(values), args.repeat)
    g.compact()  # as the lifters do once a graph is built
    nodes = g.nodes()
    values = [val for node in nodes for val in node.outputs]
    n = len(nodes)
    t_fast, scanned = timed(lambda: matcher.scan(values), args.repeat)
    found = found_by(scanned)
    del scanned
    t_cold = timed_cold(lambda: matcher.scan(values), args.repeat)
    t_loop, _ = timed(lambda: bare_loop(nodes), args.repeat)
    t_ref = t_idx = None
    if size <= args.reference_max:
        rep = args.reference_repeat
        t_ref, ref_found = timed(lambda: reference_scan(pdefs, values), rep)
        t_idx, idx_found = timed(lambda: reference_indexed_scan(matcher, values), rep)
        if ref_found != found or idx_found != found:
            return None

    def us(t: float | None) -> str:
        return "-" if t is None else f"{t / n * 1e6:.3f}"

    ratio = "-" if t_ref is None else f"{t_ref / t_fast:.1f}x"
    print(
        f"{n:>9} {us(t_fast):>9} {us(t_cold):>9} {us(t_loose):>9} {us(t_ref):>10} {us(t_idx):>10}"
        f" {us(t_loop):>10} {ratio:>9} {len(found):>8}",
        flush=True,
    )
    return n, t_fast / n * 1e6, t_cold / n * 1e6, None if t_ref is None else t_ref / t_fast


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=float, nargs="+", default=[1e3, 1e4, 1e5, 1e6])
    ap.add_argument("--repeat", type=int, default=9, help="runs per measurement (median)")
    ap.add_argument("--reference-max", type=float, default=1e5,
                    help="largest size the reference machine runs on")  # fmt: skip
    ap.add_argument("--reference-repeat", type=int, default=5)
    args = ap.parse_args(argv)

    pdefs = rules()
    matcher = Matcher(pdefs)
    backends = ", ".join(
        f"{p.name}: {c.backend}" for p, c in zip(pdefs, matcher.compiled, strict=True)
    )
    print(f"rule set: {backends}")
    print(
        f"python {sys.version.split()[0]}, median of {args.repeat} samples "
        f"({args.reference_repeat} for the reference) of ≥ 50 ms each, gc off while timing"
    )
    header = (
        f"{'nodes':>9} {'fast':>9} {'fast cold':>9} {'not compact':>9} {'reference':>10}"
        f" {'ref+index':>10}"
        f" {'bare loop':>10} {'ref/fast':>9} {'matches':>8}   (µs per node)"
    )
    print(header)
    rows = []
    for size in args.sizes:
        row = measure(int(size), pdefs, matcher, args)
        if row is None:
            print("MISMATCH between the fast engine and the reference machine")
            return 1
        rows.append(row)
    print()
    for label, col in (("warm", 1), ("cold", 2)):
        per_node = [r[col] for r in rows]
        growth = max(per_node) / min(per_node)
        print(
            f"fast ({label}): ≤ 2 µs/node at every size: {max(per_node) <= 2.0} "
            f"(max {max(per_node):.3f}); per-node cost within 1.5x across sizes: "
            f"{growth <= 1.5} (max/min {growth:.2f})"
        )
    ratios = [r[3] for r in rows if r[3] is not None]
    if ratios:
        print(f"≥ 20x faster than the reference: {min(ratios) >= 20} (min {min(ratios):.1f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
