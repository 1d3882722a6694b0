"""The replacement operators of the standard rules and their JAX implementations.

A rule replaces a matched subgraph by ONE node of these operators. Its attribute ``plan``
(:mod:`pypm_jax.rules._plans`) says how the node's inputs map onto the kernel; the
implementation registered here (``pypm_jax.jax.register_impl``) transposes the inputs into
the kernel's layout, calls ``pallas_kernels``, and transposes/casts the result so the
replaced value keeps exactly its shape and dtype. Absent optional inputs (no bias, no mask)
are a literal ``0`` the plan tells the implementation to ignore.

Kernel selection is ``pallas_kernels``'s: Pallas on GPU, the plain-JAX reference on CPU,
``PYPM_KERNEL_IMPL=interpret`` for the Pallas interpreter.
"""

from __future__ import annotations

__all__ = ["FlashAttention", "FlashAttentionSinks", "GemmEpilogue"]

from typing import Any

import pypm_jax as pm

from ..jax import register_impl
from ._plans import AttentionPlan, GemmPlan


def _infer(*_inputs: Any, plan: Any) -> tuple[Any, Any]:
    """The replaced value's type, which the plan carries."""
    return plan.out_shape, plan.out_dtype


@pm.op(attrs=("plan",), op_class="attention", infer=_infer)
def FlashAttention(a, b, v, bias, mask, scale):  # noqa: N802 (operators are named like the paper's)
    return 1


@pm.op(attrs=("plan",), op_class="attention", infer=_infer)
def FlashAttentionSinks(a, b, v, bias, mask, scale, sinks):  # noqa: N802
    """``FlashAttention`` whose softmax also counts one logit ``sinks[h]`` per head."""
    return 1


@pm.op(attrs=("plan",), op_class="gemm", infer=_infer)
def GemmEpilogue(x, w, bias):  # noqa: N802
    return 1


def _static_scalar(x: Any) -> float | None:
    """x as a Python float if it is known while tracing (a literal), else None."""
    import jax

    try:
        return float(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


@register_impl(FlashAttention)
@register_impl(FlashAttentionSinks)
def flash_attention_impl(
    a: Any,
    b: Any,
    v: Any,
    bias: Any,
    mask: Any,
    scale: Any,
    sinks: Any = None,
    *,
    plan: AttentionPlan,
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
        kernel_bias = jnp.transpose(bias, plan.perm_scores) if jnp.ndim(bias) else bias
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
        masked_rows=plan.masked_rows,
        sinks=None if sinks is None else jnp.asarray(sinks),
    )
    return jnp.transpose(out, plan.perm_out).astype(plan.out_dtype)


@register_impl(GemmEpilogue)
def gemm_epilogue_impl(x: Any, w: Any, bias: Any, *, plan: GemmPlan) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import gemm_epilogue

    if plan.transpose_w:
        w = jnp.transpose(w)
    b = jnp.reshape(bias, (plan.n,)) if plan.bias else None
    out = gemm_epilogue(x, w, b, activation=plan.activation)
    return out.astype(plan.out_dtype)
