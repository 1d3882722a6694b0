"""The pytest plugin of pypm_jax (registered through the ``pytest11`` entry point).

``pytest --pypm-verify`` turns ``verify=True`` on for every ``pm.optimize`` in the test run:
each optimized function checks its rewritten program against the original on the first
concrete inputs of each signature and raises :class:`~pypm_jax.jax.VerificationError`
naming the rewrites responsible. The fixture ``pypm_verify`` does the same for one test.
``pypm_jax.testing.assert_equivalent`` is the explicit check (values and gradients).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("pypm_jax").addoption(
        "--pypm-verify",
        action="store_true",
        default=False,
        help="check every pm.optimize'd program against the original (verify=True)",
    )


_SAVED = pytest.StashKey[bool]()


def _optimize_module() -> Any:
    """``pypm_jax.jax.optimize``, the module (the package's attribute of that name is the
    function), imported on use: the plugin loads with pytest, before any test needs JAX."""
    return importlib.import_module("pypm_jax.jax.optimize")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--pypm-verify"):
        optimize_module = _optimize_module()
        config.stash[_SAVED] = optimize_module.VERIFY_ALL
        optimize_module.VERIFY_ALL = True


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SAVED in config.stash:  # (an in-process run inside another keeps the outer's)
        optimize_module = _optimize_module()
        optimize_module.VERIFY_ALL = config.stash[_SAVED]


def pytest_report_header(config: pytest.Config) -> str | None:
    return "pypm_jax: every pm.optimize verifies" if config.getoption("--pypm-verify") else None


@pytest.fixture
def pypm_verify(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``verify=True`` for every ``pm.optimize`` called during this test."""
    monkeypatch.setattr(_optimize_module(), "VERIFY_ALL", True)
    yield
