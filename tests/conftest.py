"""Shared pytest configuration: the Hypothesis profile, the ``engine`` fixture, GPU tests
that skip cleanly without a GPU, and a definition cache private to the run."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings

from pypm_testing import budget

for _name, _n in budget.MAX_EXAMPLES.items():
    settings.register_profile(
        _name, max_examples=_n, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
settings.load_profile(budget.profile())


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


# The default rules' definition cache (pypm_jax.rules._cache) goes to a directory of this
# run, not the user's ~/.cache. The process that creates it (the xdist controller, whose
# environment the workers inherit) removes it at exit.
if "PYPM_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="pypm-test-cache-")
    os.environ["PYPM_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
