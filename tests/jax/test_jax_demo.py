"""The README's main job without the ``models`` extra: part 2 demos a Flax linen encoder."""

import logging
import sys

import pytest

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
    assert "kernels: the Pallas kernels in the interpreter" in out


def test_the_demo_says_how_kernels_run_on_cpu(monkeypatch):
    monkeypatch.delenv("PYPM_KERNEL_IMPL", raising=False)
    monkeypatch.setattr(demo, "_has_gpu", lambda: False)
    line = demo._kernels_line(None)
    assert "XLA reference" in line and "PYPM_KERNEL_IMPL=interpret" in line
    # the demo itself sets the interpreter on CPU (its check is of the kernels) and says so
    line = demo._kernels_line("interpret")
    assert "Pallas kernels in the interpreter" in line and "XLA reference" in line


def test_the_demo_silences_transformers_deprecation_banner():
    hf_logging = pytest.importorskip("transformers.utils.logging")
    logger = hf_logging.get_logger("transformers.modeling_flax_utils")  # where the banner is
    before = hf_logging.get_verbosity()
    assert logger.isEnabledFor(logging.WARNING)
    with demo._quiet_transformers():
        assert not logger.isEnabledFor(logging.WARNING)
    assert hf_logging.get_verbosity() == before
