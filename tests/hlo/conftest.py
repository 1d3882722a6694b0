"""StableHLO frontend tests: the model corpus of ``tests/jax`` is importable as ``corpus``."""

from __future__ import annotations

import os
import sys

_JAX_TESTS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "jax")
if _JAX_TESTS not in sys.path:
    sys.path.insert(0, _JAX_TESTS)
