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

from collections.abc import Mapping
from typing import Any

from ..core.calculus import RuleDef
from ..core.terms import Operator
from .fast import CompiledPattern, from_summary, summary
from .rewrite import _reach_of, guarded_pattern

# The driver bounds a pattern's reach at this many pattern nodes (``rewrite._reach``): a
# summary's reach is at most this, or null (unbounded).
_MAX_REACH = 500


def rule_summary(rule: RuleDef) -> dict[str, Any] | None:
    """What compiling ``rule``'s pattern for the matching machine decides -- its root
    operators and structural pre-check -- as JSON values (operators by qualified name), and
    how deep below its root a match can look (the driver's ``reach``). The pattern is the
    one the rewrite driver matches (the rule's guard folded in), compiled afresh for the
    machine, also where it would otherwise become generated code: a summary holds no code,
    and the machine finds the same matches in the same order."""
    data = summary(CompiledPattern(guarded_pattern(rule), backend="machine"))
    return None if data is None else {**data, "reach": _reach_of(rule.pattern)}


def load_rule_summary(rule: RuleDef, data: Any, ops: Mapping[str, Operator] | None = None) -> bool:
    """Make what ``data`` (from :func:`rule_summary`) describes the compiled form of
    ``rule``'s pattern, and its reach the driver's, so the driver does not compile them
    again; False, with nothing changed, when ``data`` is not a well-formed summary naming
    only the pattern's operators. ``ops``: as :func:`~pypm_jax.engine.compiled.from_summary`
    takes it (the operators of the definitions ``rule`` was read with)."""
    reach = data.get("reach", False) if type(data) is dict else False
    if reach is not None and (type(reach) is not int or not 0 <= reach <= _MAX_REACH):
        return False
    if from_summary(guarded_pattern(rule), data, ops) is None:
        return False
    _reach_of.put(rule.pattern, reach)
    return True
