"""The rewrite report: a table that fits 100 columns, one row per kernel that runs (kernel,
shape/dtype, flags from the replacement operator's describer), counts by kernel and module,
and the same as data (``to_dict`` / ``to_json``)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

import pypm_jax as pm
from pypm_jax.core.errors import SourceLoc
from pypm_jax.engine.report import Built, short_path
from pypm_jax.engine.rewrite import RewriteRecord, RewriteReport
from pypm_jax.jax import KernelInfo, register_describe

HERE = os.path.abspath(__file__)


def _causal_attention_and_mlp(q, k, v, w, x):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
    s = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), s, -1e9)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
    return o, jax.nn.gelu(x @ w)


Q = jnp.ones((2, 16, 4, 64))
W, X = jnp.ones((64, 128)), jnp.ones((32, 64))
ARGS = (Q, Q, Q, W, X)


def test_the_report_names_kernels_shapes_and_flags_one_row_per_kernel_that_runs():
    report = pm.optimize(_causal_attention_and_mlp).report(*ARGS)
    text = str(report)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), text
    # too wide with the whole path: the sources' shared directory is said once, above
    assert lines[0].startswith("sources under ") and lines[0].endswith("tests/jax/"), text
    lines = lines[1:]
    # the attention was rewritten twice (the causal mask folded in): one row, the last rule
    rows = [line.split() for line in lines[1:3]]
    assert [r[:5] for r in rows] == [
        ["attention_causal_mask", "attention", "f32", "B2", "H4"],
        ["gemm_epilogue_no_bias", "gemm", "f32", "32x64x128", "gelu_tanh"],
    ], text
    assert "S16 D64  causal,mask" in lines[1] and "test_jax_report.py:25" in lines[1]
    assert lines[-1] == "by kernel: attention[causal,mask] x1, gemm[gelu_tanh] x1"

    data = json.loads(report.to_json())
    first, causal, gemm = data["rewrites"]
    assert (first["on"], causal["on"], gemm["on"]) == (None, 0, None)
    assert first["flags"] == ["mask"] and causal["flags"] == ["causal", "mask"]
    assert causal["source"] == {"file": short_path(HERE), "line": 25}
    assert gemm["replaced"] > 1 and gemm["kernel"] == "gemm"
    assert data["by_kernel"] == {"attention[causal,mask]": 1, "gemm[gelu_tanh]": 1}
    assert data["fallback"] is None and data["disabled"] == [] and data["fused"] == []


@pm.op(op_class="kernel")
def ReportedOp(x):
    return 1


def _record(i: int, module: str, file: str, built=()) -> RewriteRecord:
    return RewriteRecord(
        rule="a_rule_with_a_rather_long_name",
        pattern="P",
        root=i,
        replaced=(i, i + 100),
        source=SourceLoc(file, 10 + i, ""),
        module_path=module,
        op="exp",
        built=built,
    )


def test_long_cells_are_cut_to_fit_and_layers_group_as_one_module():
    deep = "FlaxBertForMaskedLMModule/bert/encoder/layer/{}/attention/self/query"
    far = "/" + "/".join(["very_long_directory_name"] * 6) + "/model.py"
    built = (Built(ReportedOp, {}, "f32[8,1024,4096]"),)
    report = RewriteReport(_record(i, deep.format(i), far, built) for i in range(12))
    text = str(report)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), text
    assert lines[0] == "modules under FlaxBertForMaskedLMModule/bert/encoder/layer/"
    assert lines[1].startswith("sources under ...") and lines[1].endswith("_name/")
    last = lines[14].split()
    assert last[-1] == "model.py:21" and last[-2].endswith("query")  # paths keep their ends
    assert "a_rule_with_a_rather_long_name" in lines[3]
    assert "by module: FlaxBertForMaskedLMModule/bert/encoder/layer/*/attention/self/query x12" in (
        text.replace("\n  ", " ")
    )


def test_a_describer_plugs_in_and_a_failing_one_does_not_break_the_report():
    built = (Built(ReportedOp, {"plan": 3}, "f32[2]"),)
    report = RewriteReport([_record(0, "", "m.py", built)])
    assert report.rows()[0]["kernel"] == "ReportedOp" and report.rows()[0]["shape"] == "f32[2]"
    register_describe(ReportedOp, lambda attrs, t: KernelInfo("k", f"n={attrs['plan']}", ("x",)))
    row = report.rows()[0]
    assert (row["kernel"], row["shape"], row["flags"]) == ("k", "n=3", ["x"])
    register_describe(ReportedOp, lambda attrs, t: attrs["missing"])
    row = report.rows()[0]
    assert row["kernel"] == "ReportedOp" and row["flags"] == ["<describe failed: KeyError>"]


def test_sources_print_relative_to_the_working_directory_or_their_package():
    assert short_path(os.path.join(os.getcwd(), "a", "b.py")) == os.path.join("a", "b.py")
    installed = os.path.join(os.sep, "venv", "lib", "site-packages", "flax", "linen", "x.py")
    assert short_path(installed) == os.path.join("flax", "linen", "x.py")
    assert short_path("rel/c.py") == "rel/c.py"


def test_a_fused_kernel_the_program_already_calls_is_left_alone_and_reported(monkeypatch):
    """A program that already calls a fused attention (here the Pallas kernel itself; on a
    GPU also ``jax.nn.dot_product_attention(implementation="cudnn")``) has no softmax for
    the rules there: it is left as written, and the report says so with its source line,
    while the rest of the program is still rewritten."""
    import pallas_kernels as pk

    monkeypatch.setenv("PYPM_KERNEL_IMPL", "interpret")

    def fused_and_mlp(q, k, v, w, x):
        return pk.flash_attention(q, k, v, impl="interpret"), jax.nn.gelu(x @ w)  # MARK

    line = next(i for i, t in enumerate(open(HERE), 1) if t.rstrip().endswith("# MARK"))
    fast = pm.optimize(fused_and_mlp)
    want = jax.jit(fused_and_mlp)(*ARGS)
    got = fast(*ARGS)
    for a, b in zip(got, want, strict=True):
        assert jnp.allclose(a, b, rtol=1e-5, atol=1e-5)
    report = fast.report(*ARGS)
    assert [r.rule for r in report] == ["gemm_epilogue_no_bias"]
    (fused,) = report.fused
    assert fused.startswith("Pallas kernel flash_attention_fwd at ") and f":{line}" in fused
    assert f"already fused, left as written: {fused}" in str(report)
    assert json.loads(report.to_json())["fused"] == [fused]
