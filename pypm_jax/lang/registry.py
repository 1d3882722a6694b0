"""Name tables filled at import/definition time, read when loading serialized rules.

Operators register under their qualified name (``namespace.name``) when defined; guard
functions (pure predicates callable from guards) register under their name. Loading a blob
resolves names here and never executes code from the blob.
"""

from __future__ import annotations

__all__ = [
    "OPS",
    "GUARD_FNS",
    "register_op",
    "register_guard_fn",
    "guard_fn",
    "collect_guard_failures",
]

import contextlib
import functools
import math
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from ..core.calculus import GuardFn
from ..core.errors import GuardFunctionWarning
from ..core.terms import CONST, LEAF, Operator
from ..semantics.guards import MAX_RESULT_BITS

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
        origin = f"{fn.__module__}.{fn.__qualname__}"
        full = name or origin
        taken = GUARD_FNS.get(full)
        if taken is not None and getattr(taken.fn, "origin", origin) != origin:
            # two functions under one name: guards would silently call the later one
            raise ValueError(
                f"guard function name {full!r} is taken by {taken.fn.origin}; "
                f"give {origin} another name"
            )
        register_guard_fn(full, _reporting(full, fn))
        return fn

    return deco


# Where the guard functions that raise on this thread are reported: a list while a rewrite
# collects them (to name the rules in one warning), else None (warn at once).
_failures = threading.local()
_MAX_FAILURES = 64


def _reporting(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, reporting an exception it raises before raising it on: the guard calling it
    does not hold (undefined, as the paper says), but not without a word."""

    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            sink = getattr(_failures, "sink", None)
            if sink is None:
                warnings.warn(
                    f"guard function {name} raised {type(exc).__name__}: {exc}; the guard "
                    "calling it does not hold",
                    GuardFunctionWarning,
                    stacklevel=2,
                )
            elif len(sink) < _MAX_FAILURES:
                sink.append((name, exc))
            raise

    functools.update_wrapper(call, fn)  # (``__wrapped__`` is ``fn``: the frontend's look-up)
    call.origin = f"{fn.__module__}.{fn.__qualname__}"  # type: ignore[attr-defined]
    return call


@contextlib.contextmanager
def collect_guard_failures() -> Iterator[list[tuple[str, Exception]]]:
    """Collect (guard function name, exception) for each guard function raising inside."""
    previous = getattr(_failures, "sink", None)
    sink: list[tuple[str, Exception]] = []
    _failures.sink = sink
    try:
        yield sink
    finally:
        _failures.sink = previous


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
