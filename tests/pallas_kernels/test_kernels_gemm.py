"""GEMM + fused epilogue in Pallas interpret mode vs the plain-JAX reference (CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (
    ACTIVATIONS,
    gemm_epilogue,
    gemm_epilogue_reference,
    gemm_fused,
    gemm_fused_experts,
    gemm_fused_experts_reference,
    gemm_fused_pair,
    gemm_fused_pair_reference,
    gemm_fused_reference,
    supports_gemm_experts,
)
from pallas_kernels._gemm import GemmBlocks, erf
from pypm_testing.kernels import GRAD_TOL, assert_close, jitted, rnd

# M=37, K=50, N=45: none divides the 16-wide interpret tiles.
RAGGED = ((3, 37 // 3 + 1, 50), (50, 45))


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_every_activation_with_bias_ragged_batched(activation: str) -> None:
    x = rnd(0, (3, 13, 50), scale=0.5)
    w = rnd(1, (50, 45), scale=0.3)
    b = rnd(2, (45,))
    out = jitted(gemm_epilogue, activation=activation, impl="interpret")(x, w, b)
    ref = jitted(gemm_epilogue_reference, activation=activation)(x, w, b)
    assert out.shape == (3, 13, 45) and out.dtype == x.dtype
    assert_close(out, ref, "float32", what=activation)


@pytest.mark.parametrize(
    "dtype,activation,with_bias",
    [
        ("bfloat16", "gelu_tanh", True),
        ("float16", "silu", True),
        ("bfloat16", "gelu", False),
        ("float16", "none", False),
        ("float32", "relu", False),
    ],
)
def test_dtypes_accumulate_in_f32(dtype: str, activation: str, with_bias: bool) -> None:
    x = rnd(3, (37, 70), dtype)
    w = rnd(4, (70, 33), dtype, scale=0.2)
    b = rnd(5, (33,), dtype) if with_bias else None
    out = jitted(gemm_epilogue, activation=activation, impl="interpret")(x, w, b)
    ref = jitted(gemm_epilogue_reference, activation=activation)(x, w, b)
    assert out.dtype == jnp.dtype(dtype)
    assert_close(out, ref, dtype, what=f"{dtype}/{activation}")


@pytest.mark.slow
def test_leading_dims_and_vector_input() -> None:
    w = rnd(6, (24, 40))
    b = rnd(7, (40,))
    x4 = rnd(8, (2, 3, 5, 24))
    assert_close(
        gemm_epilogue(x4, w, b, activation="tanh", impl="interpret"),
        gemm_epilogue_reference(x4, w, b, activation="tanh"),
        "float32",
    )
    x1 = rnd(9, (24,))
    out = gemm_epilogue(x1, w, b, activation="relu", impl="interpret")
    assert out.shape == (40,)
    assert_close(out, gemm_epilogue_reference(x1, w, b, activation="relu"), "float32")


@pytest.mark.slow
def test_templated_epilogue_custom_chains() -> None:
    x = rnd(10, (37, 50))
    w = rnd(11, (50, 45), scale=0.2)
    b, s = rnd(12, (45,)), rnd(13, (45,))

    def chain(a, b):
        return jnp.tanh(a + b) * 0.5

    def affine_leaky(a, s, t):
        y = a * s + t
        return jnp.where(y > 0, y, 0.1 * y)

    def no_cols(a):
        return jnp.exp(-a * a) + jnp.sqrt(jnp.abs(a))

    for fn, cols in ((chain, (b,)), (affine_leaky, (s, b)), (no_cols, ())):
        out = jax.jit(lambda x, w, *cols, fn=fn: gemm_fused(x, w, fn, *cols, impl="interpret"))(
            x, w, *cols
        )
        want = jax.jit(lambda x, w, *cols, fn=fn: gemm_fused_reference(x, w, fn, *cols))(
            x, w, *cols
        )
        assert_close(out, want, "float32", what=fn.__name__)


def test_templated_epilogue_bf16_output_cast_and_f32_tiles() -> None:
    """The epilogue sees f32 tiles (accumulator and column operands)."""
    seen = []

    def probe(a, b):
        seen.append((a.dtype, b.dtype))
        return a * b

    x, w, b = (
        rnd(14, (16, 32), "bfloat16"),
        rnd(15, (32, 16), "bfloat16"),
        rnd(16, (16,), "bfloat16"),
    )
    out = gemm_fused(x, w, probe, b, impl="interpret")
    assert out.dtype == jnp.bfloat16
    assert all(dt == (jnp.float32, jnp.float32) for dt in seen)
    assert_close(out, gemm_fused_reference(x, w, probe, b), "bfloat16")


def test_non_elementwise_epilogue_is_rejected() -> None:
    x, w = rnd(17, (16, 16)), rnd(18, (16, 16))
    with pytest.raises(ValueError, match="elementwise"):
        gemm_fused(x, w, lambda a: jnp.sum(a, axis=0), impl="interpret")


def test_larger_tiles_and_k_loop() -> None:
    x, w, b = rnd(19, (100, 200)), rnd(20, (200, 70), scale=0.1), rnd(21, (70,))
    blocks = GemmBlocks(32, 32, 64, 2, 4, 2)
    out = jitted(gemm_epilogue, activation="gelu", impl="interpret", _blocks=blocks)(x, w, b)
    assert_close(out, jitted(gemm_epilogue_reference, activation="gelu")(x, w, b), "float32")


@pytest.mark.slow
def test_gradients_through_gemm_epilogue() -> None:
    x, w, b = rnd(22, (2, 19, 30)), rnd(23, (30, 21), scale=0.3), rnd(24, (21,))
    cot = rnd(25, (2, 19, 21))
    for act in ("gelu", "silu"):
        got = jax.jit(
            jax.grad(
                lambda x, w, b, a=act: jnp.sum(
                    gemm_epilogue(x, w, b, activation=a, impl="interpret") * cot
                ),
                argnums=(0, 1, 2),
            )
        )(x, w, b)
        want = jax.jit(
            jax.grad(
                lambda x, w, b, a=act: jnp.sum(
                    gemm_epilogue_reference(x, w, b, activation=a) * cot
                ),
                argnums=(0, 1, 2),
            )
        )(x, w, b)
        for name, g, r in zip("xwb", got, want, strict=True):
            assert_close(g, r, "float32", tol_table=GRAD_TOL, what=f"{act} d{name}")


def test_in_kernel_erf_is_accurate() -> None:
    xs = jnp.linspace(-6, 6, 2001)
    np.testing.assert_allclose(erf(xs), jax.scipy.special.erf(xs), rtol=1e-6, atol=5e-7)
    # what the exact-GELU epilogue computes, against jax.nn.gelu (only |error| counts there)
    ys = jnp.linspace(-8, 8, 200_001)
    gelu = 0.5 * ys * (1.0 + erf(ys / np.sqrt(2.0)))
    want = jax.nn.gelu(ys, approximate=False)
    assert float(jnp.max(jnp.abs(gelu - want))) <= 1e-6


# Operands of every kind the kernel tiles, for a [3, 13, 45] result (M=39, N=45: ragged),
# in their plain shapes and in shapes with extra size-1 axes.
OPERAND_SHAPES = {
    "plain": {"col": (45,), "row": (3, 13, 1), "full": (3, 13, 45), "scalar": ()},
    "size-1 axes": {"col": (1, 1, 45), "row": (3, 13, 1), "full": (3, 13, 45), "scalar": (1, 1)},
}


def _every_kind(acc, col, row, full, scalar):
    """Reads each operand twice (gradients through both uses)."""
    h = jnp.log1p(jnp.exp(acc * col + row)) * full + scalar
    return h + col * row * scalar


@pytest.mark.parametrize("shapes", list(OPERAND_SHAPES))
def test_operand_kinds_values_and_gradients(shapes: str) -> None:
    x, w = rnd(30, (3, 13, 50), scale=0.5), rnd(31, (50, 45), scale=0.3)
    ops = [rnd(32 + i, s) for i, s in enumerate(OPERAND_SHAPES[shapes].values())]
    cot = rnd(39, (3, 13, 45))

    def kernel(x, w, *ops):
        return gemm_fused(x, w, _every_kind, *ops, impl="interpret")

    def plain(x, w, *ops):
        return _every_kind(x @ w, *ops)

    out = jax.jit(kernel)(x, w, *ops)
    assert out.shape == (3, 13, 45)
    assert_close(out, jax.jit(plain)(x, w, *ops), "float32", what=shapes)
    reference = jax.jit(lambda x, w, *ops: gemm_fused_reference(x, w, _every_kind, *ops))
    assert_close(out, reference(x, w, *ops), "float32", what=shapes)
    argnums = tuple(range(2 + len(ops)))
    got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * cot), argnums))(x, w, *ops)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(plain(*a) * cot), argnums))(x, w, *ops)
    for name, g, r in zip(("dx", "dw", *OPERAND_SHAPES[shapes]), got, want, strict=True):
        assert g.shape == r.shape, (shapes, name)
        assert_close(g, r, "float32", tol_table=GRAD_TOL, what=f"{shapes} d{name}")


def test_mixed_operands_and_out_dtype() -> None:
    """A bias, a row scale and a residual in one epilogue; an f32 result of bf16 inputs."""
    x, w = rnd(40, (37, 50), jnp.bfloat16), rnd(41, (50, 45), jnp.bfloat16, scale=0.3)
    b, s, res = rnd(42, (45,)), rnd(43, (37, 1)), rnd(44, (37, 45), jnp.bfloat16)

    def epi(acc, b, s, res):
        return jax.nn.relu(acc + b) * s + res

    out = jax.jit(
        lambda *a: gemm_fused(*a[:2], epi, *a[2:], impl="interpret", out_dtype=jnp.float32)
    )(x, w, b, s, res)
    assert out.dtype == jnp.float32
    want = jax.jit(lambda *a: gemm_fused_reference(*a[:2], epi, *a[2:], out_dtype=jnp.float32))(
        x, w, b, s, res
    )
    assert_close(out, want, "float32")
    assert_close(out, epi(jnp.dot(x, w, preferred_element_type=jnp.float32), b, s, res), "bfloat16")


def test_kernel_epilogue_runs_in_the_kernel_only() -> None:
    x, w = rnd(50, (20, 24)), rnd(51, (24, 18))
    exact = lambda a: jax.lax.erf(a)  # noqa: E731
    out = gemm_fused(x, w, exact, impl="interpret", kernel_epilogue=erf)
    assert_close(out, erf(x @ w), "float32")
    ref = gemm_fused(x, w, exact, impl="xla", kernel_epilogue=erf)
    np.testing.assert_array_equal(ref, jax.jit(lambda x, w: jax.lax.erf(x @ w))(x, w))


@pytest.mark.parametrize("shape", [(3, 1, 45), (2, 13, 45), (13, 45, 1), (45, 1)])
def test_operands_the_kernel_cannot_tile_are_refused(shape) -> None:
    x, w = rnd(0, (3, 13, 50)), rnd(1, (50, 45))
    with pytest.raises(ValueError, match="operand 0 of shape"):
        gemm_fused(x, w, lambda a, c: a + c, jnp.ones(shape), impl="interpret")


# ------------------------------------------------- batched: an expert axis on the weight

EXPERT_OPERANDS = {  # against the [E=3, 2, 13, 45] result
    "shared column": (45,),
    "per-expert column": (3, 1, 1, 45),
    "per-expert row": (3, 2, 13, 1),
    "shared full": (2, 13, 45),
    "per-expert full": (3, 2, 13, 45),
    "scalar": (),
}


# every operand kind with both activations; `make test-fast` runs each kind with one of them
EXPERT_CASES = [
    pytest.param(
        operand,
        x_batched,
        id=f"{operand}-{'x per expert' if x_batched else 'x shared'}",
        marks=() if i % 2 == x_batched else pytest.mark.slow,
    )
    for i, operand in enumerate(EXPERT_OPERANDS)
    for x_batched in (False, True)
]


@pytest.mark.parametrize(("operand", "x_batched"), EXPERT_CASES)
def test_experts_values_and_gradients(operand: str, x_batched: bool) -> None:
    """``epilogue(x @ w[e], c)`` for each expert: one pallas_call (the experts on its grid),
    equal to the einsum in values and gradients (x, w and the operand)."""
    e, lead = 3, (2, 13)
    x = rnd(60, ((e, *lead, 50) if x_batched else (*lead, 50)), scale=0.5)
    w, c = rnd(61, (e, 50, 45), scale=0.3), rnd(62, EXPERT_OPERANDS[operand])
    cot = rnd(63, (e, *lead, 45))

    def epi(acc, c):
        return jax.nn.silu(acc + c) * c

    def kernel(x, w, c):
        return gemm_fused_experts(x, w, epi, c, x_batched=x_batched, impl="interpret")

    def plain(x, w, c):
        spec = "e...k,ekn->e...n" if x_batched else "...k,ekn->e...n"
        return epi(jnp.einsum(spec, x, w), c)

    out = jax.jit(kernel)(x, w, c)
    assert out.shape == (e, *lead, 45)
    assert str(jax.make_jaxpr(kernel)(x, w, c)).count("pallas_call") == 1
    assert_close(out, jax.jit(plain)(x, w, c), "float32", what=operand)
    reference = jax.jit(
        lambda x, w, c: gemm_fused_experts_reference(x, w, epi, c, x_batched=x_batched)
    )
    assert_close(out, reference(x, w, c), "float32", what=operand)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * cot), (0, 1, 2)))(x, w, c)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(plain(*a) * cot), (0, 1, 2)))(x, w, c)
    for name, g, r in zip(("dx", "dw", "dc"), got, want, strict=True):
        assert g.shape == r.shape, (operand, name)
        assert_close(g, r, "float32", tol_table=GRAD_TOL, what=f"{operand} {name}")


@pytest.mark.parametrize("shape", [(2, 1, 1, 45), (3, 2, 1, 45), (4, 3, 2, 13, 45)])
def test_experts_operands_the_kernel_cannot_tile_are_refused(shape) -> None:
    x, w = rnd(0, (2, 13, 50)), rnd(1, (3, 50, 45))
    with pytest.raises(ValueError, match="operand 0 of shape"):
        gemm_fused_experts(x, w, lambda a, c: a + c, jnp.ones(shape), impl="interpret")
    assert not supports_gemm_experts(x.shape, w.shape, "float32", operand_shapes=(shape,))
    assert supports_gemm_experts(x.shape, w.shape, "float32", operand_shapes=((45,),))


# ------------------------------------------------------- gated pairs: two GEMMs, one kernel


@pytest.mark.parametrize("pair_at", [0, 1], ids=["up first", "up last"])
def test_gated_pair_values_and_gradients(pair_at: int) -> None:
    """``silu(x @ w + b) * (x @ w2)`` with ``x @ w2`` computed in the kernel (one
    pallas_call), equal to the plain program in values and in
    gradients of x, w, w2 and the bias."""
    x, w, w2 = rnd(70, (3, 13, 50), scale=0.5), rnd(71, (50, 45), scale=0.3), rnd(72, (50, 45))
    b, cot = rnd(73, (45,)), rnd(74, (3, 13, 45))

    def epi(acc, *ops):
        up, bias = (ops[0], ops[1]) if pair_at == 0 else (ops[1], ops[0])
        return jax.nn.silu(acc + bias) * up

    def kernel(x, w, w2, b):
        return gemm_fused_pair(x, w, w2, epi, b, pair_at=pair_at, impl="interpret")

    def plain(x, w, w2, b):
        return jax.nn.silu(x @ w + b) * (x @ w2)

    out = jax.jit(kernel)(x, w, w2, b)
    assert str(jax.make_jaxpr(kernel)(x, w, w2, b)).count("pallas_call") == 1
    assert_close(out, jax.jit(plain)(x, w, w2, b), "float32")
    ref = jax.jit(lambda x, w, w2, b: gemm_fused_pair_reference(x, w, w2, epi, b, pair_at=pair_at))
    assert_close(out, ref(x, w, w2, b), "float32")
    got = jax.jit(jax.grad(lambda *a: jnp.sum(kernel(*a) * cot), (0, 1, 2, 3)))(x, w, w2, b)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(plain(*a) * cot), (0, 1, 2, 3)))(x, w, w2, b)
    for name, g, r in zip(("dx", "dw", "dw2", "db"), got, want, strict=True):
        assert g.shape == r.shape, name
        assert_close(g, r, "float32", tol_table=GRAD_TOL, what=name)


def test_gated_pair_bf16_rounds_the_second_gemm_as_the_program_does() -> None:
    x, w, w2 = (
        rnd(80 + i, s, jnp.bfloat16, scale=0.3)
        for i, s in enumerate(((37, 50), (50, 45), (50, 45)))
    )

    def epi(acc, up):
        return jax.nn.gelu(acc) * up

    out = gemm_fused_pair(x, w, w2, epi, impl="interpret")
    assert out.dtype == jnp.bfloat16
    assert_close(out, gemm_fused_pair_reference(x, w, w2, epi), "bfloat16")
    with pytest.raises(ValueError, match="w2 must have w's shape"):
        gemm_fused_pair(x, w, w2[:, :44], epi, impl="interpret")
