#!/usr/bin/env python3
"""Benchmark pallas_kernels against the XLA programs they replace.

GPU (default when JAX's backend is a GPU):
  * flash attention forward (and forward+backward at seq 2048) vs XLA's unfused
    attention, seq 512..4096, bf16, head dim 64/128, causal and not;
  * a decoder's causal bias as data vs with ``mask_is_causal`` (what rules/causal.py
    turns on) vs XLA, seq 1024..4096;
  * soft-capped causal attention (``score_mod``) and a 256-key sliding window
    (``mask_mod``, with and without ``band`` block skipping) vs the unfused programs,
    seq 2048/8192, forward and forward+backward;
  * GEMM + epilogue vs ``jax.jit(lambda x, w, b: act(x @ w + b))``;
  * GEMM epilogue regions (softplus, mish, soft-capping, squared ReLU, a residual, a
    per-row scale): ``pm.optimize`` with the standard rules vs ``jax.jit``.
CPU (``--cpu-small``, or automatically without a GPU): small shapes, the
``impl=None`` fallback vs the original program, to show it is not slower (the
modifier rows included).

Each figure is the median of >= 10 samples taken after warm-up in this process;
a sample times ``inner`` back-to-back calls (``block_until_ready`` on the last) and
divides, so per-call dispatch overhead does not swamp sub-millisecond kernels.

Usage:  python benchmarks/kernels.py [--cpu-small] [--tune] [--samples N] [--only attention|gemm]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from pallas_kernels import _dispatch as dsp  # noqa: E402
from pallas_kernels._attention import AttentionBlocks, default_blocks  # noqa: E402
from pallas_kernels._gemm import GemmBlocks, default_gemm_blocks  # noqa: E402
from pallas_kernels._gemm_mgpu import MosaicGemmConfig, default_mosaic_config  # noqa: E402


def _hopper() -> bool:
    cc = dsp.gpu_compute_capability()
    return cc is not None and cc.startswith("9.")


def bench_many(
    fns: dict[str, Callable[..., Any]], *args: Any, samples: int = 15, min_sample_s: float = 10e-3
) -> dict[str, float]:
    """Median seconds per call for each function (compile + warm-up excluded).

    Samples of the candidates are interleaved round-robin so machine-load drift
    affects all of them alike.  A sample times ``inner`` back-to-back calls
    (``block_until_ready`` on the last) so dispatch overhead does not dominate.
    """
    inner = {}
    for name, fn in fns.items():
        jax.block_until_ready(fn(*args))  # compile
        t0 = time.perf_counter()
        for _ in range(3):
            jax.block_until_ready(fn(*args))
        single = (time.perf_counter() - t0) / 3
        inner[name] = max(1, min(200, math.ceil(min_sample_s / max(single, 1e-7))))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            out = None
            for _ in range(inner[name]):
                out = fn(*args)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - t0) / inner[name])
    global _LAST_MINIMA
    _LAST_MINIMA = {name: min(t) for name, t in times.items()}
    return {name: statistics.median(t) for name, t in times.items()}


# Per-function minimum sample of the last bench_many call: a load-robust second
# statistic, reported next to the median on the shared-CPU tables.
_LAST_MINIMA: dict[str, float] = {}


def bench(fn: Callable[..., Any], *args: Any, samples: int = 15) -> float:
    return bench_many({"f": fn}, *args, samples=samples)["f"]


def flax_style_attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """The unfused program as Flax writes it (``nn.dot_product_attention``): scores,
    mask with finfo(dtype).min and softmax all in the input dtype, [B, S, H, D]."""
    d = q.shape[-1]
    w = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(d).astype(q.dtype), k)
    if causal:
        tri = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))
        w = jnp.where(tri, w, jnp.finfo(w.dtype).min)
    w = jax.nn.softmax(w).astype(q.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", w, v)


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f}"


def _attn_inputs(b: int, s: int, h: int, d: int, dtype: Any) -> tuple[jax.Array, ...]:
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(kk, (b, s, h, d), jnp.float32).astype(dtype) for kk in ks)


def grad_of(fn: Callable[..., Any]) -> Callable[..., Any]:
    """jit(grad wrt q, k, v) of sum(fn(q, k, v)): forward + backward cost."""
    return jax.jit(
        jax.grad(lambda a, b, c: jnp.sum(fn(a, b, c).astype(jnp.float32)), argnums=(0, 1, 2))
    )


def attention_table(
    shapes: list[tuple[int, int, int, int]],
    dtype: Any,
    impl: str | None,
    samples: int,
    with_bwd: set[tuple[int, int]],
    out: list[str],
) -> None:
    label = "kernel" if impl == "pallas" else "impl=None (fallback)"
    out.append(f"\n### Flash attention forward, {jnp.dtype(dtype).name}, layout BSHD\n")
    out.append(
        f"| B | S | H | D | causal | {label} ms | XLA reference ms | XLA Flax-style ms "
        "| speedup vs faster XLA |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    bwd_rows = []
    for b, s, h, d in shapes:
        q, k, v = _attn_inputs(b, s, h, d, dtype)
        for causal in (False, True):
            kern = jax.jit(
                lambda q, k, v, c=causal: pk.flash_attention(q, k, v, causal=c, impl=impl)
            )
            ref = jax.jit(lambda q, k, v, c=causal: pk.attention_reference(q, k, v, causal=c))
            flx = jax.jit(lambda q, k, v, c=causal: flax_style_attention(q, k, v, c))
            r = bench_many({"k": kern, "r": ref, "f": flx}, q, k, v, samples=samples)
            tk, tr, tf = r["k"], r["r"], r["f"]
            base = min(tr, tf)
            out.append(
                f"| {b} | {s} | {h} | {d} | {causal} | {_ms(tk)} | {_ms(tr)} | {_ms(tf)} "
                f"| {base / tk:.2f}x |"
            )
            print(out[-1], flush=True)
            if (s, d) in with_bwd:
                gk = grad_of(
                    lambda q, k, v, c=causal: pk.flash_attention(q, k, v, causal=c, impl=impl)
                )
                gr = grad_of(lambda q, k, v, c=causal: pk.attention_reference(q, k, v, causal=c))
                gf = grad_of(lambda q, k, v, c=causal: flax_style_attention(q, k, v, c))
                r = bench_many({"k": gk, "r": gr, "f": gf}, q, k, v, samples=samples)
                bk_, br, bf = r["k"], r["r"], r["f"]
                bwd_rows.append(
                    f"| {b} | {s} | {h} | {d} | {causal} | {_ms(bk_)} | {_ms(br)} "
                    f"| {_ms(bf)} | {min(br, bf) / bk_:.2f}x |"
                )
                print(bwd_rows[-1], flush=True)
        del q, k, v
    if bwd_rows:
        out.append(
            f"\n### Flash attention forward+backward (grad wrt q, k, v), {jnp.dtype(dtype).name}\n"
        )
        out.append(
            f"| B | S | H | D | causal | {label} ms | XLA reference ms | XLA Flax-style ms "
            "| speedup vs faster XLA |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|")
        out.extend(bwd_rows)


def hf_decoder_bias(b: int, s: int, dtype: Any) -> jax.Array:
    """A Hugging Face Flax decoder's attention bias, ``[B, 1, S, S]``: ``where(causal and
    not padding, 0, finfo.min)``, the second sequence left-padded by 100 tokens."""
    tri = jnp.tril(jnp.ones((s, s), bool))
    keep = jnp.arange(s)[None, :] >= jnp.asarray([0, 100] * (b // 2) + [0] * (b % 2))[:, None]
    mask = keep[:, None, None, :] & tri
    return jnp.where(mask, 0.0, float(jnp.finfo(dtype).min)).astype(dtype)


def biased_attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array) -> jax.Array:
    """The unfused program of a decoder with such a bias (Flax's ``dot_product_attention``)."""
    d = q.shape[-1]
    w = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(d).astype(q.dtype), k) + bias
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w).astype(q.dtype), v)


def causal_bias_table(
    shapes: list[tuple[int, int, int, int]],
    dtype: Any,
    samples: int,
    with_bwd: set[tuple[int, int]],
    out: list[str],
) -> None:
    """What ``rules/causal.py`` buys a decoder: the kernel with its causal bias as data vs
    with ``mask_is_causal=True`` (blocks above the diagonal skipped), against XLA."""
    out.append(f"\n### Decoder causal bias (Hugging Face style), {jnp.dtype(dtype).name}\n")
    out.append(
        "| B | S | H | D | pass | kernel, bias as data ms | kernel, mask_is_causal ms "
        "| XLA unfused ms | skip gain | vs XLA |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for b, s, h, d in shapes:
        q, k, v = _attn_inputs(b, s, h, d, dtype)
        bias = hf_decoder_bias(b, s, dtype)
        scale = 1.0 / math.sqrt(d)

        def kern(promise: bool, bias: jax.Array = bias, scale: float = scale) -> Any:
            return lambda q_, k_, v_: pk.flash_attention(
                q_, k_, v_, bias, scale=scale, mask_is_causal=promise, impl="pallas"
            )

        passes = [("fwd", jax.jit)] + ([("fwd+bwd", grad_of)] if (s, d) in with_bwd else [])
        for name, wrap in passes:
            r = bench_many(
                {
                    "data": wrap(kern(False)),
                    "skip": wrap(kern(True)),
                    "xla": wrap(lambda q, k, v, bias=bias: biased_attention(q, k, v, bias)),
                },
                q,
                k,
                v,
                samples=samples,
            )
            out.append(
                f"| {b} | {s} | {h} | {d} | {name} | {_ms(r['data'])} | {_ms(r['skip'])} "
                f"| {_ms(r['xla'])} | {r['data'] / r['skip']:.2f}x | {r['xla'] / r['skip']:.2f}x |"
            )
            print(out[-1], flush=True)


def cpu_attention_table(
    shapes: list[tuple[int, int, int, int]], dtype: Any, samples: int, out: list[str]
) -> None:
    """CPU: the impl=None fallback (the jitted reference) vs the Flax-style original."""
    out.append(f"\n### Attention on CPU, {jnp.dtype(dtype).name}: fallback vs original program\n")
    out.append(
        "| B | S | H | D | causal | impl=None fallback ms | original (Flax-style) ms "
        "| original / fallback (median) | same, min sample |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|")
    for b, s, h, d in shapes:
        q, k, v = _attn_inputs(b, s, h, d, dtype)
        for causal in (False, True):
            fb = jax.jit(lambda q, k, v, c=causal: pk.flash_attention(q, k, v, causal=c))
            orig = jax.jit(lambda q, k, v, c=causal: flax_style_attention(q, k, v, c))
            r = bench_many({"fb": fb, "orig": orig}, q, k, v, samples=samples)
            mins = _LAST_MINIMA
            out.append(
                f"| {b} | {s} | {h} | {d} | {causal} | {_ms(r['fb'])} | {_ms(r['orig'])} "
                f"| {r['orig'] / r['fb']:.2f}x | {mins['orig'] / mins['fb']:.2f}x |"
            )
            print(out[-1], flush=True)


SOFTCAP, WINDOW = 50.0, 256  # Gemma 2's attention logit cap and a local layer's window


def _softcap(s: Any, b: Any, h: Any, qi: Any, ki: Any, cap: Any) -> Any:
    return jnp.tanh(s / cap) * cap


def _window(b: Any, h: Any, qi: Any, ki: Any, w: Any) -> Any:
    return (ki <= qi) & (ki > qi - w)


def modified_original(q: jax.Array, k: jax.Array, v: jax.Array, kind: str) -> jax.Array:
    """The unfused program of a soft-capped causal / a sliding-window attention."""
    d, s = q.shape[-1], q.shape[1]
    w = jnp.einsum("bqhd,bkhd->bhqk", q / jnp.sqrt(d).astype(q.dtype), k).astype(jnp.float32)
    qi, ki = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    keep = ki <= qi
    if kind == "softcap":
        w = jnp.tanh(w / SOFTCAP) * SOFTCAP
    else:
        keep = keep & (ki > qi - WINDOW)
    w = jnp.where(keep, w, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(w).astype(q.dtype), v)


def _modified_kernel(kind: str, impl: str | None, band: bool) -> Callable[..., Any]:
    if kind == "softcap":
        kw = dict(score_mod=_softcap, captures=(jnp.float32(SOFTCAP),), causal=True)
    else:
        kw = dict(mask_mod=_window, captures=(jnp.int32(WINDOW),))
        if band:
            kw["band"] = (1 - WINDOW, 0)
    return lambda q, k, v: pk.flash_attention(q, k, v, impl=impl, **kw)


def modifier_table(
    shapes: list[tuple[int, int, int, int]],
    dtype: Any,
    impl: str | None,
    samples: int,
    out: list[str],
) -> None:
    """Soft-capped causal attention (``score_mod``) and a sliding window of 256 keys
    (``mask_mod``, with and without ``band`` block skipping) vs the unfused program."""
    label = "kernel" if impl == "pallas" else "impl=None (fallback)"
    out.append(
        f"\n### Attention modifiers, {jnp.dtype(dtype).name}, fwd+bwd "
        f"(soft-cap {SOFTCAP}, window {WINDOW})\n"
    )
    out.append(
        f"| B | S | H | D | modifier | pass | {label} ms | {label}, no band ms | original ms "
        "| original / kernel |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for b, s, h, d in shapes:
        q, k, v = _attn_inputs(b, s, h, d, dtype)
        for kind in ("softcap", "window"):
            for name, wrap in (("fwd", jax.jit), ("fwd+bwd", grad_of)):
                fns = {
                    "k": wrap(_modified_kernel(kind, impl, band=True)),
                    "o": wrap(lambda q, k, v, kind=kind: modified_original(q, k, v, kind)),
                }
                if kind == "window":
                    fns["nb"] = wrap(_modified_kernel(kind, impl, band=False))
                r = bench_many(fns, q, k, v, samples=samples)
                nb = _ms(r["nb"]) if "nb" in r else "-"
                out.append(
                    f"| {b} | {s} | {h} | {d} | {kind} | {name} | {_ms(r['k'])} | {nb} "
                    f"| {_ms(r['o'])} | {r['o'] / r['k']:.2f}x |"
                )
                print(out[-1], flush=True)


_ACT_PLAIN = {
    "relu": jax.nn.relu,
    "gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True),
    "gelu": lambda y: jax.nn.gelu(y, approximate=False),
    "silu": jax.nn.silu,
    "quick_gelu": lambda y: y * jax.nn.sigmoid(1.702 * y),  # transformers' (CLIP's) spelling
}


def gemm_table(
    shapes: list[tuple[int, int, int]],
    acts: list[str],
    dtype: Any,
    impl: str | None,
    samples: int,
    out: list[str],
) -> None:
    label = "kernel" if impl == "pallas" else "impl=None (fallback)"
    where = "GPU" if impl == "pallas" else "CPU"
    # On a Hopper GPU the Mosaic kernel (pallas_kernels/_gemm_mgpu.py) is timed in the
    # same round-robin as the Triton kernel and the original.
    mosaic = impl == "pallas" and _hopper() and jnp.dtype(dtype) != jnp.float32
    out.append(f"\n### GEMM + bias + activation on {where}, {jnp.dtype(dtype).name}\n")
    extra_head = " Mosaic kernel ms | original / Mosaic (median) | same, min sample |" * mosaic
    out.append(
        f"| M | K | N | act | {label} ms | XLA `act(x@w+b)` (original) ms | {label} TFLOP/s "
        f"| original time / ours (median) | same, min sample |{extra_head}"
    )
    out.append("|---|---|---|---|---|---|---|---|---|" + "---|---|---|" * mosaic)
    for m, kdim, n in shapes:
        ks = jax.random.split(jax.random.PRNGKey(1), 3)
        x = jax.random.normal(ks[0], (m, kdim), jnp.float32).astype(dtype)
        w = (jax.random.normal(ks[1], (kdim, n), jnp.float32) / math.sqrt(kdim)).astype(dtype)
        b = jax.random.normal(ks[2], (n,), jnp.float32).astype(dtype)
        for act in acts:
            kern = jax.jit(
                lambda x, w, b, a=act: pk.gemm_epilogue(x, w, b, activation=a, impl=impl)
            )
            orig = jax.jit(lambda x, w, b, f=_ACT_PLAIN[act]: f(x @ w + b))
            fns = {"k": kern, "o": orig}
            if mosaic:
                fns["m"] = jax.jit(
                    lambda x, w, b, a=act: pk.gemm_epilogue(
                        x, w, b, activation=a, impl="pallas", _backend="mosaic"
                    )
                )
            r = bench_many(fns, x, w, b, samples=samples)
            tk, to = r["k"], r["o"]
            tflops = 2 * m * n * kdim / tk / 1e12
            mins = _LAST_MINIMA
            extra = ""
            if mosaic:
                extra = f" {_ms(r['m'])} | {to / r['m']:.2f}x | {mins['o'] / mins['m']:.2f}x |"
            out.append(
                f"| {m} | {kdim} | {n} | {act} | {_ms(tk)} | {_ms(to)} | {tflops:.3g} "
                f"| {to / tk:.2f}x | {mins['o'] / mins['k']:.2f}x |{extra}"
            )
            print(out[-1], flush=True)


def tune(samples: int, what: list[str]) -> None:
    """Sweep tile configurations for the target shapes (GPU only); prints the times."""
    print("\n## Tuning sweep (median ms)\n", flush=True)
    for d in (64, 128) if "attention" in what else ():
        q, k, v = _attn_inputs(4, 2048, 16, d, jnp.bfloat16)
        base = default_blocks(2048, 2048, d, jnp.bfloat16, False, causal=False)
        for causal in (False, True):
            for bq, bk, warps, stages in [
                (128, 64, 4, 3),
                (128, 64, 8, 3),
                (128, 128, 8, 3),
                (128, 32, 4, 3),
                (64, 64, 4, 3),
                (128, 64, 4, 4),
                (128, 128, 4, 2),
                (64, 128, 4, 3),
            ]:
                blocks = AttentionBlocks(
                    bq,
                    bk,
                    warps,
                    stages,
                    base.block_q_bwd,
                    base.block_k_bwd,
                    base.num_warps_bwd,
                    base.num_stages_bwd,
                )
                f = jax.jit(
                    lambda q, k, v, c=causal, bl=blocks: pk.flash_attention(
                        q, k, v, causal=c, impl="pallas", _blocks=bl
                    )
                )
                try:
                    t = bench(f, q, k, v, samples=samples)
                    print(
                        f"attn fwd d={d} causal={causal} {bq}x{bk} w{warps} s{stages}: {_ms(t)}",
                        flush=True,
                    )
                except Exception as e:  # a config may exceed shared memory / registers
                    print(
                        f"attn fwd d={d} causal={causal} {bq}x{bk} w{warps} s{stages}: FAILED "
                        f"{type(e).__name__}: {str(e)[:120]}",
                        flush=True,
                    )
        for bq, bk, warps, stages in [
            (64, 64, 4, 2),
            (64, 64, 8, 2),
            (32, 64, 4, 2),
            (64, 128, 8, 2),
            (32, 128, 4, 2),
            (64, 64, 4, 3),
            (128, 64, 8, 2),
            (32, 32, 4, 2),
        ]:
            blocks = dataclasses_replace(
                base, block_q_bwd=bq, block_k_bwd=bk, num_warps_bwd=warps, num_stages_bwd=stages
            )
            g = jax.jit(
                jax.grad(
                    lambda q, k, v, bl=blocks: jnp.sum(
                        pk.flash_attention(q, k, v, causal=False, impl="pallas", _blocks=bl).astype(
                            jnp.float32
                        )
                    ),
                    argnums=(0, 1, 2),
                )
            )
            try:
                t = bench(g, q, k, v, samples=samples)
                print(f"attn fwd+bwd d={d} bwd {bq}x{bk} w{warps} s{stages}: {_ms(t)}", flush=True)
            except Exception as e:
                print(
                    f"attn fwd+bwd d={d} bwd {bq}x{bk} w{warps} s{stages}: FAILED "
                    f"{type(e).__name__}: {str(e)[:120]}",
                    flush=True,
                )
    if "gemm" not in what:
        return
    ks = jax.random.split(jax.random.PRNGKey(1), 3)
    m, kdim, n = 8192, 1024, 4096
    x = jax.random.normal(ks[0], (m, kdim), jnp.bfloat16)
    w = jax.random.normal(ks[1], (kdim, n), jnp.bfloat16) * 0.03
    b = jax.random.normal(ks[2], (n,), jnp.bfloat16)
    # (block_m, block_n, block_k, group_m, num_warps, num_stages); a first H100 sweep
    # also covered 128x256x64 s4, 256x128x64, 128x128x{32,64} w4/w8, 64x256x32,
    # 256x128x32, 128x256x32 and 256x256x64 -- all slower than 128x256x64 w8 s3.
    for cfg in [
        (128, 256, 64, 8, 8, 3),
        (128, 256, 64, 4, 8, 3),
        (128, 256, 64, 16, 8, 3),
        (128, 256, 64, 8, 8, 2),
        (128, 128, 128, 8, 8, 2),
        (256, 128, 64, 4, 8, 3),
    ]:
        blocks = GemmBlocks(*cfg)
        f = jax.jit(
            lambda x, w, b, bl=blocks: pk.gemm_epilogue(
                x, w, b, activation="gelu_tanh", impl="pallas", _blocks=bl
            )
        )
        try:
            t = bench(f, x, w, b, samples=samples)
            print(
                f"gemm gelu_tanh {cfg}: {_ms(t)} ({2 * m * n * kdim / t / 1e12:.0f} TFLOP/s)",
                flush=True,
            )
        except Exception as e:
            print(f"gemm {cfg}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
    if _hopper():
        tune_mosaic(samples)


def tune_mosaic(samples: int) -> None:
    """Tiles of the Hopper kernel against XLA's fused ``relu(x @ w + b)`` (the epilogue
    furthest from the target in the H100 timings of the Triton kernel), each timed side by side
    with XLA."""
    print("\n## Mosaic GEMM sweep, bf16 relu: kernel ms / XLA ms\n", flush=True)
    orig = jax.jit(lambda x, w, b: jax.nn.relu(x @ w + b))
    for m, kdim, n in [(8192, 1024, 4096), (4096, 4096, 4096), (8192, 4096, 1024)]:
        ks = jax.random.split(jax.random.PRNGKey(1), 3)
        x = jax.random.normal(ks[0], (m, kdim), jnp.bfloat16)
        w = jax.random.normal(ks[1], (kdim, n), jnp.bfloat16) * 0.03
        b = jax.random.normal(ks[2], (n,), jnp.bfloat16)
        # (tile_m, tile_n, max_concurrent_steps, grid_minor_dim, grid_tile_width, wg_dimension,
        #  preload_columns)
        for tm, tn, steps, minor, width, wg, *pre in [
            (128, 128, 4, "n", 8, "n"),
            (128, 128, 4, "n", 8, "n", False),
            (128, 128, 4, "n", 4, "n"),
            (128, 128, 4, "n", 16, "n"),
            (128, 128, 4, "m", 8, "n"),
            (128, 128, 3, "n", 8, "n"),
            (128, 128, 4, "n", 8, "m"),
            (64, 128, 4, "n", 8, "n"),
            (128, 64, 4, "n", 8, "n"),
            (128, 256, 2, "n", 8, "m"),
        ]:
            cfg = MosaicGemmConfig(tm, tn, 64, steps, 64, 64, minor, width, wg, *pre)
            f = jax.jit(
                lambda x, w, b, c=cfg: pk.gemm_epilogue(
                    x, w, b, activation="relu", impl="pallas", _blocks=c
                )
            )
            try:
                r = bench_many({"k": f, "o": orig}, x, w, b, samples=samples)
                print(
                    f"mosaic {m}x{kdim}x{n} {tm}x{tn} s{steps} {minor}{width} wg={wg} "
                    f"preload={cfg.preload_columns}: "
                    f"{_ms(r['k'])} / XLA {_ms(r['o'])} = {r['o'] / r['k']:.2f}x "
                    f"({2 * m * n * kdim / r['k'] / 1e12:.0f} TFLOP/s)",
                    flush=True,
                )
            except Exception as e:  # a config may exceed shared memory / registers
                print(f"mosaic {cfg}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)


def dataclasses_replace(obj: Any, **kw: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **kw)


# Epilogues the region rule fuses (rules/epilogue.py): fn(h, r, s) of h = x @ w + b, a
# residual r [M, N] and a per-row scale s [M].
_REGIONS: dict[str, Callable[..., Any]] = {
    "softplus": lambda h, r, s: jax.nn.softplus(h),
    "mish": lambda h, r, s: h * jnp.tanh(jax.nn.softplus(h)),
    "soft-cap tanh(h/30)*30": lambda h, r, s: jnp.tanh(h / 30.0) * 30.0,
    "relu(h)**2": lambda h, r, s: jax.nn.relu(h) ** 2,
    "silu(h) + residual": lambda h, r, s: jax.nn.silu(h) + r,
    "gelu(h) * row scale": lambda h, r, s: jax.nn.gelu(h) * s[:, None],
}


def region_table(
    shapes: list[tuple[int, int, int]], dtype: Any, samples: int, out: list[str]
) -> None:
    """``pm.optimize`` (the region kernel, or XLA where the fuse policy says so) vs the
    original program; the rules that fired are listed so a row never times a no-op."""
    import pypm_jax as pm

    where = jax.default_backend().upper()
    out.append(f"\n### GEMM epilogue regions via pm.optimize on {where}, {jnp.dtype(dtype).name}\n")
    out.append("| M | K | N | epilogue | pm.optimize ms | original ms | original / ours | rules |")
    out.append("|---|---|---|---|---|---|---|---|")
    for m, kdim, n in shapes:
        ks = jax.random.split(jax.random.PRNGKey(2), 5)
        x = jax.random.normal(ks[0], (m, kdim), jnp.float32).astype(dtype)
        w = (jax.random.normal(ks[1], (kdim, n), jnp.float32) / math.sqrt(kdim)).astype(dtype)
        b = jax.random.normal(ks[2], (n,), jnp.float32).astype(dtype)
        r = jax.random.normal(ks[3], (m, n), jnp.float32).astype(dtype)
        s = jax.random.normal(ks[4], (m,), jnp.float32).astype(dtype)
        for name, epi in _REGIONS.items():

            def program(x, w, b, r, s, epi=epi):
                return epi(x @ w + b, r, s)

            fast = pm.optimize(program)
            fired = ", ".join(f"{k} {v}" for k, v in fast.report(x, w, b, r, s).counts().items())
            times = bench_many({"k": fast, "o": jax.jit(program)}, x, w, b, r, s, samples=samples)
            tk, to = times["k"], times["o"]
            out.append(
                f"| {m} | {kdim} | {n} | {name} | {_ms(tk)} | {_ms(to)} | {to / tk:.2f}x "
                f"| {fired or 'none'} |"
            )
            print(out[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--cpu-small", action="store_true", help="small CPU shapes, fallback vs original"
    )
    ap.add_argument(
        "--tune",
        nargs="+",
        choices=("attention", "gemm"),
        default=[],
        help="GPU tile sweeps to run before the tables",
    )
    ap.add_argument("--samples", type=int, default=15, help="timed samples per figure (>= 10)")
    ap.add_argument("--only", choices=("attention", "gemm"), default=None)
    args = ap.parse_args()
    samples = max(10, args.samples)
    gpu = jax.default_backend() == "gpu"
    small = args.cpu_small or not gpu
    dev = jax.devices()[0]
    print(
        f"# device: {getattr(dev, 'device_kind', dev.platform)} | backend {jax.default_backend()} "
        f"| jax {jax.__version__} | samples/figure {samples}",
        flush=True,
    )
    if args.tune and gpu:
        tune(samples, args.tune)
    out: list[str] = []
    if small:
        impl = None  # the documented fallback; on CPU this is the XLA reference
        if args.only in (None, "attention"):
            for dtype in (jnp.float32, jnp.bfloat16):
                cpu_attention_table(
                    [(2, 128, 4, 64), (2, 256, 4, 64), (1, 512, 4, 128)], dtype, samples, out
                )
            modifier_table([(1, 512, 4, 64)], jnp.float32, impl, samples, out)
        if args.only in (None, "gemm"):
            for dtype in (jnp.float32, jnp.bfloat16):
                gemm_table(
                    [(256, 256, 512), (512, 512, 512)],
                    ["relu", "gelu_tanh"],
                    dtype,
                    impl,
                    samples,
                    out,
                )
            region_table([(256, 256, 512)], jnp.float32, samples, out)
    else:
        if args.only in (None, "attention"):
            shapes = [(4, s, 16, d) for d in (64, 128) for s in (512, 1024, 2048, 4096)]
            attention_table(shapes, jnp.bfloat16, "pallas", samples, {(2048, 64), (2048, 128)}, out)
            causal_bias_table(
                [(4, s, 16, d) for d in (64, 128) for s in (1024, 2048, 4096)],
                jnp.bfloat16,
                samples,
                {(2048, 64), (2048, 128)},
                out,
            )
            modifier_table(
                [(4, s, 16, d) for d in (64, 128) for s in (2048, 8192)],
                jnp.bfloat16,
                "pallas",
                samples,
                out,
            )
        if args.only in (None, "gemm"):
            gemm_table(
                [(8192, 1024, 4096), (4096, 4096, 4096), (8192, 4096, 1024)],
                ["gelu_tanh", "relu"],
                jnp.bfloat16,
                "pallas",
                samples,
                out,
            )
            gemm_table(
                [(2048, 1024, 4096)],
                ["gelu", "silu", "quick_gelu"],
                jnp.float16,
                "pallas",
                samples,
                out,
            )
            region_table([(8192, 1024, 4096), (4096, 4096, 4096)], jnp.bfloat16, samples, out)
        print(
            "\ndefault tiles: attention d64",
            default_blocks(2048, 2048, 64, jnp.bfloat16, False),
            "d64 causal",
            default_blocks(2048, 2048, 64, jnp.bfloat16, False, causal=True),
            "d128",
            default_blocks(2048, 2048, 128, jnp.bfloat16, False),
            "gemm",
            default_gemm_blocks(8192, 4096, 1024, jnp.bfloat16, False),
            "mosaic gemm",
            default_mosaic_config(8192, 4096, False),
        )
    print("\n" + "\n".join(out), flush=True)


if __name__ == "__main__":
    main()
