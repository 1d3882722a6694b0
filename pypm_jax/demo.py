"""The main job (``make demo``): PyPM patterns at work.

Part 1 runs the paper's examples on hand-built terms: patterns in the paper's notation,
matches, and a rewrite with its report. Part 2 (when the JAX bridge is installed) optimizes a
real Flax model — a Hugging Face Flax BERT built from a small config with random weights —
prints the rewrite report, and checks the optimized program against the original.
"""

from __future__ import annotations

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


def _has_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def model_demo() -> int:
    """Optimize a Hugging Face Flax BERT (small config, random weights) and check it."""
    import os
    import time

    # On CPU, run the real Pallas kernels in interpret mode so the check exercises them.
    os.environ.setdefault("PYPM_KERNEL_IMPL", "auto" if _has_gpu() else "interpret")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from transformers import BertConfig, FlaxBertModel

    print("\n== Part 2: pm.optimize on a Hugging Face Flax BERT (random weights)")
    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        hidden_act="gelu_new",
    )
    model = FlaxBertModel(config, seed=0)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, config.vocab_size)
    mask = jnp.ones((2, 32), jnp.int32).at[1, 24:].set(0)  # a padded second sequence

    def bert(params, ids, mask):
        return model(ids, attention_mask=mask, params=params).last_hidden_state

    print(
        f"  model: BERT, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads; batch 2, seq 32 (one padded), backend "
        f"{jax.default_backend()}, kernels: {os.environ['PYPM_KERNEL_IMPL']}"
    )
    fast = pm.optimize(bert)
    t0 = time.perf_counter()
    report = fast.report(model.params, ids, mask)
    print(f"  lift + rewrite + lower: {time.perf_counter() - t0:.2f} s")
    print("  rewrite report:")
    for line in str(report).splitlines():
        print(f"    {line}")
    expected = jax.jit(bert)(model.params, ids, mask)
    got = fast(model.params, ids, mask)
    err = float(jnp.max(jnp.abs(expected - got)))
    scale = float(jnp.max(jnp.abs(expected)))
    kinds = {}
    for r in report:
        kind = (
            "attention"
            if r.rule.startswith("attention")
            else ("gemm_epilogue" if r.rule.startswith("gemm_epilogue") else r.rule)
        )
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"  rewrites: {kinds}")
    print(f"  max |optimized - original| = {err:.3e} (max |original| = {scale:.3e})")
    ok = np.isfinite(err) and err <= 1e-4 * max(1.0, scale)
    expected_sites = {
        "attention": config.num_hidden_layers,
        "gemm_epilogue": config.num_hidden_layers,
    }
    sites_ok = all(kinds.get(k, 0) == n for k, n in expected_sites.items())
    print(
        f"  equivalence: {'OK' if ok else 'MISMATCH'}; "
        f"sites: {'OK' if sites_ok else f'expected {expected_sites}'}"
    )
    return 0 if ok and sites_ok else 1


def main() -> int:
    language_demo()
    return model_demo()


if __name__ == "__main__":
    sys.exit(main())
