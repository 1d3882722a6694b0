"""Compiled patterns: generated code where it can be made, else the machine behind its
pre-check; and their summaries (what compiling decided, as JSON values).
"""

from __future__ import annotations

__all__ = [
    "CompiledPattern",
    "compile_pattern",
    "match_first",
    "match_all",
    "solutions",
    "summary",
    "from_summary",
]

import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..core.calculus import (
    EConst,
    PApp,
    Pattern,
    PatternDef,
    PCall,
    PGuard,
    PMu,
    children,
    expr_children,
)
from ..core.match import Match
from ..core.terms import CONST, OpClass, Operator
from .analysis import OpSpec, _ByIdentity, _calls_self, _Unsupported, root_set
from .machine import (
    _EARLY_DEPTH,
    _EXACT,
    MatchRun,
    RawSolution,
    _early_shapes,
    _pre_guards,
    _trail_machine,
)
from .precheck import (
    _DEEP_LIMIT,
    _SHAPE_DEPTH,
    _admits,
    _check_of,
    _deep_prefilter,
    _depth,
    _make_test,
    _prefilter,
    _Shape,
    _shape_of_test,
    _test_of,
)


class CompiledPattern:
    """A pattern ready to match: ``first(t)`` and ``solutions(t)`` give raw solutions
    ``(θ, φ, matched terms)``, the first one being the same in both.

    ``backend`` says which engine runs it ("generated" or "machine"); ``source`` holds the
    generated Python for inspection (empty for the machine). ``root_ops``: the operators
    and op classes a match can be rooted at (:func:`~pypm_jax.engine.analysis.root_set`),
    None for any.
    """

    __slots__ = (
        "pdef", "backend", "source", "root_ops", "unique", "_first", "_all", "_test", "_deep",
        "_pre", "_pass", "_fit",
    )  # fmt: skip

    def __init__(self, pdef: PatternDef, *, backend: str | None = None):
        self.pdef = pdef
        self.root_ops = root_set(pdef)
        self.source = ""
        self.backend = "machine"
        self.unique = False  # True: at most one solution, so first() is all there is
        # (the machine's pre-checks: generated code has its own)
        self._test = self._pass = self._deep = self._fit = None
        body = pdef.body
        if backend != "machine" and not (isinstance(body, PMu) and _calls_self(body)):
            # (a pattern that is one recursive definition gains nothing from a wrapper)
            from .codegen import _generate  # (loaded rules run on the machine: not imported)

            try:
                self._first, self._all, self.source, self.unique = _generate(body)
                self.backend = "generated"
            except _Unsupported:
                if backend == "generated":
                    raise
            except RecursionError:  # too deep to compile: the machine runs it
                if backend == "generated":
                    raise _Unsupported("pattern too deep to generate") from None
        if self.backend == "machine":
            shape = _prefilter(body)
            self._test = None if shape is None else _make_test(shape)  # (the pre-check)
            self._pass = None if shape is None else _check_of(self._test)  # (run as this)
            self._deep = _deep_prefilter(body)
            self._fit = _lazy_fit(self)
            self._pre = _UNSET
            self._all = self._machine_all
            self._first = self._machine_first

    def _checks(self, t: Any, run: MatchRun | None) -> int | None:
        """What runs before the machine at ``t``: the structural pre-checks, the guards
        before its first choice (:func:`~pypm_jax.engine.machine._pre_guards`), then the
        run's ``on_start`` (cleared). None: no match at ``t`` (or none the caller keeps);
        else how many of those guards the machine takes as held."""
        test = self._pass  # (``_passes`` of ``_test``)
        if test is not None and not test(t):
            return None
        fit = self._fit  # (``_fits`` of ``_deep``)
        if fit is not None and not fit(t):
            return None
        pre = self._pre
        if pre is _UNSET:
            pre = self._pre = _pre_guards(self.pdef.body)
        held = 0 if pre is None else pre.check(t, _EXACT if run is None else run)
        if held is not None and run is not None and run.on_start is not None:
            start, run.on_start = run.on_start, None
            if not start(t):
                return None
        return held

    def admits(self, op: Any, kids: tuple) -> bool:
        """Can a term whose signature is ``op`` and ``kids`` (each input's operator and arity,
        flat: :func:`~pypm_jax.engine.index.signature`) pass the pre-check in front of the
        machine? False only where no such term has a match."""
        return self._test is None or _admits(self._test, op, kids)

    def _machine_first(self, t: Any, run: MatchRun | None = None) -> RawSolution | None:
        held = self._checks(t, run)
        if held is None:
            return None
        for sol in _trail_machine(self.pdef.body, t, run=run, held=held):
            return sol
        return None

    def _machine_all(self, t: Any, run: MatchRun | None = None) -> Iterator[RawSolution]:
        held = self._checks(t, run)
        if held is None:
            return iter(())
        return _trail_machine(self.pdef.body, t, run=run, held=held)

    def first(self, t: Any, run: MatchRun | None = None) -> RawSolution | None:
        """The machine's first (θ, φ, matched terms) at ``t``, or None."""
        return self._first(t, run)

    def solutions(self, t: Any, run: MatchRun | None = None) -> Iterator[RawSolution]:
        """Every (θ, φ, matched terms) in exploration order, repeats included.

        The matched terms are those the pattern's applications and literals matched (the
        match's structure, used by the rewrite driver to know which nodes a match covers).
        ``run`` (a :class:`MatchRun`) bounds and observes the work; with
        ``run.distinct`` repeats of a tabled call's answers are left out (the solutions'
        parameters, deduplicated, are the same in the same order).
        """
        return self._all(t, run)

    def __repr__(self) -> str:
        return f"<CompiledPattern {self.pdef.name} ({self.backend})>"


_compiled = _ByIdentity(CompiledPattern)
_CONST_NAME = CONST.qualname
_UNSET: Any = object()  # ``CompiledPattern._pre`` not worked out yet (it is at the first match)


def _lazy_fit(cp: CompiledPattern) -> Callable | None:
    """None for no deep pre-check; else a function that makes the function of its shape's
    test (``_check_of``; making the test reads the whole shape) when first called, puts it
    in ``cp._fit`` and runs it: most loaded patterns are never tried in a process. (The
    pre-check's function is made at once: it makes its inputs' where first reached.)"""
    shape = cp._deep
    if shape is None:
        return None

    def first(t: Any) -> bool:
        check = cp._fit = _check_of(_test_of(shape))
        return check(t)

    return first


# ------------------------------------------------------- summaries of compiled patterns
#
# What compiling a pattern for the machine decides (no generated code; its root operators;
# its pre-check) is data: a summary in JSON values, operators by qualified name. Summaries
# shipped with the package (the standard rules', pypm_jax.rules._prebuilt) let a new process
# skip deciding again; they hold no code, and a summary that does not fit its pattern is
# refused, so the pattern is compiled as usual.


def summary(cp: CompiledPattern) -> dict[str, Any] | None:
    """``cp``'s decisions as JSON values, or None for generated code (not summarized)."""
    if cp.backend != "machine":
        return None

    pre = _shape_of_test(cp._test)
    data: dict[str, Any] = {
        "backend": "machine",
        "root_ops": None,
        "shape": None if pre is None else _shared(pre),
    }
    if cp._deep is not None:
        data["deep"] = _shared(cp._deep)
    if type(cp.pdef.body) is not PMu:  # (the machine's early checks: none on a bare μ)
        early = _early_shapes(cp.pdef.body)
        data["early"] = None if early is None else {v: _shared(sh) for v, sh in early.items()}
    if cp.root_ops is not None:
        ops = [r for r in cp.root_ops if isinstance(r, Operator)]
        classes = [r for r in cp.root_ops if isinstance(r, OpClass)]
        specs = [r for r in cp.root_ops if isinstance(r, OpSpec)]
        data["root_ops"] = sorted(op.qualname for op in ops)
        if classes:  # (op classes: also roots of every operator of theirs)
            data["root_classes"] = sorted(c.name for c in classes)
        if specs:  # (and every operator a spec admits)
            data["root_specs"] = sorted(
                (_spec_data(x) for x in specs), key=lambda d: json.dumps(d, sort_keys=True)
            )
    return data


_SPEC_KEYS = ("index", "n_in", "n_out", "names", "op_class", "pure")


def _spec_data(spec: OpSpec) -> dict[str, Any]:
    """An :class:`OpSpec` as JSON values (names sorted, the op class by name)."""
    return {
        "index": spec.index,
        "n_in": spec.n_in,
        "n_out": spec.n_out,
        "names": None if spec.names is None else sorted(spec.names),
        "op_class": None if spec.op_class is None else spec.op_class.name,
        "pure": spec.pure,
    }


def _spec_of(raw: Any, names: frozenset[str], classes: dict[str, OpClass]) -> OpSpec:
    """The :class:`OpSpec` ``raw`` (from :func:`_spec_data`) describes; ValueError where it
    is not one, or names an operator name or op class its pattern's guards do not."""

    def count(x: Any, least: int) -> bool:
        return type(x) is int and x >= least

    if type(raw) is not dict or sorted(raw) != list(_SPEC_KEYS):
        raise ValueError("not a root spec")
    n_in, n_out, index, ns, cls, pure = (
        raw["n_in"], raw["n_out"], raw["index"], raw["names"], raw["op_class"], raw["pure"]
    )  # fmt: skip
    if not (
        (n_in is None or count(n_in, 0))
        and (n_out is None or count(n_out, 1))
        and count(index, 0)
        and type(pure) is bool
        and (ns is None or (type(ns) is list and all(type(n) is str for n in ns)))
        and (cls is None or type(cls) is str)
    ):
        raise ValueError("not a root spec")
    if ns is not None and not set(ns) <= names:
        raise ValueError("a root spec names an operator name the pattern does not")
    return OpSpec(
        n_in,
        n_out,
        index,
        None if ns is None else frozenset(ns),
        None if cls is None else classes[cls],  # (KeyError: a class the pattern does not name)
        pure,
    )


def _shared(sh: list) -> list:
    """A shape as JSON values ``[refs, root]`` with each sub-shape that occurs more than
    once (equal ones: the deep pre-check reaches one definition on many paths) written once,
    in ``refs``: a kid is null, a shape, or the index of a ref; a ref reads only refs before
    it."""
    keys: dict[int, Any] = {}  # id(sub-shape) -> its structure, as a hashable value
    uses: dict[Any, int] = {}

    def key(s: list) -> Any:
        k = keys.get(id(s))
        if k is None:
            k = keys[id(s)] = tuple(
                (
                    op,
                    n,
                    None if kids is None else tuple(None if c is None else key(c) for c in kids),
                )
                for op, n, kids in s
            )
        uses[k] = uses.get(k, 0) + 1
        return k

    key(sh)
    refs: list[Any] = []
    index: dict[Any, int] = {}
    written: set[Any] = set()

    def enc(s: _Shape) -> Any:
        if s is None:
            return None
        k = keys[id(s)]
        i = index.get(k)
        if i is not None:
            return i
        out = [
            [
                None if op is None else op.qualname,
                n,
                None if kids is None else [enc(c) for c in kids],
            ]
            for op, n, kids in s
        ]
        if uses[k] == 1 and k not in written:
            written.add(k)
            return out
        index[k] = len(refs)
        refs.append(out)
        return len(refs) - 1

    root = enc(sh)
    return [refs, root]


def _operators_of(p: Pattern) -> dict[str, Operator]:
    """The operators a pattern names (applications, and operator arguments of definitions
    and references), by qualified name.

    Worked out once per sub-pattern and kept (:data:`_OPS_BELOW`): the standard rules'
    patterns share most of their sub-patterns (7,449 nodes across the 81 patterns, 1,413
    distinct), and each pattern's summary asks."""
    memo = _OPS_BELOW
    hit = memo.get(id(p))
    if hit is not None and hit[0] is p:
        return hit[1]
    if len(memo) >= _OPS_BELOW_LIMIT:
        memo.clear()
    stack: list[tuple[Pattern, bool]] = [(p, False)]
    while stack:
        q, ready = stack.pop()
        hit = memo.get(id(q))
        if hit is not None and hit[0] is q:
            continue
        kids = children(q)
        if not ready:
            stack.append((q, True))
            stack.extend((k, False) for k in kids)
            continue
        own: dict[str, Operator] = {}
        if isinstance(q, PApp):
            own[q.op.qualname] = q.op
        elif isinstance(q, PMu | PCall):
            for a in q.args:
                if isinstance(a, Operator):
                    own[a.qualname] = a
        below = [memo[id(k)][1] for k in kids]
        if not own and len(below) == 1:
            found = below[0]  # shared, never changed
        else:
            found = own
            for b in below:
                found.update(b)
        memo[id(q)] = (q, found)
    return memo[id(p)][1]


# id(sub-pattern) -> (the sub-pattern, its operators): it holds the key object, so its id is
# not reused while its entry lives; cleared when full
_OPS_BELOW: dict[int, tuple[Pattern, dict[str, Operator]]] = {}
_OPS_BELOW_LIMIT = 1 << 16


def _guard_constants(p: Pattern) -> tuple[dict[str, OpClass], frozenset[str]]:
    """The op classes (by name) and the strings a pattern's guards name (constants)."""
    found: dict[str, OpClass] = {}
    strings: set[str] = set()
    seen: set[int] = set()
    stack = [p]
    while stack:
        q = stack.pop()
        if id(q) in seen:
            continue
        seen.add(id(q))
        if isinstance(q, PGuard):
            exprs = [q.guard]
            while exprs:
                e = exprs.pop()
                if isinstance(e, EConst):
                    values = e.value if type(e.value) is tuple else (e.value,)
                    found.update((v.name, v) for v in values if isinstance(v, OpClass))
                    strings.update(v for v in values if type(v) is str)
                exprs.extend(expr_children(e))
        stack.extend(children(q))
    return found, frozenset(strings)


def from_summary(
    pdef: PatternDef, data: Any, ops: Mapping[str, Operator] | None = None
) -> CompiledPattern | None:
    """The compiled form of ``pdef`` that ``data`` (from :func:`summary`) describes, made
    the one ``compile_pattern(pdef)`` returns; None (nothing changed) when ``data`` is not a
    well-formed summary naming only operators, op classes and operator names of ``pdef``.

    ``ops``: the operators the summary may name, by qualified name, where the caller knows
    them to be those of ``pdef`` (the definitions' own table, when the summary was written
    for exactly these definitions); by default worked out from ``pdef``."""
    if ops is None:
        ops = _operators_of(pdef.body)
    const = _CONST_NAME

    def op_of(name: Any) -> Operator | None:
        if name is None:
            return None
        if name == const:
            return CONST
        return ops[name]  # KeyError: an operator the pattern does not name

    def alternatives(raw: Any, depth: int, limit: int) -> Iterator[tuple[Any, Any, Any]]:
        """A shape's alternatives as (operator, arity, the kids as written), checked."""
        if type(raw) is not list or not raw or depth > limit:
            raise ValueError("not a shape")
        for alt in raw:
            if type(alt) is not list or len(alt) != 3:
                raise ValueError("not a shape alternative")
            name, n, kids = alt
            if n is not None and (type(n) is not int or n < 0):
                raise ValueError("not an arity")
            if kids is not None and (type(kids) is not list or n is None or len(kids) != n):
                raise ValueError("kids do not match the arity")
            yield op_of(name), n, kids

    def shape(raw: Any, depth: int, limit: int = _SHAPE_DEPTH, refs: list | None = None) -> _Shape:
        if raw is None:
            return None
        if type(raw) is int and refs is not None:  # a shared shape (see _shared)
            if not 0 <= raw < len(refs) or depth + refs[raw][1] > limit:
                raise ValueError("not a shape")
            return refs[raw][0]
        return [
            (op, n, None if kids is None else tuple(shape(k, depth + 1, limit, refs) for k in kids))
            for op, n, kids in alternatives(raw, depth, limit)
        ]

    def shared(raw: Any, limit: int) -> _Shape:
        if raw is None:
            return None
        if type(raw) is not list or len(raw) != 2 or type(raw[0]) is not list:
            raise ValueError("not a shared shape")
        refs: list[tuple[list, int]] = []
        depths: dict[int, int] = {}
        for r in raw[0]:  # each ref read at depth 0 (its own depth is what it adds)
            s = shape(r, 0, limit, refs)
            if s is None:
                raise ValueError("not a shape")
            refs.append((s, _depth(s, depths)))
        return shape(raw[1], 0, limit, refs)

    try:
        if type(data) is not dict or data.get("backend") != "machine":
            return None
        roots = data.get("root_ops")
        if roots is not None and type(roots) is not list:
            return None
        root_ops: frozenset[Operator | OpClass | OpSpec | None] | None = None
        if roots is not None:
            classes = data.get("root_classes", [])
            specs = data.get("root_specs", [])
            if type(classes) is not list or type(specs) is not list:
                return None
            named, strings = _guard_constants(pdef.body) if classes or specs else ({}, frozenset())
            root_ops = frozenset(
                [
                    *(op_of(n) for n in roots),
                    *(named[c] for c in classes),
                    *(_spec_of(x, strings, named) for x in specs),
                ]
            )
        elif "root_classes" in data or "root_specs" in data:
            return None  # (classes and specs narrow a set of roots; "any root" has none)
        shaped = shared(data.get("shape"), _SHAPE_DEPTH)  # (read as its test: one per ref)
        pre = None if shaped is None else _make_test(shaped)
        deep = shared(data.get("deep"), _DEEP_LIMIT)
        early: Any = _UNSET  # (no "early": worked out at the first match, as when compiled)
        if "early" in data:
            raw = data["early"]
            if type(pdef.body) is PMu or (raw is not None and type(raw) is not dict):
                return None
            early = None
            if raw:
                early = {}
                for var, sh in raw.items():
                    if type(var) is not str or (parsed := shared(sh, _EARLY_DEPTH)) is None:
                        return None
                    early[var] = parsed
    except (KeyError, ValueError, TypeError):
        return None
    if root_ops is not None and None in root_ops:
        return None
    cp = CompiledPattern.__new__(CompiledPattern)
    cp.pdef = pdef
    cp.root_ops = root_ops  # type: ignore[assignment]
    cp.source = ""
    cp.backend = "machine"
    cp.unique = False
    cp._test = pre
    cp._pass = None if pre is None else _check_of(pre)
    cp._deep = deep
    cp._fit = _lazy_fit(cp)
    cp._pre = _UNSET
    cp._all = cp._machine_all
    cp._first = cp._machine_first
    if early is not _UNSET:
        _early_shapes.put(pdef.body, early)
    return _compiled.put(pdef, cp)


def compile_pattern(pdef: PatternDef) -> CompiledPattern:
    """The compiled form of ``pdef``, built once per definition object.

    Cached by identity, not by value: dataclass equality calls ``EConst(1)`` and
    ``EConst(1.0)`` equal, yet a guard such as ``str(c) == "1"`` tells them apart, so two
    equal-looking definitions may not share generated code.
    """
    return _compiled(pdef)


# ------------------------------------------------------------------------- the public API


def match_first(pdef: PatternDef, t: Any, *, budget: int | None = None) -> Match | None:
    """The reference machine's first solution for ``pdef`` at ``t``, or None.

    Its parameters are the reference's; θ leaves out the local variables bound inside
    tabled recursive calls. ``budget``: raise ``MatchBudgetError`` past that many steps."""
    sol = compile_pattern(pdef).first(t, MatchRun(budget, distinct=True))
    return None if sol is None else Match(pdef, t, sol[0], sol[1], owned=True)


def match_all(pdef: PatternDef, t: Any, *, budget: int | None = None) -> Iterator[Match]:
    """Every solution in the machine's exploration order, dropping repeated parameters."""
    seen: set[tuple[tuple[str, int], ...]] = set()
    for theta, phi, _ in compile_pattern(pdef).solutions(t, MatchRun(budget, distinct=True)):
        m = Match(pdef, t, theta, phi, owned=True)
        key = m.key()
        if key not in seen:
            seen.add(key)
            yield m


def solutions(p: Pattern, t: Any) -> Iterator[tuple[dict[str, Any], dict[str, Operator]]]:
    """Every (θ, φ) of a bare pattern in exploration order, as ``_machine.solutions``."""
    cp = compile_pattern(PatternDef("<pattern>", (), p))
    for theta, phi, _ in cp.solutions(t):
        yield theta, phi
