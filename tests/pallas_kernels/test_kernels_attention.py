"""Flash attention in Pallas interpret mode vs the plain-JAX reference (CPU)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import attention_reference, flash_attention
from pallas_kernels._attention import MASK_VALUE, AttentionBlocks
from pypm_testing.kernels import (
    GRAD_TOL,
    MODIFIER_CASES,
    alibi,
    assert_close,
    attention_inputs,
    differentiable_args,
    hf_padding_bias,
    jitted,
    left_padding_mask,
    modifier_case,
    padding_mask,
    rnd,
    sliding_window_8,
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    layout: str = "BSHD"
    b: int = 2
    sq: int = 32
    skv: int = 32
    hq: int = 2
    hkv: int = 2
    d: int = 32
    dtype: str = "float32"
    causal: bool = False
    bias: str | None = (
        None  # None | "pad" [B,1,1,Skv] | "full" [B,Hq,Sq,Skv] | "hf" | "head" [1,Hq,1,1]
    )
    mask: str | None = (
        None  # None | "pad" [B,1,1,Skv] | "full" | "left" (fully masked rows) | "int"
    )
    scale: float | None = None

    def __str__(self) -> str:
        return self.name


def _operands(c: Case, seed: int = 0):
    q, k, v = attention_inputs(seed, c.layout, c.b, c.sq, c.skv, c.hq, c.hkv, c.d, c.dtype)
    lengths = [max(1, c.skv - 7 * (i + 1)) for i in range(c.b)]
    bias = mask = None
    if c.bias == "pad":
        bias = rnd(seed + 10, (c.b, 1, 1, c.skv))
    elif c.bias == "full":
        bias = rnd(seed + 10, (c.b, c.hq, c.sq, c.skv), c.dtype)
    elif c.bias == "head":
        bias = rnd(seed + 10, (1, c.hq, 1, 1))
    elif c.bias == "hf":
        bias = hf_padding_bias(c.b, c.skv, [c.skv] + [0] * (c.b - 1))  # batch 1 fully padded
    if c.mask == "pad":
        mask = padding_mask(c.b, c.skv, lengths)
    elif c.mask == "full":
        mask = jax.random.bernoulli(jax.random.PRNGKey(seed + 20), 0.8, (c.b, c.hq, c.sq, c.skv))
    elif c.mask == "int":
        mask = jax.random.bernoulli(jax.random.PRNGKey(seed + 20), 0.8, (c.sq, c.skv)).astype(
            jnp.int32
        )
    elif c.mask == "left":
        # Left padding: the first `pad` keys are masked, so with causal the first
        # `pad` query rows see nothing (fully masked rows); batch 1 is all padding.
        starts = jnp.asarray([5] + [c.skv] * (c.b - 1))
        mask = (jnp.arange(c.skv)[None, :] >= starts[:, None])[:, None, None, :]
    return q, k, v, bias, mask


FWD_CASES = [
    Case("bshd_f32_plain"),
    Case("bhsd_f32_causal_d64", layout="BHSD", sq=48, skv=48, d=64, causal=True),
    Case(
        "bshd_bf16_gqa_causal_padmask_ragged",
        sq=37,
        skv=45,
        hq=4,
        hkv=2,
        dtype="bfloat16",
        causal=True,
        mask="pad",
    ),
    Case(
        "bhsd_f16_fullbias_ragged_d128",
        layout="BHSD",
        b=1,
        sq=20,
        skv=33,
        d=128,
        dtype="float16",
        bias="full",
    ),
    Case("bshd_f32_mqa_d256", b=1, sq=16, skv=24, hq=4, hkv=1, d=256, bias="pad"),
    Case(
        "bhsd_bf16_hf_bias_causal",
        layout="BHSD",
        sq=40,
        skv=40,
        dtype="bfloat16",
        causal=True,
        bias="hf",
    ),
    Case("bshd_f32_left_padding_causal_fully_masked_rows", sq=33, skv=33, causal=True, mask="left"),
    Case("bhsd_f32_left_padding_fully_masked_rows", layout="BHSD", sq=24, skv=40, mask="left"),
    Case("bshd_f32_causal_sq_gt_skv", sq=40, skv=24, causal=True),
    Case(
        "bhsd_f32_causal_sq_lt_skv_mask_bias",
        layout="BHSD",
        sq=20,
        skv=50,
        causal=True,
        mask="full",
        bias="pad",
    ),
    Case("bshd_f32_d48_scale_headbias", sq=19, skv=21, hq=4, hkv=4, d=48, scale=0.3, bias="head"),
    Case("bshd_f16_int_mask_decode_sq1", sq=1, skv=37, hq=4, hkv=1, dtype="float16", mask="int"),
    Case(
        "bhsd_bf16_gqa_d64_full_mask",
        layout="BHSD",
        sq=32,
        skv=48,
        hq=4,
        hkv=2,
        d=64,
        dtype="bfloat16",
        mask="full",
    ),
]


# The larger or masked cases take 5-10 s each in the interpreter: `make test-fast` leaves
# them and the gradient cases to `make test`.
SLOW_CASES = {
    "bshd_f32_left_padding_causal_fully_masked_rows",
    "bhsd_f32_causal_sq_lt_skv_mask_bias",
    "bshd_f16_int_mask_decode_sq1",
    "bshd_bf16_gqa_causal_padmask_ragged",
    "bhsd_bf16_gqa_d64_full_mask",
    "bshd_f32_causal_sq_gt_skv",
}


def _params(cases, slow):
    return [pytest.param(c, marks=pytest.mark.slow) if str(c) in slow else c for c in cases]


@pytest.mark.parametrize("c", _params(FWD_CASES, SLOW_CASES), ids=str)
def test_forward_matches_reference(c: Case) -> None:
    q, k, v, bias, mask = _operands(c)
    kw = dict(scale=c.scale, causal=c.causal, layout=c.layout)
    out = jitted(flash_attention, impl="interpret", **kw)(q, k, v, bias, mask)
    ref = jitted(attention_reference, **kw)(q, k, v, bias, mask)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert_close(out, ref, c.dtype, what=c.name)


def test_fully_masked_rows_average_all_values() -> None:
    """Reference semantics: a row with every score masked averages v over all keys."""
    c = Case("left", sq=33, skv=33, causal=True, mask="left")
    q, k, v, _, mask = _operands(c)
    out = flash_attention(q, k, v, mask=mask, causal=True, impl="interpret")
    mean_v = jnp.mean(v, axis=1)  # [B, H, D]
    np.testing.assert_allclose(
        out[0, :5], jnp.broadcast_to(mean_v[0], (5,) + mean_v.shape[1:]), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        out[1], jnp.broadcast_to(mean_v[1], out[1].shape), rtol=1e-5, atol=1e-5
    )


@pytest.mark.slow
def test_gpu_block_defaults_in_interpret() -> None:
    """The GPU tile configuration (clamped to the shape) is also correct."""
    c = Case("gpu_blocks", sq=70, skv=130, hq=4, hkv=2, d=64, causal=True, mask="pad")
    q, k, v, bias, mask = _operands(c)
    blocks = AttentionBlocks(128, 64, 4, 3, 64, 64, 4, 2)
    out = jitted(flash_attention, causal=True, impl="interpret", _blocks=blocks)(
        q, k, v, bias, mask
    )
    ref = jitted(attention_reference, causal=True)(q, k, v, bias, mask)
    assert_close(out, ref, c.dtype)


GRAD_CASES = [
    Case("grad_bshd_f32_gqa_causal_ragged", sq=37, skv=45, hq=4, hkv=2, causal=True),
    Case("grad_bhsd_f32_padbias_fullmask", layout="BHSD", sq=32, skv=32, bias="pad", mask="full"),
    Case(
        "grad_bshd_f32_fully_masked_rows_causal",
        sq=33,
        skv=33,
        causal=True,
        mask="left",
        bias="pad",
    ),
    Case(
        "grad_bhsd_bf16_mqa_causal",
        layout="BHSD",
        b=1,
        sq=40,
        skv=40,
        hq=4,
        hkv=1,
        dtype="bfloat16",
        causal=True,
    ),
    Case(
        "grad_bshd_f32_fullbias_causal_sq_ne_skv",
        b=1,
        sq=24,
        skv=40,
        causal=True,
        bias="full",
        d=64,
    ),
    Case("grad_bshd_f32_noncausal_ragged", b=1, sq=21, skv=37, hq=4, hkv=2),
    Case(
        "grad_bhsd_f32_noncausal_ragged_padbias_padmask",
        layout="BHSD",
        sq=37,
        skv=21,
        bias="pad",
        mask="pad",
    ),
]


def _f32(x):
    return None if x is None else x.astype(jnp.float32)


@pytest.mark.parametrize("c", _params(GRAD_CASES, {c.name for c in GRAD_CASES}), ids=str)
def test_gradients_match_reference(c: Case) -> None:
    q, k, v, bias, mask = _operands(c, seed=3)
    kw = dict(scale=c.scale, causal=c.causal, layout=c.layout)
    cot = rnd(99, q.shape, jnp.float32)

    def loss(fn, q, k, v, bias):
        return jnp.sum(fn(q, k, v, bias, mask, **kw).astype(jnp.float32) * cot)

    def kernel(*a, **k_):
        return flash_attention(*a, impl="interpret", **k_)

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    got = jax.jit(jax.grad(lambda *a: loss(kernel, *a), argnums=argnums))(q, k, v, bias)
    # Ground truth: reference gradients in f32 from the same (possibly rounded) inputs.
    want = jax.jit(jax.grad(lambda *a: loss(attention_reference, *a), argnums=argnums))(
        _f32(q), _f32(k), _f32(v), _f32(bias)
    )
    for name, g, w in zip("q k v bias".split(), got, want, strict=False):
        assert bool(jnp.all(jnp.isfinite(g.astype(jnp.float32)))), name
        assert_close(g, w, c.dtype, tol_table=GRAD_TOL, what=f"{c.name}: d{name}")


@pytest.mark.slow
def test_jit_and_vmap_compose() -> None:
    c = Case("compose", sq=20, skv=20, causal=True)
    q, k, v, _, _ = _operands(c)
    f = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, impl="interpret"))
    assert_close(f(q, k, v), jitted(attention_reference, causal=True)(q, k, v), "float32")
    vm = jax.vmap(lambda q, k, v: flash_attention(q, k, v, causal=True, impl="interpret"))
    ref = jax.jit(jax.vmap(lambda q, k, v: attention_reference(q, k, v, causal=True)))
    qs, ks, vs = (jnp.stack([x, x * 0.5]) for x in (q, k, v))
    assert_close(vm(qs, ks, vs), ref(qs, ks, vs), "float32")


# ------------------------------------------------------------------ mask_is_causal
#
# ``mask_is_causal=True`` promises the bias/mask already masks every key above the diagonal:
# the kernel skips those blocks (16-row blocks in interpret mode, so these shapes skip some)
# and must give the reference's result *without* the flag, gradients included -- also for
# left padding, whose first query rows have no key left (and for a bias, keep a gradient).


def _causal_operands(kind: str, sq: int, skv: int, dtype: str, seed: int = 5):
    q, k, v = attention_inputs(seed, "BSHD", 2, sq, skv, 2, 2, 32, dtype)
    tril = jnp.arange(sq)[:, None] >= jnp.arange(skv)[None, :]
    starts = jnp.asarray([0, 5])  # batch 1 is left-padded: its rows 0..4 see no key
    keep = (jnp.arange(skv)[None, :] >= starts[:, None])[:, None, None, :] & tril
    if kind == "mask":
        return q, k, v, None, keep
    big_negative = float(jnp.finfo(dtype).min)  # in the bias's dtype: finite, <= MASK_VALUE/2
    bias = jnp.where(keep, 0.0, big_negative).astype(dtype)
    if kind == "alibi":
        alibi = jnp.asarray([-0.5, -0.25])[None, :, None, None] * jnp.arange(skv)
        bias = jnp.maximum(bias + alibi.astype(dtype), big_negative)
    return q, k, v, bias, None


CAUSAL_PROMISES = [
    ("mask", 40, 40, "float32"),
    ("bias", 40, 40, "float32"),
    ("alibi", 37, 37, "bfloat16"),
    ("mask", 24, 40, "float32"),  # more keys than queries: top-left
    ("mask", 40, 24, "float16"),  # fewer keys
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, sq, skv, dtype", CAUSAL_PROMISES)
def test_mask_is_causal_forward_and_gradients_are_the_reference(kind, sq, skv, dtype):
    q, k, v, bias, mask = _causal_operands(kind, sq, skv, dtype)
    out = jitted(flash_attention, mask_is_causal=True, impl="interpret")(q, k, v, bias, mask)
    want_out = jitted(attention_reference)(q, k, v, bias, mask)
    assert_close(out, want_out, dtype, what="forward")
    cot = rnd(7, q.shape, jnp.float32)
    argnums = (0, 1, 2) if bias is None else (0, 1, 2, 3)

    def loss(fn, q, k, v, bias, **kw):
        return jnp.sum(fn(q, k, v, bias, mask, **kw).astype(jnp.float32) * cot)

    got = jax.jit(
        jax.grad(
            lambda *a: loss(flash_attention, *a, mask_is_causal=True, impl="interpret"),
            argnums=argnums,
        )
    )(q, k, v, bias)
    want = jax.jit(jax.grad(lambda *a: loss(attention_reference, *a), argnums=argnums))(
        _f32(q), _f32(k), _f32(v), _f32(bias)
    )
    for name, g, w in zip("q k v bias".split(), got, want, strict=False):
        assert_close(g, w, dtype, tol_table=GRAD_TOL, what=f"{kind}: d{name}")
    if bias is not None:  # the padded rows' scores keep their gradient (a bias adds)
        assert float(jnp.max(jnp.abs(got[0][1, :5]))) > 0


def test_mask_is_causal_skips_blocks():
    """With a mask that does *not* hide the upper triangle the promise is broken, and the
    result shows the blocks above the diagonal were skipped (so the flag does something)."""
    q, k, v = attention_inputs(1, "BSHD", 1, 48, 48, 2, 2, 32, "float32")
    everything = jnp.ones((1, 1, 48, 48), bool)
    out = flash_attention(q, k, v, mask=everything, mask_is_causal=True, impl="interpret")
    full = jitted(attention_reference)(q, k, v, mask=everything)
    causal = jitted(attention_reference, causal=True)(q, k, v)
    assert not np.allclose(out, full, atol=1e-3) and not np.allclose(out, causal, atol=1e-3)
    # the first block row (queries 0..15) sees keys 0..15 only
    blockwise = jitted(attention_reference)(q[:, :16], k[:, :16], v[:, :16])
    np.testing.assert_allclose(out[:, :16], blockwise, rtol=1e-5, atol=1e-5)


def test_mask_is_causal_needs_a_mask_or_bias():
    q, k, v = attention_inputs(1, "BSHD", 1, 8, 8, 2, 2, 32, "float32")
    with pytest.raises(ValueError, match="mask_is_causal"):
        flash_attention(q, k, v, mask_is_causal=True, impl="interpret")


# ------------------------------------------------------------------ modifiers (reference)
#
# The reference defines the semantics of score_mod / mask_mod / captures / sinks /
# masked_rows; these tests pin it against independent plain-JAX spellings of the same
# attention (the way model code writes it).


def _plain_attention(q, k, v, logits_fn):
    """BSHD attention whose f32 logits [B, H, Sq, Skv] come from ``logits_fn(s)``."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits_fn(s), axis=-1), v)


def _softcap(s, b, h, qi, ki, cap):
    return jnp.tanh(s / cap) * cap


def test_reference_score_mod_is_applied_before_bias_and_masks():
    q, k, v = attention_inputs(2, "BSHD", 2, 12, 20, 2, 2, 8, "float32")
    bias = rnd(3, (2, 1, 1, 20))
    cap = jnp.float32(0.7)

    def mask_mod(b, h, qi, ki, cap):  # every modifier receives every capture
        return ki <= qi + 4

    out = jitted(attention_reference, score_mod=_softcap, mask_mod=mask_mod)(
        q, k, v, bias, captures=(cap,)
    )
    keep = jnp.arange(20)[None, :] <= jnp.arange(12)[:, None] + 4
    want = jax.jit(_plain_attention, static_argnums=3)(
        q, k, v, lambda s: jnp.where(keep, jnp.tanh(s / cap) * cap + bias, MASK_VALUE)
    )
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_reference_sinks_equal_a_concatenated_sink_logit():
    """GPT-OSS spelling: a per-head logit concatenated before the softmax, sliced off after."""
    q, k, v = attention_inputs(4, "BSHD", 1, 9, 9, 3, 3, 8, "float32")
    sinks = jnp.asarray([0.5, -1.0, 3.0])
    out = jitted(attention_reference, causal=True)(q, k, v, sinks=sinks)

    @jax.jit
    def concatenated(q, k, v, sinks):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
        s = jnp.where(jnp.tril(jnp.ones((9, 9), bool)), s, MASK_VALUE)
        sink_col = jnp.broadcast_to(sinks[None, :, None, None], s.shape[:3] + (1,))
        p = jax.nn.softmax(jnp.concatenate([s, sink_col], axis=-1), axis=-1)[..., :-1]
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    np.testing.assert_allclose(out, concatenated(q, k, v, sinks), rtol=1e-5, atol=1e-5)


def test_reference_zero_rows_are_keras_rezeroing():
    """masked_rows="zero" is Keras's ``where(mask, softmax, 0)``: only fully masked rows
    change (to 0)."""
    c = Case("left", sq=12, skv=12, causal=True, mask="left")
    q, k, v, _, mask = _operands(c)
    uniform = jitted(attention_reference, causal=True)(q, k, v, mask=mask)
    zero = jitted(attention_reference, causal=True, masked_rows="zero")(q, k, v, mask=mask)

    @jax.jit
    def rezeroed(q, k, v, mask):
        keep = jnp.logical_and(mask, jnp.tril(jnp.ones((12, 12), bool)))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        p = jnp.where(keep, jax.nn.softmax(jnp.where(keep, s, MASK_VALUE), axis=-1), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    np.testing.assert_allclose(zero, rezeroed(q, k, v, mask), atol=1e-6)
    assert float(jnp.max(jnp.abs(zero[0, :5]))) == 0.0 and float(jnp.max(jnp.abs(zero[1]))) == 0.0
    np.testing.assert_allclose(zero[0, 5:], uniform[0, 5:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(band=(3, 1), causal=True), "band=.3, 1. is empty"),
        (dict(band=(-2, 2)), "nothing masks them"),
        (dict(band=(0.5, None), causal=True), "band.0. must be an int"),
        (dict(sinks=jnp.zeros(3)), "sinks must be a float array of shape"),
        (dict(masked_rows="nan"), "masked_rows must be one of"),
        (dict(captures=(jnp.zeros(3),)), "captures need a score_mod"),
        (dict(score_mod=_softcap, captures=(jnp.zeros((5, 1)),)), "captures.0. shape"),
        (dict(score_mod=3), "score_mod must be callable"),
        (dict(mask_is_causal=True), "mask_is_causal"),
    ],
)
def test_modifier_arguments_are_validated(kwargs, match):
    q, k, v = attention_inputs(1, "BSHD", 1, 8, 8, 2, 2, 16, "float32")
    for fn in (attention_reference, flash_attention):
        with pytest.raises((ValueError, TypeError), match=match):
            fn(q, k, v, **kwargs)


# ------------------------------------------------------------------ modifiers (kernels)


def _out_and_grads(fn, q, k, v, kwargs, cot):
    """Output and the gradients of ``sum(out * cot)`` w.r.t. q, k, v and every float
    keyword argument (bias, float captures, sinks), as one compiled program per function,
    static keywords and shapes."""
    diff = {name: kwargs[name] for name in differentiable_args(kwargs)}
    arrays = {n: a for n, a in kwargs.items() if n not in diff and _is_arrays(a)}
    static = tuple(sorted((n, a) for n, a in kwargs.items() if n not in diff and n not in arrays))
    return _compiled_out_and_grads(q, k, v, arrays, diff, cot, fn=fn, static=static)


def _is_arrays(x) -> bool:
    leaves = jax.tree.leaves(x)
    return bool(leaves) and all(isinstance(a, jax.Array | np.ndarray) for a in leaves)


@functools.partial(jax.jit, static_argnames=("fn", "static"))
def _compiled_out_and_grads(q, k, v, arrays, diff, cot, *, fn, static):
    def loss(q, k, v, diff):
        out = fn(q, k, v, **arrays, **diff, **dict(static))
        return jnp.sum(out.astype(jnp.float32) * cot), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, diff)
    return out, grads


def _interpret(*args, **kwargs):
    return flash_attention(*args, impl="interpret", **kwargs)


def _assert_kernel_is_reference(q, k, v, kwargs, dtype, what):
    cot = rnd(11, q.shape)
    out, grads = _out_and_grads(_interpret, q, k, v, kwargs, cot)
    want_out, want = _out_and_grads(attention_reference, q, k, v, kwargs, cot)
    assert_close(out, want_out, dtype, what=f"{what}: forward")
    got_leaves, want_leaves = jax.tree.leaves(grads), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves) >= 3
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        assert g.shape == w.shape, (what, i)
        assert_close(g, w, dtype, tol_table=GRAD_TOL, what=f"{what}: gradient {i}")


# Each case compiles three interpreted kernels (8-25 s on 2 cores), so the interpreter runs
# the table less the cases that "everything" covers (sinks, zero rows; the GPU runs them
# all): `make test-fast` keeps soft-capping and the banded sliding window.
INTERPRET_CASES = [name for name in MODIFIER_CASES if name not in ("sinks", "zero_rows")]
MODIFIER_SLOW = set(INTERPRET_CASES) - {"softcap", "sliding_window"}


@pytest.mark.parametrize("name", _params(INTERPRET_CASES, MODIFIER_SLOW), ids=str)
def test_modifiers_kernel_matches_reference(name):
    """Soft-capping, ALiBi, bias before the scale, sliding windows and chunked local
    attention with band skipping (left padding leaves rows with no key in their window:
    they average all keys, beyond the band), document masks from int captures, and all
    of soft-capping, a window, sinks and zero rows at once: kernel values and gradients
    (q, k, v, float captures, sinks) are the reference's (ragged: 40 = 2.5 blocks of 16)."""
    q, k, v, kwargs = modifier_case(name, b=2, s=40, hq=2, d=16, dtype="float32")
    _assert_kernel_is_reference(q, k, v, kwargs, "float32", name)


def _visited_blocks(sq: int, skv: int, band: tuple[int, int], block: int) -> np.ndarray:
    """[Sq, Skv]: True where the (query, key) pair lies in a pair of blocks that holds a
    pair inside the band (what a kernel that skips the other blocks reads)."""
    lo, hi = band
    keep = np.zeros((sq, skv), bool)
    for qs in range(0, sq, block):
        for ks in range(0, skv, block):
            qe, ke = min(qs + block, sq) - 1, min(ks + block, skv) - 1
            if qs + lo <= ke and qe + hi >= ks:
                keep[qs : qe + 1, ks : ke + 1] = True
    return keep


def test_band_skips_the_blocks_outside_it():
    """A broken promise makes skipping observable: with nothing masked and band=(-20, 3)
    the kernel's values and gradients are the reference's with exactly the 16 x 16
    blocks outside the band masked -- and differ from attending everything."""
    q, k, v = attention_inputs(6, "BSHD", 1, 64, 64, 1, 1, 16, "float32")
    everything = jnp.ones((1, 1, 64, 64), bool)
    visited = jnp.asarray(_visited_blocks(64, 64, (-20, 3), 16))[None, None]
    assert 0.3 < float(jnp.mean(visited)) < 0.8
    cot = rnd(12, q.shape)
    out, grads = _out_and_grads(_interpret, q, k, v, dict(mask=everything, band=(-20, 3)), cot)
    want_out, want = _out_and_grads(attention_reference, q, k, v, dict(mask=visited), cot)
    full = jitted(attention_reference)(q, k, v)
    assert not np.allclose(out, full, atol=1e-3)
    assert_close(out, want_out, "float32", what="forward")
    for name, g, w in zip("qkv", grads[:3], want[:3], strict=True):
        assert_close(g, w, "float32", tol_table=GRAD_TOL, what=f"d{name}")


@pytest.mark.parametrize("d", [pytest.param(d, marks=pytest.mark.slow) for d in (1, 256)] + [72])
def test_any_head_dim_by_padding(d):
    """Head dims 1..256 run (zero-padded to 16 or a power of two; the default scale is
    1/sqrt of the unpadded D), with a 0-d bias, which also gets its gradient."""
    q, k, v = attention_inputs(8, "BSHD", 1, 20, 20, 2, 2, d, "float32")
    bias = jnp.float32(0.25)
    cot = rnd(13, q.shape)
    kwargs = dict(bias=bias, causal=True)
    _assert_kernel_is_reference(q, k, v, kwargs, "float32", f"d={d}")
    out, _ = _out_and_grads(_interpret, q, k, v, kwargs, cot)
    explicit = jitted(attention_reference, causal=True, scale=1 / np.sqrt(d))(q, k, v, bias=bias)
    np.testing.assert_allclose(out, explicit, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ query offsets
#
# A device holding one block of a sequence split across devices runs the kernel on its rows
# of the queries (and of the score-layout operands) with the block's first position as
# ``q_offset``: the blocks' results put together are the whole call's.


def _offset_case(name: str):
    """(q, k, v, arrays, static): score-layout ``arrays`` (sliced along the query rows where
    they have them) and the static keywords of one case; S = 40, two blocks of 20 rows
    (not a multiple of the interpreter's 16-row blocks)."""
    s, b = 40, 2
    if name == "causal":  # the plain causal kernel (log2-domain scores), GQA
        q, k, v = attention_inputs(21, "BSHD", b, s, s, 4, 2, 16, "float32")
        return q, k, v, {}, dict(causal=True)
    q, k, v = attention_inputs(22, "BSHD", b, s, s, 2, 2, 16, "float32")
    if name == "mask_is_causal":  # a causal mask the kernel is promised, and a full bias
        tril = (jnp.arange(s)[:, None] >= jnp.arange(s)[None, :])[None, None]
        arrays = dict(mask=tril, bias=rnd(23, (b, 2, s, s)))
        return q, k, v, arrays, dict(mask_is_causal=True)
    # a sliding window by mask_mod and ALiBi by score_mod, both reading query positions,
    # with left padding (rows 0..4 of batch 1 see no key: revisited beyond the band)
    slopes = jnp.asarray([-0.5, -0.25]).reshape(1, 2, 1, 1)
    arrays = dict(mask=left_padding_mask(b, s, [0, 5]), captures=(slopes,))
    return q, k, v, arrays, dict(mask_mod=sliding_window_8, score_mod=alibi, band=(-7, 0))


def _rows(x: Any, start: int, n: int, sq: int) -> Any:
    """Rows ``[start, start + n)`` of a score-layout operand that has query rows."""
    x = jnp.asarray(x)
    if x.ndim >= 2 and x.shape[-2] == sq:
        return lax.slice_in_dim(x, start, start + n, axis=x.ndim - 2)
    return x


def _in_blocks(fn, q, k, v, floats, masks, static, cot, blocks: int = 2):
    """Output and gradients (q, k, v, ``floats``) of ``sum(fn(...) * cot)`` computed by ``fn``
    on ``blocks`` blocks of the query rows, each with its traced ``q_offset``."""
    sq = q.shape[1]
    n = sq // blocks

    @jax.jit
    def block(q, k, v, floats, masks, cot, off):
        def loss(q, k, v, floats):
            out = fn(q, k, v, **floats, **masks, **static, q_offset=off)
            return jnp.sum(out * cot), out

        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, floats)

    outs, grads = [], []
    for i in range(blocks):
        fl, ms = jax.tree.map(lambda x, i=i: _rows(x, i * n, n, sq), (floats, masks))
        qi, ci = (lax.slice_in_dim(x, i * n, (i + 1) * n, axis=1) for x in (q, cot))
        (_, out), g = block(qi, k, v, fl, ms, ci, jnp.int32(i * n))
        outs.append(out)
        grads.append(g)
    dq = jnp.concatenate([g[0] for g in grads], axis=1)
    dk, dv = (sum(g[j] for g in grads) for j in (1, 2))
    dfloats = jax.tree.map(lambda *xs: _join(xs, sq), *(g[3] for g in grads))
    return jnp.concatenate(outs, axis=1), (dq, dk, dv, dfloats)


def _join(parts: tuple[Any, ...], sq: int) -> Any:
    """A score-layout operand's gradient from the blocks': their rows side by side, or
    summed where the operand has no query rows."""
    if parts[0].ndim >= 2 and parts[0].shape[-2] * len(parts) == sq and parts[0].shape[-2] > 1:
        return jnp.concatenate(parts, axis=parts[0].ndim - 2)
    return sum(parts)


@pytest.mark.parametrize(
    "name",
    ["causal", *(pytest.param(n, marks=pytest.mark.slow) for n in ("mask_is_causal", "window"))],
)
def test_query_blocks_with_offsets_are_the_whole_call(name):
    """The kernel on each block of the query rows with its (traced) ``q_offset``: outputs
    and gradients (q, k, v, bias, float captures) put together are the whole reference
    call's, and so are the reference's own blocks. Without the offset the second block
    differs (with ``mask_is_causal`` the kernel then skips keys the mask keeps)."""
    q, k, v, arrays, static = _offset_case(name)
    cot = rnd(24, q.shape)
    floats = {n: a for n, a in arrays.items() if n != "mask"}
    masks = {n: a for n, a in arrays.items() if n == "mask"}

    def loss(q, k, v, floats):
        out = attention_reference(q, k, v, **floats, **masks, **static)
        return jnp.sum(out * cot), out

    (_, want_out), want = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
        q, k, v, floats
    )
    for fn in (_interpret, attention_reference):
        out, grads = _in_blocks(fn, q, k, v, floats, masks, static, cot)
        assert_close(out, want_out, "float32", what=f"{name}: forward")
        for what, g, w in zip(("dq", "dk", "dv"), grads[:3], want[:3], strict=True):
            assert_close(g, w, "float32", tol_table=GRAD_TOL, what=f"{name}: {what}")
        for g, w in zip(jax.tree.leaves(grads[3]), jax.tree.leaves(want[3]), strict=True):
            assert_close(g, w, "float32", tol_table=GRAD_TOL, what=f"{name}: d{list(floats)}")
    rows = jax.tree.map(lambda x: _rows(x, 20, 20, 40), (floats, masks))
    late = _interpret(q[:, 20:], k, v, **rows[0], **rows[1], **static)  # no offset: wrong
    assert not np.allclose(late, want_out[:, 20:], atol=1e-3)


def test_q_offset_must_be_an_integer_scalar():
    q, k, v = attention_inputs(1, "BSHD", 1, 8, 8, 2, 2, 16, "float32")
    for bad in (1.5, jnp.zeros(2, jnp.int32), True):
        for fn in (attention_reference, flash_attention):
            with pytest.raises(TypeError, match="q_offset must be an int"):
                fn(q, k, v, causal=True, q_offset=bad)
