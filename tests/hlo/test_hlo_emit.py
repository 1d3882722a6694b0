"""``hlo.emit``: the module with the sites replaced by calls to the kernels parses, verifies
and runs, and computes what the original computes (kernels in the Pallas interpreter)."""

from __future__ import annotations

import corpus
import jax
import numpy as np
import pytest
from test_hlo_find import SIZE, mlp

import hlo

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
    return hlo._compat.load(text).funcs["main"].body.ops


def _kernel_calls(text):
    """main's calls of emitted kernels: (callee family, op)."""
    return [
        (op.attrs["callee"].split("_")[1], op)
        for op in _main(text)
        if op.name == "func.call" and op.attrs["callee"].startswith("pypm_")
    ]


@pytest.mark.parametrize("name", list(MODELS))
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
    want_families = sorted(
        ("FlashAttention" if rule.startswith("attention") else "GemmEpilogue")
        for rule, n in counts.items()
        for _ in range(n)
    )
    assert families == want_families
    if name != "mlp":  # every softmax went into a kernel
        assert "stablehlo.exponential" not in [op.name for op in _main(result.text)]
    flat = jax.tree.leaves(args)
    want = hlo.execute(lowered, flat)
    got = hlo.execute(result.text, flat)
    assert len(want) == len(got)
    for a, b in zip(want, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        scale = max(float(np.max(np.abs(a))), 1e-30)
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * scale, err_msg=desc)


def test_emitted_calls_have_the_sites_locations():
    fn, args, _ = corpus.linen_mha(True, SIZE)
    result = hlo.emit(jax.jit(fn, keep_unused=True).lower(*args))
    (record,) = result.emitted
    ((family, call),) = _kernel_calls(result.text)
    assert family == "FlashAttention"
    assert (record.source.file, record.source.line) in call.loc.frames


def test_sites_inside_loops_are_reported_not_emitted():
    fn, args, _ = corpus.linen_scan(False, SIZE)
    lowered = jax.jit(fn, keep_unused=True).lower(*args)
    result = hlo.emit(lowered)
    assert result.report.counts() == {"attention": 1, "gemm_epilogue": 1}
    assert not result.emitted and len(result.skipped) == 2
    assert all("region" in why for _, why in result.skipped)
    flat = jax.tree.leaves(args)
    (want,) = hlo.execute(lowered, flat)
    (got,) = hlo.execute(result.text, flat)
    np.testing.assert_array_equal(got, want)


def test_emit_of_a_file_without_sites_is_the_same_program(tmp_path):
    path = tmp_path / "f.mlir"
    lowered = jax.jit(lambda x: x * 2.0 + 1.0).lower(np.ones(3, np.float32))
    path.write_text(lowered.as_text())
    result = hlo.emit(path)
    assert not result.report and not result.emitted
    (out,) = hlo.execute(result.text, [np.arange(3, dtype=np.float32)])
    np.testing.assert_array_equal(out, [1.0, 3.0, 5.0])
