"""The one switch between matchers: the paper's reference machine and the fast engine.

``engine="reference"`` runs ``pypm_jax.semantics.machine`` (the small-step machine of the paper's
appendix); ``engine="fast"`` runs ``pypm_jax.engine.fast`` (compiled patterns). Both return the
same first solution and the same ``match_all`` order. The default is the fast engine; the
environment variable ``PYPM_ENGINE=reference`` switches the default for a whole process.
"""

from __future__ import annotations

__all__ = ["ENGINES", "default_engine", "match_first", "match_all"]

import importlib
import os
from collections.abc import Iterator
from typing import Any

from ..core.calculus import PatternDef
from ..core.match import Match

ENGINES = ("reference", "fast")


def default_engine() -> str:
    name = os.environ.get("PYPM_ENGINE", "fast")
    if name not in ENGINES:
        raise ValueError(f"PYPM_ENGINE={name!r}: expected one of {ENGINES}")
    return name


def _module(engine: str | None) -> Any:
    engine = engine or default_engine()
    if engine == "reference":
        return importlib.import_module("pypm_jax.semantics.machine")
    if engine == "fast":
        return importlib.import_module("pypm_jax.engine.fast")
    raise ValueError(f"unknown engine {engine!r}: expected one of {ENGINES}")


def match_first(
    pattern: PatternDef, term: Any, *, engine: str | None = None, budget: int | None = None
) -> Match | None:
    """The first solution in the machine's order, or None. ``budget``: raise
    ``MatchBudgetError`` past that many machine steps (None: unbounded)."""
    return _module(engine).match_first(pattern, term, budget=budget)


def match_all(
    pattern: PatternDef, term: Any, *, engine: str | None = None, budget: int | None = None
) -> Iterator[Match]:
    """Every distinct solution, lazily, in exploration order (``budget``: as above)."""
    return _module(engine).match_all(pattern, term, budget=budget)
