"""The Hopper (Mosaic GPU) GEMM kernel on CPU: numerics in Mosaic GPU's interpret mode,
lowering for CUDA through ``jax.export`` (which runs Mosaic's lowering and layout
inference here, without a GPU), and the backend selection's errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import (
    ACTIVATIONS,
    gemm_epilogue,
    gemm_epilogue_reference,
    gemm_fused,
    gemm_fused_reference,
)
from pallas_kernels import _dispatch as dsp
from pallas_kernels import _gemm as g
from pallas_kernels import _gemm_mgpu as gm
from pypm_testing.kernels import GRAD_TOL, assert_close, jitted, rnd

# M=100, K=96, N=200 against the interpreted 64x(2x64) CTA tiles and tile_k=64: two row
# tiles, two column tiles, two K steps, all padded; two programs share the four tiles.
X_SHAPE, W_SHAPE = (100, 96), (96, 200)
# The interpreter's time grows with the tiles: each activation's epilogue runs on one CTA
# tile (M=40 of 64 rows, padded; K=64; N=128, the tile's two 64-column halves). The tests
# below run the four tiles of X_SHAPE (the tiling, the K loop and the padding of every edge).
ONE_TILE_X, ONE_TILE_W = (40, 64), (64, 128)


@pytest.mark.slow
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_with_bias_bf16(activation: str) -> None:
    x = rnd(0, ONE_TILE_X, "bfloat16")
    w = rnd(1, ONE_TILE_W, "bfloat16", scale=0.2)
    b = rnd(2, (128,), "bfloat16")
    kernel = jitted(gemm_epilogue, activation=activation, impl="interpret", _backend="mosaic")
    out = kernel(x, w, b)
    ref = jitted(gemm_epilogue_reference, activation=activation)(x, w, b)
    assert out.shape == (40, 128) and out.dtype == jnp.bfloat16
    assert_close(out, ref, "bfloat16", what=activation)


@pytest.mark.slow
def test_f16_no_bias_batched_leading_dims() -> None:
    x = rnd(3, (2, 3, 21, 96), "float16")
    w = rnd(4, W_SHAPE, "float16", scale=0.2)
    out = jitted(gemm_epilogue, activation="gelu", impl="interpret", _backend="mosaic")(x, w)
    ref = jitted(gemm_epilogue_reference, activation="gelu")(x, w)
    assert out.shape == (2, 3, 21, 200) and out.dtype == jnp.float16
    assert_close(out, ref, "float16")


@pytest.mark.slow
def test_templated_epilogue_two_columns() -> None:
    x = rnd(5, X_SHAPE, "bfloat16")
    w = rnd(6, W_SHAPE, "bfloat16", scale=0.2)
    s, t = rnd(7, (200,), "bfloat16"), rnd(8, (200,), "float32")

    def affine_leaky(a, s, t):
        y = a * s + t
        return jnp.where(y > 0, y, 0.1 * y)

    out = jax.jit(
        lambda x, w, s, t: gemm_fused(x, w, affine_leaky, s, t, impl="interpret", _backend="mosaic")
    )(x, w, s, t)
    ref = jax.jit(lambda x, w, s, t: gemm_fused_reference(x, w, affine_leaky, s, t))(x, w, s, t)
    assert_close(out, ref, "bfloat16")


@pytest.mark.slow
def test_exact_values_when_products_are_exact() -> None:
    # Small integers: every product and sum is exact in bf16 x bf16 -> f32, so the kernel
    # must agree bit for bit (a tile or padding mix-up cannot hide in a tolerance).
    x = jax.random.randint(jax.random.PRNGKey(9), X_SHAPE, -3, 4).astype(jnp.bfloat16)
    w = jax.random.randint(jax.random.PRNGKey(10), W_SHAPE, -3, 4).astype(jnp.bfloat16)
    b = jnp.arange(200, dtype=jnp.float32).astype(jnp.bfloat16)
    out = jitted(gemm_epilogue, activation="relu", impl="interpret", _backend="mosaic")(x, w, b)
    ref = jitted(gemm_epilogue_reference, activation="relu")(x, w, b)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


@pytest.mark.slow
def test_columns_loaded_in_the_epilogue_instead_of_before_the_loop() -> None:
    x = rnd(20, X_SHAPE, "bfloat16")
    w = rnd(21, W_SHAPE, "bfloat16", scale=0.2)
    b = rnd(22, (200,), "bfloat16")
    cfg = gm.MosaicGemmConfig(64, 64, 64, 2, 64, 64, "m", 2, "n", preload_columns=False)
    out = jitted(gemm_epilogue, activation="gelu_tanh", impl="interpret", _blocks=cfg)(x, w, b)
    ref = jitted(gemm_epilogue_reference, activation="gelu_tanh")(x, w, b)
    assert_close(out, ref, "bfloat16")


@pytest.mark.slow
def test_gradients_through_the_mosaic_forward() -> None:
    x = rnd(11, (64, 96), "bfloat16")
    w = rnd(12, (96, 128), "bfloat16", scale=0.2)
    b = rnd(13, (128,), "bfloat16")

    def loss(fn):
        return lambda x, w, b: jnp.sum(fn(x, w, b).astype(jnp.float32) ** 2)

    got = jax.jit(
        jax.grad(
            loss(
                lambda x, w, b: gemm_epilogue(
                    x, w, b, activation="silu", impl="interpret", _backend="mosaic"
                )
            ),
            argnums=(0, 1, 2),
        )
    )(x, w, b)
    want = jax.jit(
        jax.grad(
            loss(lambda x, w, b: gemm_epilogue_reference(x, w, b, activation="silu")),
            argnums=(0, 1, 2),
        )
    )(x, w, b)
    for a, e in zip(got, want, strict=True):
        assert_close(a, e, "bfloat16", tol_table=GRAD_TOL)


# --------------------------------------------------------------------------- #
# Lowering for CUDA (no GPU needed: jax.export runs Mosaic GPU's Python lowering and
# layout inference; PTX is compiled only when a GPU runs the module)
# --------------------------------------------------------------------------- #


def _export_for_cuda(epilogue, n_cols: int, dtype=jnp.bfloat16, config=None) -> str:
    config = config or gm.MosaicGemmConfig()
    x = jax.ShapeDtypeStruct((512, 256), dtype)
    w = jax.ShapeDtypeStruct((256, 512), dtype)
    cols = (jax.ShapeDtypeStruct((512,), jnp.float32),) * n_cols

    def fn(x, w, *c):
        return gm.gemm_mosaic(x, w, c, epilogue, dtype, False, config)

    return jax.export.export(jax.jit(fn), platforms=["cuda"])(x, w, *cols).mlir_module()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_lowers_for_cuda(activation: str, with_bias: bool) -> None:
    epilogue = g._KERNEL_EPILOGUES[(activation, with_bias)]
    assert gm.mosaic_error(jnp.bfloat16, (jnp.float32,) * with_bias, epilogue) is None
    module = _export_for_cuda(epilogue, int(with_bias))
    assert "mosaic_gpu" in module


def test_f16_and_small_m_config_lower_for_cuda() -> None:
    epilogue = g._KERNEL_EPILOGUES[("gelu_tanh", True)]
    assert "mosaic_gpu" in _export_for_cuda(epilogue, 1, jnp.float16)
    small = gm.default_mosaic_config(32, 512, interpret=False)
    assert (small.tile_m, small.tile_n) == (64, 128)
    assert "mosaic_gpu" in _export_for_cuda(epilogue, 1, config=small)
    narrow = gm.default_mosaic_config(4096, 72, interpret=False)
    assert (narrow.tile_m, narrow.cta_tile_n) == (128, 128)
    assert "mosaic_gpu" in _export_for_cuda(epilogue, 1, config=narrow)
    late = gm.MosaicGemmConfig(preload_columns=False)
    assert "mosaic_gpu" in _export_for_cuda(epilogue, 1, config=late)


# One epilogue per allowed primitive, so the allow-list claims only what lowers.
_PER_PRIMITIVE = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b * b + 1.0),
    "max": lambda a, b: jnp.maximum(a, b),
    "min": lambda a, b: jnp.minimum(a, b),
    "neg": lambda a, b: -a,
    "abs": lambda a, b: jnp.abs(a),
    "exp": lambda a, b: jnp.exp(a),
    "log": lambda a, b: jnp.log(a * a + 1.0),
    "tanh": lambda a, b: jnp.tanh(a),
    "logistic": lambda a, b: lax.logistic(a),
    "rsqrt": lambda a, b: lax.rsqrt(a * a + 1.0),
    "integer_pow": lambda a, b: a**3,
    "select_n": lambda a, b: lax.select(a > b, a, b),
    "lt": lambda a, b: lax.select(a < b, a, b),
    "le": lambda a, b: lax.select(a <= b, a, b),
    "gt": lambda a, b: lax.select(a > 0.5, a, b),
    "ge": lambda a, b: lax.select(a >= b, a, b),
    "convert_element_type": lambda a, b: a.astype(jnp.bfloat16).astype(jnp.float32) + b,
    "broadcast_in_dim": lambda a, b: a * lax.broadcast_in_dim(jnp.float32(0.5), a.shape, ()),
}


def test_per_primitive_table_covers_the_allow_list() -> None:
    assert set(_PER_PRIMITIVE) == set(gm.EPILOGUE_PRIMITIVES)


@pytest.mark.parametrize("prim", sorted(gm.EPILOGUE_PRIMITIVES))
def test_each_allowed_primitive_lowers_for_cuda(prim: str) -> None:
    epilogue = _PER_PRIMITIVE[prim]
    tile = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    used = gm._primitive_names(jax.make_jaxpr(epilogue)(tile, tile).jaxpr)
    assert prim in used, (prim, used)
    assert "mosaic_gpu" in _export_for_cuda(epilogue, 1)


# --------------------------------------------------------------------------- #
# Selection
# --------------------------------------------------------------------------- #


def test_auto_backend_is_triton_until_timed_on_a_gpu(monkeypatch) -> None:
    monkeypatch.delenv(g.GEMM_BACKEND_ENV, raising=False)
    ep = g._KERNEL_EPILOGUES[("relu", True)]
    assert g.resolve_gemm_backend(None, "interpret", jnp.bfloat16, (jnp.bfloat16,), ep) == "triton"


@pytest.mark.parametrize(
    "cc,dtype,epilogue,impl,want",
    [
        ("9.0", jnp.bfloat16, g._KERNEL_EPILOGUES[("relu", True)], "pallas", "mosaic"),
        ("9.0", jnp.float16, g._KERNEL_EPILOGUES[("gelu", True)], "pallas", "mosaic"),
        ("9.0", jnp.float32, g._KERNEL_EPILOGUES[("relu", True)], "pallas", "triton"),
        ("9.0", jnp.bfloat16, lambda a, b: jax.nn.relu(a + b), "pallas", "triton"),
        ("8.0", jnp.bfloat16, g._KERNEL_EPILOGUES[("relu", True)], "pallas", "triton"),
        ("10.0", jnp.bfloat16, g._KERNEL_EPILOGUES[("relu", True)], "pallas", "triton"),
        (None, jnp.bfloat16, g._KERNEL_EPILOGUES[("relu", True)], "interpret", "triton"),
    ],
)
def test_auto_policy_once_switched_on(monkeypatch, cc, dtype, epilogue, impl, want) -> None:
    # The policy MOSAIC_AUTO_ON_HOPPER turns on: Mosaic for compiled calls on sm90 it can
    # serve, Triton for everything else (never an error: auto is not a request).
    monkeypatch.delenv(g.GEMM_BACKEND_ENV, raising=False)
    monkeypatch.setattr(g, "MOSAIC_AUTO_ON_HOPPER", True)
    monkeypatch.setattr(dsp, "gpu_compute_capability", lambda: cc)
    assert g.resolve_gemm_backend(None, impl, dtype, (jnp.bfloat16,), epilogue) == want


def test_prefer_mosaic_in_the_environment_is_the_auto_policy(monkeypatch) -> None:
    monkeypatch.setenv(g.GEMM_BACKEND_ENV, "prefer-mosaic")
    monkeypatch.setattr(dsp, "gpu_compute_capability", lambda: "9.0")
    relu = g._KERNEL_EPILOGUES[("relu", True)]
    assert g.resolve_gemm_backend(None, "pallas", jnp.bfloat16, (jnp.bfloat16,), relu) == "mosaic"
    # f32 is not for the Mosaic kernel: a preference, so Triton, not an error
    assert g.resolve_gemm_backend(None, "pallas", jnp.float32, (jnp.float32,), relu) == "triton"
    monkeypatch.setattr(dsp, "gpu_compute_capability", lambda: "8.0")
    assert g.resolve_gemm_backend(None, "pallas", jnp.bfloat16, (jnp.bfloat16,), relu) == "triton"


@pytest.mark.slow
def test_env_override_routes_to_mosaic(monkeypatch) -> None:
    calls = []
    real = gm.gemm_mosaic

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(gm, "gemm_mosaic", spy)
    monkeypatch.setenv(g.GEMM_BACKEND_ENV, "mosaic")
    x = rnd(14, (64, 64), "bfloat16")
    w = rnd(15, (64, 128), "bfloat16")
    out = gemm_epilogue(x, w, activation="tanh", impl="interpret")
    assert calls == [(64, 64)]
    assert_close(out, gemm_epilogue_reference(x, w, activation="tanh"), "bfloat16")


def test_mosaic_requests_that_cannot_run_raise(monkeypatch) -> None:
    monkeypatch.delenv(g.GEMM_BACKEND_ENV, raising=False)
    x32, w32 = rnd(16, (8, 8)), rnd(17, (8, 8))
    with pytest.raises(ValueError, match="dtype float32"):
        gemm_epilogue(x32, w32, impl="interpret", _backend="mosaic")
    x, w = x32.astype(jnp.bfloat16), w32.astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="custom_jvp_call"):
        gemm_fused(x, w, jax.nn.relu, impl="interpret", _backend="mosaic")
    with pytest.raises(ValueError, match="not elementwise"):  # written for [bn] columns
        gemm_fused(x, w, lambda a, b: a + b[None, :], x32[0], impl="interpret", _backend="mosaic")
    with pytest.raises(ValueError, match="does not trace"):
        gemm_fused(x, w, lambda a, b: a + b[:, :3], x32[0], impl="interpret", _backend="mosaic")
    with pytest.raises(ValueError, match="invalid _backend='cuda'"):
        gemm_epilogue(x, w, impl="interpret", _backend="cuda")
    monkeypatch.setenv(g.GEMM_BACKEND_ENV, "tpu")
    with pytest.raises(ValueError, match=r"invalid \$PYPM_GEMM_BACKEND='tpu'"):
        gemm_epilogue(x, w, impl="interpret")


def test_interpret_params_shim_finds_the_class() -> None:
    # The kernels' only private JAX import: fails here, loudly, if JAX moves the class.
    params = dsp.mosaic_gpu_interpret_params()
    assert type(params).__name__ == "InterpretGPUParams"
