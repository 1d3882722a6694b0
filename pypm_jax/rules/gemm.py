"""Dense + bias + activation → ``pallas_kernels.gemm_epilogue``, in the pattern language.

``act(dot_general(x, w) + b)``: ``Dense``'s ``dot_general`` contracts x's last axis with a
weight matrix (stored ``[K, N]`` or ``[N, K]``); ``BiasAdd`` adds a bias of N elements,
reshaped or broadcast along the last axis, in either operand order; ``Activation`` has one
alternate per spelling of each activation the kernel fuses. Every ``Activation`` alternate
binds ``sig``, the value that characterises it (the ``tanh`` of a tanh-GELU, the ``erfc`` of
an exact GELU, the ``logistic`` of a SiLU...); the guard function
:func:`~pypm_jax.rules._plans.activation_of` names the activation from the operators of the
root and of ``sig``, so one rule covers every activation.

The paper's own example is here: GELU's ``x / 2`` appears as ``x * 0.5``, ``0.5 * x`` and
``x / 2`` -- the alternates of ``Half``.
"""

from __future__ import annotations

import math

from ..lang import frontend as pm
from ..vocab import prims as P
from ._kernels import GemmEpilogue
from ._plans import activation_of, gemm_plan, gemm_supported

__all__ = [
    "GEMM_RULES",
    "GEMM_LINEAR_RULES",
    "Activation",
    "BiasAdd",
    "BiasVec",
    "Half",
]

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT2 = 1.0 / math.sqrt(2.0)
SQRT2 = math.sqrt(2.0)
QUICK_GELU_SCALE = 1.702  # pallas_kernels.QUICK_GELU_SCALE (not imported: see _plans)

# ------------------------------------------------------------------ arithmetic spellings


@pm.pattern
def Mul2(a, b):
    """a * b, in either operand order."""
    return P.mul(a, b)


@pm.pattern
def Mul2(a, b):  # noqa: F811 (alternates share a name)
    return P.mul(b, a)


@pm.pattern
def Add2(a, b):
    """a + b, in either operand order."""
    return P.add(a, b)


@pm.pattern
def Add2(a, b):  # noqa: F811
    return P.add(b, a)


@pm.pattern
def Half(x):
    """x / 2 (the paper's GELU example)."""
    return Mul2(x, 0.5)


@pm.pattern
def Half(x):  # noqa: F811
    return P.div(x, 2.0)


@pm.pattern
def Cube(x):
    """x ** 3."""
    p = P.integer_pow(x)
    assert p.y == 3
    return p


@pm.pattern
def Cube(x):  # noqa: F811
    return Mul2(Mul2(x, x), x)


# ------------------------------------------------------------------------ activations


@pm.pattern
def Activation(h, sig):
    """relu: ``max(h, 0)`` (``jax.nn.relu``'s custom_jvp body, ``jnp.maximum``)."""
    sig <= Relu(h)
    return sig


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """tanh-approximate GELU: ``h * 0.5 * (1 + tanh(sqrt(2/pi) * (h + 0.044715 h^3)))``."""
    sig <= P.tanh(Mul2(Add2(h, Mul2(Cube(h), 0.044715)), SQRT_2_OVER_PI))
    return Mul2(h, Half(Add2(sig, 1.0)))


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """tanh-approximate GELU, grouped as ``(h / 2) * (1 + tanh(...))``."""
    sig <= P.tanh(Mul2(Add2(h, Mul2(Cube(h), 0.044715)), SQRT_2_OVER_PI))
    return Mul2(Half(h), Add2(sig, 1.0))


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """tanh-approximate GELU as BLOOM writes it (transformers' ``bloom_gelu_forward``):
    ``h * 0.5 * (1 + tanh(0.79788456 * h * (1 + 0.044715 * h * h)))``, sqrt(2/pi) rounded."""
    c = pm.var()
    assert c.value > SQRT_2_OVER_PI - 1e-7 and c.value < SQRT_2_OVER_PI + 1e-7
    sig <= P.tanh(Mul2(Mul2(h, c), Add2(Mul2(Mul2(h, 0.044715), h), 1.0)))
    return Mul2(Half(h), Add2(sig, 1.0))


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """exact GELU as ``jax.nn.gelu`` writes it: ``(h / 2) * erfc(-h / sqrt 2)``."""
    sig <= P.erfc(Mul2(P.neg(h), INV_SQRT2))
    return Mul2(Half(h), sig)


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """exact GELU, textbook form: ``(h / 2) * (1 + erf(h / sqrt 2))``."""
    sig <= P.erf(InvSqrt2(h))
    return Mul2(Half(h), Add2(sig, 1.0))


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """exact GELU, grouped as ``h * ((1 + erf(h / sqrt 2)) / 2)``."""
    sig <= P.erf(InvSqrt2(h))
    return Mul2(h, Half(Add2(sig, 1.0)))


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """SiLU / swish: ``h * sigmoid(h)`` (``jax.nn.silu``)."""
    sig <= P.logistic(h)
    return Mul2(h, sig)


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """SiLU written out: ``h / (1 + exp(-h))``."""
    sig <= P.exp(P.neg(h))
    return P.div(h, Add2(sig, 1.0))


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """quick GELU (CLIP's ``quick_gelu`` in transformers, OpenCLIP): ``h * sigmoid(1.702 h)``.
    ``sig`` is the scaling ``mul``: the root and it are both ``mul``s, which no other
    activation's pair is (SiLU's is ``mul``, ``logistic``)."""
    sig <= Mul2(h, QUICK_GELU_SCALE)
    return Mul2(h, P.logistic(sig))


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """sigmoid (``jax.nn.sigmoid``)."""
    sig <= P.logistic(h)
    return sig


@pm.pattern
def Activation(h, sig):  # noqa: F811
    """tanh."""
    sig <= P.tanh(h)
    return sig


@pm.pattern
def Relu(h):
    """``max(h, 0)`` in either operand order."""
    return P.max(h, 0.0)


@pm.pattern
def Relu(h):  # noqa: F811
    return P.max(0.0, h)


@pm.pattern
def InvSqrt2(h):
    """h / sqrt(2)."""
    return P.div(h, SQRT2)


@pm.pattern
def InvSqrt2(h):  # noqa: F811
    return Mul2(h, INV_SQRT2)


# ---------------------------------------------------------------------- dense and bias


@pm.pattern
def BiasVec(b):
    """A bias vector as added to ``[..., N]``: reshaped to ``[1, .., N]``, broadcast along
    the last axis, or given already shaped (the plan checks its shape)."""
    y = P.reshape(b)
    assert b.rank == 1
    return y


@pm.pattern
def BiasVec(b):  # noqa: F811
    y = P.broadcast_in_dim(b)
    assert b.rank == 1 and y.broadcast_dimensions == (y.rank - 1,)
    return y


@pm.pattern
def BiasVec(b):  # noqa: F811
    return b


@pm.pattern
def BiasAdd(y, bias):
    """y + bias, either operand order."""
    return Add2(y, BiasVec(bias))


# -------------------------------------------------------------------- the epilogues
#
# Patterns bind r (the value replaced), y (the dot_general), x, w, sig and, with a bias,
# bias. The rule plans the kernel call (which axes contract, bias shape, activation) and
# checks the kernel supports it.


@pm.pattern
def GemmBiasAct(r, y, x, w, bias, sig):
    h = pm.var()
    r <= Activation(h, sig)
    h <= BiasAdd(y, bias)
    y <= P.dot_general(x, w)
    return r


@pm.pattern
def GemmAct(r, y, x, w, sig):
    r <= Activation(y, sig)
    y <= P.dot_general(x, w)
    return r


@pm.pattern
def GemmBias(r, y, x, w, bias):
    r <= BiasAdd(y, bias)
    y <= P.dot_general(x, w)
    return r


@pm.rule(GemmBiasAct, single_use=True)
def gemm_epilogue(r, y, x, w, bias, sig):
    plan = gemm_plan(x.shape, w.shape, (x.dtype, w.dtype, y.dtype), y.dimension_numbers,
                     (r.shape, r.dtype), bias.shape, activation_of(r.op, sig.op))  # fmt: skip
    assert gemm_supported(plan, x.shape)
    return GemmEpilogue(x, w, bias, plan=plan)


@pm.rule(GemmAct, single_use=True)
def gemm_epilogue_no_bias(r, y, x, w, sig):
    plan = gemm_plan(x.shape, w.shape, (x.dtype, w.dtype, y.dtype), y.dimension_numbers,
                     (r.shape, r.dtype), None, activation_of(r.op, sig.op))  # fmt: skip
    assert gemm_supported(plan, x.shape)
    return GemmEpilogue(x, w, 0, plan=plan)


@pm.rule(GemmBias, single_use=True)
def gemm_epilogue_linear(r, y, x, w, bias):
    plan = gemm_plan(x.shape, w.shape, (x.dtype, w.dtype, y.dtype), y.dimension_numbers,
                     (r.shape, r.dtype), bias.shape, "none")  # fmt: skip
    assert gemm_supported(plan, x.shape)
    return GemmEpilogue(x, w, bias, plan=plan)


# Dense + activation sites (with or without bias). Plain dense + bias (activation "none")
# is opt-in: XLA already fuses a bias add into its GEMM, and every projection would match.
GEMM_RULES = [gemm_epilogue, gemm_epilogue_no_bias]
GEMM_LINEAR_RULES = [gemm_epilogue_linear]
