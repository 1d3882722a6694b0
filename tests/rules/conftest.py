"""Rule-library tests: kernels run in the Pallas interpreter; the corpus is importable."""

from __future__ import annotations

import os
import sys

import pytest

_HERE = os.path.dirname(__file__)
for _p in (_HERE, os.path.join(os.path.dirname(_HERE), "jax")):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture(autouse=True)
def _interpret_kernels(monkeypatch):
    """Every substituted kernel runs its Pallas code in interpret mode (CPU), not the XLA
    reference: the tests check the kernels the rules call, not a stand-in."""
    monkeypatch.setenv("PYPM_KERNEL_IMPL", "interpret")
