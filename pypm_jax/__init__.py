"""pypm-jax: the PyPM pattern language (CGO'25), retargeted to JAX.

The public API; everything else lives in private modules. ``docs/`` describes the semantics,
the portable format, the JAX bridge and the standard rules; ``dir(pypm_jax)`` lists ``__all__``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .core.calculus import RuleDef
from .core.dtypes import DTYPES, DType, as_dtype
from .core.errors import (
    FormatError,
    GuardFunctionWarning,
    MatchBudgetError,
    PatternDefinitionError,
    PyPMError,
    RewriteLimitError,
    RuleError,
    SourceLoc,
)
from .core.match import Match
from .core.terms import OpClass, Operator, Term, const, leaf
from .lang.frontend import Op, PatternFunction, Rule, op, opclass, pattern, rule, var
from .lang.frontend import as_pattern_def as _as_pattern_def
from .lang.frontend import as_rule_def as _as_rule_def
from .lang.registry import guard_fn
from .semantics.guards import Refusal

__all__ = [
    # language
    "op",
    "pattern",
    "rule",
    "var",
    "Op",
    "opclass",
    "guard_fn",
    "Refusal",
    "const",
    "leaf",
    "Operator",
    "OpClass",
    "Term",
    "PatternFunction",
    "Rule",
    "Match",
    "DType",
    # matching and rewriting
    "match",
    "match_all",
    "Graph",
    "rewrite",
    "explain",
    # portable format
    "serialize",
    "deserialize",
    # errors
    "PyPMError",
    "PatternDefinitionError",
    "FormatError",
    "RewriteLimitError",
    "RuleError",
    "GuardFunctionWarning",
    "MatchBudgetError",
    "SourceLoc",
    # dtypes
    "f32",
    "f16",
    "bf16",
    "f64",
    "i8",
    "i16",
    "i32",
    "i64",
    "u8",
    "u32",
    "bool_",
    "as_dtype",
]

f32, f16, bf16, f64 = DTYPES["f32"], DTYPES["f16"], DTYPES["bf16"], DTYPES["f64"]
i8, i16, i32, i64 = DTYPES["i8"], DTYPES["i16"], DTYPES["i32"], DTYPES["i64"]
u8, u32, bool_ = DTYPES["u8"], DTYPES["u32"], DTYPES["bool"]


def match(
    pattern: Any, term: Any, *, engine: str | None = None, budget: int | None = None
) -> Match | None:
    """The first match of ``pattern`` at ``term`` in the paper's algorithmic order, or None.

    ``engine`` is ``"fast"`` (default) or ``"reference"`` (the paper's small-step machine).
    ``budget``: raise :class:`MatchBudgetError` past that many machine steps (default None:
    unbounded).
    """
    from .engine.select import match_first

    return match_first(_as_pattern_def(pattern), term, engine=engine, budget=budget)


def match_all(
    pattern: Any, term: Any, *, engine: str | None = None, budget: int | None = None
) -> Iterator[Match]:
    """Every distinct match of ``pattern`` at ``term``, lazily, in exploration order
    (``budget``: as for :func:`match`, for the whole enumeration)."""
    from .engine.select import match_all as _match_all

    return _match_all(_as_pattern_def(pattern), term, engine=engine, budget=budget)


def _core(item: Any) -> Any:
    if isinstance(item, PatternFunction):
        return item.definition
    if isinstance(item, Rule):
        return item.definition
    return item


def serialize(items: Iterable[Any]) -> bytes:
    """Portable, versioned bytes for operators, patterns and rules (no code inside)."""
    from .format import serialize as _serialize

    return _serialize([_core(i) for i in items])


def deserialize(blob: bytes, *, ops: Any = None) -> list[Any]:
    """Load what :func:`serialize` wrote; never executes code. Raises :class:`FormatError`."""
    from .format import deserialize as _deserialize

    return _deserialize(blob, ops=ops)


def rewrite(graph: Any, rules: Sequence[Any], **options: Any) -> Any:
    """Rewrite ``graph`` greedily and destructively to a fixpoint with ``rules`` (in order)."""
    from .engine.rewrite import rewrite as _rewrite

    return _rewrite(graph, [_as_rule_def(r) for r in rules], **options)


def explain(pattern: Any, target: Any, **options: Any) -> Any:
    """Why ``pattern`` does (not) match ``target`` (a term, a graph value or a whole graph).

    ``pattern`` may also be a rule (``@pm.rule``): then the explanation says why the rule
    does (not) fire, naming the rule's ``assert`` that failed where its pattern matched.
    """
    from .engine.explain import explain as _explain

    if isinstance(pattern, Rule | RuleDef):
        return _explain(_as_rule_def(pattern), target, **options)
    return _explain(_as_pattern_def(pattern), target, **options)


_REWRITE_TYPES = ("RewriteResult", "RewriteReport", "RewriteRecord")  # what rewrite returns
__all__ += list(_REWRITE_TYPES)


def __getattr__(name: str) -> Any:
    if name == "Graph":
        from .core.graph import Graph

        return Graph
    if name in _REWRITE_TYPES:
        from .engine import rewrite as _rewrite

        return getattr(_rewrite, name)
    raise AttributeError(f"module 'pypm_jax' has no attribute {name!r}")


# --- JAX bridge exports (pypm_jax.jax), added by the JAX-bridge work; imported on first use
# so that importing the core never imports JAX.
_JAX_BRIDGE = ("optimize", "optimize_module", "nnx_optimize", "register_impl")
__all__ += list(_JAX_BRIDGE)
_core_getattr = __getattr__


def __getattr__(name: str) -> Any:  # noqa: F811
    if name in _JAX_BRIDGE:
        from . import jax as _bridge

        return getattr(_bridge, name)
    return _core_getattr(name)


def __dir__() -> list[str]:
    """The public names only (not the typing helpers this module imports)."""
    return sorted(__all__)
