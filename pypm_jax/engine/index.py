"""Many patterns indexed by the operators their root can have."""

from __future__ import annotations

__all__ = ["Matcher"]

from collections.abc import Iterator, Sequence
from typing import Any

from ..core.calculus import PatternDef
from ..core.match import Match
from ..core.terms import OpClass, Operator
from .analysis import root_set
from .compiled import CompiledPattern, compile_pattern, match_all

# ------------------------------------------------------------------------------ the index

Candidate = tuple[int, PatternDef, CompiledPattern | None]
"""(index, definition, compiled pattern: None in an index built with ``compiled=False``)."""


def _order(e: Candidate) -> int:
    return e[0]


class _ByClass(dict):
    """The index of a pattern set with roots given by op class: ``op -> candidates`` for
    the operators the patterns name, and for every other operator the first time it is
    looked up, from its class (so an operator made after the index, in a class a pattern's
    root has, is a candidate too). ``get(op, default)`` and ``op in`` read as on a plain
    index: ``default`` / False where the candidates are the wildcards alone.

    An operator's class is read when the index first meets the operator."""

    __slots__ = ("wild", "by_class")

    def __init__(self, table: dict, wild: tuple, by_class: dict[OpClass, list[Candidate]]):
        super().__init__(table)
        self.wild = wild
        self.by_class = by_class

    def __missing__(self, op: Operator) -> tuple[Candidate, ...]:
        more = self.by_class.get(op.op_class) if op.op_class is not None else None
        cands = self.wild if not more else tuple(sorted(more + list(self.wild), key=_order))
        self[op] = cands
        return cands

    def get(self, op: Operator, default: Any = None) -> Any:  # type: ignore[override]
        cands = self[op]
        return default if cands is self.wild else cands

    def __contains__(self, op: object) -> bool:
        return self[op] is not self.wild  # type: ignore[index]


class Matcher:
    """Many patterns, indexed by the operator their root can have.

    ``candidates(op)`` lists, in pattern order, the patterns that can match a value whose
    operator is ``op``: those rooted at ``op`` or at ``op``'s op class (an operator
    variable whose guard names the class, :func:`~pypm_jax.engine.analysis.root_set`), and
    those whose root can be anything (a variable, an unguarded operator variable, or an
    alternate with such a branch). Finding that list is one dict lookup, so values no
    pattern can match cost almost nothing.

    ``compiled=False`` builds the index alone (from :func:`root_set`), for a caller that
    matches with the reference machine; its candidates carry no compiled pattern, and its
    ``match_first`` and ``scan`` are not for use.
    """

    __slots__ = ("patterns", "compiled", "_table", "_wild")

    def __init__(self, patterns: Sequence[PatternDef], *, compiled: bool = True):
        self.patterns = tuple(patterns)
        n = len(self.patterns)
        self.compiled: tuple[CompiledPattern | None, ...] = (
            tuple(compile_pattern(p) for p in self.patterns) if compiled else (None,) * n
        )
        roots = [
            root_set(p) if c is None else c.root_ops
            for p, c in zip(self.patterns, self.compiled, strict=True)
        ]
        entries = [
            (i, p, c) for i, (p, c) in enumerate(zip(self.patterns, self.compiled, strict=True))
        ]
        self._wild: tuple[Candidate, ...] = tuple(
            e for e, r in zip(entries, roots, strict=True) if r is None
        )
        table: dict[Operator, list[Candidate]] = {}
        by_class: dict[OpClass, list[Candidate]] = {}
        for e, r in zip(entries, roots, strict=True):
            for x in r or ():
                (by_class if isinstance(x, OpClass) else table).setdefault(x, []).append(e)  # type: ignore[arg-type]
        for op, es in table.items():  # an operator named and in a class named: both
            more = by_class.get(op.op_class) if op.op_class is not None else None
            if more:
                es.extend(e for e in more if e not in es)
        index = {op: tuple(sorted(es + list(self._wild), key=_order)) for op, es in table.items()}
        self._table: dict[Operator, tuple[Candidate, ...]] = (
            _ByClass(index, self._wild, by_class) if by_class else index
        )

    def candidates(self, op: Operator) -> tuple[Candidate, ...]:
        """Patterns (index, definition, compiled) that can match a value of operator ``op``."""
        return self._table.get(op, self._wild)

    @property
    def table(self) -> dict[Operator, tuple[Candidate, ...]]:
        """The index itself: operator -> candidates; ``table.get(op, wildcards)`` is
        ``candidates(op)``, and ``op in table`` says whether it holds more than the
        wildcards."""
        return self._table

    @property
    def wildcards(self) -> tuple[Candidate, ...]:
        return self._wild

    def match_first(self, value: Any) -> tuple[int, Match] | None:
        """The first pattern (in order) matching ``value``, with its first match."""
        for i, pdef, cp in self._table.get(value.op, self._wild):
            sol = cp.first(value)
            if sol is not None:
                return i, Match(pdef, value, sol[0], sol[1], owned=True)
        return None

    def match_all(self, value: Any) -> Iterator[tuple[int, Match]]:
        """Every pattern's every match at ``value``: patterns in order, matches in order."""
        for i, pdef, _ in self._table.get(value.op, self._wild):
            for m in match_all(pdef, value):
                yield i, m

    def scan(self, values: Any) -> list[tuple[Any, int, Match]]:
        """The first match of each value (a Graph's values or any iterable of terms)."""
        nodes = getattr(values, "nodes", None)
        if callable(nodes):
            values = [v for n in nodes() for v in n.outputs]
        get = self._table.get
        wild = self._wild
        found = []
        for v in values:
            cands = get(v.op, wild)
            if not cands:
                continue
            for i, pdef, cp in cands:
                sol = cp._first(v)
                if sol is not None:
                    found.append((v, i, Match(pdef, v, sol[0], sol[1], owned=True)))
                    break
        return found
