"""The fast engine against the paper's machine on random patterns and random DAGs.

Both back ends of the fast engine (generated code, and the iterative machine used for
recursive patterns) must give the reference machine's exact results: the same first
solution, the same solutions in the same order, the same θ and φ including the fresh names
of unfolded existentials. Targets are hash-consed terms and graph values.
"""

from __future__ import annotations

import functools
import itertools
from contextlib import nullcontext
from typing import NamedTuple
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    ECmp,
    EConst,
    ENot,
    EOpAttr,
    EOr,
    Expr,
    PAlt,
    PApp,
    Param,
    Pattern,
    PatternDef,
    PCall,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    RApp,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax.core.errors import PyPMError
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import OpClass, Operator
from pypm_jax.engine import codegen as _codegen
from pypm_jax.engine import fast as _fast
from pypm_jax.engine import rewrite as _rewrite
from pypm_jax.engine.analysis import _draws_names, admits, root_set, rule_roots
from pypm_jax.engine.fast import CompiledPattern, Matcher, compile_guard
from pypm_jax.engine.index import _Index
from pypm_jax.engine.rewrite import rewrite
from pypm_jax.semantics import machine as _machine
from pypm_jax.semantics.guards import guard_holds
from pypm_jax.semantics.subst import FreshNames
from pypm_testing.draws import BOOLS, ints, sampled
from pypm_testing.engine import (
    F1,
    G2,
    LEAVES,
    OPS,
    PARAMS,
    SPLIT,
    A,
    B,
    branchy_defs,
    dags,
    guards,
    pattern_defs,
    patterns,
    same_type,
    solution_key,
)
from pypm_testing.strategies import pattern_and_term

MAX_SOLUTIONS = 50
FUSED = Operator("fused", 1, namespace="engine_tests", infer=same_type)
TARGETS = [*LEAVES, F1(A), SPLIT(B)[1]]


def reference_solutions(pdef, t):
    return [
        solution_key(theta, phi)
        for theta, phi in itertools.islice(_machine.solutions(pdef.body, t), MAX_SOLUTIONS)
    ]


def compiled_solutions(cp: CompiledPattern, t):
    return [
        solution_key(theta, phi)
        for theta, phi, _ in itertools.islice(cp.solutions(t), MAX_SOLUTIONS)
    ]


def check_same(pdef, t):
    expected = reference_solutions(pdef, t)
    cp = _fast.compile_pattern(pdef)  # (the one the public API below uses: compiled once)
    assert compiled_solutions(cp, t) == expected
    first = cp.first(t)
    assert (None if first is None else solution_key(*first[:2])) == (expected[:1] or [None])[0]
    machine = CompiledPattern(pdef, backend="machine")
    assert compiled_solutions(machine, t) == expected
    # the public API: deduplicated by parameters, wrapped in Match
    ref = [m.key() for m in itertools.islice(_machine.match_all(pdef, t), MAX_SOLUTIONS)]
    got = [m.key() for m in itertools.islice(_fast.match_all(pdef, t), MAX_SOLUTIONS)]
    assert got == ref
    return expected


@given(pattern_defs(), dags(), st.data())
def test_terms_same_solutions_as_reference(pdef, pool, data):
    """Also, on the same examples (drawn once for both; each property sees CI's 2,000): a
    pattern that draws no names says so (:func:`check_draws_no_names`)."""
    t = data.draw(st.sampled_from(pool[-4:]))
    check_draws_no_names(pdef, t)
    check_same(pdef, t)


@given(pattern_defs(), dags(), st.data())
def test_graph_values_same_solutions_as_reference(pdef, pool, data):
    g = Graph(pool[-3:])
    values = g.values()
    v = data.draw(st.sampled_from(values))
    check_same(pdef, v)


OPAQUE = Operator("opaque", 1, pure=False, infer=same_type, namespace="engine_tests")
NAMES = st.sampled_from(("f1", "f2", "g2", "split", "cat", "opaque"))
CLASSES = st.sampled_from((OpClass("unary"), OpClass("binary")))
_OPS = st.sampled_from(OPS)


class Hint(NamedTuple):
    """What the generators read of a term a pattern should often fit (one strategy object
    per hint, not per term): its operator, input count and output index."""

    op: Operator
    n_in: int
    index: int


def hint_of(t) -> Hint:
    return Hint(t.op, len(t.inputs), t.index)


class _Hinted(NamedTuple):
    names: st.SearchStrategy
    ops: st.SearchStrategy
    classes: st.SearchStrategy
    name_sets: st.SearchStrategy
    op_sets: st.SearchStrategy
    class_sets: st.SearchStrategy


@functools.cache
def _hinted(op: Operator | None) -> _Hinted:
    """The strategies of constants for atoms about ``op`` (or none): names, operators and
    classes, often ``op``'s, and sets of them."""
    if op is None:
        names, ops, classes = NAMES, _OPS, CLASSES
    else:
        names = st.one_of(st.just(op.name), NAMES)
        ops = st.sampled_from((op, *OPS))
        classes = CLASSES
        if op.op_class is not None:
            classes = st.sampled_from((op.op_class, OpClass("unary"), OpClass("binary")))
    return _Hinted(
        names,
        ops,
        classes,
        st.sets(names, min_size=1),
        st.sets(ops, min_size=1),
        st.sets(classes, min_size=1),
    )


_N_OUT_CHOICES = st.sampled_from((None, None, 1, 2))
_UNREAD = st.sampled_from((1, None, ("f1",)))
_ALSO = st.sampled_from((0, 0, 1, 2, 3))
_ALSO_BRANCH = st.sampled_from((0, 0, 1, 2))


@functools.cache  # (one strategy object per arguments: drawn unvalidated)
@st.composite
def root_atoms(draw, fun: bool, hint: Hint | None = None) -> Expr:
    """A comparison of the root's op class (``F``'s, ``fun``; else ``x``'s), name (``F``'s)
    or operator (``x``'s) with constants; now and then one about the other variable.
    ``hint``: what the constants often name (so that matches are common)."""
    hinted = hint is not None and draw(ints(0, 3)) > 0
    c = _hinted(hint.op if hinted else None)
    if draw(ints(0, 7)) == 0:
        fun = not fun
    if fun and draw(BOOLS):
        name = EOpAttr("F", "name")
        kind = draw(ints(0, 3))
        if kind == 0:
            return ECmp("==", name, EConst(draw(c.names)))
        if kind == 1:
            return ECmp("==", EConst(draw(c.names)), name)
        if kind == 2:
            return ECmp("in", name, EConst(tuple(draw(c.name_sets))))
        return ECmp("==", name, EConst(draw(_UNREAD)))  # (unread)
    if fun:
        cls = EOpAttr("F", "op_class")
        if draw(BOOLS):
            return ECmp("==", cls, EConst(draw(c.classes)))
        return ECmp("in", cls, EConst(tuple(draw(c.class_sets))))
    kind = draw(ints(0, 3))
    if kind == 0:
        return ECmp("==", EConst(draw(c.classes)), EAttr("x", "op_class"))
    if kind == 1:
        return ECmp("in", EAttr("x", "op_class"), EConst(tuple(draw(c.class_sets))))
    if kind == 2:
        return ECmp("==", EAttr("x", "op"), EConst(draw(c.ops)))
    return ECmp("in", EAttr("x", "op"), EConst(tuple(draw(c.op_sets))))


@functools.cache  # (one strategy object per arguments: drawn unvalidated)
@st.composite
def fun_root(draw, hint: Hint | None = None) -> Pattern:
    """``F(...)`` of 0-2 operands (mostly variables, so that it often matches), maybe of a
    given output count and output index; often those of ``hint``, where given."""
    if hint is not None and draw(ints(0, 3)):
        n, n_out = min(hint.n_in, 3), draw(sampled((None, hint.op.n_out)))
        index = hint.index
    else:
        n = draw(ints(0, 2))
        n_out = draw(_N_OUT_CHOICES)
        index = draw(ints(0, 1)) if n_out != 1 else 0
    operands = [
        PVar(name) if draw(ints(0, 3)) else draw(patterns(1)) for name in ("y", "z", "e")[:n]
    ]
    return PFunVar("F", tuple(operands), index, n_out)


@functools.cache  # (one strategy object per arguments: drawn unvalidated)
@st.composite
def root_guarded(draw, hint: Hint | None = None) -> PatternDef:
    """A pattern whose root is an operator variable (applied at the root, bound by a
    constraint on the root variable, or on two alternates) or a variable, under guards on
    its op class, name or operator (what the root index reads) combined with other guards,
    maybe behind an ∃ of the same name (then the guard is not about the root) or in a
    constraint. ``hint``: what the pattern often fits (its arity, outputs, name)."""
    form = draw(ints(0, 4))
    if form <= 1:
        root: Pattern = draw(fun_root(hint))
        hidden = "F"
    elif form == 2:  # x <= F(...)
        root, hidden = PConstr(PVar("x"), "x", draw(fun_root(hint))), "F"
    elif form == 3:  # on both alternates
        root = PAlt(draw(fun_root(hint)), PConstr(PVar("x"), "x", draw(fun_root(hint))))
        hidden = "F"
    else:
        root, hidden = PVar("x"), "x"
    if draw(ints(0, 3)) == 0:
        root = PExists(hidden, root, "op" if hidden == "F" else "term")
    if draw(ints(0, 3)) == 0:
        root = PConstr(root, "x", draw(patterns(1)))
    fun = hidden == "F"
    guard = draw(root_atoms(fun, hint))
    for _ in range(draw(_ALSO)):
        if draw(ints(0, 3)):
            other = draw(root_atoms(fun, hint))
        else:
            other = draw(guards(("x", "y"), ("F",)))
        guard = EAnd((other, guard)) if draw(BOOLS) else EOr((guard, other))
    body: Pattern = PGuard(root, guard)
    if draw(ints(0, 3)) == 0:
        body = PAlt(body, draw(patterns(1)))
    return PatternDef("P", PARAMS, body)


def targets(pool: list) -> list:
    """The pool's latest terms, and opaque (impure) applications to two of them."""
    return [*pool[-4:], OPAQUE(pool[-1]), OPAQUE(pool[0])]


@given(dags(), st.data())
def test_the_root_index_admits_every_root_with_a_match(pool, data):
    """A value the index leaves out (its operator, op class, name, arity and output count
    not among the pattern's roots) has no match: the reference machine finds none there.
    The index's key is the operator alone, which admits at least what the term admits."""
    pdef = data.draw(root_guarded(hint_of(data.draw(st.sampled_from(targets(pool))))))
    roots = root_set(pdef)
    matcher = Matcher([pdef], compiled=False)
    for t in targets(pool):
        exact = admits(roots, t.op, len(t.inputs))
        if not exact:
            assert next(_machine.solutions(pdef.body, t), None) is None, (roots, t)
        assert not exact or admits(roots, t.op)
        assert bool(matcher.candidates(t.op)) == admits(roots, t.op)
    check_same(pdef, data.draw(st.sampled_from(targets(pool))))


@functools.cache  # (one strategy object per arguments: drawn unvalidated)
@st.composite
def branch_guards(draw, hint: Hint | None = None) -> Expr:
    """A rule branch's guard: a root atom, alone or with others (``and``, ``or``,
    ``not``: an ``elif`` chain's shape)."""
    guard = draw(root_atoms(True, hint))
    for _ in range(draw(_ALSO_BRANCH)):
        other = draw(_branch_others(hint))
        kind = draw(ints(0, 2))
        if kind == 0:
            guard = EAnd((ENot(other), guard))
        elif kind == 1:
            guard = EAnd((other, guard))
        else:
            guard = EOr((guard, other))
    return guard


@functools.cache
def _branch_others(hint: Hint | None) -> st.SearchStrategy[Expr]:
    return st.one_of(root_atoms(True, hint), guards(("x", "y"), ("F",)))


_RESULTS = st.sampled_from((RApp(FUSED, (RVar("x"),)), RApp(F1, (RVar("y"),)), RVar("y")))


@st.composite
def guarded_rules(draw, i: int = 0, hints=()) -> RuleDef:
    """A rule of a :func:`root_guarded` pattern and 1-3 branches under root guards, often
    fitting one of ``hints`` (terms)."""
    hint = hint_of(draw(st.sampled_from(hints))) if hints else None
    pdef = draw(root_guarded(hint))
    branches = tuple(
        RuleBranch(draw(branch_guards(hint)), draw(_RESULTS)) for _ in range(draw(ints(1, 3)))
    )
    return RuleDef(f"r{i}", pdef, branches, draw(BOOLS))


@given(dags(), st.data())
def test_a_rule_fires_only_where_its_roots_admit(pool, data):
    """Where the index narrowed by a rule's branches leaves a term out, no solution of the
    rule's pattern there has a branch whose guard holds: the rule cannot fire."""
    rule = data.draw(guarded_rules(hints=targets(pool)))
    roots = rule_roots(rule)
    for t in targets(pool):
        if admits(roots, t.op, len(t.inputs)):
            continue
        for theta, phi in itertools.islice(_machine.solutions(rule.pattern.body, t), 50):
            assert not any(guard_holds(b.guard, theta, phi) for b in rule.branches), (roots, t)


def _rewritten(rules: list[RuleDef], pool: list, engine: str, every_node: bool) -> tuple:
    """The graph and report of rewriting the pool's graph; ``every_node``: with an index
    that offers every rule at every node."""
    g = Graph([*pool[-3:], OPAQUE(pool[-1])])

    def offer_all(pdefs, **kwargs):
        m = Matcher(pdefs, **kwargs)
        everything = tuple(enumerate(zip(pdefs, m.compiled, strict=True)))
        m._wild = tuple((i, p, c) for i, (p, c) in everything)
        m._table = _Index(m._wild, {}, {}, [])
        return m

    patch = mock.patch.object(_rewrite, "Matcher", offer_all) if every_node else nullcontext()
    try:
        with patch:
            report = rewrite(g, rules, engine=engine, max_iterations=60).report
        return str(g), [(r.rule, r.root, r.replaced, r.created) for r in report]
    except PyPMError as exc:
        return type(exc).__name__, str(exc)


@given(dags(max_nodes=8), st.sampled_from(("fast", "reference")), st.data())
def test_the_index_changes_no_rewrite(pool, engine, data):
    """Rewriting with the index (patterns' roots, rules' branches) does what trying every
    rule at every node does."""
    hints = [*pool[-3:], OPAQUE(pool[-1])]
    rules = [data.draw(guarded_rules(i, hints)) for i in range(data.draw(st.integers(1, 3)))]
    assert _rewritten(rules, pool, engine, False) == _rewritten(rules, pool, engine, True)


# Branchy patterns are generated with a generator function per definition that has
# alternates of its own; forcing that form on every pattern checks it the same way.


@given(branchy_defs(), dags(), st.data())
def test_generator_functions_same_solutions_as_reference(pdef, pool, data):
    t = data.draw(st.sampled_from(pool[-4:]))
    with mock.patch.object(_codegen, "_INLINE_PATHS", 0):
        check_same(pdef, t)


@given(pattern_defs(), dags(), st.data())
def test_generator_functions_on_graph_values(pdef, pool, data):
    g = Graph(pool[-3:])
    v = data.draw(st.sampled_from(g.values()))
    with mock.patch.object(_codegen, "_INLINE_PATHS", 0):
        check_same(pdef, v)


@given(pattern_and_term(well_moded=False))
def test_generator_functions_shared_strategies(pt):
    pdef, t = pt
    with mock.patch.object(_codegen, "_INLINE_PATHS", 0):
        check_same(pdef, t)


@given(
    st.lists(st.one_of(pattern_defs(depth=2), root_guarded()), min_size=1, max_size=4),
    dags(),
)
def test_matcher_index_finds_what_trying_every_pattern_finds(pdefs, pool):
    g = Graph(pool[-3:])
    matcher = Matcher(pdefs)
    found = [(v, i, m.key()) for v, i, m in matcher.scan(g)]
    expected = []
    for v in g.values():
        for i, p in enumerate(pdefs):
            m = _machine.match_first(p, v)
            if m is not None:
                expected.append((v, i, m.key()))
                break
    assert found == expected


# Cuts and fresh names. The machine and generated code skip parts of a search that cannot
# succeed (an early refusal of a spine-constrained variable, a side of an alternate the
# term cannot match). Where the skipped part would have drawn fresh names, the exact
# solutions would renumber the names drawn after it; so exact runs cut only where nothing
# skipped draws a name, and distinct runs (parameters only) cut everywhere.

_H = PMu("H", (), (), PExists("z", PVar("z")))  # one unfolding draws z#N
_REFUSED_THEN_NAMED = PatternDef(  # x bound in an alternate, refused early, then H
    "P",
    (Param("x"),),
    PConstr(
        PApp(G2, (PAlt(PApp(F1, (PVar("x"),)), PVar("x")), _H)),
        "x",
        PApp(F1, (PVar("w"),)),
    ),
)
_R0_BODY = PAlt(
    PExists("y", PConstr(PVar("x"), "x", PFunVar("f", (PCall("R0", ("y", "f", "g")),)))),
    PAlt(
        PExists(
            "y",
            PExists(
                "z",
                PConstr(
                    PVar("x"),
                    "x",
                    PFunVar("g", (PCall("R0", ("y", "f", "g")), PCall("R0", ("z", "f", "g")))),
                ),
            ),
        ),
        PVar("x"),
    ),
)
_R0_PARAMS = (Param("x"), Param("f", "op"), Param("g", "op"))
_SKIPPED_THEN_NAMED = PatternDef(  # a side that cannot match G2(A, A), drawing F4#1
    "P0",
    _R0_PARAMS,
    PAlt(
        PMu("H5", (), (), PExists("F4", PFunVar("F4", ()), kind="op")),
        PMu("R0", _R0_PARAMS, ("x", "f", "g"), _R0_BODY),
    ),
)


@pytest.mark.parametrize(
    ("pdef", "t"),
    [(_REFUSED_THEN_NAMED, G2(F1(A), B)), (_SKIPPED_THEN_NAMED, G2(A, A))],
    ids=["early-refusal", "alternate-look-ahead"],
)
@pytest.mark.parametrize("inline", [True, False], ids=["inline", "generators"])
def test_cuts_keep_the_fresh_names_of_exact_solutions(pdef, t, inline):
    names = {n for key in reference_solutions(pdef, t) for n, _ in key[0] if "#" in n}
    assert names  # (the example: a solution binds a name drawn after the cut)
    with mock.patch.object(_codegen, "_INLINE_PATHS", _codegen._INLINE_PATHS if inline else 0):
        check_same(pdef, t)


def check_draws_no_names(pdef, t):
    """``_draws_names`` is what exact runs' cuts rely on: where it says a pattern draws no
    fresh name, the reference machine draws none while matching it."""
    drawn = []
    real = FreshNames.__call__

    def draw(self, name):
        drawn.append(name)
        return real(self, name)

    with mock.patch.object(FreshNames, "__call__", draw):
        try:
            reference_solutions(pdef, t)
        except PyPMError:
            pass  # (a pattern that raises: what it drew before is still counted)
    if not _draws_names(pdef.body):
        assert drawn == []


# The shared strategies of tests/core: patterns abstracted from random terms (so many match,
# often several times), well-moded or not; checked here on full θ/φ and on both back ends.


@given(pattern_and_term(well_moded=False))
def test_shared_strategies_terms(pt):
    pdef, t = pt
    check_same(pdef, t)


@given(pattern_and_term(), st.data())
def test_shared_strategies_graph_values(pt, data):
    pdef, t = pt
    g = Graph([t])
    v = data.draw(st.sampled_from(g.values() + g.inputs))
    check_same(pdef, v)


@given(
    guards(("x", "y", "z"), ("F", "G")),
    st.dictionaries(st.sampled_from(("x", "y")), st.sampled_from(TARGETS), max_size=2),
    st.dictionaries(st.sampled_from(("F",)), st.sampled_from(OPS), max_size=1),
)
def test_compiled_guards_hold_exactly_when_interpreted_ones_do(g, theta, phi):
    assert compile_guard(g)(theta, phi) is guard_holds(g, theta, phi)


def test_guards_are_generated_at_their_first_evaluation():
    """A rewrite run asks for every rule's guard; only those evaluated are generated."""
    from pypm_jax.core.calculus import EAttr, ECmp, EConst
    from pypm_jax.engine.guard_code import _compiled_guards

    g = ECmp("==", EAttr("x", "rank"), EConst(2))
    holds = compile_guard(g)
    assert id(g) not in _compiled_guards.entries
    theta = {"x": TARGETS[0]}
    assert holds(theta, {}) is guard_holds(g, theta, {})
    assert _compiled_guards.entries[id(g)][0] is g
    assert compile_guard(g) is _compiled_guards(g)  # generated already: no indirection
