"""The region rules' patterns check an operator before they explore its operands.

``Spine`` (attention regions) and ``PwRegion`` (GEMM epilogue regions) recurse through
operators chosen by a guard on an operator variable. Written as ``f(Spine(..))`` with the
guard beside it, the guard is checked only once the recursion under ``f`` has finished, so a
failed match explores every operator of that arity behind the value: through the q/k
projections into the residual stream, the whole network before the layer (BERT-base's
rewrite pass went from ~50 ms to ~1 s). The patterns match ``t <= Spine(..)`` against the
operand of a sub-pattern ``UnaryOp(t)`` / ``BinaryOp(t, u)`` whose guard runs first. These
tests count machine steps (a budget), never time: the work of a failed match must not grow
with the depth of the network behind it.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import pypm_jax as pm
from pypm_jax.jax.lift import lift
from pypm_jax.rules.attention_region import attention_region
from pypm_jax.rules.epilogue import gemm_epilogue_region

D, H = 64, 2


def _deep_attention(depth: int, residual: bool):
    """A stack of ``depth`` dense layers (``h + h @ w`` or ``tanh(h @ w)``) feeding q, k and
    v, then an attention with
    Hugging Face BERT's head mask (``einsum("...hqk,h->...hqk", p, head_mask)``): at the
    head-mask einsum the region pattern finds a softmax and the scores under the logits, and
    the rule's guard (the attention plan) refuses it there, so the machine backtracks."""

    def fn(x, ws, head_mask):
        h = x
        for i in range(depth):
            h = h + h @ ws[i] if residual else jnp.tanh(h @ ws[i])
        b, s, _ = h.shape
        q = k = v = h.reshape(b, s, H, D // H)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 0.125 + 1.0
        p = jnp.einsum("...hqk,h->...hqk", jax.nn.softmax(scores, axis=-1), head_mask)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v)

    x = jax.random.normal(jax.random.key(0), (2, 8, D))
    ws = jax.random.normal(jax.random.key(1), (depth, D, D)) * 0.05
    return lift(jax.make_jaxpr(fn)(x, ws, jnp.ones((H,))))


def _fits(depth: int, residual: bool, rule, budget: int) -> bool:
    """Does every match of ``rule`` in the program of ``depth`` layers finish within
    ``budget`` machine steps (no node skipped with a warning)?"""
    prog = _deep_attention(depth, residual)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.rewrite(prog.graph, [rule], match_budget=budget)
    return not any("machine steps" in str(w.message) for w in caught)


def _steps(depth: int, residual: bool, rule) -> int:
    """The smallest per-match budget the rule's matches fit in."""
    lo, hi = 1, 1 << 18
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(depth, residual, rule, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


@pytest.mark.parametrize(
    ("rule", "residual"),
    [(attention_region, True), (attention_region, False), (gemm_epilogue_region, False)],
)
def test_a_failed_region_match_does_not_explore_the_network_behind_it(rule, residual):
    """(A residual stack is itself one pointwise graph of GEMMs, which the GEMM region
    pattern explores as a region may: it is left out for that rule.)"""
    assert _steps(24, residual, rule) == _steps(2, residual, rule)
