"""The zoo's site counter (``pypm_testing.zoo.count_sites``) on small programs whose sites
are known: it must count what it claims, independently of the rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import pypm_jax as pm
from pypm_testing import zoo

B, S, H, D = 2, 8, 2, 32
KEY = jax.random.PRNGKey(0)


def _x(*shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, jnp.float32)


def _attention(x, w, cap=None):
    """Self-attention of ``x`` [B, S, 64] with q, k, v projected by ``w`` [3, 64, H, D]
    (scores are a product of two activations, never of a weight)."""
    q, k, v = (jnp.einsum("bsm,mhd->bshd", x, w[i]) for i in range(3))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D)
    if cap is not None:
        s = jnp.tanh(s / cap) * cap
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _sites(fn, *args):
    sites = zoo.count_sites(zoo.lifted_original(fn, args))
    return len(sites.attention), len(sites.dense)


def test_counts_attention_including_soft_capped_scores():
    x, w = _x(B, S, 64), _x(3, 64, H, D, seed=1)
    assert _sites(_attention, x, w) == (1, 0)
    assert _sites(lambda x, w: _attention(x, w, cap=50.0), x, w) == (1, 0)
    assert _sites(lambda x, w: _attention(_attention(x, w).reshape(x.shape), w), x, w) == (2, 0)


def test_a_router_softmax_is_not_attention():
    """A softmax over a projection (a weight operand) mixing expert outputs is no attention."""
    x, w, experts = _x(B, S, 64), _x(64, 4, seed=1), _x(4, B, S, 64, seed=2)

    def moe(x, w, experts):
        return jnp.einsum("bse,ebsd->bsd", jax.nn.softmax(x @ w, axis=-1), experts)

    assert _sites(moe, x, w, experts) == (0, 0)


@pytest.mark.parametrize(
    "act,sites",
    [
        (jax.nn.gelu, 1),
        (lambda h: jax.nn.gelu(h, approximate=False), 1),
        (jax.nn.silu, 1),
        (jax.nn.relu, 1),
        (jnp.tanh, 1),
        (lambda h: h, 0),
        (lambda h: jnp.exp(h), 0),
    ],
)
def test_counts_dense_activation(act, sites):
    x, w, b = _x(B, S, 64), _x(64, 128, seed=1), _x(128, seed=2)
    assert _sites(lambda x, w, b: act(x @ w + b), x, w, b) == (0, sites)


def test_counts_one_site_per_dot_and_none_after_a_reduction():
    x, w, g = _x(B, S, 64), _x(64, 2, 128, seed=1), _x(B, S, 128, seed=2)

    def fused_gate_up(x, w):
        h = jnp.einsum("bsd,dtf->tbsf", x, w)  # one einsum, sliced into gate and up
        return jax.nn.gelu(h[0]) * h[1]

    def reduced(x, w, g):
        h = jnp.einsum("bsd,dtf->bstf", x, w)[:, :, 0]
        return jnp.tanh(jnp.sum(h, axis=-1, keepdims=True) + g)

    assert _sites(fused_gate_up, x, w) == (0, 1)
    assert _sites(reduced, x, w, g) == (0, 0)


def test_covered_sites_are_gone_from_the_rewritten_program():
    x, w, b, wa = _x(B, S, 64), _x(64, 128, seed=1), _x(128, seed=2), _x(3, 64, H, D, seed=3)

    def fn(x, w, b, wa):
        return jax.nn.gelu(x @ w + b), _attention(x, wa), jax.nn.gelu(x @ w.T.T)

    args = (x, w, b, wa)
    cov = zoo.coverage(fn, args)
    assert (cov.attention, cov.dense) == (1, 2)
    assert (cov.attention_covered, cov.dense_covered) == (1, 2)
    assert sum(cov.fired.values()) == 3
    left = zoo.coverage(fn, args, pm.optimize(fn, rules=[]))
    assert (left.attention_covered, left.dense_covered) == (0, 0)
    assert len(left.left.attention) == 1 and len(left.left.dense) == 2


def test_explain_left_shows_the_spelling_and_the_closest_rule():
    """A softmax over the queries (not the keys) is a site no attention kernel computes:
    the printer shows its operations and where the closest rule stopped."""
    x, w = _x(B, S, 64), _x(3, 64, H, D, seed=1)

    def over_queries(x, w):
        q, k, v = (jnp.einsum("bsm,mhd->bshd", x, w[i]) for i in range(3))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-2), v)

    cov = zoo.coverage(over_queries, (x, w))
    assert (cov.attention, cov.attention_covered) == (1, 0)
    text = "\n".join(zoo.explain_left(cov))
    assert text.startswith("- attention site at ")
    assert "= exp(" in text and "= reduce_sum(" in text  # the spelling
    # the closest rule's pattern matches; its plan refuses a softmax over another axis
    assert "does not fire" in text and "attention_plan" in text
