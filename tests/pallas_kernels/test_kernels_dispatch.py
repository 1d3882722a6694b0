"""Support predicates, implementation selection, env override, error handling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pypm_testing.kernels import has_pallas_call, rnd


def test_public_api() -> None:
    assert set(pk.__all__) >= {
        "flash_attention",
        "attention_reference",
        "supports_attention",
        "gemm_epilogue",
        "gemm_epilogue_reference",
        "gemm_fused",
        "gemm_fused_reference",
        "supports_gemm",
        "ACTIVATIONS",
    }
    assert pk.ACTIVATIONS == (
        "none",
        "relu",
        "gelu_tanh",
        "gelu",
        "silu",
        "sigmoid",
        "tanh",
        "quick_gelu",
    )


@pytest.mark.parametrize(
    "args,kw",
    [
        (((2, 128, 8, 64), (2, 128, 8, 64), (2, 128, 8, 64), "bfloat16"), {}),
        (((2, 8, 37, 32), (2, 2, 45, 32), (2, 2, 45, 32), np.float16), {"layout": "BHSD"}),
        (
            ((1, 5, 4, 256), (1, 9, 1, 256), (1, 9, 1, 256), jnp.float32),
            {"bias_shape": (1, 1, 1, 9), "mask_shape": (5, 9)},
        ),
        (
            ((2, 16, 4, 96), (2, 16, 4, 96), (2, 16, 4, 96), "float32"),
            {"bias_shape": (2, 4, 16, 16), "mask_shape": (2, 1, 1, 16)},
        ),
        (((2, 16, 4, 1), (2, 16, 4, 1), (2, 16, 4, 1), "float32"), {"bias_shape": ()}),
        (
            ((2, 16, 4, 72), (2, 16, 4, 72), (2, 16, 4, 72), "float32"),
            {"capture_shapes": [(1, 4, 1, 1), (), (2, 1, 16, 1)]},
        ),
    ],
)
def test_supports_attention_true(args, kw) -> None:
    assert pk.supports_attention(*args, **kw)


@pytest.mark.parametrize(
    "args,kw",
    [
        (((2, 16, 4, 0), (2, 16, 4, 0), (2, 16, 4, 0), "float32"), {}),  # head dim 0
        (((2, 16, 4, 512), (2, 16, 4, 512), (2, 16, 4, 512), "float32"), {}),  # head dim > 256
        (((2, 16, 4, 64), (2, 16, 3, 64), (2, 16, 3, 64), "float32"), {}),  # 4 % 3 != 0
        (
            ((2, 16, 4, 64), (2, 16, 4, 64), (2, 16, 4, 64), "float32"),
            {"capture_shapes": [(1, 4, 1, 1), (3, 1, 1, 1)]},
        ),
        (((2, 16, 4, 64), (2, 16, 4, 64), (2, 16, 4, 64), "float64"), {}),  # dtype
        (((2, 16, 4, 64), (2, 16, 4, 64), (2, 16, 4, 64), "int8"), {}),
        (((16, 4, 64), (16, 4, 64), (16, 4, 64), "float32"), {}),  # rank 3
        (((2, 16, 4, 64), (2, 16, 4, 64), (2, 17, 4, 64), "float32"), {}),  # k != v
        (((2, 16, 4, 64), (3, 16, 4, 64), (3, 16, 4, 64), "float32"), {}),  # batch
        (
            ((2, 16, 4, 64), (2, 16, 4, 64), (2, 16, 4, 64), "float32"),
            {"bias_shape": (2, 4, 16, 8)},
        ),
        (
            ((2, 16, 4, 64), (2, 16, 4, 64), (2, 16, 4, 64), "float32"),
            {"mask_shape": (1, 2, 1, 1, 1)},
        ),
        (((2, 16, 4, 64), (2, 16, 4, 64), (2, 16, 4, 64), "float32"), {"layout": "BSH"}),
        (((2, 16, 4, 64), (2, 16, 4, 64), (2, 16, 4, 64), "not-a-dtype"), {}),
    ],
)
def test_supports_attention_false(args, kw) -> None:
    assert not pk.supports_attention(*args, **kw)


def test_supports_gemm() -> None:
    assert pk.supports_gemm((8192, 1024), (1024, 4096), "bfloat16", bias_shape=(4096,))
    assert pk.supports_gemm((2, 3, 37), (37, 45), np.float16)
    assert pk.supports_gemm((37,), (37, 5), jnp.float32)
    assert not pk.supports_gemm((8, 32), (16, 4), "float32")  # K mismatch
    assert not pk.supports_gemm((8, 32), (32, 4), "float32", bias_shape=(5,))  # bias != [N]
    assert not pk.supports_gemm((8, 32), (32, 4), "float32", bias_shape=(1, 4))
    assert not pk.supports_gemm((8, 32), (32, 4, 1), "float32")  # w rank
    assert not pk.supports_gemm((8, 32), (32, 4), "float64")
    assert not pk.supports_gemm((0, 32), (32, 4), "float32")  # empty


def _attn_args(d: int = 32):
    return (rnd(0, (1, 16, 2, d)), rnd(1, (1, 16, 2, d)), rnd(2, (1, 16, 2, d)))


def test_auto_impl_on_cpu_is_the_reference(monkeypatch) -> None:
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    if jax.default_backend() == "gpu":
        pytest.skip("CPU fallback behaviour")
    q, k, v = _attn_args()
    mask = jnp.tril(jnp.ones((16, 16), bool))
    out = pk.flash_attention(q, k, v, mask=mask)
    np.testing.assert_array_equal(out, jax.jit(pk.attention_reference)(q, k, v, mask=mask))
    assert not has_pallas_call(lambda q, k, v: pk.flash_attention(q, k, v), q, k, v)
    x, w, b = rnd(3, (8, 32)), rnd(4, (32, 16)), rnd(5, (16,))
    out = pk.gemm_epilogue(x, w, b, activation="gelu")
    np.testing.assert_array_equal(
        out,
        jax.jit(pk.gemm_epilogue_reference, static_argnames="activation")(
            x, w, b, activation="gelu"
        ),
    )
    assert not has_pallas_call(lambda x, w: pk.gemm_epilogue(x, w, activation="relu"), x, w)


def test_auto_impl_handles_unsupported_shapes_with_xla(monkeypatch) -> None:
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    q, k, v = _attn_args(d=320)  # head dim 320: no kernel, auto uses the reference
    assert not has_pallas_call(lambda q, k, v: pk.flash_attention(q, k, v), q, k, v)
    # jitted vs eager reference: the same program up to XLA's fusion of the 320-long sums
    np.testing.assert_allclose(
        pk.flash_attention(q, k, v), pk.attention_reference(q, k, v), rtol=1e-5, atol=1e-6
    )


def test_env_override_forces_interpret(monkeypatch) -> None:
    q, k, v = _attn_args()
    monkeypatch.setenv(pk.ENV_VAR, "interpret")
    assert has_pallas_call(lambda q, k, v: pk.flash_attention(q, k, v), q, k, v)
    x, w = rnd(3, (8, 32)), rnd(4, (32, 16))
    assert has_pallas_call(lambda x, w: pk.gemm_epilogue(x, w, activation="relu"), x, w)
    np.testing.assert_allclose(
        pk.gemm_epilogue(x, w, activation="relu"),
        pk.gemm_epilogue_reference(x, w, activation="relu"),
        rtol=1e-5,
        atol=1e-5,
    )
    monkeypatch.setenv(pk.ENV_VAR, "xla")
    assert not has_pallas_call(lambda q, k, v: pk.flash_attention(q, k, v), q, k, v)
    monkeypatch.setenv(pk.ENV_VAR, "auto")
    pk.flash_attention(q, k, v)
    monkeypatch.setenv(pk.ENV_VAR, "triton!")
    with pytest.raises(ValueError, match="PYPM_KERNEL_IMPL"):
        pk.flash_attention(q, k, v)
    # An override is explicit: an unsupported call raises instead of falling back.
    monkeypatch.setenv(pk.ENV_VAR, "interpret")
    with pytest.raises(ValueError, match="head dim 320"):
        pk.flash_attention(*_attn_args(d=320))


def test_invalid_and_unavailable_impls_raise(monkeypatch) -> None:
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    q, k, v = _attn_args()
    x, w = rnd(3, (8, 32)), rnd(4, (32, 16))
    for bad in ("cuda", "Pallas", ""):
        with pytest.raises(ValueError, match="invalid impl"):
            pk.flash_attention(q, k, v, impl=bad)
        with pytest.raises(ValueError, match="invalid impl"):
            pk.gemm_epilogue(x, w, impl=bad)
    if jax.default_backend() != "gpu":
        with pytest.raises(ValueError, match="GPU backend"):
            pk.flash_attention(q, k, v, impl="pallas")
        with pytest.raises(ValueError, match="GPU backend"):
            pk.gemm_fused(x, w, lambda a: a, impl="pallas")
    with pytest.raises(ValueError, match="head dim 320"):
        pk.flash_attention(*_attn_args(d=320), impl="interpret")
    with pytest.raises(ValueError, match="share a dtype"):
        pk.gemm_epilogue(x, w.astype(jnp.bfloat16), impl="interpret")
    # ... while the XLA implementation handles mixed dtypes by promotion.
    assert pk.gemm_epilogue(x, w.astype(jnp.bfloat16), impl="xla").dtype == jnp.float32


def test_argument_validation() -> None:
    q, k, v = _attn_args()
    with pytest.raises(ValueError, match="layout"):
        pk.flash_attention(q, k, v, layout="SBHD")
    with pytest.raises(ValueError, match="broadcastable"):
        pk.flash_attention(q, k, v, bias=jnp.zeros((1, 2, 16, 5)))
    with pytest.raises(TypeError, match="mask must be boolean"):
        pk.flash_attention(q, k, v, mask=jnp.ones((16, 16), jnp.float32))
    with pytest.raises(TypeError, match="scale"):
        pk.flash_attention(q, k, v, scale=jnp.float32(0.5))
    with pytest.raises(ValueError, match="multiple of kv heads"):
        pk.flash_attention(rnd(0, (1, 16, 3, 32)), k, v)
    with pytest.raises(ValueError, match="activation"):
        pk.gemm_epilogue(rnd(3, (8, 32)), rnd(4, (32, 16)), activation="swish")
    with pytest.raises(ValueError, match="contraction"):
        pk.gemm_epilogue(rnd(3, (8, 32)), rnd(4, (31, 16)))
    with pytest.raises(ValueError, match=r"shape \[N\]"):
        pk.gemm_fused(rnd(3, (8, 32)), rnd(4, (32, 16)), lambda a, b: a + b, jnp.zeros((8,)))
    with pytest.raises(TypeError, match="callable"):
        pk.gemm_fused(rnd(3, (8, 32)), rnd(4, (32, 16)), "relu")


def _instructions(compiled_text: str) -> list[str]:
    """Optimized-HLO instructions with names, metadata and configs stripped."""
    import re

    lines = [ln for ln in compiled_text.splitlines() if " = " in ln]
    text = "\n".join(lines)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r", backend_config=.*$", "", text, flags=re.M)
    text = re.sub(r"%[\w.\-]+", "%v", text)
    text = re.sub(r"\b[\w\-]+\.\d+\b", "n", text)
    return [ln.strip() for ln in text.splitlines()]


@pytest.mark.parametrize("activation", ["relu", "gelu_tanh", "silu"])
def test_cpu_fallback_compiles_to_the_original_program_f32(monkeypatch, activation) -> None:
    """'Never slower than the original on CPU', structurally: for f32 the impl=None
    GEMM fallback is the very same optimized XLA program as `act(x @ w + b)`."""
    if jax.default_backend() == "gpu":
        pytest.skip("CPU fallback behaviour")
    monkeypatch.delenv(pk.ENV_VAR, raising=False)
    acts = {
        "relu": jax.nn.relu,
        "gelu_tanh": lambda y: jax.nn.gelu(y, approximate=True),
        "silu": jax.nn.silu,
    }
    x, w, b = jnp.ones((64, 32)), jnp.ones((32, 48)), jnp.ones((48,))
    ours = jax.jit(lambda x, w, b: pk.gemm_epilogue(x, w, b, activation=activation))
    orig = jax.jit(lambda x, w, b: acts[activation](x @ w + b))
    assert _instructions(ours.lower(x, w, b).compile().as_text()) == _instructions(
        orig.lower(x, w, b).compile().as_text()
    )


def test_operand_kinds_and_support() -> None:
    lead, n = (3, 13), 45
    assert pk.operand_kind((45,), lead, n) == "col"
    assert pk.operand_kind((1, 45), lead, n) == "col"
    assert pk.operand_kind((3, 13, 1), lead, n) == "row"
    assert pk.operand_kind((13, 1), lead, n) is None  # a row needs every leading dim
    assert pk.operand_kind((3, 13, 45), lead, n) == "full"
    assert pk.operand_kind((), lead, n) == pk.operand_kind((1, 1, 1), lead, n) == "scalar"
    assert pk.operand_kind((3, 1, 45), lead, n) is None  # per-batch bias: not tileable
    assert pk.operand_kind((1, 3, 13, 45), lead, n) is None  # rank above the result's
    assert pk.supports_gemm((3, 13, 8), (8, 45), "float32", operand_shapes=((3, 13, 1), ()))
    assert not pk.supports_gemm((3, 13, 8), (8, 45), "float32", operand_shapes=((3, 1, 45),))
