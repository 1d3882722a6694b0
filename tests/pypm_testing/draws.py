"""Strategy objects for the generators, made once.

Hypothesis validates and labels a strategy object the first time it is drawn from, and its
constructors (``st.integers``, ``st.sampled_from``, ...) look their arguments up in a cache
of their own; both cost more than the draw itself. A generator that draws thousands of small
values per test draws from these objects instead: the same strategies, so the same choices,
labels and examples at a given seed, for less CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

BOOLS = st.booleans()


@functools.cache
def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """``st.integers(lo, hi)``, one object per bounds."""
    return st.integers(lo, hi)


def sampled(items: Sequence[Any]) -> st.SearchStrategy[Any]:
    """``st.sampled_from(items)``, one object per sequence of items (equal items of the same
    types: ``(1, 2)`` and ``(1.0, 2.0)`` are equal tuples, not the same choices)."""
    items = tuple(items)
    return _sampled(items, tuple(map(type, items)))


@functools.lru_cache(maxsize=4096)
def _sampled(items: tuple, _types: tuple) -> st.SearchStrategy[Any]:
    return st.sampled_from(items)
