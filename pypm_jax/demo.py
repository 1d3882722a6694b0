"""The main job (``make demo``): PyPM patterns at work.

Part 1 runs the paper's examples on hand-built terms: patterns in the paper's notation,
matches, and a rewrite with its report. Part 2 (when the JAX bridge is installed) optimizes a
real Flax model — a Hugging Face Flax BERT built from a small config with random weights —
prints the rewrite report, and checks the optimized program against the original.
"""

from __future__ import annotations

import importlib.util
import sys

import pypm_jax as pm
from pypm_jax._calculus import show

# ----------------------------------------------------------------- part 1: the language


@pm.op(op_class="contraction")
def MatMul(x, y):
    return 1


@pm.op(op_class="layout")
def Trans(x):
    return 1


@pm.op
def FusedMMxyT(x, y):
    return 1


@pm.op(op_class="unary_pointwise")
def Relu(x):
    return 1


@pm.op(op_class="unary_pointwise")
def Tanh(x):
    return 1


@pm.pattern
def MMxyT(x, y):
    assert x.shape.rank == 2 and y.shape.rank == 2
    return MatMul(x, Trans(y))


@pm.rule(MMxyT)
def fuse_transpose(x, y):
    assert x.dtype == pm.f32
    return FusedMMxyT(x, y)


@pm.pattern
def UnaryChain(x, f):
    return f(UnaryChain(x, f))


@pm.pattern
def UnaryChain(x, f):  # noqa: F811 — the base case: an alternate
    return f(x)


@pm.rule(UnaryChain)
def collapse_relus(x, f):
    assert f.name == "Relu"
    return Relu(x)


def language_demo() -> None:
    print("== Part 1: the PyPM language (paper examples)")
    for p in (MMxyT, UnaryChain):
        print(f"  {p.name} ≡ {show(p.definition.body)}")
    a = pm.leaf("a", shape=(64, 32), dtype="f32")
    b = pm.leaf("b", shape=(16, 32), dtype="f32")
    t = Relu(Relu(Relu(MatMul(a, Trans(b)))))
    print(f"  term: {t}")
    m = pm.match(UnaryChain, t)
    print(f"  match UnaryChain: x = {m['x']}, f = {m['f']}")
    g = pm.Graph([t])
    result = pm.rewrite(g, [fuse_transpose, collapse_relus])
    print(f"  rewritten: {result.graph.to_terms()[0]}")
    print("  report:")
    for line in str(result.report).splitlines():
        print(f"    {line}")
    blob = pm.serialize([MMxyT, fuse_transpose])
    loaded = pm.deserialize(blob)
    print(f"  portable format: {len(blob)} bytes, reloaded {[x.name for x in loaded]}")


def main() -> int:
    language_demo()
    if importlib.util.find_spec("pypm_jax.jax") is not None:
        from pypm_jax.jax.demo import model_demo

        return model_demo()
    print("\n(the JAX bridge is not installed yet: part 2 skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
