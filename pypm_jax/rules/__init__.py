"""The standard rule library: attention and GEMM epilogues → ``pallas_kernels``.

``default_rules()`` is what ``pm.optimize`` uses when given no rules: the attention rules
(names ``attention*``), then the dense + activation rules and the GEMM epilogue region rule
(names ``gemm_epilogue*``). Every rule is also importable by name. ``docs/RULES.md`` says
what each matches, and how ``$PYPM_GEMM_FUSE`` decides where a fused GEMM runs.
"""

from __future__ import annotations

from typing import Any

from . import _prebuilt, attention, causal, epilogue, gemm
from ._kernels import FlashAttention, GemmEpilogue, GemmRegion
from .attention import (
    ATTENTION_RULES,
    attention_bias,
    attention_bias_mask,
    attention_dpa,
    attention_dpa_bias,
    attention_dpa_bias_mask,
    attention_dpa_mask,
    attention_mask,
    attention_scaled,
    attention_scaled_bias,
    attention_scaled_bias_mask,
    attention_scaled_mask,
)
from .attention import attention as attention_rule
from .causal import (
    CAUSAL_RULES,
    attention_causal_bias,
    attention_causal_mask,
    attention_dpa_bias_mask_causal,
    attention_dpa_mask_causal,
)
from .epilogue import EPILOGUE_RULES, gemm_epilogue_region
from .gemm import (
    GEMM_LINEAR_RULES,
    GEMM_RULES,
    gemm_epilogue,
    gemm_epilogue_linear,
    gemm_epilogue_no_bias,
)

__all__ = [
    "default_rules",
    "attention_rules",
    "gemm_rules",
    "FlashAttention",
    "GemmEpilogue",
    "GemmRegion",
    "attention",
    "gemm",
    "attention_rule",
    "attention_bias",
    "attention_mask",
    "attention_bias_mask",
    "attention_scaled",
    "attention_scaled_bias",
    "attention_scaled_mask",
    "attention_scaled_bias_mask",
    "attention_dpa",
    "attention_dpa_mask",
    "attention_dpa_bias",
    "attention_dpa_bias_mask",
    "attention_causal_mask",
    "attention_causal_bias",
    "attention_dpa_mask_causal",
    "attention_dpa_bias_mask_causal",
    "causal",
    "gemm_epilogue",
    "gemm_epilogue_no_bias",
    "gemm_epilogue_linear",
    "gemm_epilogue_region",
    "epilogue",
]


def attention_rules() -> list[Any]:
    """Attention → flash attention, most specific spelling first; then the causal rules:
    ``jax.nn.dot_product_attention(mask=..., is_causal=True)`` with the kernel's causal flag,
    and the rules that let the kernel skip the blocks above the diagonal where its mask (or
    bias) provably hides them."""
    return list(ATTENTION_RULES) + list(CAUSAL_RULES)


def gemm_rules(*, linear: bool = False, regions: bool = True) -> list[Any]:
    """Dense + activation → GEMM with fused epilogue; ``linear=True`` adds plain dense + bias
    (before the region rule, so it takes those sites); ``regions=False`` leaves out the
    region rule (any pointwise epilogue, grown over the kernels the other rules build)."""
    rules = list(GEMM_RULES) + (list(GEMM_LINEAR_RULES) if linear else [])
    return rules + (list(EPILOGUE_RULES) if regions else [])


def default_rules() -> list[Any]:
    """The rules ``pm.optimize`` applies by default: attention rules, then epilogue rules.

    Their core definitions and compile summaries come from the data shipped in the package
    when it was built from these exact sources (:mod:`pypm_jax.rules._prebuilt`), instead of
    running the frontend in every process.
    """
    rules = attention_rules() + gemm_rules()
    _prebuilt.prime(rules)
    return rules
