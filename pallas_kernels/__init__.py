"""Pallas kernels that pypm-jax rewrite rules substitute into JAX programs.

* :func:`flash_attention` / :func:`attention_reference` / :func:`supports_attention`
* :func:`gemm_epilogue` (``act(x @ w + b)``), :func:`gemm_fused` (any elementwise
  epilogue reading column, row, full-tile and scalar operands: :func:`operand_kind`),
  their references, :func:`supports_gemm` and :data:`ACTIVATIONS`;
  :func:`gemm_fused_experts`, the same with an expert axis on the weight (``[E, K, N]``,
  MoE experts run densely) on the kernel's grid; :func:`gemm_fused_pair`, two GEMMs of one
  activation in one kernel (a gated pair).
* :func:`attention_unsupported` / :func:`gemm_unsupported`: why ``supports_*`` is False,
  in words (what ``pm.explain`` shows when a rule does not fire for that reason).
* :func:`with_forward_mode`: forward-mode derivatives (from a reference) for a kernel whose
  reverse mode is a ``custom_vjp``; the kernels above use it.

Implementation selection (``impl`` argument of every kernel):

``None``       auto: ``"pallas"`` on a GPU backend when ``supports_*`` holds,
               otherwise ``"xla"``.
``"xla"``      the plain-JAX reference compiled by XLA -- the documented CPU
               fallback; it is the original unfused computation, so an optimized
               program on CPU is never slower than the original.
``"interpret"``the same Pallas kernel under ``interpret=True`` (tests on CPU).
``"pallas"``   the Pallas kernel lowered through Triton (GPU only); GEMMs can run the
               Hopper Mosaic GPU kernel instead (``$PYPM_GEMM_BACKEND=mosaic``).

The environment variable ``PYPM_KERNEL_IMPL`` (``xla``/``interpret``/``pallas``/
``auto``) overrides the auto choice process-wide, e.g. to force every substituted
kernel through the interpreter in whole-product tests.  An explicit ``impl`` (or
the override) that cannot run raises ``ValueError``; nothing falls back silently.
"""

from __future__ import annotations

from typing import Any

from ._attention import attention_reference, flash_attention, supports_attention
from ._autodiff import with_forward_mode
from ._dispatch import ENV_VAR, IMPLS
from ._gemm import (
    ACTIVATIONS,
    epilogue_reference,
    gemm_epilogue,
    gemm_epilogue_reference,
    gemm_fused,
    gemm_fused_experts,
    gemm_fused_experts_reference,
    gemm_fused_pair,
    gemm_fused_pair_reference,
    gemm_fused_reference,
    operand_kind,
    supports_gemm,
    supports_gemm_experts,
)

__all__ = [
    "ACTIVATIONS",
    "attention_unsupported",
    "gemm_unsupported",
    "ENV_VAR",
    "IMPLS",
    "attention_reference",
    "epilogue_reference",
    "flash_attention",
    "gemm_epilogue",
    "gemm_epilogue_reference",
    "gemm_fused",
    "gemm_fused_experts",
    "gemm_fused_experts_reference",
    "gemm_fused_pair",
    "gemm_fused_pair_reference",
    "gemm_fused_reference",
    "operand_kind",
    "supports_attention",
    "supports_gemm",
    "supports_gemm_experts",
    "with_forward_mode",
]


def attention_unsupported(
    q_shape: Any,
    k_shape: Any,
    v_shape: Any,
    dtype: Any,
    *,
    layout: str = "BSHD",
    bias_shape: Any = None,
    mask_shape: Any = None,
) -> str | None:
    """Why :func:`supports_attention` is False for these arguments (e.g. ``head dim 300
    outside the supported range [1, 256]``); None when it is True."""
    from ._attention import _kernel_error

    return _kernel_error(q_shape, k_shape, v_shape, dtype, layout, bias_shape, mask_shape)


def gemm_unsupported(
    x_shape: Any, w_shape: Any, dtype: Any, *, bias_shape: Any = None
) -> str | None:
    """Why :func:`supports_gemm` is False for these arguments; None when it is True."""
    from ._gemm import _kernel_error

    return _kernel_error(x_shape, w_shape, dtype, () if bias_shape is None else (bias_shape,))
