"""Shared pytest configuration: the Hypothesis profile, the ``engine`` fixture, GPU tests
that skip cleanly without a GPU."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

import pytest
from hypothesis import HealthCheck, settings

from pypm_testing import budget

for _name, _n in budget.MAX_EXAMPLES.items():
    settings.register_profile(
        _name, max_examples=_n, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
settings.load_profile(budget.profile())


def _has_fusion_emitters_flag() -> bool:
    """Does the installed XLA know ``--xla_cpu_use_fusion_emitters``? jaxlib 0.10 does, 0.12
    no longer does, and an unknown flag in XLA_FLAGS aborts the process."""
    try:
        major, minor = (int(x) for x in version("jaxlib").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (major, minor) < (0, 11)


# XLA's CPU backend spends most of a small program's compile time in LLVM's optimizer and in
# its (MLIR) fusion emitters. The suite compiles thousands of small programs and times none of
# them, so it compiles them at LLVM's -O0 (about a third less CPU time for the interpret-mode
# kernel tests) and, where XLA has the switch, with the CPU backend's elemental emitters
# instead of the fusion emitters (about half the compile time again). Values are compared
# between programs compiled alike, or within the dtype's tolerance. (Read when a backend
# starts, after this file: XLA_FLAGS set by the caller win; subprocesses inherit it.)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _has_fusion_emitters_flag():
    os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"


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
