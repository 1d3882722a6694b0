"""Shared pytest configuration: GPU tests skip cleanly without a GPU backend."""

from __future__ import annotations

import pytest


def _has_gpu() -> bool:
    try:
        import jax

        return jax.default_backend() == "gpu"
    except Exception:  # no jax, or no usable backend
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip_gpu = pytest.mark.skip(reason="needs a GPU backend (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# Hypothesis: CI (CI=true, as `.ci/run` sets it) runs the full example counts the acceptance
# criteria ask for; a developer's default run uses fewer. Tests that need an exact count
# (the format fuzzer) set it explicitly.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
import os  # noqa: E402

settings.load_profile("ci" if os.environ.get("CI") else "dev")


def _engines() -> list[str]:
    import importlib.util

    names = ["reference"]
    if importlib.util.find_spec("pypm_jax._fast") is not None:
        names.append("fast")
    return names


@pytest.fixture(params=_engines())
def engine(request) -> str:
    """Every matcher test runs against the paper's machine and against the fast engine."""
    return request.param
