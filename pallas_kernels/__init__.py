"""Pallas kernels that pypm-jax rewrite rules substitute into JAX programs.

* :func:`flash_attention` / :func:`attention_reference` / :func:`supports_attention`
* :func:`gemm_epilogue` (``act(x @ w + b)``), :func:`gemm_fused` (any elementwise
  epilogue reading column, row, full-tile and scalar operands: :func:`operand_kind`),
  their references, :func:`supports_gemm` and :data:`ACTIVATIONS`.

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

from ._attention import attention_reference, flash_attention, supports_attention
from ._dispatch import ENV_VAR, IMPLS
from ._gemm import (
    ACTIVATIONS,
    gemm_epilogue,
    gemm_epilogue_reference,
    gemm_fused,
    gemm_fused_reference,
    operand_kind,
    supports_gemm,
)

__all__ = [
    "ACTIVATIONS",
    "ENV_VAR",
    "IMPLS",
    "attention_reference",
    "flash_attention",
    "gemm_epilogue",
    "gemm_epilogue_reference",
    "gemm_fused",
    "gemm_fused_reference",
    "operand_kind",
    "supports_attention",
    "supports_gemm",
]
