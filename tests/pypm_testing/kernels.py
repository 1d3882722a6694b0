"""Shared helpers of the pallas_kernels tests: random inputs and tolerance checks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# Max error allowed relative to the reference's magnitude, per dtype.
TOL = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 2e-2}
GRAD_TOL = {"float32": 2e-4, "bfloat16": 4e-2, "float16": 4e-2}


def rnd(seed: int, shape: tuple[int, ...], dtype=jnp.float32, scale: float = 1.0) -> jax.Array:
    x = jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32) * scale
    return x.astype(dtype)


def assert_close(actual, expected, dtype, *, tol_table=TOL, what: str = "") -> None:
    """|actual - expected| <= tol * max(1, max|expected|), elementwise, no NaNs."""
    a = np.asarray(jnp.asarray(actual, jnp.float32))
    e = np.asarray(jnp.asarray(expected, jnp.float32))
    assert a.shape == e.shape, (what, a.shape, e.shape)
    assert np.all(np.isfinite(a)) == np.all(np.isfinite(e)), f"{what}: non-finite values differ"
    tol = tol_table[jnp.dtype(dtype).name]
    bound = tol * max(1.0, float(np.max(np.abs(e))) if e.size else 1.0)
    err = float(np.max(np.abs(a - e))) if e.size else 0.0
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g} ({jnp.dtype(dtype).name})"


def jitted(fn: Callable[..., Any], **static: Any) -> Callable[..., Any]:
    """``fn`` with the ``static`` keyword arguments bound, under ``jax.jit``: one compiled
    program per call. Called eagerly, the plain-JAX references compile each of their dozens
    of operations on its own (most of an interpret-mode test's CPU time); results are the
    same within the dtype's tolerance."""
    return jax.jit(functools.partial(fn, **static))


def has_pallas_call(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


def attention_inputs(
    seed: int, layout: str, b: int, sq: int, skv: int, hq: int, hkv: int, d: int, dtype
) -> tuple[jax.Array, jax.Array, jax.Array]:
    def shape(s: int, h: int) -> tuple[int, ...]:
        return (b, s, h, d) if layout == "BSHD" else (b, h, s, d)

    return (
        rnd(seed, shape(sq, hq), dtype),
        rnd(seed + 1, shape(skv, hkv), dtype),
        rnd(seed + 2, shape(skv, hkv), dtype),
    )


def padding_mask(b: int, skv: int, lengths: list[int]) -> jax.Array:
    """Flax/HF style key-padding mask [B, 1, 1, Skv] (True = real token)."""
    return (jnp.arange(skv)[None, :] < jnp.asarray(lengths)[:, None])[:, None, None, :]


def hf_padding_bias(b: int, skv: int, lengths: list[int]) -> jax.Array:
    """Hugging Face style additive padding bias [B, 1, 1, Skv]: 0 or finfo(f32).min."""
    keep = padding_mask(b, skv, lengths)
    return jnp.where(keep, 0.0, jnp.finfo(jnp.float32).min).astype(jnp.float32)


# --------------------------------------------------------------------------- attention modifiers
#
# score_mod / mask_mod spellings shared by the interpret-mode and GPU attention tests. They are
# module-level functions: the kernels key their compilation on the callables' identity.


def softcap(s, b, h, qi, ki, cap):
    """Gemma 2's logit soft-capping ``tanh(s / c) * c`` (c a captured 0-d array)."""
    return jnp.tanh(s / cap) * cap


def alibi(s, b, h, qi, ki, slopes):
    """ALiBi: a per-head slope times the key's distance, slopes captured as [1, Hq, 1, 1]."""
    return s + slopes * (ki - qi).astype(jnp.float32)


def bias_before_scale(s, b, h, qi, ki, bias, scale):
    """Falcon's ``(q k^T + bias) * scale`` on the kernel's scaled scores."""
    return s + bias * scale


def sliding_window_8(b, h, qi, ki, *caps):
    """Causal sliding window of 8 keys (Mistral / Gemma 2 local layers): band (-7, 0)."""
    return (ki <= qi) & (ki > qi - 8)


def chunked_local_12(b, h, qi, ki, *caps):
    """Chunked local attention (Llama 4): causal inside chunks of 12, band (-11, 0)."""
    return (qi // 12 == ki // 12) & (ki <= qi)


def same_document(b, h, qi, ki, q_doc, k_doc):
    """Packed sequences: a query sees the keys of its own document (int captures)."""
    return q_doc == k_doc


def left_padding_mask(b: int, skv: int, starts: list[int]) -> jax.Array:
    """[B, 1, 1, Skv]: the first ``starts[i]`` keys of batch ``i`` are padding."""
    return (jnp.arange(skv)[None, :] >= jnp.asarray(starts)[:, None])[:, None, None, :]


MODIFIER_CASES = (
    "softcap",
    "alibi_gqa",
    "bias_before_scale",
    "sliding_window",
    "chunked_local",
    "document_mask",
    "sinks",
    "zero_rows",
    "everything",
)


def modifier_case(name: str, b: int, s: int, hq: int, d: int, dtype, seed: int = 0):
    """(q, k, v, kwargs) of one modifier case; ``kwargs`` go to both flash_attention and
    attention_reference.  Cases with left padding have fully masked rows in batch 1."""
    hkv = hq // 2 if name == "alibi_gqa" else hq
    q, k, v = attention_inputs(seed, "BSHD", b, s, s, hq, hkv, d, dtype)
    starts = [0] + [5] * (b - 1)  # batch >= 1: 5 padded keys, so rows 0..4 see nothing
    if name == "softcap":
        return q, k, v, dict(score_mod=softcap, captures=(jnp.float32(1.5),), causal=True)
    if name == "alibi_gqa":
        slopes = -(2.0 ** -jnp.arange(1, hq + 1, dtype=jnp.float32)).reshape(1, hq, 1, 1)
        return q, k, v, dict(score_mod=alibi, captures=(slopes,), causal=True)
    if name == "bias_before_scale":
        bias = rnd(seed + 10, (b, hq, s, s))
        caps = (bias, jnp.float32(1.0 / np.sqrt(d)))
        return q, k, v, dict(score_mod=bias_before_scale, captures=caps)
    if name == "sliding_window":
        mask = left_padding_mask(b, s, starts)
        return q, k, v, dict(mask=mask, mask_mod=sliding_window_8, band=(-7, 0))
    if name == "chunked_local":
        return q, k, v, dict(mask_mod=chunked_local_12, band=(-11, 0))
    if name == "document_mask":
        docs = (jnp.arange(s) >= s // 3).astype(jnp.int32) + (jnp.arange(s) >= s // 2)
        docs = jnp.stack([docs, docs[::-1]])[:b]
        caps = (docs[:, None, :, None], docs[:, None, None, :])
        return q, k, v, dict(mask_mod=same_document, captures=caps, causal=True)
    if name == "sinks":
        sinks = jnp.linspace(-1.0, 2.0, hq, dtype=jnp.float32)
        return q, k, v, dict(sinks=sinks, causal=True)
    if name == "zero_rows":
        mask = left_padding_mask(b, s, starts)
        return q, k, v, dict(mask=mask, causal=True, masked_rows="zero")
    if name == "everything":
        mask = left_padding_mask(b, s, starts)
        return (
            q,
            k,
            v,
            dict(
                mask=mask,
                score_mod=softcap,
                captures=(jnp.float32(2.0),),
                mask_mod=sliding_window_8,
                band=(-7, 0),
                sinks=jnp.linspace(0.5, -0.5, hq, dtype=jnp.float32),
                masked_rows="zero",
            ),
        )
    raise ValueError(f"unknown modifier case {name!r}")


def differentiable_args(kwargs: dict) -> list[str]:
    """Keyword arguments of a modifier case that receive gradients (float arrays)."""
    names = []
    if kwargs.get("bias") is not None:
        names.append("bias")
    caps = kwargs.get("captures", ())
    if caps and all(jnp.issubdtype(jnp.asarray(c).dtype, jnp.floating) for c in caps):
        names.append("captures")
    if kwargs.get("sinks") is not None:
        names.append("sinks")
    return names
