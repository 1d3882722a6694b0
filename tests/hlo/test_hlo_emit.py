"""``hlo.emit``: the module with the sites replaced by calls to the kernels parses, verifies
and runs, and computes what the original computes (kernels in the Pallas interpreter)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hlo_find import SIZE, mlp

import hlo
import pypm_jax as pm
from pypm_jax.jax import prims
from pypm_jax.rules import default_rules
from pypm_testing import corpus

MODELS = {
    "linen_mha_masked": (lambda: corpus.linen_mha(True, SIZE), {"attention_mask": 1}),
    "mlp": (mlp, {"gemm_epilogue": 4}),
    "bert": (lambda: corpus.hf_bert(SIZE), {"attention_bias": 2, "gemm_epilogue": 3}),
}


@pytest.fixture(autouse=True)
def _interpret_kernels(monkeypatch):
    """The kernels' Pallas code (interpret mode), not their XLA reference, is emitted."""
    monkeypatch.setenv("PYPM_KERNEL_IMPL", "interpret")


def _main(text):
    return hlo._reader.load(text).funcs["main"].body.ops


def _kernel_calls(text):
    """main's calls of emitted kernels: (callee family, op)."""
    return [
        (op.attrs["callee"].split("_")[1], op)
        for op in _main(text)
        if op.name == "func.call" and op.attrs["callee"].startswith("pypm_")
    ]


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "bert" else n for n in MODELS]
)
def test_emitted_module_runs_and_matches(name):
    build, counts = MODELS[name]
    if name == "bert" and not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    fn, args, desc = build()
    lowered = jax.jit(fn, keep_unused=True).lower(*args)
    before = lowered.as_text(debug_info=True)
    result = hlo.emit(lowered)
    assert result.report.counts() == counts, desc
    assert len(result.emitted) == sum(counts.values()) and not result.skipped, str(result)
    assert lowered.as_text(debug_info=True) == before  # the caller's module is untouched
    # the new module parses, and main calls one kernel per site instead of the site's ops
    families = sorted(f for f, _ in _kernel_calls(result.text))
    want_families = sorted(_family(rule) for rule, n in counts.items() for _ in range(n))
    assert families == want_families
    if name != "mlp":  # every softmax went into a kernel
        assert "stablehlo.exponential" not in [op.name for op in _main(result.text)]
    _assert_runs_like(lowered, result.text, jax.tree.leaves(args), desc)


@pytest.mark.slow
def test_a_rule_refining_a_kernel_is_part_of_its_site(monkeypatch):
    """GPT-2: ``attention_causal_bias`` rewrites the kernel ``attention_bias`` made (the plan
    learns the bias is causal). The two rewrites are one site: one kernel call, whose plan
    has ``mask_is_causal``, both records emitted."""
    if not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    from pypm_jax.rules import FlashAttention
    from pypm_jax.vocab.impls import KERNEL_IMPLS

    plans = []
    impl = KERNEL_IMPLS[FlashAttention]

    def recording(*args, plan, **attrs):
        plans.append(plan)
        return impl(*args, plan=plan, **attrs)

    monkeypatch.setitem(KERNEL_IMPLS, FlashAttention, recording)
    fn, args, desc = corpus.hf_gpt2(SIZE)
    lowered = jax.jit(fn, keep_unused=True).lower(*args)
    result = hlo.emit(lowered)
    counts = {"attention_bias": 2, "attention_causal_bias": 2, "gemm_epilogue": 2}
    assert result.report.counts() == counts, desc
    assert len(result.emitted) == 6 and not result.skipped, str(result)
    families = sorted(f for f, _ in _kernel_calls(result.text))
    assert families == ["FlashAttention"] * 2 + ["GemmEpilogue"] * 2
    assert plans and all(p.mask_is_causal for p in plans), plans
    assert "stablehlo.exponential" not in [op.name for op in _main(result.text)]
    _assert_runs_like(lowered, result.text, jax.tree.leaves(args), desc)


def test_a_refinement_of_a_site_not_emitted_is_skipped_with_the_reason(monkeypatch):
    """When the first rewrite of a chain cannot be emitted, the refinement says so."""
    if not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    from pypm_jax.rules import FlashAttention
    from pypm_jax.vocab.impls import KERNEL_IMPLS

    def broken(*args, **attrs):
        raise RuntimeError("no lowering today")

    monkeypatch.setitem(KERNEL_IMPLS, FlashAttention, broken)
    fn, args, _ = corpus.hf_gpt2(SIZE)
    result = hlo.emit(jax.jit(fn, keep_unused=True).lower(*args))
    skipped = {r.rule: why for r, why in result.skipped}
    assert sorted(r.rule for r in result.emitted) == ["gemm_epilogue"] * 2
    assert "no lowering today" in skipped["attention_bias"]
    why = skipped["attention_causal_bias"]
    assert (
        why.startswith("it rewrote the kernel of the attention_bias site") and "no lowering" in why
    )
    assert [f for f, _ in _kernel_calls(result.text)] == ["GemmEpilogue"] * 2


WIDER = ["llama", "bart", *corpus.MORE_HF_MODELS]


@pytest.mark.slow
@pytest.mark.parametrize("name", WIDER)
def test_every_site_of_the_wider_corpus_is_emitted(name):
    """Every site the rules find in the other Hugging Face models (causal decoders, GQA,
    ALiBi, encoder-decoders, vision) is emitted, and the module computes what it did."""
    if not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    fn, args, desc = {**corpus.HF_MODELS, **corpus.MORE_HF_MODELS}[name](SIZE)
    lowered = jax.jit(fn, keep_unused=True).lower(*args)
    result = hlo.emit(lowered)
    assert result.report and len(result.emitted) == len(result.report), str(result)
    assert not result.skipped, str(result)
    # one kernel call per site; the causal rules refine the kernel of an attention site
    refined = ("attention_causal_mask", "attention_causal_bias")
    sites = [r.rule for r in result.report if r.rule not in refined]
    want = sorted(_family(r) for r in sites)
    assert sorted(f for f, _ in _kernel_calls(result.text)) == want, desc
    _assert_runs_like(lowered, result.text, jax.tree.leaves(args), desc)


def test_emitted_calls_have_the_sites_locations():
    fn, args, _ = corpus.linen_mha(True, SIZE)
    result = hlo.emit(jax.jit(fn, keep_unused=True).lower(*args))
    (record,) = result.emitted
    ((family, call),) = _kernel_calls(result.text)
    assert family == "FlashAttention"
    assert (record.source.file, record.source.line) in call.loc.frames


def _assert_runs_like(lowered, text, args, desc=""):
    """``text`` computes what ``lowered`` computes on ``args`` (within 1e-5 of the scale)."""
    want = hlo.execute(lowered, args)
    got = hlo.execute(text, args)
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = max(float(np.max(np.abs(a))), 1e-30)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale, err_msg=desc)


def _family(rule):
    """The kernel op a standard rule builds."""
    if rule.startswith("attention"):
        return "FlashAttention"
    return "GemmRegion" if rule == "gemm_epilogue_region" else "GemmEpilogue"


def _kernels_by_depth(text):
    """The emitted kernels main calls, as (callee family, region depth, op holding it)."""
    out = []

    def walk(block, depth, holder):
        for op in block.ops:
            callee = op.attrs.get("callee", "") if op.name == "func.call" else ""
            if callee.startswith("pypm_"):
                out.append((callee.split("_")[1], depth, holder))
            for region in op.regions:
                if region is not None:
                    walk(region, depth + 1, op.name)

    walk(hlo._reader.load(text).funcs["main"].body, 0, "func.func")
    return sorted(out)


@pytest.fixture(params=["interpret", "default"])
def kernel_impl(request, monkeypatch):
    """The kernels' Pallas code (interpret mode), or what the default dispatch picks (their
    XLA reference on CPU)."""
    if request.param == "default":
        monkeypatch.delenv("PYPM_KERNEL_IMPL", raising=False)
    return request.param


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan_remat"])
def test_sites_inside_a_scan_are_emitted_in_the_while_body(remat, kernel_impl):
    fn, args, desc = corpus.linen_scan(remat, SIZE)
    lowered = jax.jit(fn, keep_unused=True).lower(*args)
    before = lowered.as_text(debug_info=True)
    result = hlo.emit(lowered)
    assert result.report.counts() == {"attention": 1, "gemm_epilogue": 1}
    assert len(result.emitted) == 2 and not result.skipped, str(result)
    assert lowered.as_text(debug_info=True) == before
    # both kernels are called from the loop's body (the layer's function was inlined there)
    assert _kernels_by_depth(result.text) == [
        ("FlashAttention", 1, "stablehlo.while"),
        ("GemmEpilogue", 1, "stablehlo.while"),
    ]
    body = [op.name for op in hlo._reader.load(result.text).funcs["main"].body.ops]
    assert "stablehlo.exponential" not in body
    # the inlined layer's ops keep their module paths (named relative to the call's)
    paths = _module_paths(result.text)
    assert {"Stack/layers/ln1", "Stack/layers/attention/query", "Stack/layers/fc2"} <= paths
    assert not [p for p in paths if p and p.startswith("layers")]
    _assert_runs_like(lowered, result.text, jax.tree.leaves(args), desc)


def _module_paths(module):
    g = hlo.lift(module)
    return {n.meta.get("module_path") for b in [g, *hlo.nested_graphs(g)] for n in b.nodes()}


def _attention(q, k, v):
    return nn.dot_product_attention(q, k, v)


def _dense_gelu(x, w, b):
    return jax.nn.gelu(x @ w + b)


def _branches(p, q, k, v, w, b):
    """An attention in a ``cond`` branch, a Dense + gelu in a ``switch`` branch, and an
    attention in a ``cond`` inside a ``fori_loop`` (a ``case`` in a ``while`` body)."""
    y = jax.lax.cond(p > 0, _attention, lambda q, k, v: q * 2.0, q, k, v)
    z = jax.lax.switch(
        jnp.clip(p, 0, 2),
        [lambda y: _dense_gelu(y, w, b), lambda y: y, lambda y: -y],
        y.reshape(2, 8, 64),
    )

    def step(i, c):
        return jax.lax.cond(i % 2 == 0, lambda c: _attention(c, c, c), lambda c: c, c)

    return jax.lax.fori_loop(0, 3, step, z.reshape(2, 8, 2, 32))


def _branch_args(p):
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    qkv = [jax.random.normal(k, (2, 8, 2, 32), jnp.float32) for k in ks[:3]]
    w = 0.1 * jax.random.normal(ks[3], (64, 64), jnp.float32)
    return [np.int32(p), *qkv, w, jax.random.normal(ks[4], (64,), jnp.float32)]


@pytest.mark.slow
def test_sites_inside_cond_switch_and_nested_regions_are_emitted(kernel_impl):
    lowered = jax.jit(_branches, keep_unused=True).lower(*_branch_args(1))
    result = hlo.emit(lowered)
    assert result.report.counts() == {"attention": 2, "gemm_epilogue": 1}
    found = hlo.find(lowered)  # the same sites, in the same order, at the same lines
    assert [(r.rule, r.source) for r in result.report] == [(r.rule, r.source) for r in found]
    assert len(result.emitted) == 3 and not result.skipped, str(result)
    assert _kernels_by_depth(result.text) == [
        ("FlashAttention", 1, "stablehlo.case"),  # the cond's branch
        ("FlashAttention", 2, "stablehlo.case"),  # the cond's branch in the loop's body
        ("GemmEpilogue", 1, "stablehlo.case"),  # the switch's branch
    ]
    # one private function per distinct kernel: both attentions have the same signature
    assert result.text.count("func.func private @pypm_FlashAttention(") == 1
    for p in (0, 1, 2, 5):  # every branch taken
        _assert_runs_like(lowered, result.text, _branch_args(p), f"p={p}")


def _dense_args():
    x = jax.random.normal(jax.random.PRNGKey(3), (2, 8, 64), jnp.float32)
    return [x, *_branch_args(0)[4:]]


@jax.jit
def _inner_dense_gelu(x, w, b):
    return _dense_gelu(x, w, b)


def test_sites_inside_a_private_function_called_twice_are_emitted(kernel_impl):
    """The replaced values are computed in a private function's body (an inner jax.jit),
    called twice: each call is inlined and gets its kernel call."""

    def f(x, w, b):
        y = _inner_dense_gelu(x, w, b)
        return _inner_dense_gelu(y, w, b) + y

    args = _dense_args()
    lowered = jax.jit(f, keep_unused=True).lower(*args)
    assert "call @_inner_dense_gelu" in lowered.as_text()
    result = hlo.emit(lowered)
    # the second call's kernel grows over ``+ y``: one site of two rewrites
    assert result.report.counts() == {"gemm_epilogue": 2, "gemm_epilogue_region": 1}
    assert len(result.emitted) == 3 and not result.skipped, str(result)
    assert {k for k in _kernels_by_depth(result.text)} == {
        ("GemmEpilogue", 0, "func.func"),
        ("GemmRegion", 0, "func.func"),
    }
    # inlined at both calls, then erased
    assert "_inner_dense_gelu" not in hlo._reader.load(result.text).funcs
    _assert_runs_like(lowered, result.text, args)


@pm.pattern
def _Doubled(x):
    return prims.mul(x, 2.0)


@pm.rule(_Doubled)
def _double_by_adding(x):
    return prims.add(x, x)


def test_sites_that_cannot_be_emitted_are_skipped_with_the_reason():
    """A rule whose replacement is no kernel cannot be emitted; a kernel that reads its
    result cannot either. Both are listed with the reason, the other sites are emitted, and
    the module still runs."""

    def f(x, w, b):
        def step(i, c):
            return _dense_gelu(c * 2.0, w, b)  # doubled, then a gemm epilogue

        return jax.lax.fori_loop(0, 2, step, x), _dense_gelu(x, w, b)

    args = _dense_args()
    lowered = jax.jit(f, keep_unused=True).lower(*args)
    result = hlo.emit(lowered, [*default_rules(), _double_by_adding])
    assert sorted(result.report.counts().items()) == [
        ("_double_by_adding", 1),
        ("gemm_epilogue", 2),
    ]
    assert [r.rule for r in result.emitted] == ["gemm_epilogue"]  # the one outside the loop
    why = {r.rule: reason for r, reason in result.skipped}
    assert why == {
        "_double_by_adding": "not one kernel node replacing one value (only kernels are emitted)",
        "gemm_epilogue": "a kernel input is the result of a rewrite that was not emitted",
    }
    assert "skipped _double_by_adding" in str(result)
    assert _kernels_by_depth(result.text) == [("GemmEpilogue", 0, "func.func")]
    _assert_runs_like(lowered, result.text, args)


def test_emit_of_a_file_without_sites_is_the_same_program(tmp_path):
    path = tmp_path / "f.mlir"
    lowered = jax.jit(lambda x: x * 2.0 + 1.0).lower(np.ones(3, np.float32))
    path.write_text(lowered.as_text())
    result = hlo.emit(path)
    assert not result.report and not result.emitted
    (out,) = hlo.execute(result.text, [np.arange(3, dtype=np.float32)])
    np.testing.assert_array_equal(out, [1.0, 3.0, 5.0])
