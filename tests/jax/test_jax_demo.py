"""The README's main job without the ``models`` extra: part 2 demos a Flax linen encoder."""

import sys

from pypm_jax import demo


def test_demo_runs_without_transformers(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.setenv("PYPM_KERNEL_IMPL", "interpret")
    assert demo.model_demo() == 0
    out = capsys.readouterr().out
    assert "transformers is not installed" in out
    assert "Flax linen encoder" in out
    assert "rewrites: {'attention': 2, 'gemm_epilogue': 2}" in out
    assert "equivalence: OK; sites: OK" in out
