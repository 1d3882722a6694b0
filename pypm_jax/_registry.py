"""Name tables filled at import/definition time, read when loading serialized rules.

Operators register under their qualified name (``namespace.name``) when defined; guard
functions (pure predicates callable from guards) register under their name. Loading a blob
resolves names here and never executes code from the blob.
"""

from __future__ import annotations

__all__ = ["OPS", "GUARD_FNS", "register_op", "register_guard_fn", "guard_fn"]

import math
from collections.abc import Callable
from typing import Any

from ._calculus import GuardFn
from ._guards import MAX_RESULT_BITS
from ._terms import CONST, LEAF, Operator

OPS: dict[str, Operator] = {}
GUARD_FNS: dict[str, GuardFn] = {}


def register_op(op: Operator) -> Operator:
    """Make ``op`` findable by its qualified name (the latest definition wins)."""
    OPS[op.qualname] = op
    return op


def register_guard_fn(name: str, fn: Callable[..., Any]) -> GuardFn:
    """Register a pure function that guards may call by ``name``."""
    if not isinstance(name, str) or not name:
        raise TypeError("a guard function needs a non-empty name")
    g = GuardFn(name, fn)
    GUARD_FNS[name] = g
    return g


def guard_fn(name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``@pm.guard_fn()`` makes a pure predicate callable inside guards."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        register_guard_fn(name or f"{fn.__module__}.{fn.__qualname__}", fn)
        return fn

    return deco


def _prod(values: Any, *, start: Any = 1) -> Any:
    """``math.prod`` that refuses an integer result beyond the guards' limit (a loaded guard
    could multiply many large literals) instead of computing it."""
    values = tuple(values)
    bits = sum(v.bit_length() for v in (start, *values) if isinstance(v, int))
    if bits > MAX_RESULT_BITS:
        raise OverflowError(f"a product of {bits} bits exceeds {MAX_RESULT_BITS}")
    return math.prod(values, start=start)


register_op(LEAF)
register_op(CONST)
for _name, _fn in {
    "len": len,
    "min": min,
    "max": max,
    "abs": abs,
    "prod": _prod,
    "int": int,
    "float": float,
    "tuple": tuple,
    "sum": sum,
    "all": all,
    "any": any,
}.items():
    register_guard_fn(_name, _fn)
