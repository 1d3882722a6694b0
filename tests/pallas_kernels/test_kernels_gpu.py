"""The same feature matrix on a GPU with the Triton-lowered kernels (impl="pallas")
at realistic sizes.  Skipped cleanly (conftest) when the backend is not a GPU.

f32 cases run under ``jax.default_matmul_precision("highest")`` (the kernels honour
it, like XLA does) so they can be held to f32 tolerances.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from pallas_kernels import _dispatch as dsp
from pypm_testing.kernels import (
    GRAD_TOL,
    MODIFIER_CASES,
    assert_close,
    attention_inputs,
    differentiable_args,
    has_pallas_call,
    hf_padding_bias,
    modifier_case,
    padding_mask,
    rnd,
)

pytestmark = pytest.mark.gpu


def _precision(dtype: str):
    return (
        jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()
    )


# (name, layout, b, sq, skv, hq, hkv, d, dtype, causal, bias, mask)
ATTN = [
    ("bshd_bf16_d64", "BSHD", 2, 512, 512, 8, 8, 64, "bfloat16", False, None, None),
    ("bshd_bf16_d64_causal", "BSHD", 2, 512, 512, 8, 8, 64, "bfloat16", True, None, None),
    ("bhsd_bf16_d128_causal", "BHSD", 2, 1024, 1024, 8, 8, 128, "bfloat16", True, None, None),
    ("bhsd_f16_d128", "BHSD", 2, 1024, 1024, 8, 8, 128, "float16", False, None, None),
    ("bshd_f32_d32_causal", "BSHD", 2, 256, 256, 4, 4, 32, "float32", True, None, None),
    (
        "bshd_bf16_gqa_ragged_d96_padmask",
        "BSHD",
        2,
        1000,
        1100,
        8,
        2,
        96,
        "bfloat16",
        True,
        None,
        "pad",
    ),
    ("bhsd_f16_mqa_d256_fullbias", "BHSD", 1, 384, 200, 4, 1, 256, "float16", False, "full", None),
    ("bshd_f32_d256_padbias", "BSHD", 1, 130, 257, 2, 2, 256, "float32", False, "pad", None),
    ("bhsd_bf16_hf_bias_causal", "BHSD", 2, 512, 512, 8, 8, 64, "bfloat16", True, "hf", None),
    ("bshd_f32_left_padding_causal", "BSHD", 2, 300, 300, 4, 4, 64, "float32", True, None, "left"),
    ("bshd_bf16_causal_sq_gt_skv", "BSHD", 2, 700, 300, 4, 4, 128, "bfloat16", True, None, "full"),
    (
        "bhsd_bf16_noncausal_ragged_d128",
        "BHSD",
        2,
        600,
        777,
        8,
        4,
        128,
        "bfloat16",
        False,
        None,
        None,
    ),
]


def _operands(case, seed: int = 0):
    name, layout, b, sq, skv, hq, hkv, d, dtype, causal, bias_kind, mask_kind = case
    q, k, v = attention_inputs(seed, layout, b, sq, skv, hq, hkv, d, dtype)
    bias = mask = None
    if bias_kind == "pad":
        bias = rnd(seed + 10, (b, 1, 1, skv))
    elif bias_kind == "full":
        bias = rnd(seed + 10, (b, hq, sq, skv), dtype)
    elif bias_kind == "hf":
        bias = hf_padding_bias(b, skv, [skv - 100] + [0] * (b - 1))
    if mask_kind == "pad":
        mask = padding_mask(b, skv, [skv - 37 * (i + 1) for i in range(b)])
    elif mask_kind == "full":
        mask = jax.random.bernoulli(jax.random.PRNGKey(seed + 20), 0.8, (b, hq, sq, skv))
    elif mask_kind == "left":
        starts = jnp.asarray([70] + [skv] * (b - 1))
        mask = (jnp.arange(skv)[None, :] >= starts[:, None])[:, None, None, :]
    return q, k, v, bias, mask, dict(causal=causal, layout=layout)


@pytest.mark.parametrize("case", ATTN, ids=[c[0] for c in ATTN])
def test_attention_forward_gpu(case) -> None:
    q, k, v, bias, mask, kw = _operands(case)
    with _precision(case[8]):
        out = pk.flash_attention(q, k, v, bias, mask, impl="pallas", **kw)
        ref = pk.attention_reference(q, k, v, bias, mask, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, ref, case[8], what=case[0])


GRAD = [ATTN[1], ATTN[2], ATTN[5], ATTN[6], ATTN[7], ATTN[9], ATTN[10], ATTN[11]]


@pytest.mark.parametrize("case", GRAD, ids=[c[0] for c in GRAD])
def test_attention_gradients_gpu(case) -> None:
    q, k, v, bias, mask, kw = _operands(case, seed=5)
    cot = rnd(77, q.shape)
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def loss(fn, q, k, v, bias):
        return jnp.sum(fn(q, k, v, bias, mask, **kw).astype(jnp.float32) * cot)

    def f32(x):
        return None if x is None else x.astype(jnp.float32)

    with _precision(case[8]):
        got = jax.jit(
            jax.grad(
                lambda *a: loss(lambda *x, **y: pk.flash_attention(*x, impl="pallas", **y), *a),
                argnums=argnums,
            )
        )(q, k, v, bias)
    with jax.default_matmul_precision("highest"):
        want = jax.jit(jax.grad(lambda *a: loss(pk.attention_reference, *a), argnums=argnums))(
            f32(q), f32(k), f32(v), f32(bias)
        )
    for name, g, w in zip("q k v bias".split(), got, want, strict=False):
        assert_close(g, w, case[8], tol_table=GRAD_TOL, what=f"{case[0]}: d{name}")


# mask_is_causal: a causal bias or mask (left padding: whole rows with no key), the kernel
# skipping the blocks above the diagonal; the result is the reference's without the flag.
CAUSAL_PROMISES = [
    ("bias", 512, 512, 64, "bfloat16"),
    ("mask", 300, 300, 64, "float32"),
    ("bias", 640, 1000, 128, "bfloat16"),
]


@pytest.mark.parametrize("kind, sq, skv, d, dtype", CAUSAL_PROMISES)
def test_attention_mask_is_causal_gpu(kind, sq, skv, d, dtype) -> None:
    q, k, v = attention_inputs(3, "BSHD", 2, sq, skv, 4, 4, d, dtype)
    tril = jnp.arange(sq)[:, None] >= jnp.arange(skv)[None, :]
    starts = jnp.asarray([0, 70])
    keep = (jnp.arange(skv)[None, :] >= starts[:, None])[:, None, None, :] & tril
    bias = mask = None
    if kind == "bias":
        bias = jnp.where(keep, 0.0, float(jnp.finfo(dtype).min)).astype(dtype)
    else:
        mask = keep
    cot = rnd(78, q.shape)
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def loss(fn, q, k, v, bias, **kw):
        return jnp.sum(fn(q, k, v, bias, mask, **kw).astype(jnp.float32) * cot)

    with _precision(dtype):
        out = pk.flash_attention(q, k, v, bias, mask, mask_is_causal=True, impl="pallas")
        got = jax.jit(
            jax.grad(
                lambda *a: loss(pk.flash_attention, *a, mask_is_causal=True, impl="pallas"),
                argnums=argnums,
            )
        )(q, k, v, bias)
    with jax.default_matmul_precision("highest"):
        ref = pk.attention_reference(q, k, v, bias, mask)
        f32 = [None if x is None else x.astype(jnp.float32) for x in (q, k, v, bias)]
        want = jax.jit(jax.grad(lambda *a: loss(pk.attention_reference, *a), argnums=argnums))(*f32)
    assert_close(out, ref, dtype, what=f"{kind}: forward")
    for name, g, w in zip("q k v bias".split(), got, want, strict=False):
        assert_close(g, w, dtype, tol_table=GRAD_TOL, what=f"{kind}: d{name}")


# score_mod / mask_mod / captures / band / sinks / zero rows (the interpret-mode table at
# GPU sizes): values and gradients of q, k, v, float captures and sinks.
GPU_MODIFIERS = [(name, "bfloat16") for name in MODIFIER_CASES] + [
    ("softcap", "float32"),
    ("sliding_window", "float32"),
    ("everything", "float32"),
]


@pytest.mark.parametrize("name, dtype", GPU_MODIFIERS)
def test_attention_modifiers_gpu(name, dtype) -> None:
    q, k, v, kwargs = modifier_case(name, b=2, s=700, hq=4, d=64, dtype=dtype)
    diff = {n: kwargs[n] for n in differentiable_args(kwargs)}
    cot = rnd(79, q.shape)

    def loss(fn, q, k, v, diff):
        out = fn(q, k, v, **{**kwargs, **diff})
        return jnp.sum(out.astype(jnp.float32) * cot), out

    def kernel(*a, **kw):
        return pk.flash_attention(*a, impl="pallas", **kw)

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1, 2, 3), has_aux=True)
    with _precision(dtype):
        (_, out), got = jax.jit(grad(functools.partial(loss, kernel)))(q, k, v, diff)
    with jax.default_matmul_precision("highest"):
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        (_, ref), want = jax.jit(grad(functools.partial(loss, pk.attention_reference)))(*f32, diff)
    assert_close(out, ref, dtype, what=f"{name}: forward")
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        assert_close(g, w, dtype, tol_table=GRAD_TOL, what=f"{name}: gradient {i}")


@pytest.mark.parametrize("d", [1, 8, 72, 200])
def test_attention_any_head_dim_gpu(d) -> None:
    q, k, v = attention_inputs(4, "BSHD", 2, 300, 300, 4, 4, d, "bfloat16")
    bias = jnp.float32(0.5)
    out = pk.flash_attention(q, k, v, bias, causal=True, impl="pallas")
    ref = pk.attention_reference(q, k, v, bias, causal=True)
    assert_close(out, ref, "bfloat16", what=f"d={d}")


def test_auto_impl_uses_pallas_on_gpu(monkeypatch) -> None:
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    q, k, v = attention_inputs(0, "BSHD", 1, 128, 128, 2, 2, 64, "bfloat16")
    assert has_pallas_call(lambda q, k, v: pk.flash_attention(q, k, v), q, k, v)
    q_odd, k_odd, v_odd = attention_inputs(0, "BSHD", 1, 128, 128, 2, 2, 20, "bfloat16")
    assert has_pallas_call(lambda q, k, v: pk.flash_attention(q, k, v), q_odd, k_odd, v_odd)
    q_big, k_big, v_big = attention_inputs(0, "BSHD", 1, 128, 128, 2, 2, 320, "bfloat16")
    assert not has_pallas_call(lambda q, k, v: pk.flash_attention(q, k, v), q_big, k_big, v_big)
    x, w = rnd(1, (256, 128), jnp.bfloat16), rnd(2, (128, 64), jnp.bfloat16)
    assert has_pallas_call(lambda x, w: pk.gemm_epilogue(x, w, activation="relu"), x, w)


@pytest.mark.parametrize("activation", pk.ACTIVATIONS)
def test_gemm_every_activation_gpu(activation: str) -> None:
    x = rnd(0, (1024, 1024), jnp.bfloat16)
    w = rnd(1, (1024, 1024), jnp.bfloat16, scale=0.03)
    b = rnd(2, (1024,), jnp.bfloat16)
    out = pk.gemm_epilogue(x, w, b, activation=activation, impl="pallas")
    ref = pk.gemm_epilogue_reference(x, w, b, activation=activation)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, "bfloat16", what=activation)


@pytest.mark.parametrize(
    "dtype,shape_x,shape_w,activation",
    [
        ("float16", (1000, 999), (999, 1001), "gelu"),
        ("float32", (4, 256, 512), (512, 768), "silu"),
        ("bfloat16", (2, 3, 100, 320), (320, 72), "gelu_tanh"),
        ("float32", (7, 33), (33, 2049), "sigmoid"),
    ],
)
def test_gemm_dtypes_ragged_batched_gpu(dtype, shape_x, shape_w, activation) -> None:
    x = rnd(3, shape_x, dtype)
    w = rnd(4, shape_w, dtype, scale=0.05)
    b = rnd(5, (shape_w[1],), dtype)
    with _precision(dtype):
        out = pk.gemm_epilogue(x, w, b, activation=activation, impl="pallas")
        ref = pk.gemm_epilogue_reference(x, w, b, activation=activation)
    assert_close(out, ref, dtype, what=f"{dtype}/{activation}")


def test_gemm_templated_epilogue_and_grad_gpu() -> None:
    x = rnd(6, (512, 384), jnp.bfloat16)
    w = rnd(7, (384, 640), jnp.bfloat16, scale=0.05)
    b, s = rnd(8, (640,), jnp.bfloat16), rnd(9, (640,))

    def chain(a, b, s):
        return jnp.tanh(a + b) * 0.5 + s * jnp.maximum(a, 0.0)

    out = pk.gemm_fused(x, w, chain, b, s, impl="pallas")
    assert_close(out, pk.gemm_fused_reference(x, w, chain, b, s), "bfloat16")
    xf, wf, bf = (a.astype(jnp.float32) for a in (x, w, b))
    with jax.default_matmul_precision("highest"):
        got = jax.grad(
            lambda x, w, b: pk.gemm_epilogue(x, w, b, activation="gelu", impl="pallas").sum(),
            argnums=(0, 1, 2),
        )(xf, wf, bf)
        want = jax.grad(
            lambda x, w, b: pk.gemm_epilogue_reference(x, w, b, activation="gelu").sum(),
            argnums=(0, 1, 2),
        )(xf, wf, bf)
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, "float32", tol_table=GRAD_TOL)


# --------------------------------------------------------------------------- #
# The Hopper kernel (pallas_kernels/_gemm_mgpu.py), asked for explicitly: auto still
# picks Triton until its timings are recorded (docs/STATUS.md).
# --------------------------------------------------------------------------- #


def _need_hopper() -> None:
    cc = dsp.gpu_compute_capability()
    if cc is None or not cc.startswith("9."):
        pytest.skip(f"the Mosaic GEMM needs a Hopper (sm90) GPU, this is {cc}")


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", pk.ACTIVATIONS)
def test_gemm_mosaic_every_activation_gpu(activation: str, with_bias: bool) -> None:
    _need_hopper()
    x = rnd(10, (1024, 1024), jnp.bfloat16)
    w = rnd(11, (1024, 1024), jnp.bfloat16, scale=0.03)
    b = rnd(12, (1024,), jnp.bfloat16) if with_bias else None
    out = pk.gemm_epilogue(x, w, b, activation=activation, impl="pallas", _backend="mosaic")
    ref = pk.gemm_epilogue_reference(x, w, b, activation=activation)
    assert out.dtype == jnp.bfloat16
    assert_close(out, ref, "bfloat16", what=f"mosaic {activation} bias={with_bias}")


@pytest.mark.parametrize(
    "dtype,shape_x,shape_w,activation",
    [
        ("float16", (1000, 999), (999, 1001), "gelu"),
        ("bfloat16", (2, 3, 100, 320), (320, 72), "gelu_tanh"),
        ("bfloat16", (40, 4096), (4096, 4096), "relu"),
        ("float16", (8192, 1024), (1024, 4096), "silu"),
    ],
)
def test_gemm_mosaic_ragged_batched_gpu(dtype, shape_x, shape_w, activation) -> None:
    _need_hopper()
    x = rnd(13, shape_x, dtype)
    w = rnd(14, shape_w, dtype, scale=0.05)
    b = rnd(15, (shape_w[1],), dtype)
    out = pk.gemm_epilogue(x, w, b, activation=activation, impl="pallas", _backend="mosaic")
    ref = pk.gemm_epilogue_reference(x, w, b, activation=activation)
    assert_close(out, ref, dtype, what=f"mosaic {dtype}/{activation}")


def test_gemm_mosaic_templated_epilogue_and_grad_gpu() -> None:
    _need_hopper()
    x = rnd(16, (512, 384), jnp.bfloat16)
    w = rnd(17, (384, 640), jnp.bfloat16, scale=0.05)
    b, s = rnd(18, (640,), jnp.bfloat16), rnd(19, (640,))

    def chain(a, b, s):
        return jnp.tanh(a + b) * 0.5 + s * jnp.maximum(a, 0.0)

    out = pk.gemm_fused(x, w, chain, b, s, impl="pallas", _backend="mosaic")
    assert_close(out, pk.gemm_fused_reference(x, w, chain, b, s), "bfloat16")
    got = jax.grad(
        lambda x, w, b: (
            pk.gemm_epilogue(x, w, b, activation="gelu", impl="pallas", _backend="mosaic")
            .astype(jnp.float32)
            .sum()
        ),
        argnums=(0, 1, 2),
    )(x, w, b)
    want = jax.grad(
        lambda x, w, b: (
            pk.gemm_epilogue_reference(x, w, b, activation="gelu").astype(jnp.float32).sum()
        ),
        argnums=(0, 1, 2),
    )(x, w, b)
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, "bfloat16", tol_table=GRAD_TOL)
