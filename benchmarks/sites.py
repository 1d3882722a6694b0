#!/usr/bin/env python3
"""Per-site kernel timings at the shapes a model's rewrite sites have (GPU).

``benchmarks/e2e.py`` times whole models; when an optimized model is not faster, this
program times its kernels one by one against the XLA programs they replace, at the
shapes of the model's sites (median of >= 10 interleaved samples, as kernels.py).

Usage:  python benchmarks/sites.py [--samples N]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from kernels import bench_many, flax_style_attention  # noqa: E402

import pallas_kernels as pk  # noqa: E402

_ACT = {
    "gelu": lambda y: jax.nn.gelu(y, approximate=False),
    "gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True),
    "silu": jax.nn.silu,
    "relu": jax.nn.relu,
}

# (name, B, S, H, D): e2e.py's GPU size (batch 8, hidden 768, 12 heads)
ATTENTION = [
    ("bert/gpt2 S=512", 8, 512, 12, 64, jnp.bfloat16),
    ("vit S=485 (ragged)", 8, 485, 12, 64, jnp.bfloat16),
    ("llama f32 (mixed bf16 promoted)", 8, 512, 12, 64, jnp.float32),
]
# (name, M, K, N, act, dtype)
GEMM = [
    ("bert ffn", 8 * 512, 768, 3072, "gelu", jnp.bfloat16),
    ("vit ffn", 8 * 485, 768, 3072, "gelu", jnp.bfloat16),
    ("gpt2 ffn", 8 * 512, 768, 3072, "gelu_tanh", jnp.bfloat16),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=12)
    samples = max(10, ap.parse_args().samples)
    dev = jax.devices()[0]
    print(f"# {getattr(dev, 'device_kind', dev.platform)} | jax {jax.__version__}", flush=True)
    impl = "pallas" if jax.default_backend() == "gpu" else None
    print("| attention site | kernel ms | XLA (Flax-style) ms | XLA / kernel |")
    print("|---|---|---|---|")
    for name, b, s, h, d, dt in ATTENTION:
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dt) for kk in ks)
        fk = jax.jit(lambda q, k, v: pk.flash_attention(q, k, v, impl=impl))
        fo = jax.jit(lambda q, k, v: flax_style_attention(q, k, v, False))
        r = bench_many({"k": fk, "o": fo}, q, k, v, samples=samples)
        print(f"| {name} | {r['k'] * 1e3:.3f} | {r['o'] * 1e3:.3f} | {r['o'] / r['k']:.2f}x |",
              flush=True)  # fmt: skip
    print("\n| GEMM site | kernel ms | XLA `act(x@w+b)` ms | XLA / kernel |")
    print("|---|---|---|---|")
    for name, m, kd, n, act, dt in GEMM:
        ks = jax.random.split(jax.random.PRNGKey(1), 3)
        x = jax.random.normal(ks[0], (m, kd), jnp.float32).astype(dt)
        w = (jax.random.normal(ks[1], (kd, n), jnp.float32) / math.sqrt(kd)).astype(dt)
        bias = jax.random.normal(ks[2], (n,), jnp.float32).astype(dt)
        fk = jax.jit(lambda x, w, b, a=act: pk.gemm_epilogue(x, w, b, activation=a, impl=impl))
        fo = jax.jit(lambda x, w, b, f=_ACT[act]: f(x @ w + b))
        r = bench_many({"k": fk, "o": fo}, x, w, bias, samples=samples)
        print(f"| {name} {m}x{kd}x{n} {act} | {r['k'] * 1e3:.3f} | {r['o'] * 1e3:.3f} "
              f"| {r['o'] / r['k']:.2f}x |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
