"""Every matcher test in tests/core runs against every engine that exists.

"reference" is the paper's small-step machine (``pypm_jax._machine``); "fast" joins as soon
as ``pypm_jax._fast`` exists, so the whole suite then checks it too.
"""

from __future__ import annotations

import importlib.util

import pytest

HAS_FAST = importlib.util.find_spec("pypm_jax._fast") is not None
ENGINES = ["reference", "fast"] if HAS_FAST else ["reference"]


@pytest.fixture(params=ENGINES, scope="session")
def engine(request: pytest.FixtureRequest) -> str:
    """The name of a matcher, for ``pypm_jax._engine.match_first(..., engine=engine)``.

    Session-scoped so Hypothesis tests may use it (it holds no state between examples).
    """
    return request.param
