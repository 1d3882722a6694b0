"""Many patterns indexed by the operators their root can have."""

from __future__ import annotations

__all__ = ["ByInputs", "Matcher", "signature"]

from collections.abc import Iterator, Sequence
from typing import Any

from ..core.calculus import PatternDef
from ..core.match import Match
from ..core.terms import OpClass, Operator
from .analysis import OpSpec, Roots, _meet, root_set
from .compiled import CompiledPattern, compile_pattern, match_all

# ------------------------------------------------------------------------------ the index

Candidate = tuple[int, PatternDef, CompiledPattern | None]
"""(index, definition, compiled pattern: None in an index built with ``compiled=False``)."""


def _order(e: Candidate) -> int:
    return e[0]


class _Index(dict):
    """The index of a pattern set: ``op -> candidates``, each operator's worked out the
    first time it is looked up (so an operator made after the index -- the lifter makes
    them as it meets primitives -- is resolved like any other): the patterns rooted at it,
    at its op class, or at an :class:`~pypm_jax.engine.analysis.OpSpec` that admits it,
    with the wildcards, in pattern order. ``get(op, default)`` and ``op in`` read as on a
    plain index: ``default`` / False where the candidates are the wildcards alone;
    ``index[op]`` is the candidates themselves.

    An operator's class, name, arity and output count are read when the index first meets
    it. A variadic operator's nodes are offered the patterns of every arity (the count of
    a node's inputs is not part of the key), which the match refuses or not."""

    __slots__ = ("wild", "named", "by_class", "specs")

    def __init__(
        self,
        wild: tuple[Candidate, ...],
        named: dict[Operator, list[Candidate]],
        by_class: dict[OpClass, list[Candidate]],
        specs: list[tuple[OpSpec, Candidate]],
    ):
        super().__init__()
        self.wild = wild
        self.named = named
        self.by_class = by_class
        self.specs = specs

    def __missing__(self, op: Operator) -> tuple[Candidate, ...]:
        found = {e[0]: e for e in self.named.get(op, ())}
        if op.op_class is not None:
            found.update((e[0], e) for e in self.by_class.get(op.op_class, ()))
        found.update((e[0], e) for spec, e in self.specs if spec.admits(op))
        if found:
            found.update((e[0], e) for e in self.wild)
            cands = tuple(sorted(found.values(), key=_order))
        else:
            cands = self.wild
        self[op] = cands
        return cands

    def get(self, op: Operator, default: Any = None) -> Any:  # type: ignore[override]
        cands = self[op]
        return default if cands is self.wild else cands

    def __contains__(self, op: object) -> bool:
        return self[op] is not self.wild  # type: ignore[index]


class ByInputs(dict):
    """The index one level further: a term's *signature* -> the candidates (from
    ``table``, an operator's) whose pre-check admits it, read two levels deep
    (:meth:`~pypm_jax.engine.compiled.CompiledPattern.admits`). The signature is a tuple:
    the term's operator, then each input's operator and arity (:func:`signature`). A
    candidate left out is one whose pre-check refuses every term with that signature; the
    others keep their order. Worked out once per signature and index: a graph has few."""

    __slots__ = ("table",)

    def __init__(self, table: dict[Operator, tuple[Candidate, ...]]):
        super().__init__()
        self.table = table

    def __missing__(self, sig: tuple) -> tuple[Candidate, ...]:
        op, kids = sig[0], sig[1:]
        found = self[sig] = tuple(
            e for e in self.table[op] if e[2] is None or e[2].admits(op, kids)
        )
        return found


def signature(value: Any) -> tuple:
    """``value``'s key in :class:`ByInputs`: its operator, then each input's operator and
    arity."""
    ins = value.inputs
    if len(ins) == 2:  # (the common cases spelt out: no generator, one tuple)
        a, b = ins
        return (value.op, a.op, len(a.inputs), b.op, len(b.inputs))
    if len(ins) == 1:
        a = ins[0]
        return (value.op, a.op, len(a.inputs))
    return (value.op, *[x for i in ins for x in (i.op, len(i.inputs))])


class Matcher:
    """Many patterns, indexed by the operator their root can have.

    ``candidates(op)`` lists, in pattern order, the patterns that can match a value whose
    operator is ``op``: those rooted at ``op``, at ``op``'s op class, or at any operator
    of its arity, output count and name (an operator variable, maybe with a guard on its
    class or name: :func:`~pypm_jax.engine.analysis.root_set`), and those whose root can
    be anything (a variable, or an alternate with such a branch). Finding that list is one
    dict lookup, so values no pattern can match cost almost nothing.

    ``compiled=False`` builds the index alone (from :func:`root_set`), for a caller that
    matches with the reference machine; its candidates carry no compiled pattern, and its
    ``match_first`` and ``scan`` are not for use. ``narrow``: per pattern, roots (or None)
    that its matches' roots must also have for the caller to use them (a rule's branches'
    guards, :func:`~pypm_jax.engine.analysis.rule_roots`).
    """

    __slots__ = ("patterns", "compiled", "_table", "_wild")

    def __init__(
        self,
        patterns: Sequence[PatternDef],
        *,
        compiled: bool = True,
        narrow: Sequence[Roots | None] | None = None,
    ):
        self.patterns = tuple(patterns)
        n = len(self.patterns)
        self.compiled: tuple[CompiledPattern | None, ...] = (
            tuple(compile_pattern(p) for p in self.patterns) if compiled else (None,) * n
        )
        roots = [
            root_set(p) if c is None else c.root_ops
            for p, c in zip(self.patterns, self.compiled, strict=True)
        ]
        if narrow is not None:
            roots = [_meet(r, m) for r, m in zip(roots, narrow, strict=True)]
        entries = [
            (i, p, c) for i, (p, c) in enumerate(zip(self.patterns, self.compiled, strict=True))
        ]
        self._wild: tuple[Candidate, ...] = tuple(
            e for e, r in zip(entries, roots, strict=True) if r is None
        )
        named: dict[Operator, list[Candidate]] = {}
        by_class: dict[OpClass, list[Candidate]] = {}
        specs: list[tuple[OpSpec, Candidate]] = []
        for e, r in zip(entries, roots, strict=True):
            for x in r or ():
                if isinstance(x, OpSpec):
                    specs.append((x, e))
                else:
                    (by_class if isinstance(x, OpClass) else named).setdefault(x, []).append(e)  # type: ignore[arg-type]
        self._table = _Index(self._wild, named, by_class, specs)

    def candidates(self, op: Operator) -> tuple[Candidate, ...]:
        """Patterns (index, definition, compiled) that can match a value of operator ``op``."""
        return self._table[op]

    @property
    def table(self) -> dict[Operator, tuple[Candidate, ...]]:
        """The index itself: operator -> candidates; ``table[op]`` and
        ``table.get(op, wildcards)`` are ``candidates(op)``, and ``op in table`` says
        whether it holds more than the wildcards."""
        return self._table

    @property
    def wildcards(self) -> tuple[Candidate, ...]:
        return self._wild

    def match_first(self, value: Any) -> tuple[int, Match] | None:
        """The first pattern (in order) matching ``value``, with its first match."""
        for i, pdef, cp in self._table[value.op]:
            sol = cp.first(value)
            if sol is not None:
                return i, Match(pdef, value, sol[0], sol[1], owned=True)
        return None

    def match_all(self, value: Any) -> Iterator[tuple[int, Match]]:
        """Every pattern's every match at ``value``: patterns in order, matches in order."""
        for i, pdef, _ in self._table[value.op]:
            for m in match_all(pdef, value):
                yield i, m

    def scan(self, values: Any) -> list[tuple[Any, int, Match]]:
        """The first match of each value (a Graph's values or any iterable of terms)."""
        nodes = getattr(values, "nodes", None)
        if callable(nodes):
            values = [v for n in nodes() for v in n.outputs]
        table = self._table
        found = []
        for v in values:
            cands = table[v.op]
            if not cands:
                continue
            for i, pdef, cp in cands:
                sol = cp._first(v)
                if sol is not None:
                    found.append((v, i, Match(pdef, v, sol[0], sol[1], owned=True)))
                    break
        return found
