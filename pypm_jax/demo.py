"""The main job (``make demo``): PyPM patterns at work.

Part 1 runs the paper's examples on hand-built terms: patterns in the paper's notation,
matches, and a rewrite with its report. Part 2 (when the JAX bridge is installed) optimizes a
real Flax model — a Hugging Face Flax BERT built from a small config with random weights —
prints the rewrite report, and checks the optimized program against the original. Without
the ``models`` extra (no ``transformers``), part 2 says how to install it and optimizes a Flax
linen encoder instead. On CPU the kernels run as their XLA reference (it says so);
``PYPM_KERNEL_IMPL=interpret`` runs the Pallas kernels in the interpreter.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import pypm_jax as pm
from pypm_jax.core.calculus import show

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


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' logger at ERROR while the model is built: its Flax classes announce their
    deprecation (a banner about the library, not this demo)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _kernels_line(impl: str | None) -> str:
    """Which implementation the kernels run as, in words."""
    if impl == "interpret" and not _has_gpu():
        return (
            "kernels: the Pallas kernels in the interpreter (on CPU pm.optimize runs each "
            "kernel as its\n  XLA reference unless PYPM_KERNEL_IMPL=interpret; the demo sets "
            "it to check the kernels)"
        )
    if impl:
        return f"kernels: PYPM_KERNEL_IMPL={impl}"
    if _has_gpu():
        return "kernels: Pallas (Triton) on the GPU"
    return (
        "kernels: on CPU each kernel runs as its XLA reference (the original computation, "
        "unfused);\n  PYPM_KERNEL_IMPL=interpret runs the Pallas kernels in the interpreter"
    )


def _bert_model() -> tuple[str, Any, tuple[Any, ...], dict[str, int]]:
    """A Hugging Face Flax BERT from a small config (the ``models`` extra)."""
    import jax
    import jax.numpy as jnp
    from transformers import BertConfig, FlaxBertModel

    layers = 2
    config = BertConfig(
        vocab_size=1000,
        hidden_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        intermediate_size=512,
        max_position_embeddings=64,
        hidden_act="gelu_new",
    )
    with _quiet_transformers():
        model = FlaxBertModel(config, seed=0)
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 32), 0, config.vocab_size)
    mask = jnp.ones((2, 32), jnp.int32).at[1, 24:].set(0)  # a padded second sequence

    def bert(params, ids, mask):
        return model(ids, attention_mask=mask, params=params).last_hidden_state

    what = "Hugging Face Flax BERT, 2 layers, hidden 128, 4 heads; batch 2, seq 32 (one padded)"
    return what, bert, (model.params, ids, mask), {"attention": layers, "gemm_epilogue": layers}


def _linen_model() -> tuple[str, Any, tuple[Any, ...], dict[str, int]]:
    """A Flax linen encoder (attention + GELU MLP), for installs without ``transformers``."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h, mask=mask)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(128)(nn.gelu(nn.Dense(512)(h)))

    class Encoder(nn.Module):
        @nn.compact
        def __call__(self, x, mask):
            for _ in range(2):
                x = Block()(x, mask)
            return x

    model = Encoder()
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 32, 128))
    keep = jnp.ones((2, 32), bool).at[1, 24:].set(False)  # a padded second sequence
    mask = nn.make_attention_mask(keep, keep)
    params = model.init(jax.random.PRNGKey(0), x, mask)
    what = "Flax linen encoder, 2 blocks, hidden 128, 4 heads; batch 2, seq 32 (one padded)"
    return what, model.apply, (params, x, mask), {"attention": 2, "gemm_epilogue": 2}


def model_demo() -> int:
    """Optimize a real Flax model (small config, random weights) and check it."""
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    try:
        what, fn, args, expected_sites = _bert_model()
    except ImportError as exc:
        print(
            f"\n  ({exc.name or 'transformers'} is not installed, so no Hugging Face BERT: "
            "pip install 'pypm-jax[models]' for it; a Flax linen encoder instead)"
        )
        what, fn, args, expected_sites = _linen_model()
    print(f"\n== Part 2: pm.optimize on a {what.split(',')[0]} (random weights)")
    print(f"  model: {what}; backend {jax.default_backend()}")
    print(f"  {_kernels_line(os.environ.get('PYPM_KERNEL_IMPL'))}")
    fast = pm.optimize(fn)
    t0 = time.perf_counter()
    report = fast.report(*args)
    print(f"  lift + rewrite + lower: {time.perf_counter() - t0:.2f} s")
    print("  rewrite report:")
    for line in str(report).splitlines():
        print(f"    {line}")
    expected = jax.jit(fn)(*args)
    got = fast(*args)
    err = float(jnp.max(jnp.abs(expected - got)))
    scale = float(jnp.max(jnp.abs(expected)))
    kinds: dict[str, int] = {}
    for r in report:
        kind = next((k for k in ("attention", "gemm_epilogue") if r.rule.startswith(k)), r.rule)
        kinds[kind] = kinds.get(kind, 0) + 1
    print(f"  rewrites: {kinds}")
    print(f"  max |optimized - original| = {err:.3e} (max |original| = {scale:.3e})")
    ok = np.isfinite(err) and err <= 1e-4 * max(1.0, scale)
    sites_ok = all(kinds.get(k, 0) == n for k, n in expected_sites.items())
    print(
        f"  equivalence: {'OK' if ok else 'MISMATCH'}; "
        f"sites: {'OK' if sites_ok else f'expected {expected_sites}'}"
    )
    return 0 if ok and sites_ok else 1


def main() -> int:
    # On CPU the demo runs the real Pallas kernels in the interpreter, so that its
    # equivalence check checks the kernels rather than their references.
    if not _has_gpu():
        os.environ.setdefault("PYPM_KERNEL_IMPL", "interpret")
    language_demo()
    with warnings.catch_warnings():  # third-party deprecation notices; pypm's own still show
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        return model_demo()


if __name__ == "__main__":
    sys.exit(main())
