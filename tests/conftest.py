"""Shared pytest configuration: the Hypothesis profile, the ``engine`` fixture, GPU tests
that skip cleanly without a GPU."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from pypm_testing import budget

for _name, _n in budget.MAX_EXAMPLES.items():
    settings.register_profile(
        _name, max_examples=_n, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
settings.load_profile(budget.profile())

# XLA's CPU backend spends most of a small program's compile time in LLVM's optimizer. The
# suite compiles thousands of small programs and times none of them, so it compiles them at
# LLVM's -O0: about a third less CPU time for the interpret-mode kernel tests. Values are
# compared between programs compiled alike, or within the dtype's tolerance. (Read when a
# backend starts, after this file: XLA_FLAGS set by the caller win; subprocesses inherit it.)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()


def pytest_report_header(config) -> str:
    return f"hypothesis profile: {budget.profile()} (PYPM_HYPOTHESIS_PROFILE)"


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


# pm's two engines: the paper's small-step machine and the fast matcher.
ENGINES = ("reference", "fast")


@pytest.fixture(params=ENGINES, scope="module")
def engine(request: pytest.FixtureRequest) -> str:
    """Every matcher test runs against both engines: the ``engine=`` argument of ``pm.match``,
    ``pm.rewrite`` and the private ``match_first``/``match_all``. Module-scoped (it holds no
    state), so Hypothesis tests may use it too."""
    return request.param
