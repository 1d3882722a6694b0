"""The ``pypm-jax`` command line: ``find`` / ``report`` on a StableHLO file and on
``module:function`` with example argument types."""

from __future__ import annotations

import json
import os
import textwrap
import tomllib

import jax
import jax.numpy as jnp
import pytest

from pypm_jax import cli

MODEL = textwrap.dedent(
    """
    import jax, jax.numpy as jnp

    def forward(q, k, v, x, w):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 8.0
        o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v)
        return o, jax.nn.gelu(x @ w)
    """
)


@pytest.fixture
def model_dir(tmp_path, monkeypatch):
    (tmp_path / "cli_model.py").write_text(MODEL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _args(head_dim):
    qkv = [f"f32[2,16,4,{head_dim}]"] * 3
    return [a for t in [*qkv, "f32[8,64]", "f32[64,32]"] for a in ("--arg", t)]


def test_report_on_a_function_lists_rewrites_and_the_sites_missed(model_dir):
    text = cli.run(["report", "cli_model:forward", *_args(300)])
    lines = text.splitlines()
    assert lines[1].split()[:4] == ["gemm_epilogue_no_bias", "gemm", "f32", "8x64x32"]
    assert lines[1].endswith("cli_model.py:7")
    assert "missed:" in lines and lines[-1].startswith("attention at cli_model.py:6: ")
    assert "head dim 300 outside the supported range" in lines[-1]
    data = json.loads(cli.run(["report", "cli_model:forward", *_args(300), "--json"]))
    assert [r["kernel"] for r in data["rewrites"]] == ["gemm"]
    assert [m["kind"] for m in data["missed"]] == ["attention"]


def test_find_on_a_stablehlo_file(model_dir):
    a = jax.ShapeDtypeStruct((2, 16, 4, 32), jnp.float32)
    x, w = jax.ShapeDtypeStruct((8, 64), jnp.float32), jax.ShapeDtypeStruct((64, 32), jnp.float32)
    from cli_model import forward

    (model_dir / "m.mlir").write_text(jax.jit(forward).lower(a, a, a, x, w).as_text())
    rows = [line.split()[:2] for line in cli.run(["find", "m.mlir"]).splitlines()[1:]]
    assert rows == [["attention_scaled", "attention"], ["gemm_epilogue_no_bias", "gemm"]]
    assert cli.run(["report", "m.mlir"]).endswith(
        "no missed sites: every attention-like and GEMM+activation-like site was rewritten"
    )


def test_bad_command_lines_say_what_is_wrong(model_dir, capsys):
    assert cli.main(["find", "nowhere"]) == 2
    assert "neither a file nor module:function" in capsys.readouterr().err
    assert cli.main(["find", "cli_model:forward", "--arg", "f33[2]"]) == 2
    assert "expected DTYPE[SHAPE]" in capsys.readouterr().err
    assert cli.main(["find", "cli_model:nope"]) == 2
    assert "has no attribute nope" in capsys.readouterr().err
    assert cli.parse_arg("bf16[2, 3]") == jax.ShapeDtypeStruct((2, 3), jnp.bfloat16)
    assert cli.parse_arg("i32") == jax.ShapeDtypeStruct((), jnp.int32)


def test_the_console_script_is_declared():
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert project["scripts"]["pypm-jax"] == "pypm_jax.cli:main"
    assert project["entry-points"]["pytest11"] == {
        "pypm_jax.pytest_plugin": "pypm_jax.pytest_plugin"
    }
