"""The standard rules find the same sites on StableHLO as on the jaxpr, with the same sources.

For each model the jaxpr is lifted (``pypm_jax.jax.lift``) and rewritten with
``default_rules()``; the StableHLO of the same function (``jax.jit(fn).lower(*args)``) goes
through ``hlo.find``. Both must report the same rules, in the same order, at the same
``file:line`` and Flax module path, and the counts must be the model's sites
(``docs/RULES.md``). Head dim 32: the kernels' smallest, so every site is one they take.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import hlo
import pypm_jax as pm
from pypm_jax.jax import lift, prims, rewrite_nested
from pypm_jax.rules import default_rules
from pypm_testing import corpus

HERE = os.path.abspath(__file__)
SIZE = corpus.Size(hidden=64, heads=2)  # head dim 32


class MLP(nn.Module):
    """Dense + activation, every spelling the GEMM-epilogue rules take from Flax/jax.nn."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="fc1")(x))
        x = nn.gelu(nn.Dense(64, name="fc2")(x))  # tanh approximation
        x = nn.gelu(nn.Dense(64, name="fc3")(x), approximate=False)
        x = nn.silu(nn.Dense(64, name="fc4")(x))  # lowered as x * (1 / (1 + exp(-x)))
        return nn.Dense(64, name="out")(x)  # no activation: not a site


def mlp():
    model = MLP()
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 8, 64), jnp.float32)
    variables = model.init(jax.random.PRNGKey(0), x)
    return model.apply, (variables, x), "Dense + relu / gelu / gelu(exact) / silu"


MODELS = {
    "linen_mha": (lambda: corpus.linen_mha(False, SIZE), {"attention": 1}),
    "linen_mha_masked": (lambda: corpus.linen_mha(True, SIZE), {"attention_mask": 1}),
    "mlp": (mlp, {"gemm_epilogue": 4}),
    "bert": (lambda: corpus.hf_bert(SIZE), {"attention_bias": 2, "gemm_epilogue": 3}),
    "linen_scan": (lambda: corpus.linen_scan(False, SIZE), {"attention": 1, "gemm_epilogue": 1}),
    "gpt2": (
        lambda: corpus.hf_gpt2(SIZE),
        {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2},
    ),
}


def _sites(report):
    return [(r.rule, str(r.source), r.module_path) for r in report]


@pytest.mark.parametrize("name", list(MODELS))
def test_same_sites_on_stablehlo_as_on_the_jaxpr(name):
    build, counts = MODELS[name]
    if name in ("bert", "gpt2") and not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    fn, args, desc = build()
    on_jaxpr = rewrite_nested(lift(jax.make_jaxpr(fn)(*args)), default_rules()).report
    on_hlo = hlo.find(jax.jit(fn).lower(*args))
    assert on_hlo.counts() == counts, f"{desc}\n{on_hlo}"
    assert _sites(on_hlo) == _sites(on_jaxpr), f"{desc}\njaxpr:\n{on_jaxpr}\nhlo:\n{on_hlo}"
    assert all(r.source is not None for r in on_hlo)


def test_bert_sites_name_the_layers():
    if not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    fn, args, _ = corpus.hf_bert(SIZE)
    report = hlo.find(jax.jit(fn).lower(*args))
    paths = [r.module_path for r in report if r.rule == "attention_bias"]
    assert paths == [
        "FlaxBertModule/encoder/layer/0/attention/self",
        "FlaxBertModule/encoder/layer/1/attention/self",
    ]
    assert all(r.source.file.endswith("modeling_flax_bert.py") for r in report)


def test_find_on_a_file_with_its_own_rules(tmp_path):
    @pm.pattern
    def ScaledTanh(x):
        return prims.tanh(prims.mul(x, 2.0))

    @pm.op(op_class="kernel")
    def FastScaledTanh(x):
        return 1

    @pm.rule(ScaledTanh)
    def scaled_tanh(x):
        return FastScaledTanh(x)

    def f(x):
        return jnp.tanh(x * 2.0) + jnp.tanh(x * 3.0)  # marker: tanh

    path = tmp_path / "f.mlir"
    path.write_text(jax.jit(f).lower(jnp.ones((4,))).as_text(debug_info=True))
    report = hlo.find(str(path), rules=[scaled_tanh])
    (record,) = report
    line = next(i for i, t in enumerate(open(HERE), 1) if "marker: tanh" in t and "next(" not in t)
    assert record.rule == "scaled_tanh" and str(record.source) == f"{HERE}:{line}"
    assert report.counts() == {"scaled_tanh": 1} and "scaled_tanh" in str(report)
    assert any(n.op is FastScaledTanh for n in report.graph.nodes())


def test_normalization_is_reported_separately_and_can_be_turned_off():
    fn, args, _ = mlp()
    low = jax.jit(fn).lower(*args)
    report = hlo.find(low)
    assert report.normalized.counts() == {"raise_logistic": 1}
    # the activation rule does not see the raw silu; the region rule takes it as written
    raw = {"gemm_epilogue": 3, "gemm_epilogue_region": 1}
    assert hlo.find(low, normalize=False).counts() == raw


def test_find_raises_typed_errors_on_bad_input():
    with pytest.raises(pm.FormatError):
        hlo.find("not a module")
    with pytest.raises(hlo.HloError):
        hlo.find("module {}")
