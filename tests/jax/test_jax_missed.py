""" "Why not": ``fast.missed(*args)`` lists the attention-like and GEMM+activation-like sites
no rule rewrote, each with the deepest check that stopped the rules in words; a guard
function says why with ``pm.Refusal``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pypm_jax as pm
from pypm_jax.jax import prims


def _model(q, k, v, w, x):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    return o, jax.nn.gelu(x @ w), jnp.tanh(jnp.exp(x) @ w.T.T)


W, X = jnp.ones((64, 128)), jnp.ones((32, 64))


def test_missed_names_each_site_left_and_the_check_that_stopped_it():
    small = jnp.ones((2, 16, 4, 300))  # head dim 300: the kernel takes 1..256
    fast = pm.optimize(_model)
    report, missed = fast.report(small, small, small, W, X), fast.missed(small, small, small, W, X)
    assert report.counts() == {"gemm_epilogue_no_bias": 2}, str(report)
    (site,) = missed
    assert (site.kind, site.source.line) == ("attention", 16)
    assert "head dim 300 outside the supported range [1, 256]" in site.reason
    assert site.rule.startswith("attention")
    line = str(missed)
    assert line.startswith("attention at ") and "test_jax_missed.py:16" in line
    assert missed.to_dict()[0]["reason"] == site.reason

    big = jnp.ones((2, 16, 4, 32))
    assert list(fast.missed(big, big, big, W, X)) == []
    assert str(fast.missed(big, big, big, W, X)).startswith("no missed sites")


def _tanh_of_a_product_read_twice(x, w):
    h = x @ w
    return jnp.tanh(h), h  # the product is read outside the epilogue: single-use refuses


def test_a_gemm_site_is_found_and_explained_with_the_rules_words():
    (site,) = pm.optimize(_tanh_of_a_product_read_twice).missed(X, W)
    assert site.kind == "gemm" and site.rule.startswith("gemm_epilogue")
    assert site.reason.startswith("the rule is single-use, but %")
    assert "also read outside it (pypm_jax/rules/gemm.py:" in site.reason


@pm.guard_fn("test.small_enough")
def small_enough(shape):
    n = shape[-1]
    return True if n <= 8 else pm.Refusal(f"last axis {n} is over 8")


@pm.pattern
def Exp(x):
    return prims.exp(x)


@pm.op(op_class="kernel")
def SmallExp(x):
    return 1


@pm.rule(Exp)
def small_exp(x):
    assert small_enough(x.shape)
    return SmallExp(x)


def test_a_guard_functions_refusal_reaches_the_explanation():
    graph = pm.jax.lift(jax.make_jaxpr(jnp.exp)(jnp.ones((2, 16)))).graph
    e = pm.explain(small_exp, graph)
    assert not e.matched
    assert e.best.failure.reason == "last axis 16 is over 8"
    assert "is false: last axis 16 is over 8" in str(e)
    assert bool(pm.Refusal("no")) is False and pm.Refusal("a") == pm.Refusal("a")


def test_an_nnx_module_says_what_it_missed():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(64, 128, rngs=nnx.Rngs(0))

        def __call__(self, x):
            h = self.dense(x)
            return jnp.tanh(h), h  # the product is read twice: the epilogue refuses

    (site,) = pm.nnx_optimize(Mlp()).missed(X)
    assert site.kind == "gemm" and "single-use" in site.reason


def _head_masked(q, k, v, head_mask):
    p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k), -1)
    p = jnp.einsum("bhqk,h->bhqk", p, head_mask)  # a product with a vector only scales
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def test_the_site_is_the_values_product_not_a_head_mask_product_on_the_way():
    small = jnp.ones((2, 16, 4, 16))
    (site,) = pm.optimize(_head_masked).missed(small, small, small, jnp.ones(4))
    values_product = _head_masked.__code__.co_firstlineno + 3  # its return line
    assert site.kind == "attention" and site.source.line == values_product
    # the rules take a head mask of ones only (what Hugging Face passes for none): that stops
    # them before the head dim is looked at
    assert "head_mask_identity" in site.reason and "rules/attention.py:" in site.reason
