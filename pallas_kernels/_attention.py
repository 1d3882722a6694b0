"""Flash attention: plain-JAX reference, Pallas kernels (forward + custom_vjp backward).

Semantics (shared by the reference and the kernels)
---------------------------------------------------
``scores = (q @ k^T) * scale + bias`` in f32; every score whose ``mask`` entry is
False, or that lies above the causal diagonal, is *replaced* by
``finfo(float32).min`` (exactly what Flax's ``dot_product_attention_weights``
does); ``softmax`` in f32; ``out = softmax @ v`` in q's dtype.

* ``causal`` is top-left aligned: query ``i`` attends keys ``j <= i`` whatever
  ``Sq`` and ``Skv`` are (no ``Skv - Sq`` offset). Flax and Hugging Face use the
  same alignment for equal lengths; for KV-cache style bottom-right alignment pass
  an explicit ``mask`` instead.
* A fully masked row therefore gets uniform weights over all ``Skv`` keys (the
  mean of ``v``), never NaN -- the kernels reproduce this exactly, including when
  causal block skipping would otherwise hide some of those keys.
* ``bias``/``mask`` are given in score layout ``[B, Hq, Sq, Skv]`` (numpy
  broadcasting, size-1 dims allowed) whatever the q/k/v layout.
* Grouped / multi-query attention: ``Hq % Hkv == 0``; q head ``h`` reads kv head
  ``h // (Hq // Hkv)``.

Kernel design
-------------
Forward is FlashAttention-2 style (grid over q blocks x batch x heads, online
softmax in f32, ``exp2`` with ``log2(e)`` folded into the score scale when there is
no bias/mask).  Blocks strictly below the causal diagonal and free of sequence
padding skip all masking work.  Non-divisible lengths are zero-padded to block
multiples in the wrapper; padded keys get ``-inf`` (so they never receive weight,
not even in fully masked rows) and padded query rows are sliced off.

Backward uses two kernels (dK/dV over kv blocks, dQ over q blocks) and the saved
per-row max ``m`` and normaliser ``denom`` (kept separately rather than as a
log-sum-exp so fully masked rows, whose max is ``finfo.min``, keep their exact
1/Skv weights).  With grouped kv heads dK/dV are produced per q head in f32 and
summed over the group by XLA.  The bias gradient is computed by XLA from the same
residuals (O(Sq*Skv) memory); under ``jit`` XLA removes it entirely when the
bias cotangent is unused (the usual constant padding bias).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

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
MIN_HEAD_DIM, MAX_HEAD_DIM = 32, 256


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
    q_shape: Any, k_shape: Any, v_shape: Any, layout: str, bias_shape: Any, mask_shape: Any
) -> str | None:
    """Reason the arguments are not a well-formed attention call (None if they are)."""
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
    for name, s in (("bias", bias_shape), ("mask", mask_shape)):
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
) -> str | None:
    """Reason the Pallas kernel cannot run this call (None when it can)."""
    err = _structure_error(q_shape, k_shape, v_shape, layout, bias_shape, mask_shape)
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
) -> bool:
    """True iff :func:`flash_attention`'s Pallas kernel handles these shapes/dtype.

    Pure Python (no tracing): rewrite rules call it as a guard.  ``dtype`` may be a
    name ("bfloat16") or a numpy/JAX dtype.  Requires rank-4 q/k/v in ``layout``,
    k.shape == v.shape, equal batch and head dim, ``Hq % Hkv == 0``, head dim in
    [32, 256], dtype in {float32, bfloat16, float16}, and bias/mask shapes
    broadcastable to ``[B, Hq, Sq, Skv]``.  Any sequence lengths are fine.
    """
    return _kernel_error(q_shape, k_shape, v_shape, dtype, layout, bias_shape, mask_shape) is None


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
    layout: str = "BSHD",
) -> jax.Array:
    """Plain-JAX attention (einsum + f32 softmax) with the module's semantics.

    This is also the ``impl="xla"`` fallback, so it is written the way XLA compiles
    best (plain 4-D einsums, one fused scale/bias/mask/softmax pass): on CPU it is
    at least as fast as the usual Flax-style original program.
    """
    _check_layout(layout)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    bias = None if bias is None else jnp.asarray(bias)
    mask = None if mask is None else jnp.asarray(mask)
    _validate_arrays(q, k, v, bias, mask, layout)
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
    if bias is not None:
        logits = logits + bias.astype(f32)
    keep = None
    if mask is not None:
        keep = mask if mask.dtype == jnp.bool_ else mask != 0
    if causal:
        tri = jnp.arange(sq)[:, None] >= jnp.arange(skv)[None, :]
        keep = tri if keep is None else jnp.logical_and(keep, tri)
    if keep is not None:
        logits = jnp.where(keep, logits, MASK_VALUE)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    eq = "bhqk,bkhd->bqhd" if layout == "BSHD" else "bhqk,bhkd->bhqd"
    out = jnp.einsum(eq, weights, v, preferred_element_type=f32)
    return out.astype(q.dtype)


_reference_jit = jax.jit(attention_reference, static_argnames=("scale", "causal", "layout"))


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


@dataclasses.dataclass(frozen=True)
class _Cfg:
    layout: str
    causal: bool  # mask the scores above the diagonal
    skip_above: bool  # skip the kv blocks above the diagonal (causal, or mask_is_causal)
    scale: float
    kv_len: int  # true (unpadded) kv length
    kv_padded: bool  # kv was padded to a block multiple (padded keys get -inf)
    group: int  # Hq // Hkv
    has_bias: bool
    has_mask: bool
    bias_full: tuple[bool, bool, bool, bool]  # per score dim: real extent (not broadcast)
    mask_full: tuple[bool, bool, bool, bool]
    blocks: AttentionBlocks
    interpret: bool
    precision: Any

    @property
    def exact(self) -> bool:
        """Bias/mask present: masked scores must be finfo.min (not -inf) and the
        softmax is evaluated in the natural-log domain to avoid overflowing it."""
        return self.has_bias or self.has_mask


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


def _scores(
    cfg: _Cfg,
    q: jax.Array,
    k: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    structural: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """Score tile and its keep-mask (None when nothing is masked by mask/causal).

    ``structural`` = apply causal and kv-padding masks (only needed on diagonal /
    padded blocks).  Fast mode (no bias/mask) returns log2-domain scores; exact mode
    returns natural-domain scores with masked entries = finfo.min (like the reference)
    and padded keys = -inf.
    """
    s = dsp.dot(q, k, trans_b=True, precision=cfg.precision)
    kv_padded = structural and cfg.kv_padded
    if cfg.exact:
        s = s * cfg.scale
        if bias is not None:
            s = s + bias.astype(jnp.float32)
        keep = None if mask is None else (mask != 0)
        if structural and cfg.causal:
            tri = q_pos[:, None] >= k_pos[None, :]
            keep = tri if keep is None else jnp.logical_and(keep, tri)
        if keep is not None:
            s = jnp.where(keep, s, MASK_VALUE)
        if kv_padded:
            s = jnp.where(k_pos[None, :] < cfg.kv_len, s, -jnp.inf)
        return s, keep
    s = s * (cfg.scale * _LOG2E)
    valid = None
    if structural and cfg.causal:
        valid = q_pos[:, None] >= k_pos[None, :]
    if kv_padded:
        kvv = k_pos[None, :] < cfg.kv_len
        valid = kvv if valid is None else jnp.logical_and(valid, kvv)
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    return s, None


def _exp(cfg: _Cfg, x: jax.Array) -> jax.Array:
    return jnp.exp2(x * _LOG2E) if cfg.exact else jnp.exp2(x)


def _safe_max(m: jax.Array) -> jax.Array:
    """Row max usable as an exponent offset (rows that are all -inf stay finite)."""
    return jnp.where(m == -jnp.inf, 0.0, m)


def _fori(lo: Any, hi: Any, body: Any, carry: Any) -> Any:
    if isinstance(lo, int) and isinstance(hi, int) and lo >= hi:
        return carry
    return lax.fori_loop(lo, hi, body, carry)


def _kv_ranges(cfg: _Cfg, q_start: Any, bq: int, bk: int, nk: int) -> tuple[Any, Any]:
    """(n_unmasked, hi) for a q block: kv blocks [0, n_unmasked) need no causal or
    padding mask; blocks [n_unmasked, hi) do; blocks >= hi are above the diagonal."""
    full_kv = cfg.kv_len // bk
    if not cfg.skip_above:
        return min(full_kv, nk), nk
    hi = jnp.minimum(lax.div(q_start + bq + bk - 1, bk), nk)
    n_unmasked = jnp.minimum(lax.div(q_start + 1, bk), full_kv)
    return n_unmasked, hi


def _fwd_kernel(*refs: Any, cfg: _Cfg, with_stats: bool) -> None:
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    bias_ref = next(it) if cfg.has_bias else None
    mask_ref = next(it) if cfg.has_mask else None
    o_ref = next(it)
    m_ref, l_ref = (next(it), next(it)) if with_stats else (None, None)

    bq, bk = cfg.blocks.block_q, cfg.blocks.block_k
    nk = k_ref.shape[0] // bk
    q_start = pl.program_id(0) * bq
    q = q_ref[...]
    q_pos = q_start + jnp.arange(bq, dtype=jnp.int32)
    kv_full_bias = cfg.has_bias and cfg.bias_full[3]
    kv_full_mask = cfg.has_mask and cfg.mask_full[3]

    def body(j: Any, carry: Any, structural: bool) -> Any:
        o, m, denom = carry
        start = j * bk
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        bias = None
        if bias_ref is not None:
            bias = bias_ref[:, pl.ds(start, bk)] if kv_full_bias else bias_ref[...]
        mask = None
        if mask_ref is not None:
            mask = mask_ref[:, pl.ds(start, bk)] if kv_full_mask else mask_ref[...]
        k_pos = start + jnp.arange(bk, dtype=jnp.int32)
        s, _ = _scores(cfg, q, k, q_pos, k_pos, bias, mask, structural)
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
    n_unmasked, hi = _kv_ranges(cfg, q_start, bq, bk, nk)
    carry = _fori(0, n_unmasked, functools.partial(body, structural=False), carry)
    carry = _fori(n_unmasked, hi, functools.partial(body, structural=True), carry)
    if cfg.skip_above and cfg.exact:
        # Rows that saw only masked scores must average over *all* keys (reference
        # semantics), including the causally skipped ones: visit them in that case.
        ext = jnp.where(jnp.min(carry[1]) <= _FULLY_MASKED_THRESHOLD, nk, hi)
        carry = _fori(hi, ext, functools.partial(body, structural=True), carry)
    o, m, denom = carry
    o_ref[...] = (o / denom[:, None]).astype(o_ref.dtype)
    if with_stats:
        m_ref[...] = m
        l_ref[...] = denom


def _dq_kernel(*refs: Any, cfg: _Cfg) -> None:
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    bias_ref = next(it) if cfg.has_bias else None
    mask_ref = next(it) if cfg.has_mask else None
    do_ref, m_ref, l_ref, delta_ref, dq_ref = next(it), next(it), next(it), next(it), next(it)

    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_k_bwd
    nk = k_ref.shape[0] // bk
    q_start = pl.program_id(0) * bq
    q = q_ref[...]
    do = do_ref[...]
    m = m_ref[...]
    m_use = _safe_max(m)
    inv_l = 1.0 / l_ref[...]
    delta = delta_ref[...]
    q_pos = q_start + jnp.arange(bq, dtype=jnp.int32)
    kv_full_bias = cfg.has_bias and cfg.bias_full[3]
    kv_full_mask = cfg.has_mask and cfg.mask_full[3]

    def body(j: Any, dq: Any, structural: bool) -> Any:
        start = j * bk
        k = k_ref[pl.ds(start, bk), :]
        v = v_ref[pl.ds(start, bk), :]
        bias = None
        if bias_ref is not None:
            bias = bias_ref[:, pl.ds(start, bk)] if kv_full_bias else bias_ref[...]
        mask = None
        if mask_ref is not None:
            mask = mask_ref[:, pl.ds(start, bk)] if kv_full_mask else mask_ref[...]
        k_pos = start + jnp.arange(bk, dtype=jnp.int32)
        s, keep = _scores(cfg, q, k, q_pos, k_pos, bias, mask, structural)
        p = _exp(cfg, s - m_use[:, None]) * inv_l[:, None]
        dpv = dsp.dot(do, v, trans_b=True, precision=cfg.precision)
        ds = p * (dpv - delta[:, None])
        if keep is not None:
            ds = jnp.where(keep, ds, 0.0)
        return dq + dsp.dot(ds.astype(k.dtype), k, precision=cfg.precision)

    dq = jnp.zeros((bq, q.shape[-1]), jnp.float32)
    n_unmasked, hi = _kv_ranges(cfg, q_start, bq, bk, nk)
    dq = _fori(0, n_unmasked, functools.partial(body, structural=False), dq)
    dq = _fori(n_unmasked, hi, functools.partial(body, structural=True), dq)
    if cfg.skip_above and cfg.exact:
        ext = jnp.where(jnp.min(m) <= _FULLY_MASKED_THRESHOLD, nk, hi)
        dq = _fori(hi, ext, functools.partial(body, structural=True), dq)
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs: Any, cfg: _Cfg) -> None:
    it = iter(refs)
    q_ref, k_ref, v_ref = next(it), next(it), next(it)
    bias_ref = next(it) if cfg.has_bias else None
    mask_ref = next(it) if cfg.has_mask else None
    do_ref, m_ref, l_ref, delta_ref = next(it), next(it), next(it), next(it)
    dk_ref, dv_ref = next(it), next(it)

    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_k_bwd
    nq = q_ref.shape[0] // bq
    j = pl.program_id(0)
    k_start = j * bk
    k = k_ref[...]
    v = v_ref[...]
    k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)
    q_full_bias = cfg.has_bias and cfg.bias_full[2]
    q_full_mask = cfg.has_mask and cfg.mask_full[2]

    def body(i: Any, carry: Any, structural: bool) -> Any:
        dk, dv = carry
        start = i * bq
        rows = pl.ds(start, bq)
        q = q_ref[rows, :]
        do = do_ref[rows, :]
        m_use = _safe_max(m_ref[rows])
        inv_l = 1.0 / l_ref[rows]
        delta = delta_ref[rows]
        bias = None
        if bias_ref is not None:
            bias = bias_ref[rows, :] if q_full_bias else bias_ref[...]
        mask = None
        if mask_ref is not None:
            mask = mask_ref[rows, :] if q_full_mask else mask_ref[...]
        q_pos = start + jnp.arange(bq, dtype=jnp.int32)
        s, keep = _scores(cfg, q, k, q_pos, k_pos, bias, mask, structural)
        p = _exp(cfg, s - m_use[:, None]) * inv_l[:, None]
        dv = dv + dsp.dot(p.astype(do.dtype), do, trans_a=True, precision=cfg.precision)
        dpv = dsp.dot(do, v, trans_b=True, precision=cfg.precision)
        ds = p * (dpv - delta[:, None])
        if keep is not None:
            ds = jnp.where(keep, ds, 0.0)
        dk = dk + dsp.dot(ds.astype(q.dtype), q, trans_a=True, precision=cfg.precision)
        return dk, dv

    dp = k.shape[-1]
    carry = (jnp.zeros((bk, dp), jnp.float32), jnp.zeros((bk, dp), jnp.float32))
    kv_block_full = j < (cfg.kv_len // bk)  # block holds no padded keys
    if cfg.skip_above:
        first = lax.div(k_start, bq)  # first q block touching it
        unmasked_from = jnp.minimum(lax.div(k_start + bk - 1 + bq - 1, bq), nq)
        unmasked_from = jnp.where(kv_block_full, jnp.maximum(unmasked_from, first), nq)
        if cfg.exact:
            # q blocks above the diagonal only matter for fully masked rows.
            def row_min(i: Any, acc: Any) -> Any:
                return jnp.minimum(acc, jnp.min(m_ref[pl.ds(i * bq, bq)]))

            lowest = _fori(0, first, row_min, jnp.float32(jnp.inf))
            pre = jnp.where(lowest <= _FULLY_MASKED_THRESHOLD, first, 0)
            carry = _fori(0, pre, functools.partial(body, structural=True), carry)
        carry = _fori(first, unmasked_from, functools.partial(body, structural=True), carry)
        carry = _fori(unmasked_from, nq, functools.partial(body, structural=False), carry)
    elif cfg.kv_len % bk == 0:
        carry = _fori(0, nq, functools.partial(body, structural=False), carry)
    else:
        # Padded kv block -> every q block needs the kv-length mask.  Integer
        # arithmetic rather than `jnp.where(pred, 0, nq)`: Pallas-Triton (jax 0.11)
        # mis-types a select between two weak-typed literals (i1 vs i32).
        split = nq * jnp.minimum(jnp.maximum(j - cfg.kv_len // bk + 1, 0), 1)
        carry = _fori(0, split, functools.partial(body, structural=True), carry)
        carry = _fori(split, nq, functools.partial(body, structural=False), carry)
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


def _stats_shape(b: int, hq: int, sq: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((b, hq, sq), jnp.float32)


def _fwd_call(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    cfg: _Cfg,
    with_stats: bool,
) -> tuple[jax.Array, ...]:
    b, sq, hq, skv, dp = _dims(cfg, q, k)
    bq = cfg.blocks.block_q
    g = cfg.group
    kv_head = (lambda h: lax.div(h, g)) if g > 1 else _ident
    in_specs = [
        _act_spec(cfg.layout, bq, dp, _ident, _ident),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
    ]
    args = [q, k, v]
    if bias is not None:
        in_specs.append(_score_spec(cfg.bias_full, bq, skv, _ident, _zero))
        args.append(bias)
    if mask is not None:
        in_specs.append(_score_spec(cfg.mask_full, bq, skv, _ident, _zero))
        args.append(mask)
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [_act_spec(cfg.layout, bq, dp, _ident, _ident)]
    if with_stats:
        out_shape += [_stats_shape(b, hq, sq)] * 2
        out_specs += [_row_spec(bq, _ident)] * 2
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, with_stats=with_stats),
        grid=(sq // bq, b, hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        name="flash_attention_fwd",
        **dsp.pallas_call_kwargs(cfg.interpret, cfg.blocks.num_warps, cfg.blocks.num_stages),
    )(*args)


def _bwd_calls(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    do: jax.Array,
    m: jax.Array,
    denom: jax.Array,
    delta: jax.Array,
    cfg: _Cfg,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, sq, hq, skv, dp = _dims(cfg, q, k)
    bq, bk = cfg.blocks.block_q_bwd, cfg.blocks.block_k_bwd
    g = cfg.group
    kv_head = (lambda h: lax.div(h, g)) if g > 1 else _ident
    params = dsp.pallas_call_kwargs(
        cfg.interpret, cfg.blocks.num_warps_bwd, cfg.blocks.num_stages_bwd
    )

    # dQ: grid over q blocks, loop over kv blocks.
    in_specs = [
        _act_spec(cfg.layout, bq, dp, _ident, _ident),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
        _act_spec(cfg.layout, skv, dp, _zero, kv_head),
    ]
    args = [q, k, v]
    if bias is not None:
        in_specs.append(_score_spec(cfg.bias_full, bq, skv, _ident, _zero))
        args.append(bias)
    if mask is not None:
        in_specs.append(_score_spec(cfg.mask_full, bq, skv, _ident, _zero))
        args.append(mask)
    in_specs += [_act_spec(cfg.layout, bq, dp, _ident, _ident)] + [_row_spec(bq, _ident)] * 3
    args += [do, m, denom, delta]
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(sq // bq, b, hq),
        in_specs=in_specs,
        out_specs=_act_spec(cfg.layout, bq, dp, _ident, _ident),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        name="flash_attention_bwd_dq",
        **params,
    )(*args)

    # dK, dV: grid over kv blocks (per q head), loop over q blocks.
    in_specs = [
        _act_spec(cfg.layout, sq, dp, _zero, _ident),
        _act_spec(cfg.layout, bk, dp, _ident, kv_head),
        _act_spec(cfg.layout, bk, dp, _ident, kv_head),
    ]
    args = [q, k, v]
    if bias is not None:
        in_specs.append(_score_spec(cfg.bias_full, sq, bk, _zero, _ident))
        args.append(bias)
    if mask is not None:
        in_specs.append(_score_spec(cfg.mask_full, sq, bk, _zero, _ident))
        args.append(mask)
    in_specs += [_act_spec(cfg.layout, sq, dp, _zero, _ident)] + [_row_spec(sq, _zero)] * 3
    args += [do, m, denom, delta]
    # Per-q-head partial dK/dV; summed over each kv group below (f32 when summing).
    part_dtype = jnp.float32 if g > 1 else k.dtype
    part_shape = (b, skv, hq, dp) if cfg.layout == "BSHD" else (b, hq, skv, dp)
    dk, dv = pl.pallas_call(
        functools.partial(_dkdv_kernel, cfg=cfg),
        grid=(skv // bk, b, hq),
        in_specs=in_specs,
        out_specs=[_act_spec(cfg.layout, bk, dp, _ident, _ident)] * 2,
        out_shape=[jax.ShapeDtypeStruct(part_shape, part_dtype)] * 2,
        name="flash_attention_bwd_dkdv",
        **params,
    )(*args)
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


def _bias_grad(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array,
    mask: jax.Array | None,
    do: jax.Array,
    m: jax.Array,
    denom: jax.Array,
    delta: jax.Array,
    cfg: _Cfg,
) -> jax.Array:
    """dL/dbias = dS reduced over the bias's broadcast dims, in XLA.

    Materialises [B, Hq, Sq, Skv]; dead code (removed by XLA under jit) whenever the
    bias cotangent is not consumed.
    """
    g = cfg.group
    qh = _to_score_layout(q, cfg.layout)
    kh = jnp.repeat(_to_score_layout(k, cfg.layout), g, axis=1)
    vh = jnp.repeat(_to_score_layout(v, cfg.layout), g, axis=1)
    doh = _to_score_layout(do, cfg.layout)
    hp = cfg.precision
    s = jnp.einsum("bhqd,bhkd->bhqk", qh, kh, preferred_element_type=jnp.float32, precision=hp)
    s = s * cfg.scale + bias.astype(jnp.float32)
    sq, skv = s.shape[2], s.shape[3]
    keep = None if mask is None else (mask != 0)
    if cfg.causal:
        tri = jnp.arange(sq)[:, None] >= jnp.arange(skv)[None, :]
        keep = tri if keep is None else jnp.logical_and(keep, tri)
    if keep is not None:
        s = jnp.where(keep, s, MASK_VALUE)
    s = jnp.where(jnp.arange(skv) < cfg.kv_len, s, -jnp.inf)
    p = jnp.exp(s - _safe_max(m)[..., None]) / denom[..., None]
    dpv = jnp.einsum("bhqd,bhkd->bhqk", doh, vh, preferred_element_type=jnp.float32, precision=hp)
    ds = p * (dpv - delta[..., None])
    if keep is not None:
        ds = jnp.where(keep, ds, 0.0)
    axes = tuple(i for i, full in enumerate(cfg.bias_full) if not full)
    return ds.sum(axis=axes, keepdims=True).astype(bias.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_core(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    cfg: _Cfg,
) -> jax.Array:
    return _fwd_call(q, k, v, bias, mask, cfg, with_stats=False)[0]


def _flash_core_fwd(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    cfg: _Cfg,
) -> tuple[jax.Array, tuple[Any, ...]]:
    o, m, denom = _fwd_call(q, k, v, bias, mask, cfg, with_stats=True)
    return o, (q, k, v, bias, mask, o, m, denom)


def _flash_core_bwd(cfg: _Cfg, res: tuple[Any, ...], do: jax.Array) -> tuple[Any, ...]:
    q, k, v, bias, mask, o, m, denom = res
    # rowsum(o * do) as an elementwise product + reduction (an einsum would be a
    # dot, i.e. TF32 on GPU under default precision).
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    if cfg.layout == "BSHD":
        delta = delta.transpose(0, 2, 1)
    dq, dk, dv = _bwd_calls(q, k, v, bias, mask, do, m, denom, delta, cfg)
    dbias = None if bias is None else _bias_grad(q, k, v, bias, mask, do, m, denom, delta, cfg)
    return dq, dk, dv, dbias, None


_flash_core.defvjp(_flash_core_fwd, _flash_core_bwd)


def _pad_axis(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _prep_score_operand(
    x: jax.Array, sq_pad: int, skv_pad: int, fill: Any
) -> tuple[jax.Array, tuple[bool, bool, bool, bool]]:
    """Rank-4 score-layout operand, real dims padded to the kernel's lengths."""
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    full = tuple(bool(x.shape[i] != 1) for i in range(4))
    # A size-1 dim whose target is also 1 stays "broadcast"; same block either way.
    if full[2]:
        x = _pad_axis(x, 2, sq_pad, fill)
    if full[3]:
        x = _pad_axis(x, 3, skv_pad, fill)
    return x, full  # type: ignore[return-value]


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
    ),
)
def _flash_pallas(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    *,
    scale: float,
    causal: bool,
    mask_is_causal: bool,
    layout: str,
    interpret: bool,
    blocks: AttentionBlocks | None,
    precision: Any,
) -> jax.Array:
    b, sq, hq, d = _split(q.shape, layout)
    _, skv, hkv, _ = _split(k.shape, layout)
    dp = dsp.next_pow2(d)
    if blocks is None:
        blocks = default_blocks(
            sq,
            skv,
            dp,
            q.dtype,
            interpret,
            causal or mask_is_causal,
            exact=bias is not None or mask is not None,
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
    cfg = _Cfg(
        layout=layout,
        causal=causal,
        skip_above=causal or mask_is_causal,
        scale=scale,
        kv_len=skv,
        kv_padded=skv_pad != skv,
        group=hq // hkv,
        has_bias=bias is not None,
        has_mask=mask is not None,
        bias_full=bias_full,
        mask_full=mask_full,
        blocks=blocks,
        interpret=interpret,
        precision=precision,
    )
    out = _flash_core(qp, kp, vp, bias, mask, cfg)
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
    _blocks: AttentionBlocks | None = None,
) -> jax.Array:
    """Memory-efficient attention; same semantics as :func:`attention_reference`.

    Args:
      q: ``[B, Sq, Hq, D]`` ("BSHD") or ``[B, Hq, Sq, D]`` ("BHSD").
      k, v: same layout with ``Skv`` and ``Hkv`` (``Hq % Hkv == 0``).
      bias: additive float array broadcastable to ``[B, Hq, Sq, Skv]``.
      mask: boolean array broadcastable to ``[B, Hq, Sq, Skv]``, True = attend.
      scale: score scale, default ``1/sqrt(D)`` (a Python number).
      causal: top-left aligned causal mask (query i attends keys j <= i).
      mask_is_causal: a promise that ``bias``/``mask`` already mask out every key above
        that diagonal (mask False, or bias <= ``MASK_VALUE / 2``). The result is the same
        as without it; the kernel skips the blocks above the diagonal, and visits them
        only for rows that have no key left (which the reference averages over all keys).
        Unlike ``causal``, nothing is masked by it, so a score the bias masks keeps its
        gradient. Needs a bias or a mask.
      layout: "BSHD" or "BHSD".
      impl: None (auto), "xla", "interpret" or "pallas"; see ``pallas_kernels``.

    Returns:
      Array in q's layout and dtype.  Differentiable w.r.t. q, k, v and bias, the mask
      gets no gradient: reverse mode runs the backward kernels (``custom_vjp``), forward
      mode (``jvp``, ``jacfwd``, ``hessian``) takes its tangents from the reference
      (``pallas_kernels._autodiff``).
    """
    layout = _check_layout(layout)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    bias = None if bias is None else jnp.asarray(bias)
    mask = None if mask is None else jnp.asarray(mask)
    _validate_arrays(q, k, v, bias, mask, layout)
    causal, mask_is_causal = bool(causal), bool(mask_is_causal)
    if mask_is_causal and bias is None and mask is None:
        raise ValueError("flash_attention: mask_is_causal=True needs a bias or a mask")
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
        return _reference_jit(q, k, v, bias, mask, scale=scale, causal=causal, layout=layout)
    kernel = functools.partial(
        _flash_pallas,
        scale=scale,
        causal=causal,
        mask_is_causal=mask_is_causal,
        layout=layout,
        interpret=impl == "interpret",
        blocks=_blocks,
        precision=dsp.matmul_precision(q.dtype),
    )
    reference = functools.partial(_reference_jit, scale=scale, causal=causal, layout=layout)
    return with_forward_mode(kernel, reference)(q, k, v, bias, mask)
