"""The library as a whole: names and order of the default rules, rules as portable data."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pypm_jax as pm
import pypm_jax.rules as R
from pypm_testing.rules import check


def test_default_rules_canonical_first_then_attention_then_epilogues():
    names = [r.name for r in R.default_rules()]
    n_canonical = len(R.canonical_rules())
    n_attention = sum(n.startswith("attention") for n in names)
    assert n_canonical >= 4 and n_attention == len(R.attention_rules()) and n_attention >= 10
    assert all(n.startswith("canonical_") for n in names[:n_canonical])
    assert all(n.startswith("attention") for n in names[n_canonical : n_canonical + n_attention])
    assert all(n.startswith("gemm_epilogue") for n in names[n_canonical + n_attention :])
    assert names == [r.name for r in R.standard_rules()]
    assert "gemm_epilogue_linear" not in names and names[-1] == "gemm_epilogue_region"
    assert [r.name for r in R.gemm_rules(linear=True)][-2:] == [
        "gemm_epilogue_linear",
        "gemm_epilogue_region",
    ]
    assert "gemm_epilogue_region" not in [r.name for r in R.gemm_rules(regions=False)]
    assert [r.name for r in pm.optimize(lambda x: x).rules] == names  # what pm.optimize uses


def test_rules_compile_and_name_their_patterns():
    for rule in [*R.default_rules(), R.gemm_epilogue_linear, R.gemm_epilogue_pair]:
        d = rule.definition
        assert d.branches and d.pattern.name[0].isupper()
        # attention_causal_* and the region rules after attention_region replace a kernel
        # node and keep reading its (shared) mask or captured operands; the canonical rules
        # that drop layout ops replace a value by an equal one (nothing computed twice); those
        # that rebuild a contraction or move a layout op past a computation (grouped 5-D
        # einsums, moved or split scores, a squeeze or a transpose of a GEMM) would compute it
        # twice if it were read elsewhere (canonical_sliced_dot's and canonical_split_dot's
        # guards ask instead that every reader of the GEMM be such a slice)
        rebuilds = ("canonical_grouped", "canonical_scaled", "canonical_transpose_")
        rebuilds = (*rebuilds, "canonical_transposed_", "canonical_squeezed_dot")
        rebuilds = (*rebuilds, "canonical_swapped_dot", "canonical_split_scores")
        rebuilds = (*rebuilds, "canonical_split_unary", "canonical_split_scalar")
        rebuilds = (*rebuilds, "canonical_split_where", "canonical_split_softmax")
        rebuilds = (*rebuilds, "canonical_split_transpose")
        # attention_region_zero, like attention_region, replaces a whole attention
        rebuilds = (*rebuilds, "attention_region_zero")
        shared = rule.name.startswith(("attention_causal", "attention_region_", "canonical_"))
        shared = shared and not rule.name.startswith(rebuilds)
        assert d.single_use == (not shared), rule.name


def test_serialized_rules_rewrite_the_same():
    """Guards are data: the loaded rules name the same guard functions and operators."""
    loaded = pm.deserialize(pm.serialize(R.default_rules()))
    assert [r.name for r in loaded] == [r.name for r in R.default_rules()]

    def block(q, k, v, x, w, b):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        return a, jax.nn.gelu(x @ w + b)

    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    args = (
        jax.random.normal(ks[0], (2, 8, 2, 32)),
        jax.random.normal(ks[1], (2, 8, 2, 32)),
        jax.random.normal(ks[2], (2, 8, 2, 32)),
        jax.random.normal(ks[3], (2, 8, 64)),
        jax.random.normal(ks[4], (64, 32)) / 8,
        jax.random.normal(ks[5], (32,)),
    )
    check(block, args, {"attention": 1, "gemm_epilogue": 1}, rules=loaded)
