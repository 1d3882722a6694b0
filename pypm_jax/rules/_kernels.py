"""The replacement operators of the standard rules and their JAX implementations.

A rule replaces a matched subgraph by ONE node of these operators. Its attribute ``plan``
(:mod:`pypm_jax.rules._plans`) says how the node's inputs map onto the kernel; the
implementation registered here (``pypm_jax.jax.register_impl``) transposes the inputs into
the kernel's layout, calls ``pallas_kernels``, and transposes/casts the result so the
replaced value keeps exactly its shape and dtype. Absent optional inputs (no bias, no mask)
are a literal ``0`` the plan tells the implementation to ignore.

Kernel selection is ``pallas_kernels``'s: Pallas on GPU, the plain-JAX reference on CPU,
``PYPM_KERNEL_IMPL=interpret`` for the Pallas interpreter.

GEMM epilogues follow a *fuse policy* (``$PYPM_GEMM_FUSE``: ``auto``, ``always``,
``never``; see :func:`gemm_impl`): where XLA already fuses the same epilogue into its own
GEMM, the automatic choice leaves the site to XLA.
"""

from __future__ import annotations

__all__ = [
    "FlashAttention",
    "GemmEpilogue",
    "GemmRegion",
    "RegionOperands",
    "FUSE_ENV",
    "FUSE_POLICIES",
    "fuse_policy",
    "gemm_impl",
]

import os
from typing import Any

import pypm_jax as pm

from ..jax import register_impl
from ._gemm_regions import GemmRegionPlan
from ._plans import AttentionPlan, GemmPlan
from ._region import describe, region_fn

FUSE_ENV = "PYPM_GEMM_FUSE"
FUSE_POLICIES = ("auto", "always", "never")


def _infer(*_inputs: Any, plan: Any, **_attrs: Any) -> tuple[Any, Any]:
    """The replaced value's type, which the plan carries."""
    return plan.out_shape, plan.out_dtype


@pm.op(attrs=("plan",), op_class="attention", infer=_infer)
def FlashAttention(a, b, v, bias, mask, scale):  # noqa: N802 (operators are named like the paper's)
    return 1


@pm.op(attrs=("plan",), op_class="gemm", infer=_infer)
def GemmEpilogue(x, w, bias):  # noqa: N802
    return 1


def _describe_region(*, region: Any, plan: Any) -> str:
    """The report's text for a ``GemmRegion``: its region (``acc`` is ``x @ w``)."""
    return describe(region)


@pm.op(attrs=("region", "plan"), op_class="gemm", infer=_infer, describe=_describe_region)
def GemmRegion(x, w, operands):  # noqa: N802
    """``region(x @ w, *operands)`` (:mod:`pypm_jax.rules._region`); ``operands`` is ``0``
    (none) or a :func:`RegionOperands` pack."""
    return 1


def _infer_pack(*_inputs: Any) -> tuple[Any, Any]:
    return None, None


@pm.op(op_class="pack", infer=_infer_pack)
def RegionOperands(rest, operand):  # noqa: N802
    """The operands of a region: those of ``rest`` (``0``: none, or another pack), then
    ``operand``. A list grows by one per rewrite, with rules of a fixed shape."""
    return 1


def _static_scalar(x: Any) -> float | None:
    """x as a Python float if it is known while tracing (a literal), else None."""
    import jax

    try:
        return float(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


@register_impl(FlashAttention)
def flash_attention_impl(
    a: Any, b: Any, v: Any, bias: Any, mask: Any, scale: Any, *, plan: AttentionPlan
) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import flash_attention

    q, k = (a, b) if plan.q_operand == 0 else (b, a)
    kernel_scale = 1.0
    if plan.scale_input:
        # A literal scale goes to the kernel, which scales the f32 scores as the program did;
        # a computed one (``scores / jnp.sqrt(d)`` is a sqrt at run time) scales q instead.
        c = _static_scalar(scale)
        if c is not None and c != 0.0:
            kernel_scale = c if plan.scale_input > 0 else 1.0 / c
        else:
            c = jnp.reshape(scale, ()).astype(q.dtype)
            q = q * c if plan.scale_input > 0 else q / c
    # operands of mixed float dtypes run in the plan's (wider) dtype; a no-op otherwise
    q = jnp.transpose(q, plan.perm_q).astype(plan.dtype)
    k = jnp.transpose(k, plan.perm_k).astype(plan.dtype)
    v = jnp.transpose(v, plan.perm_v).astype(plan.dtype)
    kernel_bias = kernel_mask = None
    if plan.bias:
        kernel_bias = jnp.transpose(bias, plan.perm_scores)
        if plan.bias < 0:
            kernel_bias = -kernel_bias
    if plan.mask:
        kernel_mask = jnp.transpose(mask, plan.perm_scores)
    out = flash_attention(
        q,
        k,
        v,
        kernel_bias,
        kernel_mask,
        scale=kernel_scale,
        causal=plan.causal,
        mask_is_causal=plan.mask_is_causal,
        layout=plan.layout,
    )
    return jnp.transpose(out, plan.perm_out).astype(plan.out_dtype)


def fuse_policy() -> str:
    """``$PYPM_GEMM_FUSE`` (default ``auto``), checked: a misspelt policy raises."""
    policy = os.environ.get(FUSE_ENV, "").strip().lower() or "auto"
    if policy not in FUSE_POLICIES:
        raise ValueError(f"${FUSE_ENV}={policy!r}: expected one of {FUSE_POLICIES}")
    return policy


def gemm_impl(xla_fuses: bool) -> str | None:
    """The ``impl`` a GEMM-epilogue site asks ``pallas_kernels`` for.

    * ``never``: ``"xla"`` -- XLA's own GEMM and the epilogue as the program wrote it;
    * ``always``: None -- the kernels' own choice (Pallas on a GPU, ``$PYPM_KERNEL_IMPL``);
    * ``auto``: like ``always``, except that a site whose epilogue XLA:GPU already fuses into
      its GEMM (``xla_fuses``: a bias or residual add, then at most a ReLU or tanh-GELU:
      cuBLASLt's epilogues) runs as ``"xla"`` on a GPU when no kernel implementation was
      asked for explicitly: the kernel cannot beat the fusion it would replace. (On a CPU
      the automatic choice is the reference, the original computation, anyway.)
    """
    from pallas_kernels import ENV_VAR
    from pallas_kernels._dispatch import on_gpu

    policy = fuse_policy()
    if policy == "never":
        return "xla"
    explicit = os.environ.get(ENV_VAR, "").strip().lower() not in ("", "auto")
    if policy == "auto" and xla_fuses and not explicit and on_gpu():
        return "xla"
    return None


@register_impl(GemmEpilogue)
def gemm_epilogue_impl(x: Any, w: Any, bias: Any, *, plan: GemmPlan) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import gemm_epilogue

    if plan.transpose_w:
        w = jnp.transpose(w)
    b = jnp.reshape(bias, (plan.n,)) if plan.bias else None
    fused_by_xla = plan.activation in ("none", "relu", "gelu_tanh")
    out = gemm_epilogue(x, w, b, activation=plan.activation, impl=gemm_impl(fused_by_xla))
    return out.astype(plan.out_dtype)


@register_impl(RegionOperands)
def region_operands_impl(rest: Any, operand: Any) -> tuple[Any, ...]:
    return (*(rest if isinstance(rest, tuple) else ()), operand)


def _operand_tile(value: Any, kind: str, rank: int) -> Any:
    """The part of an operand (the value the program read, of the result's shape where it
    was broadcast) the kernel tiles: XLA folds these slices of a broadcast away."""
    import jax.numpy as jnp

    value = jnp.asarray(value)
    value = jnp.reshape(value, (1,) * (rank - value.ndim) + value.shape)
    if kind == "col":
        return value[(0,) * (rank - 1)]
    if kind == "row":
        return value[..., :1]
    if kind == "scalar":
        return value[(0,) * rank]
    return value


@register_impl(GemmRegion)
def gemm_region_impl(x: Any, w: Any, operands: Any, *, region: Any, plan: GemmRegionPlan) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import gemm_fused

    if plan.transpose_w:
        w = jnp.transpose(w)
    ops = operands if isinstance(operands, tuple) else ()
    rank = len(plan.out_shape)
    tiles = tuple(_operand_tile(v, k, rank) for v, k in zip(ops, plan.operands, strict=True))
    return gemm_fused(
        x,
        w,
        region_fn(region),
        *tiles,
        impl=gemm_impl(plan.xla_fuses),
        kernel_epilogue=region_fn(region, "kernel"),
        out_dtype=plan.out_dtype,
    )
