"""The standard rule library: attention and GEMM epilogues → ``pallas_kernels``.

``default_rules()`` is what ``pm.optimize`` uses when given no rules: the canonicalizing
rules (names ``canonical_*``, which rewrite spellings that compute nothing to one form),
then the attention rules (names ``attention*``), then the dense + activation rules and the
GEMM epilogue region rule (names ``gemm_epilogue*``). Every rule is also importable by
name. ``docs/RULES.md`` says what each matches, and how ``$PYPM_GEMM_FUSE`` decides where a
fused GEMM runs.
"""

from __future__ import annotations

from typing import Any

from . import (
    _prebuilt,
    attention,
    attention_region,
    canonical,
    causal,
    epilogue,
    gemm,
    masked_rows,
    sinks,
)
from ._kernels import (
    AttentionRegion,
    FlashAttention,
    FlashAttentionSinks,
    GemmEpilogue,
    GemmPairRegion,
    GemmRegion,
)
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
from .attention_region import REGION_RULES
from .canonical import (
    CANONICAL_RULES,
    canonical_copy,
    canonical_grouped_probs,
    canonical_grouped_scores,
    canonical_grouped_scores_moved,
    canonical_reshapes,
    canonical_scaled_reshape,
    canonical_softmax,
    canonical_transpose_scalar,
    canonical_transpose_softmax,
    canonical_transpose_unary,
    canonical_transpose_where,
    canonical_transposed_probs,
    canonical_transposed_probs_second,
    canonical_transposes,
)
from .causal import (
    CAUSAL_RULES,
    attention_causal_bias,
    attention_causal_mask,
    attention_dpa_bias_mask_causal,
    attention_dpa_mask_causal,
)
from .epilogue import EPILOGUE_RULES, PAIR_RULES, gemm_epilogue_pair, gemm_epilogue_region
from .gemm import (
    GEMM_LINEAR_RULES,
    GEMM_RULES,
    gemm_epilogue,
    gemm_epilogue_linear,
    gemm_epilogue_no_bias,
)
from .masked_rows import (
    MASKED_ROWS_RULES,
    attention_bias_mask_zero,
    attention_mask_zero,
    attention_scaled_bias_mask_zero,
    attention_scaled_mask_zero,
)
from .sinks import (
    SINKS_RULES,
    attention_bias_sinks,
    attention_scaled_bias_sinks,
    attention_scaled_sinks,
    attention_sinks,
)

__all__ = [
    "default_rules",
    "standard_rules",
    "canonical_rules",
    "attention_rules",
    "gemm_rules",
    "FlashAttention",
    "AttentionRegion",
    "attention_region",
    "GemmEpilogue",
    "GemmRegion",
    "GemmPairRegion",
    "gemm_epilogue_pair",
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
    "attention_mask_zero",
    "attention_sinks",
    "attention_scaled_sinks",
    "attention_bias_sinks",
    "attention_scaled_bias_sinks",
    "sinks",
    "FlashAttentionSinks",
    "attention_bias_mask_zero",
    "attention_scaled_mask_zero",
    "attention_scaled_bias_mask_zero",
    "masked_rows",
    "attention_causal_mask",
    "attention_causal_bias",
    "attention_dpa_mask_causal",
    "attention_dpa_bias_mask_causal",
    "causal",
    "canonical",
    "canonical_copy",
    "canonical_transposes",
    "canonical_reshapes",
    "canonical_softmax",
    "canonical_scaled_reshape",
    "canonical_grouped_scores",
    "canonical_grouped_scores_moved",
    "canonical_grouped_probs",
    "canonical_transpose_unary",
    "canonical_transpose_scalar",
    "canonical_transpose_where",
    "canonical_transpose_softmax",
    "canonical_transposed_probs",
    "canonical_transposed_probs_second",
    "gemm_epilogue",
    "gemm_epilogue_no_bias",
    "gemm_epilogue_linear",
    "gemm_epilogue_region",
    "epilogue",
]


def canonical_rules() -> list[Any]:
    """Rewrites to one form of what computes nothing (``copy``, no-op layout ops) and of the
    ``vmap``-ped softmax, so the kernel rules see one spelling (``rules/canonical.py``)."""
    return list(CANONICAL_RULES)


def attention_rules() -> list[Any]:
    """Attention → flash attention, most specific spelling first; then the causal rules:
    ``jax.nn.dot_product_attention(mask=..., is_causal=True)`` with the kernel's causal flag,
    and the rules that let the kernel skip the blocks above the diagonal where its mask (or
    bias) provably hides them. Between them, the masked spellings whose probabilities are
    re-zeroed by the same mask (Keras): the kernel's ``masked_rows="zero"``; those with a
    per-head sink logit (GPT-OSS): the kernel's ``sinks``; and the region rules, which take
    the logits no fixed spelling matched (soft-caps, biases before the scale, masks in any
    order) into the kernel's ``score_mod`` / ``mask_mod``."""
    return (
        list(ATTENTION_RULES)
        + list(MASKED_ROWS_RULES)
        + list(SINKS_RULES)
        + list(REGION_RULES)
        + list(CAUSAL_RULES)
    )


def gemm_rules(*, linear: bool = False, regions: bool = True, pairs: bool = False) -> list[Any]:
    """Dense + activation → GEMM with fused epilogue; ``linear=True`` adds plain dense + bias
    (before the region rule, so it takes those sites); ``regions=False`` leaves out the
    region rule (any pointwise epilogue, grown over the kernels the other rules build);
    ``pairs=True`` adds ``gemm_epilogue_pair`` (a gated pair ``act(x @ w1) * (x @ w2)``'s
    two GEMMs in one kernel; not in ``default_rules()`` until timed on a GPU)."""
    rules = list(GEMM_RULES) + (list(GEMM_LINEAR_RULES) if linear else [])
    rules += list(EPILOGUE_RULES) if regions else []
    return rules + (list(PAIR_RULES) if regions and pairs else [])


def standard_rules() -> list[Any]:
    """The default rules in their order, as their sources define them (not primed): what
    ``python -m pypm_jax.rules --regenerate`` builds the shipped data from."""
    return canonical_rules() + attention_rules() + gemm_rules()


def default_rules() -> list[Any]:
    """The rules ``pm.optimize`` applies by default: the canonicalizing rules, then the
    attention rules, then the epilogue rules. They run as one rule list: the driver tries
    rules in this order at every node, and a node the canonical rules rewrite is revisited,
    so a kernel rule matches the canonical form wherever one exists.

    Their core definitions and compile summaries come from the data shipped in the package
    when it was built from these exact sources (:mod:`pypm_jax.rules._prebuilt`), instead of
    running the frontend in every process.
    """
    rules = standard_rules()
    _prebuilt.prime(rules)
    return rules
