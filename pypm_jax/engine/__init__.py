"""Matching and rewriting: the fast engine, the switch between it and the paper's machine,
the rewrite driver, explanations and reports.

Internal layers: the public API is ``pypm_jax`` (``import pypm_jax as pm``). The layers
above use the submodules (``engine.rewrite``'s driver, ``engine.report``'s describers); the
names here are what a rule library's shipped cache (:mod:`pypm_jax.rules._prebuilt`) needs
of the engine, and all it may use: the compile summary of a rule's pattern, computed when
the cache is generated and given back when it is loaded.
"""

from __future__ import annotations

__all__ = ["rule_summary", "load_rule_summary"]

from typing import Any

from ..core.calculus import RuleDef
from .fast import CompiledPattern, from_summary, summary
from .rewrite import guarded_pattern


def rule_summary(rule: RuleDef) -> dict[str, Any] | None:
    """What compiling ``rule``'s pattern for the matching machine decides -- its root
    operators and structural pre-check -- as JSON values (operators by qualified name). The
    pattern is the one the rewrite driver matches (the rule's guard folded in), compiled
    afresh for the machine, also where it would otherwise become generated code: a summary
    holds no code, and the machine finds the same matches in the same order."""
    return summary(CompiledPattern(guarded_pattern(rule), backend="machine"))


def load_rule_summary(rule: RuleDef, data: Any) -> bool:
    """Make what ``data`` (from :func:`rule_summary`) describes the compiled form of
    ``rule``'s pattern, so the driver does not compile it again; False, with nothing
    changed, when ``data`` is not a well-formed summary naming only the pattern's operators."""
    return from_summary(guarded_pattern(rule), data) is not None
