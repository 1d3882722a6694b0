"""Flash attention: plain-JAX reference, Pallas kernels (forward + custom_vjp backward).

Semantics (shared by the reference and the kernels)
---------------------------------------------------
In f32, per (batch ``b``, q head ``h``, query ``qi``, key ``ki``):

1. ``s = (q @ k^T) * scale`` (``scale`` defaults to ``1/sqrt(D)`` of the caller's q);
2. ``s = score_mod(s, b, h, qi, ki, *captures)`` if given;
3. ``s = s + bias`` if given;
4. ``s`` is *replaced* by ``finfo(float32).min`` (exactly what Flax's
   ``dot_product_attention_weights`` does) wherever ``mask`` is False,
   ``mask_mod(b, h, qi, ki, *captures)`` is False, or ``causal`` and ``ki > qi``;
5. ``p = softmax(s)`` over the keys; with ``sinks`` (``[Hq]``) each row's softmax also
   counts the logit ``sinks[h]`` (in the max and the denominator; it carries no value);
6. ``out = p @ v`` in q's dtype.

* ``causal`` is top-left aligned: query ``i`` attends keys ``j <= i`` whatever
  ``Sq`` and ``Skv`` are (no ``Skv - Sq`` offset). Flax and Hugging Face use the
  same alignment for equal lengths; for KV-cache style bottom-right alignment pass
  an explicit ``mask`` (or a ``mask_mod``) instead.
* A row is *fully masked* when its every score is at most ``MASK_VALUE / 2`` after step 4
  (all keys masked, or pushed there by a bias). With ``masked_rows="uniform"`` (default)
  such a row gets uniform weights over all ``Skv`` keys (the mean of ``v``), never NaN;
  with ``masked_rows="zero"`` it outputs 0 and passes no gradient (Keras's
  ``where(mask, softmax, 0)``). The kernels reproduce both exactly, including when
  block skipping would otherwise hide some keys.
* ``bias``/``mask`` and every array in ``captures`` are given in score layout
  ``[B, Hq, Sq, Skv]`` (numpy broadcasting, size-1 dims and 0-d arrays allowed) whatever
  the q/k/v layout.
* ``score_mod``/``mask_mod`` are static, hashable callables (keep them stable: they key
  the compilation), elementwise on score tiles: ``b``/``h`` are int32 scalars in the
  kernels (int32 arrays in the reference), ``qi`` an int32 ``[bq, 1]`` and ``ki`` an int32
  ``[1, bk]`` tile of absolute positions, each capture the matching tile of its array
  (f32 if floating, bool/int otherwise), broadcast-compatible with ``[bq, bk]``. Every
  modifier receives every capture. They may use ``jnp`` arithmetic, comparisons,
  ``where``, ``tanh``, ``exp``, ``log`` ... (what Pallas-Triton lowers).
* ``band=(lo, hi)`` (ints or None) *promises* that every key outside
  ``qi + lo <= ki <= qi + hi`` is masked (by mask/mask_mod/causal, or a bias
  ``<= MASK_VALUE / 2``). The kernels skip the kv blocks wholly outside it; the result is
  the same as without the promise. ``mask_is_causal=True`` is ``band=(None, 0)``, and
  ``causal`` narrows any band to ``hi <= 0``.
* ``q_offset`` (an int, or an int32 scalar traced per device) is the position of the first
  query: query row ``i`` has position ``q_offset + i`` wherever positions are read
  (``causal``, ``band``, the ``qi`` of ``score_mod``/``mask_mod``), while ``bias``, ``mask``
  and captures stay indexed by row. A call on rows ``[o, o + n)`` of the queries (with those
  rows of the score-layout operands) and ``q_offset=o`` gives those rows of the whole call:
  what a device holding one block of a sequence split across devices runs.
* Gradients reach q, k, v, bias, the float captures (through ``score_mod``) and sinks;
  masks, ``mask_mod`` and integer captures get none.
* Grouped / multi-query attention: ``Hq % Hkv == 0``; q head ``h`` reads kv head
  ``h // (Hq // Hkv)``.
* Head dims 1..256: the kernels zero-pad D to the next power of two (at least 16);
  zero columns change no dot product and the padded output columns are sliced off.

Kernel design
-------------
Forward is FlashAttention-2 style (grid over q blocks x batch x heads, online
softmax in f32, ``exp2`` with ``log2(e)`` folded into the score scale for plain/causal
attention).  Each q block visits only the kv blocks that hold keys of its band;
blocks strictly below the causal diagonal and free of sequence padding skip the
causal/padding masking work.  Rows that saw only masked scores in the band revisit
the blocks outside it (uniform rows average over all keys).  The sink is folded into
the row statistics at the end.  Non-divisible lengths are zero-padded to block
multiples in the wrapper (captures repeat their edge, so modifiers stay finite there);
padded keys get ``-inf`` (so they never receive weight, not even in fully masked rows)
and padded query rows are sliced off.

Backward uses two kernels (dK/dV over kv blocks, dQ over q blocks) with the same band
skipping and the saved per-row max ``m`` and normaliser ``denom`` (kept separately
rather than as a log-sum-exp so fully masked rows, whose max is ``finfo.min``, keep
their exact 1/Skv weights; a zeroed row saves ``denom = inf``, so its probabilities and
gradients are 0).  ``score_mod``'s derivative is taken inside the kernels (``jax.vjp`` of
the tile function).  With grouped kv heads dK/dV are produced per q head in f32 and
summed over the group by XLA.  The bias, capture and sink gradients are computed by
XLA from the same residuals (O(Sq*Skv) memory for bias and captures, O(Sq) for sinks);
under ``jit`` XLA removes them entirely when those cotangents are unused (the usual
constant padding bias).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _dispatch as dsp
from ._autodiff import with_forward_mode

pl = dsp.LazyModule("jax.experimental.pallas")  # imported when a kernel is built

MASK_VALUE: float = float(np.finfo(np.float32).min)
# A row whose running max is below this has only masked (finfo.min) scores so far.
_FULLY_MASKED_THRESHOLD: float = 0.5 * MASK_VALUE
_LOG2E: float = math.log2(math.e)
LAYOUTS: tuple[str, ...] = ("BSHD", "BHSD")
MIN_HEAD_DIM, MAX_HEAD_DIM = 1, 256


# --------------------------------------------------------------------------- #
# Validation / support predicate
# --------------------------------------------------------------------------- #


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def _head_axis(layout: str) -> int:
    return 2 if layout == "BSHD" else 1


def _split(shape: tuple[int, ...], layout: str) -> tuple[int, int, int, int]:
    """(batch, seq, heads, head_dim) of a rank-4 activation in ``layout``."""
    b, x1, x2, d = shape
    return (b, x1, x2, d) if layout == "BSHD" else (b, x2, x1, d)


def _structure_error(
    q_shape: Any,
    k_shape: Any,
    v_shape: Any,
    layout: str,
    bias_shape: Any,
    mask_shape: Any,
    score_shapes: tuple[tuple[str, Any], ...] = (),
) -> str | None:
    """Reason the arguments are not a well-formed attention call (None if they are);
    ``score_shapes`` are further (name, shape) operands in score layout."""
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    shapes = {}
    for name, s in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        try:
            s = tuple(int(d) for d in s)
        except TypeError:
            return f"{name} shape {s!r} is not a shape"
        if len(s) != 4:
            return f"{name} must be rank 4 ({layout}), got shape {s}"
        if min(s) < 1:
            return f"{name} has an empty dimension: {s}"
        shapes[name] = s
    bq, sq, hq, d = _split(shapes["q"], layout)
    bk, skv, hkv, dk = _split(shapes["k"], layout)
    if shapes["k"] != shapes["v"]:
        return f"k and v must have the same shape, got {shapes['k']} and {shapes['v']}"
    if bk != bq:
        return f"batch mismatch: q has {bq}, k/v have {bk}"
    if dk != d:
        return f"head dim mismatch: q has {d}, k/v have {dk}"
    if hq % hkv != 0:
        return f"q heads ({hq}) must be a multiple of kv heads ({hkv})"
    score = (bq, hq, sq, skv)
    for name, s in (("bias", bias_shape), ("mask", mask_shape), *score_shapes):
        if s is None:
            continue
        try:
            s = tuple(int(x) for x in s)
        except TypeError:
            return f"{name} shape {s!r} is not a shape"
        if not dsp.broadcastable(s, score):
            return f"{name} shape {s} is not broadcastable to [B, Hq, Sq, Skv] = {score}"
    return None


def _kernel_error(
    q_shape: Any,
    k_shape: Any,
    v_shape: Any,
    dtype: Any,
    layout: str,
    bias_shape: Any,
    mask_shape: Any,
    score_shapes: tuple[tuple[str, Any], ...] = (),
) -> str | None:
    """Reason the Pallas kernel cannot run this call (None when it can)."""
    err = _structure_error(q_shape, k_shape, v_shape, layout, bias_shape, mask_shape, score_shapes)
    if err is not None:
        return err
    name = dsp.dtype_name(dtype)
    if name not in dsp.SUPPORTED_DTYPES:
        return f"dtype {name or dtype!r} not supported (expected one of {dsp.SUPPORTED_DTYPES})"
    d = int(tuple(q_shape)[-1])
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        return f"head dim {d} outside the supported range [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    return None


def supports_attention(
    q_shape: Any,
    k_shape: Any,
    v_shape: Any,
    dtype: Any,
    *,
    layout: str = "BSHD",
    bias_shape: Any = None,
    mask_shape: Any = None,
    capture_shapes: Sequence[Any] = (),
) -> bool:
    """True iff :func:`flash_attention`'s Pallas kernel handles these shapes/dtype.

    Pure Python (no tracing): rewrite rules call it as a guard.  ``dtype`` may be a
    name ("bfloat16") or a numpy/JAX dtype.  Requires rank-4 q/k/v in ``layout``,
    k.shape == v.shape, equal batch and head dim, ``Hq % Hkv == 0``, head dim in
    [1, 256], dtype in {float32, bfloat16, float16}, and bias/mask/capture shapes
    broadcastable to ``[B, Hq, Sq, Skv]``.  Any sequence lengths are fine.
    """
    extra = tuple((f"captures[{i}]", c) for i, c in enumerate(capture_shapes))
    return (
        _kernel_error(q_shape, k_shape, v_shape, dtype, layout, bias_shape, mask_shape, extra)
        is None
    )


def _validate_arrays(
    q: jax.Array, k: jax.Array, v: jax.Array, bias: Any, mask: Any, layout: str
) -> None:
    err = _structure_error(
        q.shape,
        k.shape,
        v.shape,
        layout,
        None if bias is None else bias.shape,
        None if mask is None else mask.shape,
    )
    if err is not None:
        raise ValueError(f"flash_attention: {err}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"flash_attention: {name} must be floating point, got {x.dtype}")
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"flash_attention: bias must be a float array, got {bias.dtype}")
    if mask is not None and not (
        mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)
    ):
        raise TypeError(
            f"flash_attention: mask must be boolean (True = attend), got {mask.dtype}; "
            "pass additive float masks as `bias`."
        )


MASKED_ROWS: tuple[str, ...] = ("uniform", "zero")


@dataclasses.dataclass(frozen=True)
class _Mods:
    """The validated modifier arguments of one call (see the module docstring)."""

    score_mod: Callable[..., Any] | None
    mask_mod: Callable[..., Any] | None
    captures: tuple[jax.Array, ...]
    band: tuple[int | None, int | None] | None
    sinks: jax.Array | None
    masked_rows: str


def _band_bound(x: Any, name: str) -> int | None:
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise TypeError(f"flash_attention: {name} must be an int or None, got {x!r}")
    return int(x)


def _check_band(band: Any) -> tuple[int | None, int | None] | None:
    if band is None:
        return None
    if not isinstance(band, (tuple, list)) or len(band) != 2:
        raise TypeError(f"flash_attention: band must be a pair (lo, hi), got {band!r}")
    lo, hi = _band_bound(band[0], "band[0]"), _band_bound(band[1], "band[1]")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"flash_attention: band=({lo}, {hi}) is empty (lo > hi)")
    return None if lo is None and hi is None else (lo, hi)


def _check_mods(
    q: jax.Array,
    k: jax.Array,
    layout: str,
    bias: jax.Array | None,
    mask: jax.Array | None,
    causal: bool,
    mask_is_causal: bool,
    score_mod: Any,
    mask_mod: Any,
    captures: Any,
    band: Any,
    sinks: Any,
    masked_rows: Any,
) -> _Mods:
    """Validate the modifier keywords; errors name the argument at fault."""
    b, sq, hq, _ = _split(q.shape, layout)
    skv = _split(k.shape, layout)[1]
    score = (b, hq, sq, skv)
    if score_mod is not None:
        dsp.as_callable(score_mod, "flash_attention: score_mod")
    if mask_mod is not None:
        dsp.as_callable(mask_mod, "flash_attention: mask_mod")
    if not isinstance(captures, (tuple, list)):
        raise TypeError(
            f"flash_attention: captures must be a tuple of arrays, got {type(captures).__name__}"
        )
    caps = tuple(jnp.asarray(c) for c in captures)
    if caps and score_mod is None and mask_mod is None:
        raise ValueError("flash_attention: captures need a score_mod or a mask_mod to read them")
    for i, c in enumerate(caps):
        if not dsp.broadcastable(c.shape, score):
            raise ValueError(
                f"flash_attention: captures[{i}] shape {c.shape} is not broadcastable to "
                f"[B, Hq, Sq, Skv] = {score}"
            )
    masked_by_something = bias is not None or mask is not None or mask_mod is not None
    if mask_is_causal and not masked_by_something:
        raise ValueError("flash_attention: mask_is_causal=True needs a bias, a mask or a mask_mod")
    band = _check_band(band)
    if band is not None and not (masked_by_something or (causal and band[0] is None)):
        raise ValueError(
            f"flash_attention: band={band} promises keys outside it are masked, but nothing "
            "masks them (pass a mask, mask_mod or bias)"
        )
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if sinks.shape != (hq,) or not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise ValueError(
                f"flash_attention: sinks must be a float array of shape [Hq] = ({hq},), got "
                f"{sinks.dtype}{list(sinks.shape)}"
            )
    if masked_rows not in MASKED_ROWS:
        raise ValueError(
            f"flash_attention: masked_rows must be one of {MASKED_ROWS}, got {masked_rows!r}"
        )
    return _Mods(score_mod, mask_mod, caps, band, sinks, masked_rows)


# --------------------------------------------------------------------------- #
# Reference
# --------------------------------------------------------------------------- #


def attention_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask_is_causal: bool = False,
    layout: str = "BSHD",
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    captures: Sequence[jax.Array] = (),
    band: tuple[int | None, int | None] | None = None,
    sinks: jax.Array | None = None,
    masked_rows: str = "uniform",
    q_offset: Any = 0,
) -> jax.Array:
    """Plain-JAX attention (einsum + f32 softmax): the definition of the module's semantics.

    This is also the ``impl="xla"`` fallback, so it is written the way XLA compiles
    best (plain 4-D einsums, one fused scale/bias/mask/softmax pass): on CPU it is
    at least as fast as the usual Flax-style original program.  ``mask_is_causal`` and
    ``band`` are promises about the masks that only let the kernels skip work; the
    reference checks them for consistency and otherwise ignores them.
    """
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    bias = None if bias is None else jnp.asarray(bias)
    mask = None if mask is None else jnp.asarray(mask)
    _validate_arrays(q, k, v, bias, mask, layout)
    mods = _check_mods(
        q,
        k,
        layout,
        bias,
        mask,
        causal,
        mask_is_causal,
        score_mod,
        mask_mod,
        captures,
        band,
        sinks,
        masked_rows,
    )
    q_offset = _check_q_offset(q_offset)
    b, sq, hq, d = _split(q.shape, layout)
    _, skv, hkv, _ = _split(k.shape, layout)
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else dsp.static_float(scale, "scale")
    # Grouped kv heads are repeated up to Hq: XLA:CPU runs the plain 4-D einsums
    # markedly faster than a grouped 5-D contraction (measured; see
    # benchmarks/RESULTS.md), and the copy is O(S*D) next to the O(S^2) scores.
    if g > 1:
        k = jnp.repeat(k, g, axis=_head_axis(layout))
        v = jnp.repeat(v, g, axis=_head_axis(layout))
    f32 = jnp.float32
    eq = "bqhd,bkhd->bhqk" if layout == "BSHD" else "bhqd,bhkd->bhqk"
    logits = jnp.einsum(eq, q, k, preferred_element_type=f32) * f32(scale)
    idx = _score_indices(b, hq, sq, skv, q_offset)
    caps = tuple(_capture_value(c) for c in mods.captures)
    if mods.score_mod is not None:
        logits = _apply_score_mod(mods.score_mod, logits, idx, caps)
    if bias is not None:
        logits = logits + bias.astype(f32)
    keep = None
    if mask is not None:
        keep = mask if mask.dtype == jnp.bool_ else mask != 0
    if mods.mask_mod is not None:
        kept = _apply_mask_mod(mods.mask_mod, logits.shape, idx, caps)
        keep = kept if keep is None else jnp.logical_and(keep, kept)
    if causal:
        keep = _and(keep, idx[2] >= idx[3])
    if keep is not None:
        logits = jnp.where(keep, logits, MASK_VALUE)
    weights = _softmax_with_sinks(logits, mods.sinks)
    if mods.masked_rows == "zero":
        alive = jnp.max(logits, axis=-1, keepdims=True) > _FULLY_MASKED_THRESHOLD
        weights = jnp.where(alive, weights, 0.0)
    weights = weights.astype(v.dtype)
    eq = "bhqk,bkhd->bqhd" if layout == "BSHD" else "bhqk,bhkd->bhqd"
    out = jnp.einsum(eq, weights, v, preferred_element_type=f32)
    return out.astype(q.dtype)


def _score_indices(
    b: int, hq: int, sq: int, skv: int, q_offset: Any = None
) -> tuple[jax.Array, ...]:
    """(batch, head, query, key) positions as int32 arrays broadcastable to the scores;
    query positions start at ``q_offset`` (None: 0)."""
    idx = [
        jnp.arange(n, dtype=jnp.int32).reshape(tuple(n if i == ax else 1 for i in range(4)))
        for ax, n in enumerate((b, hq, sq, skv))
    ]
    if q_offset is not None:
        idx[2] = idx[2] + jnp.reshape(q_offset, ()).astype(jnp.int32)
    return tuple(idx)


def _check_q_offset(q_offset: Any) -> jax.Array | None:
    """``q_offset`` as an int32 scalar, None for a literal 0 (nothing to add)."""
    if q_offset is None:
        return None
    if isinstance(q_offset, (int, np.integer)) and not isinstance(q_offset, (bool, np.bool_)):
        return None if int(q_offset) == 0 else jnp.int32(q_offset)
    x = jnp.asarray(q_offset) if not isinstance(q_offset, bool) else None
    if x is None or x.shape != () or not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"flash_attention: q_offset must be an int or an integer scalar, got {q_offset!r}"
        )
    return x.astype(jnp.int32)


def _capture_value(x: jax.Array) -> jax.Array:
    """A captured operand as the modifiers see it: rank 4 in score layout, f32 if float."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def _apply_score_mod(
    fn: Callable[..., Any], s: jax.Array, idx: tuple[Any, ...], caps: tuple[Any, ...]
) -> jax.Array:
    out = jnp.asarray(fn(s, *idx, *caps))
    if not jnp.issubdtype(out.dtype, jnp.floating):
        raise TypeError(f"flash_attention: score_mod must return floats, got {out.dtype}")
    return jnp.broadcast_to(out.astype(jnp.float32), s.shape)


def _apply_mask_mod(
    fn: Callable[..., Any], shape: tuple[int, ...], idx: tuple[Any, ...], caps: tuple[Any, ...]
) -> jax.Array:
    out = jnp.asarray(fn(*idx, *caps))
    if out.dtype != jnp.bool_:
        raise TypeError(f"flash_attention: mask_mod must return booleans, got {out.dtype}")
    return jnp.broadcast_to(out, shape)


def _softmax_with_sinks(logits: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over keys; with ``sinks`` ([Hq]) each row also counts the logit ``sinks[h]``."""
    if sinks is None:
        return jax.nn.softmax(logits, axis=-1)
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    m = lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink))
    e = jnp.exp(logits - m)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))


_reference_jit = jax.jit(
    attention_reference,
    static_argnames=("scale", "causal", "layout", "score_mod", "mask_mod", "masked_rows"),
)  # q_offset: an int32 array or None, traced


# --------------------------------------------------------------------------- #
# Kernel configuration
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """Tile sizes / launch parameters (static; part of the jit cache key)."""

    block_q: int
    block_k: int
    num_warps: int
    num_stages: int
    block_q_bwd: int
    block_k_bwd: int
    num_warps_bwd: int
    num_stages_bwd: int


def default_blocks(
    sq: int,
    skv: int,
    d_pad: int,
    dtype: Any,
    interpret: bool,
    causal: bool = False,
    exact: bool = False,
) -> AttentionBlocks:
    """Per-head-dim defaults, picked from an H100 sweep (benchmarks/RESULTS.md).

    ``exact`` (bias/mask present): the kernel also streams a bias/mask tile per kv
    block, so the largest tiles (which fill shared memory with 3 pipeline stages)
    are avoided.  Interpret mode uses 16-row blocks so the small CPU test shapes
    still exercise multi-block loops, causal skipping and padding.
    """
    if interpret:
        cfg = AttentionBlocks(16, 16, 4, 2, 16, 16, 4, 2)
    elif jnp.dtype(dtype) == jnp.float32:  # twice the bytes per tile: halve the tiles
        if d_pad <= 64:
            cfg = AttentionBlocks(64, 64, 4, 3, 64, 64, 4, 2)
        elif d_pad <= 128:
            cfg = AttentionBlocks(64, 32, 4, 2, 32, 32, 4, 2)
        else:
            cfg = AttentionBlocks(32, 32, 4, 2, 16, 16, 4, 2)
    elif d_pad <= 64:
        cfg = (
            AttentionBlocks(64, 64, 4, 3, 64, 64, 4, 3)
            if causal
            else AttentionBlocks(128, 64, 8, 3, 64, 64, 4, 3)
        )
    elif d_pad <= 128:
        cfg = (
            AttentionBlocks(128, 64, 8, 3, 64, 64, 4, 2)
            if exact
            else AttentionBlocks(128, 128, 8, 3, 64, 64, 4, 2)
        )
    else:
        cfg = AttentionBlocks(64, 32, 4, 2, 32, 32, 4, 2)
    return clamp_blocks(cfg, sq, skv)


def clamp_blocks(cfg: AttentionBlocks, sq: int, skv: int) -> AttentionBlocks:
    """Shrink blocks to the (power-of-two rounded) sequence lengths, minimum 16
    (the smallest tile Triton's tensor-core dot accepts)."""
    cq = max(16, dsp.next_pow2(sq))
    ck = max(16, dsp.next_pow2(skv))
    return dataclasses.replace(
        cfg,
        block_q=min(cfg.block_q, cq),
        block_k=min(cfg.block_k, ck),
        block_q_bwd=min(cfg.block_q_bwd, cq),
        block_k_bwd=min(cfg.block_k_bwd, ck),
    )


Full = tuple[bool, bool, bool, bool]  # per score dim: real extent (not broadcast)
_SINK_FULL: Full = (False, True, False, False)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    layout: str
    causal: bool  # mask the scores above the diagonal
    band: tuple[int | None, int | None]  # kv blocks outside qi+lo <= ki <= qi+hi are skipped
    scale: float
    kv_len: int  # true (unpadded) kv length
    kv_padded: bool  # kv was padded to a block multiple (padded keys get -inf)
    group: int  # Hq // Hkv
    has_bias: bool
    has_mask: bool
    bias_full: Full
    mask_full: Full
    score_mod: Callable[..., Any] | None
    mask_mod: Callable[..., Any] | None
    cap_full: tuple[Full, ...]
    cap_kinds: tuple[str, ...]  # per capture: "float", "int" or "bool" (stored as int8)
    has_sinks: bool
    has_offset: bool  # the first query's position is an operand (else 0)
    zero_rows: bool  # masked_rows="zero"
    blocks: AttentionBlocks
    interpret: bool
    precision: Any

    @property
    def exact(self) -> bool:
        """Anything beyond plain/causal attention: masked scores must be finfo.min (not
        -inf) and the softmax is evaluated in the natural-log domain to avoid overflowing it."""
        return (
            self.has_bias
            or self.has_mask
            or self.score_mod is not None
            or self.mask_mod is not None
            or self.has_sinks
            or self.zero_rows
        )

    @property
    def banded(self) -> bool:
        return self.band != (None, None)

    @property
    def revisit(self) -> bool:
        """Rows left with only masked keys after the band must still average all keys."""
        return self.banded and self.exact and not self.zero_rows


# --------------------------------------------------------------------------- #
# BlockSpecs
# --------------------------------------------------------------------------- #


def _act_spec(layout: str, rows: int, d: int, seq_idx: Any, head_idx: Any) -> pl.BlockSpec:
    """Spec for one head's ``rows`` x ``d`` slab of a [B,S,H,D] / [B,H,S,D] array.
    Grid is always (seq_block, batch, head)."""
    if layout == "BSHD":
        return pl.BlockSpec((None, rows, None, d), lambda s, b, h: (b, seq_idx(s), head_idx(h), 0))
    return pl.BlockSpec((None, None, rows, d), lambda s, b, h: (b, head_idx(h), seq_idx(s), 0))


def _row_spec(rows: int, seq_idx: Any) -> pl.BlockSpec:
    """Spec for per-row f32 statistics stored as [B, Hq, S]."""
    return pl.BlockSpec((None, None, rows), lambda s, b, h: (b, h, seq_idx(s)))


def _score_spec(
    full: tuple[bool, bool, bool, bool], q_rows: int, k_cols: int, q_idx: Any, k_idx: Any
) -> pl.BlockSpec:
    """Spec for a bias/mask in score layout with broadcast (size-1) dims kept."""
    fb, fh, fq, fk = full
    shape = (None, None, q_rows if fq else 1, k_cols if fk else 1)

    def index(s: Any, b: Any, h: Any) -> tuple[Any, ...]:
        return (b if fb else 0, h if fh else 0, q_idx(s) if fq else 0, k_idx(s) if fk else 0)

    return pl.BlockSpec(shape, index)


def _zero(_: Any) -> int:
    return 0


def _ident(x: Any) -> Any:
    return x


# --------------------------------------------------------------------------- #
# In-kernel pieces
# --------------------------------------------------------------------------- #


class _Refs(NamedTuple):
    """The score-layout operands of a kernel, in the order the wrappers pass them."""

    bias: Any
    mask: Any
    caps: tuple[Any, ...]
    sinks: Any
    offset: Any


def _take_refs(it: Any, cfg: _Cfg) -> _Refs:
    bias = next(it) if cfg.has_bias else None
    mask = next(it) if cfg.has_mask else None
    caps = tuple(next(it) for _ in cfg.cap_kinds)
    sinks = next(it) if cfg.has_sinks else None
    offset = next(it) if cfg.has_offset else None
    return _Refs(bias, mask, caps, sinks, offset)


def _q_offset(refs: _Refs) -> Any:
    """The first query's position: 0, or the int32 scalar of the offset operand's 1 x 1 tile
    (a reduction to a scalar, as loop bounds take it)."""
    return 0 if refs.offset is None else jnp.sum(refs.offset[...])


def _cap_tile(x: jax.Array, kind: str) -> jax.Array:
    """A captured operand's tile as the modifiers see it (f32 floats, bool masks)."""
    if kind == "float":
        return x.astype(jnp.float32)
    return x != 0 if kind == "bool" else x


def _load_tiles(cfg: _Cfg, refs: _Refs, load: Callable[[Any, Full], Any]) -> tuple[Any, ...]:
    """(bias, mask, caps) tiles of one score block; ``load(ref, full)`` reads a tile."""
    bias = None if refs.bias is None else load(refs.bias, cfg.bias_full)
    mask = None if refs.mask is None else load(refs.mask, cfg.mask_full)
    caps = tuple(
        _cap_tile(load(r, full), kind)
        for r, full, kind in zip(refs.caps, cfg.cap_full, cfg.cap_kinds, strict=True)
    )
    return bias, mask, caps


def _kv_tile(start: Any, bk: int) -> Callable[[Any, Full], Any]:
    """Loader of the kv block at ``start`` from a ref holding a q block x all keys."""

    def load(ref: Any, full: Full) -> Any:
        return ref[:, pl.ds(start, bk)] if full[3] else ref[...]

    return load


def _q_tile(rows: Any) -> Callable[[Any, Full], Any]:
    """Loader of the q rows ``rows`` from a ref holding all queries x a kv block."""

    def load(ref: Any, full: Full) -> Any:
        return ref[rows, :] if full[2] else ref[...]

    return load


def _scores(
    cfg: _Cfg,
    q: jax.Array,
    k: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    tiles: tuple[Any, ...],
    bh: tuple[Any, Any],
    structural: bool,
    with_vjp: bool = False,
) -> tuple[jax.Array, jax.Array | None, Any]:
    """Score tile, its keep-mask (None when nothing is masked by mask/mask_mod/causal) and,
    ``with_vjp``, the VJP of ``score_mod`` at this tile (None without one).

    ``structural`` = apply causal and kv-padding masks (only needed on diagonal /
    padded blocks).  Fast mode (plain/causal) returns log2-domain scores; exact mode
    returns natural-domain scores with masked entries = finfo.min (like the reference)
    and padded keys = -inf.
    """
    s = dsp.dot(q, k, trans_b=True, precision=cfg.precision)
    kv_padded = structural and cfg.kv_padded
    if cfg.exact:
        bias, mask, caps = tiles
        idx = (*bh, q_pos[:, None], k_pos[None, :])
        s = s * cfg.scale
        mod_vjp = None
        if cfg.score_mod is not None:
            mod = functools.partial(_apply_score_mod, cfg.score_mod, idx=idx, caps=caps)
            s, mod_vjp = jax.vjp(mod, s) if with_vjp else (mod(s), None)
        if bias is not None:
            s = s + bias.astype(jnp.float32)
        keep = None if mask is None else (mask != 0)
        if cfg.mask_mod is not None:
            kept = _apply_mask_mod(cfg.mask_mod, s.shape, idx, caps)
            keep = kept if keep is None else jnp.logical_and(keep, kept)
        if structural and cfg.causal:
            tri = q_pos[:, None] >= k_pos[None, :]
            keep = tri if keep is None else jnp.logical_and(keep, tri)
        if keep is not None:
            s = jnp.where(keep, s, MASK_VALUE)
        if kv_padded:
            s = jnp.where(k_pos[None, :] < cfg.kv_len, s, -jnp.inf)
        return s, keep, mod_vjp
    s = s * (cfg.scale * _LOG2E)
    valid = None
    if structural and cfg.causal:
        valid = q_pos[:, None] >= k_pos[None, :]
    if kv_padded:
        kvv = k_pos[None, :] < cfg.kv_len
        valid = kvv if valid is None else jnp.logical_and(valid, kvv)
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    return s, None, None


def _score_grad(
    cfg: _Cfg, p: jax.Array, dpv: jax.Array, delta: jax.Array, keep: Any, mod_vjp: Any
) -> jax.Array:
    """dL/d(scaled q k^T) of a tile: through the softmax, the masks and ``score_mod``."""
    ds = p * (dpv - delta[:, None])
    if keep is not None:
        ds = jnp.where(keep, ds, 0.0)
    if mod_vjp is not None:
        (ds,) = mod_vjp(ds)
    return ds


def _exp(cfg: _Cfg, x: jax.Array) -> jax.Array:
    return jnp.exp2(x * _LOG2E) if cfg.exact else jnp.exp2(x)


def _safe_max(m: jax.Array) -> jax.Array:
    """Row max usable as an exponent offset (rows that are all -inf stay finite)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def _fori(lo: Any, hi: Any, body: Any, carry: Any) -> Any:
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


def _floor_div(x: Any, n: int) -> Any:
    """Floor division of an int32 scalar (``lax.div`` truncates toward zero)."""
    if isinstance(x, int):
        return x // n
    return lax.div(x, n) - (lax.rem(x, n) < 0).astype(jnp.int32)


def _clip(x: Any, hi: int) -> Any:
    return jnp.minimum(jnp.maximum(x, 0), hi)


def _as_flag(pred: jax.Array) -> jax.Array:
    """0/1 int32 (range arithmetic instead of a select between literals, which
    Pallas-Triton (jax 0.11) mis-types as i1 vs i32)."""
    return pred.astype(jnp.int32)


def _kv_ranges(cfg: _Cfg, q_start: Any, bq: int, bk: int, nk: int) -> tuple[Any, Any, Any]:
    """(lo, mid, hi) for the q block at ``q_start``: kv blocks [lo, hi) hold its band's
    keys (the rest are skipped); [lo, mid) need no causal or kv-padding mask, [mid, hi) do."""
    blo, bhi = cfg.band
    lo = 0 if blo is None else _clip(_floor_div(q_start + blo, bk), nk)
    hi = nk if bhi is None else _clip(_floor_div(q_start + bq - 1 + bhi, bk) + 1, nk)
    mid = min(cfg.kv_len // bk, nk)
    if cfg.causal:  # blocks wholly at or below the diagonal
        mid = jnp.minimum(_floor_div(q_start + 1, bk), mid)
    if cfg.banded:
        mid = jnp.minimum(jnp.maximum(mid, lo), hi)
    return lo, mid, hi


def _q_ranges(
    cfg: _Cfg, j: Any, bq: int, bk: int, nq: int, q_offset: Any = 0
) -> tuple[Any, Any, Any]:
    """(lo, mid, hi) for kv block ``j``: q blocks [lo, hi) hold the rows whose band reaches
    it (the rest are skipped); [lo, mid) need the causal or kv-padding mask, [mid, hi) not.
    Row ``i`` has position ``q_offset + i``."""
    blo, bhi = cfg.band
    k_start = j * bk - q_offset  # the key block's start, in rows
    lo = 0 if bhi is None else _clip(_floor_div(k_start - bhi, bq), nq)
    hi = nq if blo is None else _clip(_floor_div(k_start + bk - 1 - blo, bq) + 1, nq)
    mid = lo
    if cfg.causal:  # q blocks wholly at or below the diagonal need no mask
        below = _floor_div(k_start + bk - 1 + bq - 1, bq)
        mid = jnp.minimum(jnp.maximum(below, lo), hi)
    if cfg.kv_padded:  # a block holding padded keys needs the kv-length mask everywhere
        padded = _clip(j - cfg.kv_len // bk + 1, 1)
        mid = mid + (hi - mid) * padded
    return lo, mid, hi


def _lost(m: jax.Array) -> jax.Array:
    """1 when some row saw only masked scores (so far), else 0."""
    return _as_flag(jnp.min(m) <= _FULLY_MASKED_THRESHOLD)


def _visit_outside(cfg: _Cfg, lo: Any, hi: Any, n: int, lost: Any, body: Any, carry: Any) -> Any:
    """Visit the blocks outside [lo, hi) when ``lost`` (reference semantics: a row with no
    unmasked key averages over all keys, including those outside the band)."""
    blo, bhi = cfg.band
    if blo is not None:
        carry = _fori(0, lo * lost, body, carry)
    if bhi is not None:
        carry = _fori(hi, hi + (n - hi) * lost, body, carry)
    return carry


def _finish_rows(
    cfg: _Cfg, o: jax.Array, m: jax.Array, denom: jax.Array, sinks_ref: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalised output and the (m, denom) statistics, with the sink logit folded in
    and, for ``masked_rows="zero"``, fully masked rows set to 0 (denom = inf, so the
    backward pass gives them zero gradients)."""
    dead = m <= _FULLY_MASKED_THRESHOLD
    if sinks_ref is not None:
        sink = jnp.max(sinks_ref[...].astype(jnp.float32), axis=1)  # (1,)
        m_all = jnp.maximum(m, sink)
        alpha = _exp(cfg, m - m_all)
        denom = alpha * denom + _exp(cfg, sink - m_all)
        o = alpha[:, None] * o
        m = m_all
    out = o / denom[:, None]
    if cfg.zero_rows:
        out = jnp.where(dead[:, None], 0.0, out)
        denom = jnp.where(dead, jnp.inf, denom)
    return out, m, denom


def _fwd_kernel(*refs: Any, cfg: _Cfg, with_stats: bool) -> None:
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    ops = _take_refs(it, cfg)
    o_ref = next(it)
    m_ref, l_ref = (next(it), next(it)) if with_stats else (None, None)

    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    nk = k_ref.shape[0] // bk
    q_start = pl.program_id(0) * bq + _q_offset(ops)  # the block's first position
    bh = (pl.program_id(1), pl.program_id(2))
    q = q_ref[...]
    q_pos = q_start + jnp.arange(bq, dtype=jnp.int32)

    def body(j: Any, carry: Any, structural: bool) -> Any:
        o, m, denom = carry
        start = j * bk
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        tiles = _load_tiles(cfg, ops, _kv_tile(start, bk))
        k_pos = start + jnp.arange(bk, dtype=jnp.int32)
        s, _, _ = _scores(cfg, q, k, q_pos, k_pos, tiles, bh, structural)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = _safe_max(m_new)
        alpha = _exp(cfg, m - m_use)
        p = _exp(cfg, s - m_use[:, None])
        denom = alpha * denom + jnp.sum(p, axis=1)
        o = alpha[:, None] * o + dsp.dot(p.astype(v.dtype), v, precision=cfg.precision)
        return o, m_new, denom

    dp = q.shape[-1]
    carry = (
        jnp.zeros((bq, dp), jnp.float32),
        jnp.full((bq,), -jnp.inf, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    lo, mid, hi = _kv_ranges(cfg, q_start, bq, bk, nk)
    carry = _fori(lo, mid, functools.partial(body, structural=False), carry)
    carry = _fori(mid, hi, functools.partial(body, structural=True), carry)
    if cfg.revisit:
        structural = functools.partial(body, structural=True)
        carry = _visit_outside(cfg, lo, hi, nk, _lost(carry[1]), structural, carry)
    out, m, denom = _finish_rows(cfg, *carry, ops.sinks)
    o_ref[...] = out.astype(o_ref.dtype)
    if with_stats:
        m_ref[...] = m
        l_ref[...] = denom


def _dq_kernel(*refs: Any, cfg: _Cfg) -> None:
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    ops = _take_refs(it, cfg)
    do_ref, m_ref, l_ref, delta_ref, dq_ref = next(it), next(it), next(it), next(it), next(it)

    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_k_bwd
    nk = k_ref.shape[0] // bk
    q_start = pl.program_id(0) * bq + _q_offset(ops)
    bh = (pl.program_id(1), pl.program_id(2))
    q = q_ref[...]
    do = do_ref[...]
    m = m_ref[...]
    m_use = _safe_max(m)
    inv_l = 1.0 / l_ref[...]
    delta = delta_ref[...]
    q_pos = q_start + jnp.arange(bq, dtype=jnp.int32)

    def body(j: Any, dq: Any, structural: bool) -> Any:
        start = j * bk
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        tiles = _load_tiles(cfg, ops, _kv_tile(start, bk))
        k_pos = start + jnp.arange(bk, dtype=jnp.int32)
        s, keep, mod_vjp = _scores(cfg, q, k, q_pos, k_pos, tiles, bh, structural, with_vjp=True)
        p = _exp(cfg, s - m_use[:, None]) * inv_l[:, None]
        dpv = dsp.dot(do, v, trans_b=True, precision=cfg.precision)
        ds = _score_grad(cfg, p, dpv, delta, keep, mod_vjp)
        return dq + dsp.dot(ds.astype(k.dtype), k, precision=cfg.precision)

    dq = jnp.zeros((bq, q.shape[-1]), jnp.float32)
    lo, mid, hi = _kv_ranges(cfg, q_start, bq, bk, nk)
    dq = _fori(lo, mid, functools.partial(body, structural=False), dq)
    dq = _fori(mid, hi, functools.partial(body, structural=True), dq)
    if cfg.revisit:
        structural = functools.partial(body, structural=True)
        dq = _visit_outside(cfg, lo, hi, nk, _lost(m), structural, dq)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs: Any, cfg: _Cfg) -> None:
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    ops = _take_refs(it, cfg)
    do_ref, m_ref, l_ref, delta_ref = next(it), next(it), next(it), next(it)
    dk_ref, dv_ref = next(it), next(it)

    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_k_bwd
    nq = q_ref.shape[0] // bq
    j = pl.program_id(0)
    bh = (pl.program_id(1), pl.program_id(2))
    k = k_ref[...]
    v = v_ref[...]
    k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
    q_offset = _q_offset(ops)

    def body(i: Any, carry: Any, structural: bool) -> Any:
        dk, dv = carry
        start = i * bq
        rows = pl.ds(start, bq)
        q = q_ref[rows, :]
        do = do_ref[rows, :]
        m_use = _safe_max(m_ref[rows])
        inv_l = 1.0 / l_ref[rows]
        delta = delta_ref[rows]
        tiles = _load_tiles(cfg, ops, _q_tile(rows))
        q_pos = start + q_offset + jnp.arange(bq, dtype=jnp.int32)
        s, keep, mod_vjp = _scores(cfg, q, k, q_pos, k_pos, tiles, bh, structural, with_vjp=True)
        p = _exp(cfg, s - m_use[:, None]) * inv_l[:, None]
        dv = dv + dsp.dot(p.astype(do.dtype), do, trans_a=True, precision=cfg.precision)
        dpv = dsp.dot(do, v, trans_b=True, precision=cfg.precision)
        ds = _score_grad(cfg, p, dpv, delta, keep, mod_vjp)
        dk = dk + dsp.dot(ds.astype(q.dtype), q, trans_a=True, precision=cfg.precision)
        return dk, dv

    dp = k.shape[-1]
    carry = (jnp.zeros((bk, dp), jnp.float32), jnp.zeros((bk, dp), jnp.float32))
    lo, mid, hi = _q_ranges(cfg, j, bq, bk, nq, q_offset)
    carry = _fori(lo, mid, functools.partial(body, structural=True), carry)
    carry = _fori(mid, hi, functools.partial(body, structural=False), carry)
    if cfg.revisit:
        # q blocks outside the band only matter for their fully masked rows.
        def row_min(i: Any, acc: Any) -> Any:
            return jnp.minimum(acc, jnp.min(m_ref[pl.ds(i * bq, bq)]))

        structural = functools.partial(body, structural=True)
        if cfg.band[1] is not None:
            low = _as_flag(_fori(0, lo, row_min, jnp.float32(jnp.inf)) <= _FULLY_MASKED_THRESHOLD)
            carry = _fori(0, lo * low, structural, carry)
        if cfg.band[0] is not None:
            high = _as_flag(_fori(hi, nq, row_min, jnp.float32(jnp.inf)) <= _FULLY_MASKED_THRESHOLD)
            carry = _fori(hi, hi + (nq - hi) * high, structural, carry)
    dk, dv = carry
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# --------------------------------------------------------------------------- #
# pallas_call wrappers (padded, normalised operands)
# --------------------------------------------------------------------------- #


def _dims(cfg: _Cfg, q: jax.Array, k: jax.Array) -> tuple[int, int, int, int, int]:
    b, sq, hq, dp = _split(q.shape, cfg.layout)
    _, skv, _, _ = _split(k.shape, cfg.layout)
    return b, sq, hq, skv, dp


def _stats_shape(b: int, hq: int, sq: int, like: jax.Array) -> jax.ShapeDtypeStruct:
    return dsp.out_struct((b, hq, sq), jnp.float32, like)


def _score_operands(
    cfg: _Cfg,
    bias: jax.Array | None,
    mask: jax.Array | None,
    caps: tuple[jax.Array, ...],
    sinks: jax.Array | None,
    q_offset: jax.Array | None = None,
) -> list[tuple[jax.Array, Full]]:
    """The kernels' score-layout operands with their real (unbroadcast) dims, in the
    order :func:`_take_refs` reads them."""
    ops: list[tuple[jax.Array, Full]] = []
    if bias is not None:
        ops.append((bias, cfg.bias_full))
    if mask is not None:
        ops.append((mask, cfg.mask_full))
    ops += list(zip(caps, cfg.cap_full, strict=True))
    if sinks is not None:
        ops.append((sinks, _SINK_FULL))
    if q_offset is not None:
        ops.append((q_offset, (False,) * 4))  # [1, 1, 1, 1]: every block reads it
    return ops


def _kv_head(cfg: _Cfg) -> Callable[[Any], Any]:
    g = cfg.group
    return (lambda h: lax.div(h, g)) if g > 1 else _ident


def _fwd_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    score_ops: list[tuple[jax.Array, Full]],
    cfg: _Cfg,
    with_stats: bool,
) -> tuple[jax.Array, ...]:
    b, sq, hq, skv, dp = _dims(cfg, q, k)
    bq = cfg.blocks.block_q
    kv_head = _kv_head(cfg)
    in_specs = [
        _act_spec(cfg.layout, bq, dp, _ident, _ident),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
    ]
    in_specs += [_score_spec(full, bq, skv, _ident, _zero) for _, full in score_ops]
    out_shape = [dsp.out_struct(q.shape, q.dtype, q)]
    out_specs = [_act_spec(cfg.layout, bq, dp, _ident, _ident)]
    if with_stats:
        out_shape += [_stats_shape(b, hq, sq, q)] * 2
        out_specs += [_row_spec(bq, _ident)] * 2
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, with_stats=with_stats),
        grid=(sq // bq, b, hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="flash_attention_fwd",
        **dsp.pallas_call_kwargs(cfg.interpret, cfg.blocks.num_warps, cfg.blocks.num_stages),
    )(q, k, v, *(x for x, _ in score_ops))


def _bwd_calls(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    score_ops: list[tuple[jax.Array, Full]],
    do: jax.Array,
    m: jax.Array,
    denom: jax.Array,
    delta: jax.Array,
    cfg: _Cfg,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, sq, hq, skv, dp = _dims(cfg, q, k)
    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_k_bwd
    g = cfg.group
    kv_head = _kv_head(cfg)
    params = dsp.pallas_call_kwargs(
        cfg.interpret, cfg.blocks.num_warps_bwd, cfg.blocks.num_stages_bwd
    )
    ops = [x for x, _ in score_ops]

    # dQ: grid over q blocks, loop over kv blocks.
    in_specs = [
        _act_spec(cfg.layout, bq, dp, _ident, _ident),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
    ]
    in_specs += [_score_spec(full, bq, skv, _ident, _zero) for _, full in score_ops]
    in_specs += [_act_spec(cfg.layout, bq, dp, _ident, _ident)] + [_row_spec(bq, _ident)] * 3
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(sq // bq, b, hq),
        in_specs=in_specs,
        out_specs=_act_spec(cfg.layout, bq, dp, _ident, _ident),
        out_shape=dsp.out_struct(q.shape, q.dtype, q),
        name="flash_attention_bwd_dq",
        **params,
    )(q, k, v, *ops, do, m, denom, delta)

    # dK, dV: grid over kv blocks (per q head), loop over q blocks.
    in_specs = [
        _act_spec(cfg.layout, sq, dp, _zero, _ident),
        _act_spec(cfg.layout, bk, dp, _ident, kv_head),
        _act_spec(cfg.layout, bk, dp, _ident, kv_head),
    ]
    in_specs += [_score_spec(full, sq, bk, _zero, _ident) for _, full in score_ops]
    in_specs += [_act_spec(cfg.layout, sq, dp, _zero, _ident)] + [_row_spec(sq, _zero)] * 3
    # Per-q-head partial dK/dV; summed over each kv group below (f32 when summing).
    part_dtype = jnp.float32 if g > 1 else k.dtype
    part_shape = (b, skv, hq, dp) if cfg.layout == "BSHD" else (b, hq, skv, dp)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg),
        grid=(skv // bk, b, hq),
        in_specs=in_specs,
        out_specs=[_act_spec(cfg.layout, bk, dp, _ident, _ident)] * 2,
        out_shape=[dsp.out_struct(part_shape, part_dtype, q)] * 2,
        name="flash_attention_bwd_dkdv",
        **params,
    )(q, k, v, *ops, do, m, denom, delta)
    if g > 1:
        hkv = hq // g
        if cfg.layout == "BSHD":
            dk = dk.reshape(b, skv, hkv, g, dp).sum(axis=3)
            dv = dv.reshape(b, skv, hkv, g, dp).sum(axis=3)
        else:
            dk = dk.reshape(b, hkv, g, skv, dp).sum(axis=2)
            dv = dv.reshape(b, hkv, g, skv, dp).sum(axis=2)
    return dq, dk.astype(k.dtype), dv.astype(v.dtype)


def _to_score_layout(x: jax.Array, layout: str) -> jax.Array:
    """[B,S,H,D] or [B,H,S,D] -> [B,H,S,D]."""
    return x.transpose(0, 2, 1, 3) if layout == "BSHD" else x


def _score_grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    caps: tuple[jax.Array, ...],
    do: jax.Array,
    m: jax.Array,
    denom: jax.Array,
    delta: jax.Array,
    cfg: _Cfg,
    q_offset: jax.Array | None = None,
) -> tuple[jax.Array | None, tuple[jax.Array | None, ...]]:
    """dL/dbias (dS reduced over the bias's broadcast dims) and dL/d(float captures) (dS
    through ``score_mod``), in XLA from the kernels' residuals.

    Materialises [B, Hq, Sq, Skv]; dead code (removed by XLA under jit) whenever those
    cotangents are not consumed.
    """
    floats = [i for i, kind in enumerate(cfg.cap_kinds) if kind == "float"]
    if cfg.score_mod is None:
        floats = []
    no_caps: tuple[None, ...] = (None,) * len(caps)
    if bias is None and not floats:
        return None, no_caps
    g = cfg.group
    qh = _to_score_layout(q, cfg.layout)
    kh = jnp.repeat(_to_score_layout(k, cfg.layout), g, axis=1)
    vh = jnp.repeat(_to_score_layout(v, cfg.layout), g, axis=1)
    doh = _to_score_layout(do, cfg.layout)
    hp = cfg.precision
    s = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32, precision=hp)
    s = s * cfg.scale
    idx = _score_indices(*s.shape, q_offset)
    capv = [_cap_tile(c, kind) for c, kind in zip(caps, cfg.cap_kinds, strict=True)]
    caps_vjp = None
    if cfg.score_mod is not None:

        def modded(fcaps: tuple[jax.Array, ...]) -> jax.Array:
            vals = list(capv)
            for i, c in zip(floats, fcaps, strict=True):
                vals[i] = c
            return _apply_score_mod(cfg.score_mod, s, idx, tuple(vals))

        fcaps = tuple(capv[i] for i in floats)
        s, caps_vjp = jax.vjp(modded, fcaps) if floats else (modded(fcaps), None)
    if bias is not None:
        s = s + bias.astype(jnp.float32)
    keep = None if mask is None else (mask != 0)
    if cfg.mask_mod is not None:
        kept = _apply_mask_mod(cfg.mask_mod, s.shape, idx, tuple(capv))
        keep = kept if keep is None else jnp.logical_and(keep, kept)
    if cfg.causal:
        keep = _and(keep, idx[2] >= idx[3])
    if keep is not None:
        s = jnp.where(keep, s, MASK_VALUE)
    s = jnp.where(idx[3] < cfg.kv_len, s, -jnp.inf)
    # exponent <= 0: keys a band skipped in a zero row may exceed that row's max.
    p = jnp.exp(jnp.minimum(s - _safe_max(m)[..., None], 0.0)) / denom[..., None]
    dpv = jnp.einsum("bhqd,bhkd->bhqk", doh, vh, preferred_element_type=jnp.float32, precision=hp)
    ds = p * (dpv - delta[..., None])
    if keep is not None:
        ds = jnp.where(keep, ds, 0.0)
    dbias = None
    if bias is not None:
        axes = tuple(i for i, full in enumerate(cfg.bias_full) if not full)
        dbias = ds.sum(axis=axes, keepdims=True).astype(bias.dtype)
    dcaps = list(no_caps)
    if caps_vjp is not None:
        (grads,) = caps_vjp(ds)
        for i, gr in zip(floats, grads, strict=True):
            dcaps[i] = gr.astype(caps[i].dtype)
    return dbias, tuple(dcaps)


def _and(a: jax.Array | None, b: jax.Array) -> jax.Array:
    return b if a is None else jnp.logical_and(a, b)


def _sinks_grad(sinks: jax.Array, m: jax.Array, denom: jax.Array, delta: jax.Array) -> jax.Array:
    """dL/dsinks: the sink's softmax weight times (0 - delta), summed over batch and rows."""
    sink = sinks.reshape(1, -1, 1)
    p_sink = jnp.exp(jnp.minimum(sink - _safe_max(m), 0.0)) / denom
    return -jnp.sum(p_sink * delta, axis=(0, 2)).reshape(sinks.shape).astype(sinks.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    caps: tuple[jax.Array, ...],
    sinks: jax.Array | None,
    q_offset: jax.Array | None,
    cfg: _Cfg,
) -> jax.Array:
    ops = _score_operands(cfg, bias, mask, caps, sinks, q_offset)
    return _fwd_call(q, k, v, ops, cfg, with_stats=False)[0]


def _flash_core_fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    caps: tuple[jax.Array, ...],
    sinks: jax.Array | None,
    q_offset: jax.Array | None,
    cfg: _Cfg,
) -> tuple[jax.Array, tuple[Any, ...]]:
    ops = _score_operands(cfg, bias, mask, caps, sinks, q_offset)
    o, m, denom = _fwd_call(q, k, v, ops, cfg, with_stats=True)
    return o, (q, k, v, bias, mask, caps, sinks, q_offset, o, m, denom)


def _flash_core_bwd(cfg: _Cfg, res: tuple[Any, ...], do: jax.Array) -> tuple[Any, ...]:
    q, k, v, bias, mask, caps, sinks, q_offset, o, m, denom = res
    # rowsum(o * do) as an elementwise product + reduction (an einsum would be a
    # dot, i.e. TF32 on GPU under default precision).
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    if cfg.layout == "BSHD":
        delta = delta.transpose(0, 2, 1)
    ops = _score_operands(cfg, bias, mask, caps, sinks, q_offset)
    dq, dk, dv = _bwd_calls(q, k, v, ops, do, m, denom, delta, cfg)
    dbias, dcaps = _score_grads(q, k, v, bias, mask, caps, do, m, denom, delta, cfg, q_offset)
    dsinks = None if sinks is None else _sinks_grad(sinks, m, denom, delta)
    return dq, dk, dv, dbias, None, dcaps, dsinks, None


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)


def _pad_axis(
    x: jax.Array, axis: int, size: int, value: Any = 0, mode: str = "constant"
) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    if mode == "edge":
        return jnp.pad(x, widths, mode="edge")
    return jnp.pad(x, widths, constant_values=value)


def _prep_score_operand(
    x: jax.Array, sq_pad: int, skv_pad: int, fill: Any, mode: str = "constant"
) -> tuple[jax.Array, Full]:
    """Rank-4 score-layout operand, real dims padded to the kernel's lengths."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    full = tuple(bool(x.shape[i] != 1) for i in range(4))
    # A size-1 dim whose target is also 1 stays "broadcast"; same block either way.
    if full[2]:
        x = _pad_axis(x, 2, sq_pad, fill, mode)
    if full[3]:
        x = _pad_axis(x, 3, skv_pad, fill, mode)
    return x, full  # type: ignore[return-value]


def _prep_captures(
    captures: tuple[jax.Array, ...], sq_pad: int, skv_pad: int
) -> tuple[tuple[jax.Array, ...], tuple[Full, ...], tuple[str, ...]]:
    """Captured operands padded by repeating their edge (padded rows and keys then see
    real values, so a modifier stays finite there), booleans stored as int8."""
    caps, fulls, kinds = [], [], []
    for c in captures:
        if jnp.issubdtype(c.dtype, jnp.floating):
            kind = "float"
        elif c.dtype == jnp.bool_:
            kind, c = "bool", c.astype(jnp.int8)
        else:
            kind = "int"
        c, full = _prep_score_operand(c, sq_pad, skv_pad, 0, mode="edge")
        caps.append(c)
        fulls.append(full)
        kinds.append(kind)
    return tuple(caps), tuple(fulls), tuple(kinds)


def _effective_band(
    band: tuple[int | None, int | None] | None, causal: bool, mask_is_causal: bool
) -> tuple[int | None, int | None]:
    """The band the kernels skip outside of: the given one, narrowed by the causal diagonal."""
    lo, hi = band or (None, None)
    if causal or mask_is_causal:
        hi = 0 if hi is None else min(hi, 0)
    return lo, hi


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale",
        "causal",
        "mask_is_causal",
        "layout",
        "interpret",
        "blocks",
        "precision",
        "score_mod",
        "mask_mod",
        "band",
        "masked_rows",
    ),
)
def _flash_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    captures: tuple[jax.Array, ...],
    sinks: jax.Array | None,
    q_offset: jax.Array | None,
    *,
    scale: float,
    causal: bool,
    mask_is_causal: bool,
    layout: str,
    interpret: bool,
    blocks: AttentionBlocks | None,
    precision: Any,
    score_mod: Callable[..., Any] | None,
    mask_mod: Callable[..., Any] | None,
    band: tuple[int | None, int | None] | None,
    masked_rows: str,
) -> jax.Array:
    b, sq, hq, d = _split(q.shape, layout)
    _, skv, hkv, _ = _split(k.shape, layout)
    # Zero columns change no dot product; 16 is the smallest tile Triton's dot accepts.
    dp = max(16, dsp.next_pow2(d))
    band = _effective_band(band, causal, mask_is_causal)
    if blocks is None:
        blocks = default_blocks(
            sq,
            skv,
            dp,
            q.dtype,
            interpret,
            band[1] is not None,
            exact=bias is not None or mask is not None or bool(captures),
        )
    else:
        blocks = clamp_blocks(blocks, sq, skv)
    sq_pad = dsp.round_up(sq, max(blocks.block_q, blocks.block_q_bwd))
    skv_pad = dsp.round_up(skv, max(blocks.block_k, blocks.block_k_bwd))
    seq_ax = 1 if layout == "BSHD" else 2
    qp = _pad_axis(_pad_axis(q, 3, dp), seq_ax, sq_pad)
    kp = _pad_axis(_pad_axis(k, 3, dp), seq_ax, skv_pad)
    vp = _pad_axis(_pad_axis(v, 3, dp), seq_ax, skv_pad)
    bias_full = mask_full = (False,) * 4
    if bias is not None:
        bias, bias_full = _prep_score_operand(bias, sq_pad, skv_pad, 0)
    if mask is not None:
        mask = (mask if mask.dtype == jnp.bool_ else mask != 0).astype(jnp.int8)
        # Padded query rows attend (so they never look "fully masked"); padded keys
        # are excluded by the kernel's kv-length check.
        mask, mask_full = _prep_score_operand(mask, sq_pad, skv_pad, 1)
    caps, cap_full, cap_kinds = _prep_captures(captures, sq_pad, skv_pad)
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(1, hq, 1, 1)
    # the kernels read the offset only where positions matter
    if band == (None, None) and score_mod is None and mask_mod is None:
        q_offset = None
    if q_offset is not None:
        q_offset = q_offset.reshape(1, 1, 1, 1)
    cfg = _Cfg(
        layout=layout,
        causal=causal,
        band=band,
        scale=scale,
        kv_len=skv,
        kv_padded=skv_pad != skv,
        group=hq // hkv,
        has_bias=bias is not None,
        has_mask=mask is not None,
        bias_full=bias_full,
        mask_full=mask_full,
        score_mod=score_mod,
        mask_mod=mask_mod,
        cap_full=cap_full,
        cap_kinds=cap_kinds,
        has_sinks=sinks is not None,
        has_offset=q_offset is not None,
        zero_rows=masked_rows == "zero",
        blocks=blocks,
        interpret=interpret,
        precision=precision,
    )
    out = _flash_core(qp, kp, vp, bias, mask, caps, sinks, q_offset, cfg)
    if layout == "BSHD":
        return out[:, :sq, :, :d]
    return out[:, :, :sq, :d]


# --------------------------------------------------------------------------- #
# Public entry point
# --------------------------------------------------------------------------- #


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    *,
    scale: float | None = None,
    causal: bool = False,
    mask_is_causal: bool = False,
    layout: str = "BSHD",
    impl: str | None = None,
    score_mod: Callable[..., Any] | None = None,
    mask_mod: Callable[..., Any] | None = None,
    captures: Sequence[jax.Array] = (),
    band: tuple[int | None, int | None] | None = None,
    sinks: jax.Array | None = None,
    masked_rows: str = "uniform",
    q_offset: Any = 0,
    _blocks: AttentionBlocks | None = None,
) -> jax.Array:
    """Memory-efficient attention; same semantics as :func:`attention_reference`.

    Args:
      q: ``[B, Sq, Hq, D]`` ("BSHD") or ``[B, Hq, Sq, D]`` ("BHSD"), any ``D`` in 1..256.
      k, v: same layout with ``Skv`` and ``Hkv`` (``Hq % Hkv == 0``).
      bias: additive float array broadcastable to ``[B, Hq, Sq, Skv]`` (0-d too).
      mask: boolean array broadcastable to ``[B, Hq, Sq, Skv]``, True = attend.
      scale: score scale, default ``1/sqrt(D)`` (a Python number).
      causal: top-left aligned causal mask (query i attends keys j <= i).
      mask_is_causal: a promise that ``bias``/``mask``/``mask_mod`` already mask out every
        key above that diagonal (mask False, or bias <= ``MASK_VALUE / 2``): the same as
        ``band=(None, 0)``. Unlike ``causal``, nothing is masked by it, so a score the
        bias masks keeps its gradient.
      layout: "BSHD" or "BHSD".
      impl: None (auto), "xla", "interpret" or "pallas"; see ``pallas_kernels``.
      score_mod: ``score_mod(s, b, h, qi, ki, *captures) -> s'``, elementwise, applied to
        the scaled f32 scores before the bias (a static, hashable callable).
      mask_mod: ``mask_mod(b, h, qi, ki, *captures) -> bool`` (True = attend).
      captures: arrays broadcastable to ``[B, Hq, Sq, Skv]`` that the modifiers read.
      band: ``(lo, hi)`` (ints or None): a promise that every key outside
        ``qi + lo <= ki <= qi + hi`` is masked; the kernel skips the kv blocks outside it.
      sinks: ``[Hq]`` float logits, one per head, counted in each row's softmax.
      masked_rows: "uniform" (a fully masked row averages all of v) or "zero" (outputs 0).
      q_offset: the position of the first query (an int or an integer scalar, traced or
        not): row ``i`` has position ``q_offset + i`` for ``causal``, ``band`` and the
        modifiers' ``qi``; bias, mask and captures stay indexed by row.

    Returns:
      Array in q's layout and dtype.  Differentiable w.r.t. q, k, v, bias, the float
      captures and sinks; masks get no gradient. Reverse mode runs the backward kernels
      (``custom_vjp``); forward mode (``jvp``, ``jacfwd``, ``hessian``) takes its tangents
      from the reference (``pallas_kernels._autodiff``).
    """
    layout = _check_layout(layout)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    bias = None if bias is None else jnp.asarray(bias)
    mask = None if mask is None else jnp.asarray(mask)
    _validate_arrays(q, k, v, bias, mask, layout)
    causal, mask_is_causal = bool(causal), bool(mask_is_causal)
    mods = _check_mods(
        q,
        k,
        layout,
        bias,
        mask,
        causal,
        mask_is_causal,
        score_mod,
        mask_mod,
        captures,
        band,
        sinks,
        masked_rows,
    )
    q_offset = _check_q_offset(q_offset)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else dsp.static_float(scale, "scale")
    reason = _kernel_error(
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        layout,
        None if bias is None else bias.shape,
        None if mask is None else mask.shape,
    )
    if reason is None and not (q.dtype == k.dtype == v.dtype):
        reason = f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    impl = dsp.resolve_impl(impl, reason, "flash_attention")
    if impl == "xla":
        return _reference_jit(
            q,
            k,
            v,
            bias,
            mask,
            scale=scale,
            causal=causal,
            layout=layout,
            score_mod=mods.score_mod,
            mask_mod=mods.mask_mod,
            captures=mods.captures,
            sinks=mods.sinks,
            masked_rows=mods.masked_rows,
            q_offset=q_offset,
        )
    kernel = functools.partial(
        _flash_pallas,
        scale=scale,
        causal=causal,
        mask_is_causal=mask_is_causal,
        layout=layout,
        interpret=impl == "interpret",
        blocks=_blocks,
        precision=dsp.matmul_precision(q.dtype),
        score_mod=mods.score_mod,
        mask_mod=mods.mask_mod,
        band=mods.band,
        masked_rows=mods.masked_rows,
    )

    def reference(q, k, v, bias, mask, captures, sinks, q_offset):  # the kernel's operands
        return _reference_jit(
            q,
            k,
            v,
            bias,
            mask,
            scale=scale,
            causal=causal,
            layout=layout,
            score_mod=mods.score_mod,
            mask_mod=mods.mask_mod,
            captures=captures,
            sinks=sinks,
            masked_rows=mods.masked_rows,
            q_offset=q_offset,
        )

    operands = (q, k, v, bias, mask, mods.captures, mods.sinks, q_offset)
    return with_forward_mode(kernel, reference)(*operands)
