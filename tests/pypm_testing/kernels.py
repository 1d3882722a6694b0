"""Shared helpers of the pallas_kernels tests: random inputs and tolerance checks."""

from __future__ import annotations

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
