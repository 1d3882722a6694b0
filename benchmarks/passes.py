#!/usr/bin/env python3
"""Pattern-rewrite passes side by side on BERT-base: pypm-jax, Inductor, ONNX Script (issue 19).

One model configuration, three compilers' pattern passes, each timed on the graph its own
compiler builds from that model: 12 layers, hidden 768, 12 heads, ffn 3072, batch 1, seq 128
by default, random weights (never downloaded), attention mask all ones, the output the last
hidden state.

* pypm-jax: Hugging Face ``FlaxBertModel`` (built by ``benchmarks/bert_base.py``), traced
  once; each round lifts the jaxpr afresh (not timed) and times
  ``rewrite_nested(prog, default_rules())``. Nodes: the lifted graph's.
* Inductor: Hugging Face ``BertModel`` (PyTorch) with ``attn_implementation="eager"`` (the
  attention spelled out, as in the Flax model, so that Inductor's attention patterns have
  something to fuse), under ``torch.no_grad()``. Each round runs ``torch.compile(...,
  backend="inductor")`` after ``torch._dynamo.reset()`` up to the end of the post-grad passes
  and stops there (no code generation). Timed: every ``PatternMatcherPass.apply`` (the
  pattern passes: the joint-graph patterns, among them the ``_sfdp_*`` attention fusions,
  and the post-grad patterns), and, as context, the whole joint-graph and post-grad pass
  stages. Nodes: the ATen graph that AOT Autograd hands to the joint-graph passes.
* ONNX Script: the same PyTorch model exported with ``torch.onnx.export(..., dynamo=True)``
  (its default optimization on), saved once; each round loads it afresh (not timed) and
  times ``onnxscript.rewriter.ort_fusions.optimize_for_ort``: its rewrite-rule applications
  (every outermost ``RewriteRule(Set).apply_to_model``) and, as context, the whole call
  (with its constant folding and shape inference). Nodes: the exported model's.

One untimed warm-up round, then ``--rounds`` timed rounds, the sides taking turns within
each round (the CPU is shared, and its load drifts), each turn with the garbage collector
off (as ``pm.optimize`` rewrites); figures are medians. µs/node is the median wall time
divided by that side's node count; "CPU µs/node" is the same with the timing thread's CPU
time (``time.thread_time``), which other jobs on a shared machine disturb less. The last
column gives pypm-jax's µs/node over the peer's pattern-pass µs/node, wall (CPU); below 1,
pypm-jax's pass is cheaper per node.

The peers need the ``peers`` extra (``pip install -e '.[models,peers]'``); without it the
program prints the pypm-jax row and says what is missing.

Usage: python benchmarks/passes.py [--rounds 5] [--layers 12] [--batch 1] [--seq 128]
       [--only pypm,inductor,onnx]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("pypm", "inductor", "onnx")
PEER_PACKAGES = {"inductor": ("torch",), "onnx": ("torch", "onnx", "onnxscript")}
HIDDEN, HEADS, FFN, VOCAB = 768, 12, 3072, 30522


@dataclass
class Row:
    name: str
    graph: str
    nodes: int = 0
    rewrites: int = 0
    pattern: list[float] = field(default_factory=list)  # seconds, one per timed round
    pattern_cpu: list[float] = field(default_factory=list)  # the timing thread's CPU seconds
    whole: list[float] = field(default_factory=list)
    whole_label: str = ""
    missing: str = ""  # why the row was not measured


def _median_ms(ts: list[float]) -> float:
    return statistics.median(ts) * 1e3


def _us_per_node(ts: list[float], nodes: int) -> float:
    return statistics.median(ts) * 1e6 / nodes


def _rounds(n: int, sides: list[Callable[[bool], None]]) -> None:
    """One untimed warm-up round, then ``n`` timed ones, the sides taking turns within each
    round (so that the shared machine's load drift reaches all of them). Each turn runs with
    the collector off after a collection, as ``pm.optimize`` runs its rewrite: the heap holds
    all three models, and a collection during one side's pass would scan the others'."""
    for i in range(n + 1):
        for one in sides:
            gc.collect()
            gc.disable()
            try:
                one(i > 0)
            finally:
                gc.enable()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- pypm-jax -------------------------------------------------------------------------------


def setup_pypm(args: argparse.Namespace) -> tuple[Row, Callable[[bool], None]]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import jax
    from bert_base import build

    from pypm_jax.jax import lift, rewrite_nested
    from pypm_jax.rules import default_rules

    fn, inputs = build(args.layers, args.batch, args.seq)
    closed = jax.make_jaxpr(fn)(*inputs)
    rules = default_rules()
    row = Row("pypm-jax", f"lifted jaxpr, {len(rules)} default rules")

    row.whole_label = "the same pass"

    def one(timed: bool) -> None:
        prog = lift(closed)
        nodes = len(prog.graph)  # before the rewrite, which edits the graph in place
        t0, c0 = time.perf_counter(), time.thread_time()
        result = rewrite_nested(prog, rules)
        t, c = time.perf_counter() - t0, time.thread_time() - c0
        if timed:
            row.nodes, row.rewrites = nodes, len(result.report)
            row.pattern.append(t)
            row.pattern_cpu.append(c)
            row.whole.append(t)

    return row, one


# -- the PyTorch model ----------------------------------------------------------------------


def torch_bert(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...]]:
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=args.layers,
        num_attention_heads=HEADS,
        intermediate_size=FFN,
        max_position_embeddings=max(512, args.seq),
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    bert = BertModel(config).eval()

    class LastHidden(torch.nn.Module):  # the output the Flax side returns
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, ids: Any, mask: Any) -> Any:
            return self.bert(ids, attention_mask=mask).last_hidden_state

    ids = torch.randint(0, VOCAB, (args.batch, args.seq))
    mask = torch.ones((args.batch, args.seq), dtype=torch.int64)
    return LastHidden().eval(), (ids, mask)


# -- Inductor -------------------------------------------------------------------------------


class _StopAfterPostGrad(Exception):
    """Raised once the post-grad passes ran: the rest of the compile is not measured."""


def setup_inductor(
    args: argparse.Namespace, model: Any, inputs: tuple[Any, ...]
) -> tuple[Row, Callable[[bool], None]]:
    import torch
    import torch._inductor.compile_fx as compile_fx
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor.pattern_matcher import PatternMatcherPass

    inductor_config.fx_graph_cache = False  # every round compiles
    torch._functorch.config.enable_autograd_cache = False
    state: dict[str, Any] = {"depth": 0, "pattern": 0.0, "pattern_cpu": 0.0}
    apply, joint, post = (
        PatternMatcherPass.apply,
        compile_fx._recursive_joint_graph_passes,
        compile_fx._recursive_post_grad_passes,
    )

    def timed_apply(self: Any, graph: Any) -> Any:
        state["depth"] += 1
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return apply(self, graph)
        finally:
            state["depth"] -= 1
            if state["depth"] == 0:  # an apply inside an apply counts once
                state["pattern"] += time.perf_counter() - t0
                state["pattern_cpu"] += time.thread_time() - c0

    def timed_joint(gm: Any, *a: Any, **k: Any) -> Any:
        state["nodes"] = len(gm.graph.nodes)
        t0 = time.perf_counter()
        out = joint(gm, *a, **k)
        state["joint"] = time.perf_counter() - t0
        return out

    def timed_post(gm: Any, *a: Any, **k: Any) -> None:
        t0 = time.perf_counter()
        post(gm, *a, **k)
        state["post"] = time.perf_counter() - t0
        raise _StopAfterPostGrad

    row = Row("Inductor", "ATen graph at the joint-graph passes")
    row.whole_label = "joint-graph + post-grad passes"

    def compile_to_post_grad() -> None:
        torch._dynamo.reset()
        counters.clear()
        state.update(pattern=0.0, pattern_cpu=0.0, joint=None, post=None)
        try:
            with torch.no_grad():
                torch.compile(model, backend="inductor", fullgraph=True)(*inputs)
        except Exception as e:  # dynamo wraps the backend's exception
            cause: BaseException | None = e
            while cause is not None and not isinstance(cause, _StopAfterPostGrad):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
        else:
            raise RuntimeError("Inductor compiled without running the post-grad passes")

    def one(timed: bool) -> None:
        PatternMatcherPass.apply = timed_apply
        compile_fx._recursive_joint_graph_passes = timed_joint
        compile_fx._recursive_post_grad_passes = timed_post
        try:
            compile_to_post_grad()
        finally:
            PatternMatcherPass.apply = apply
            compile_fx._recursive_joint_graph_passes = joint
            compile_fx._recursive_post_grad_passes = post
        if timed:
            row.nodes = state["nodes"]
            row.rewrites = counters["inductor"]["pattern_matcher_count"]
            row.pattern.append(state["pattern"])
            row.pattern_cpu.append(state["pattern_cpu"])
            row.whole.append(state["joint"] + state["post"])

    return row, one


# -- ONNX Script ----------------------------------------------------------------------------


def setup_onnx(
    args: argparse.Namespace, model: Any, inputs: tuple[Any, ...], tmp: str
) -> tuple[Row, Callable[[bool], None]]:
    import onnx_ir as ir
    import torch
    from onnxscript.rewriter import _rewrite_rule
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    state: dict[str, Any] = {"depth": 0, "rewrite": 0.0, "rewrite_cpu": 0.0, "count": 0}
    originals = {
        cls: cls.apply_to_model for cls in (_rewrite_rule.RewriteRule, _rewrite_rule.RewriteRuleSet)
    }

    def timed(apply_to_model: Callable[..., int]) -> Callable[..., int]:
        def wrapper(*a: Any, **k: Any) -> int:
            state["depth"] += 1
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                count = apply_to_model(*a, **k)
            finally:
                state["depth"] -= 1
            if state["depth"] == 0:  # a rule's apply builds a rule set and applies it
                state["rewrite"] += time.perf_counter() - t0
                state["rewrite_cpu"] += time.thread_time() - c0
                state["count"] += count
            return count

        return wrapper

    row = Row("ONNX Script", "ONNX export (dynamo=True)")
    row.whole_label = "optimize_for_ort"
    path = os.path.join(tmp, "bert.onnx")
    with torch.no_grad():
        torch.onnx.export(model, inputs, dynamo=True, verbose=False).save(path)

    def one(timed_round: bool) -> None:
        graph = ir.load(path)
        nodes = len(graph.graph)
        state.update(rewrite=0.0, rewrite_cpu=0.0, count=0)
        for cls in originals:
            cls.apply_to_model = timed(originals[cls])
        try:
            t0 = time.perf_counter()
            optimize_for_ort(graph)
            t = time.perf_counter() - t0
        finally:
            for cls, original in originals.items():
                cls.apply_to_model = original
        if timed_round:
            row.nodes, row.rewrites = nodes, state["count"]
            row.pattern.append(state["rewrite"])
            row.pattern_cpu.append(state["rewrite_cpu"])
            row.whole.append(t)

    return row, one


# -- report ---------------------------------------------------------------------------------


def _versions(sides: list[str]) -> str:
    from importlib.metadata import PackageNotFoundError, version

    names = ["jax", "jaxlib", "transformers"]
    if "inductor" in sides or "onnx" in sides:
        names += ["torch"]
    if "onnx" in sides:
        names += ["onnxscript", "onnx-ir", "onnx"]
    out = [f"Python {platform.python_version()}"]
    for name in names:
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            out.append(f"{name} not installed")
    return ", ".join(out)


def report(rows: list[Row], args: argparse.Namespace, sides: list[str]) -> None:
    import jax

    print(
        f"BERT-base: {args.layers} layers, hidden {HIDDEN}, {HEADS} heads, ffn {FFN}, "
        f"batch {args.batch}, seq {args.seq}; medians of {args.rounds} timed round(s) after "
        f"one warm-up round"
    )
    torch_on = any(r.name != "pypm-jax" and not r.missing for r in rows)
    print(
        f"Device: {_cpu_name()}, {os.cpu_count()} cores (JAX backend "
        f"{jax.default_backend()}{'; PyTorch on the CPU' if torch_on else ''})"
    )
    print(f"Software: {_versions(sides)}")
    print()
    print(
        "| system | graph | nodes | rewrites | pattern passes, median (runs, ms) | µs/node "
        "| CPU µs/node | whole stage, median | µs/node | pypm-jax µs/node ÷ this, wall (CPU) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    pypm = next((r for r in rows if r.name == "pypm-jax" and not r.missing), None)
    for r in rows:
        if r.missing:
            print(f"| {r.name} | not measured: {r.missing} | | | | | | | | |")
            continue
        per_node = _us_per_node(r.pattern, r.nodes)
        per_node_cpu = _us_per_node(r.pattern_cpu, r.nodes)
        ratio = "—"
        if pypm and r is not pypm:
            ratio = (
                f"{_us_per_node(pypm.pattern, pypm.nodes) / per_node:.2f}x "
                f"({_us_per_node(pypm.pattern_cpu, pypm.nodes) / per_node_cpu:.2f}x)"
            )
        runs = ", ".join(f"{t * 1e3:.0f}" for t in r.pattern)
        print(
            f"| {r.name} | {r.graph} | {r.nodes:,} | {r.rewrites} | "
            f"{_median_ms(r.pattern):.1f} ms ({runs}) | {per_node:.0f} | {per_node_cpu:.0f} | "
            f"{_median_ms(r.whole):.1f} ms ({r.whole_label}) | "
            f"{_us_per_node(r.whole, r.nodes):.0f} | {ratio} |"
        )


def _missing(side: str) -> str:
    needed = list(PEER_PACKAGES.get(side, ())) + ["transformers"]
    absent = [p for p in needed if importlib.util.find_spec(p) is None]
    if not absent:
        return ""
    extras = "models" if side == "pypm" else "models,peers"
    return f"{', '.join(absent)} not installed (pip install -e '.[{extras}]')"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="The peers need the `peers` extra: pip install -e '.[models,peers]'.",
    )
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per side (default 5)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument(
        "--only",
        default=",".join(SIDES),
        help=f"comma-separated sides to run, of {', '.join(SIDES)} (default: all)",
    )
    args = ap.parse_args()
    sides = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in sides if s not in SIDES]
    if unknown:
        ap.error(f"unknown side(s) {', '.join(unknown)}; choose from {', '.join(SIDES)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    # Hugging Face imports TensorFlow where it is installed (the zoo extra has it); no side
    # uses it, and loading it costs seconds and threads.
    os.environ.setdefault("USE_TF", "0")
    names = {"pypm": "pypm-jax", "inductor": "Inductor", "onnx": "ONNX Script"}
    rows, rounds = [], []
    torch_model: tuple[Any, tuple[Any, ...]] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        for side in sides:
            why = _missing(side)
            if why:
                print(f"{names[side]}: not measured: {why}", file=sys.stderr)
                rows.append(Row(names[side], "", missing=why))
                continue
            print(f"{names[side]}: setting up ...", file=sys.stderr, flush=True)
            if side == "pypm":
                row, one = setup_pypm(args)
            else:
                torch_model = torch_model or torch_bert(args)
                if side == "inductor":
                    row, one = setup_inductor(args, *torch_model)
                else:
                    row, one = setup_onnx(args, *torch_model, tmp)
            rows.append(row)
            rounds.append(one)
        print(f"{args.rounds + 1} rounds ...", file=sys.stderr, flush=True)
        _rounds(args.rounds, rounds)
    report(rows, args, sides)


if __name__ == "__main__":
    main()
