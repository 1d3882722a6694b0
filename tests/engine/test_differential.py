"""The fast engine against the paper's machine on random patterns and random DAGs.

Both back ends of the fast engine (generated code, and the iterative machine used for
recursive patterns) must give the reference machine's exact results: the same first
solution, the same solutions in the same order, the same θ and φ including the fresh names
of unfolded existentials. Targets are hash-consed terms and graph values.
"""

from __future__ import annotations

import itertools
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    ECmp,
    EConst,
    EOpAttr,
    EOr,
    Expr,
    PAlt,
    Pattern,
    PatternDef,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PVar,
)
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import OpClass
from pypm_jax.engine import codegen as _codegen
from pypm_jax.engine import fast as _fast
from pypm_jax.engine.analysis import admits, root_set
from pypm_jax.engine.fast import CompiledPattern, Matcher, compile_guard
from pypm_jax.semantics import machine as _machine
from pypm_jax.semantics.guards import guard_holds
from pypm_testing.engine import (
    F1,
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
    solution_key,
)
from pypm_testing.strategies import pattern_and_term

MAX_SOLUTIONS = 50
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
    cp = CompiledPattern(pdef)
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
    t = data.draw(st.sampled_from(pool[-4:]))
    check_same(pdef, t)


@given(pattern_defs(), dags(), st.data())
def test_graph_values_same_solutions_as_reference(pdef, pool, data):
    g = Graph(pool[-3:])
    values = g.values()
    v = data.draw(st.sampled_from(values))
    check_same(pdef, v)


@st.composite
def root_atoms(draw, fun: bool) -> Expr:
    """A comparison of the root's op class (``F``'s, ``fun``; else ``x``'s) or operator
    (``x``'s) with constants; now and then one about the other variable."""
    classes = st.sampled_from([OpClass("unary"), OpClass("binary")])
    if draw(st.integers(0, 4)) == 0:
        fun = not fun
    if fun:
        cls = EOpAttr("F", "op_class")
        if draw(st.booleans()):
            return ECmp("==", cls, EConst(draw(classes)))
        return ECmp("in", cls, EConst(tuple(draw(st.sets(classes)))))
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return ECmp("==", EConst(draw(classes)), EAttr("x", "op_class"))
    if kind == 1:
        return ECmp("in", EAttr("x", "op_class"), EConst(tuple(draw(st.sets(classes)))))
    if kind == 2:
        return ECmp("==", EAttr("x", "op"), EConst(draw(st.sampled_from(OPS))))
    return ECmp("in", EAttr("x", "op"), EConst(tuple(draw(st.sets(st.sampled_from(OPS))))))


@st.composite
def root_guarded(draw) -> PatternDef:
    """A pattern whose root is an operator variable or a variable under guards on its op
    class or operator (what the root index reads) combined with other guards, maybe behind
    an ∃ of the same name (then the guard is not about the root) or in a constraint."""
    if draw(st.booleans()):
        n = draw(st.integers(0, 2))
        root: Pattern = PFunVar("F", tuple(draw(patterns(1)) for _ in range(n)))
        hidden = "F"
    else:
        root, hidden = PVar("x"), "x"
    if draw(st.integers(0, 3)) == 0:
        root = PExists(hidden, root, "op" if hidden == "F" else "term")
    if draw(st.integers(0, 3)) == 0:
        root = PConstr(root, "x", draw(patterns(1)))
    fun = hidden == "F"
    guard = draw(root_atoms(fun))
    for _ in range(draw(st.integers(0, 3))):
        other = draw(st.one_of(root_atoms(fun), guards(("x", "y"), ("F",))))
        guard = EAnd((other, guard)) if draw(st.booleans()) else EOr((guard, other))
    body: Pattern = PGuard(root, guard)
    if draw(st.integers(0, 3)) == 0:
        body = PAlt(body, draw(patterns(1)))
    return PatternDef("P", PARAMS, body)


@given(root_guarded(), dags(), st.data())
def test_the_root_index_admits_every_root_with_a_match(pdef, pool, data):
    """A value the index leaves out (its operator and op class not among the pattern's
    roots) has no match: the reference machine finds none there."""
    roots = root_set(pdef)
    for t in pool[-4:]:
        if not admits(roots, t.op):
            assert next(_machine.solutions(pdef.body, t), None) is None, (roots, t)
    check_same(pdef, data.draw(st.sampled_from(pool[-4:])))


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
    st.dictionaries(st.sampled_from(["x", "y"]), st.sampled_from(TARGETS), max_size=2),
    st.dictionaries(st.sampled_from(["F"]), st.sampled_from(OPS), max_size=1),
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
