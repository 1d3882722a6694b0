"""pypm-jax: the PyPM pattern language (CGO'25), retargeted to JAX.

The public API; everything else lives in private modules. ``docs/`` describes the semantics,
the portable format, the JAX bridge and the standard rules; ``dir(pypm_jax)`` lists ``__all__``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
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


# --- the JAX bridge (pypm_jax.jax), imported on first use so that importing the package never
# imports JAX. The bridge names no rule library: these hand it the standard rules as the
# default (the layers import one way; README, "Layout").
__all__ += ["optimize", "optimize_module", "nnx_optimize", "register_impl"]


def _standard_rules() -> list[Any]:
    """The standard rule library's default rules (``pypm_jax.rules.default_rules()``): what
    :func:`optimize` rewrites with when given no rules."""
    from .rules import default_rules

    return list(default_rules())


def optimize(
    fn: Callable[..., Any] | None = None,
    *,
    rules: Sequence[Any] | None = None,
    verify: bool = False,
    **options: Any,
) -> Any:
    """Optimize ``fn`` with pattern rewrites, jit-like: ``@pm.optimize`` or ``pm.optimize(fn)``.

    ``rules`` default to ``pypm_jax.rules.default_rules()`` (attention and GEMM-epilogue
    kernels), imported when the first signature is traced. ``fast.report(*args)`` lists the
    rewrites for a call signature. ``verify=True`` checks the rewritten program against the
    original on the first concrete inputs of each signature. ``options`` are ``jax.jit``'s
    (``static_argnums``, ``donate_argnums``, ``in_shardings``, ...), with jit's meaning, and
    the rewrite driver's (``engine``, ``max_iterations``, ``match_budget``); any other is a
    TypeError here. The bridge's :func:`pypm_jax.jax.optimize.optimize` has the details.
    """
    from .jax.optimize import optimize as _optimize

    return _optimize(fn, rules=rules, default_rules=_standard_rules, verify=verify, **options)


def optimize_module(
    module: Any,
    *,
    method: str = "__call__",
    mutable: Any = False,
    rules: Sequence[Any] | None = None,
    verify: bool = False,
    **options: Any,
) -> Any:
    """``fast(variables, *args, **kwargs)`` = ``module.apply(variables, *args, ...)`` of a
    Flax linen module, optimized as by :func:`optimize` (the standard rules by default);
    :func:`pypm_jax.jax.flax.optimize_module` has the details."""
    from .jax.flax import optimize_module as _optimize_module

    return _optimize_module(
        module,
        method=method,
        mutable=mutable,
        rules=rules,
        default_rules=_standard_rules,
        verify=verify,
        **options,
    )


def nnx_optimize(
    module: Any,
    *,
    method: str = "__call__",
    rules: Sequence[Any] | None = None,
    verify: bool = False,
    **options: Any,
) -> Any:
    """An nnx module's ``method`` (default ``__call__``) optimized as by :func:`optimize` (the
    standard rules by default): ``fast = pm.nnx_optimize(m); fast(x)``;
    :func:`pypm_jax.jax.flax.nnx_optimize` has the details."""
    from .jax.flax import nnx_optimize as _nnx_optimize

    return _nnx_optimize(
        module, method=method, rules=rules, default_rules=_standard_rules, verify=verify, **options
    )


def __getattr__(name: str) -> Any:
    if name == "Graph":
        from .core.graph import Graph

        return Graph
    if name in _REWRITE_TYPES:
        from .engine import rewrite as _rewrite

        return getattr(_rewrite, name)
    if name == "register_impl":  # the JAX-free vocabulary's (pypm_jax.vocab)
        from .vocab import register_impl

        return register_impl
    raise AttributeError(f"module 'pypm_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names only (not the typing helpers this module imports)."""
    return sorted(__all__)
