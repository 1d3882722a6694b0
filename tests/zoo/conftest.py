"""Zoo tests: kernels run in the Pallas interpreter, as in the rule-library tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _interpret_kernels(monkeypatch):
    """Every substituted kernel runs its Pallas code in interpret mode (CPU)."""
    monkeypatch.setenv("PYPM_KERNEL_IMPL", "interpret")
