"""Rule-library tests: kernels run in the Pallas interpreter."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _interpret_kernels(monkeypatch):
    """Every substituted kernel runs its Pallas code in interpret mode (CPU), not the XLA
    reference: the tests check the kernels the rules call, not a stand-in."""
    monkeypatch.setenv("PYPM_KERNEL_IMPL", "interpret")
