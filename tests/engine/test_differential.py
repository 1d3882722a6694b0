"""The fast engine against the paper's machine on random patterns and random DAGs.

Both back ends of the fast engine (generated code, and the iterative machine used for
recursive patterns) must give the reference machine's exact results: the same first
solution, the same solutions in the same order, the same θ and φ including the fresh names
of unfolded existentials. Targets are hash-consed terms and graph values.
"""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from pypm_jax.core.graph import Graph
from pypm_jax.engine import fast as _fast
from pypm_jax.engine.fast import CompiledPattern, Matcher, compile_guard
from pypm_jax.semantics import machine as _machine
from pypm_jax.semantics.guards import guard_holds
from pypm_testing import budget
from pypm_testing.engine import (
    F1,
    LEAVES,
    OPS,
    SPLIT,
    A,
    B,
    dags,
    guards,
    pattern_defs,
    solution_key,
)
from pypm_testing.strategies import pattern_and_term

MAX_SOLUTIONS = 50
# Examples per property at CI's budget: 1,000 (2,000 before, the profile's default) for the
# five properties that compare whole solution sequences; the guard compiler keeps 2,000.
SEQUENCES = settings(max_examples=budget.examples(ci=1000, dev=200, fast=20))
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


@SEQUENCES
@given(pattern_defs(), dags(), st.data())
def test_terms_same_solutions_as_reference(pdef, pool, data):
    t = data.draw(st.sampled_from(pool[-4:]))
    check_same(pdef, t)


@SEQUENCES
@given(pattern_defs(), dags(), st.data())
def test_graph_values_same_solutions_as_reference(pdef, pool, data):
    g = Graph(pool[-3:])
    values = g.values()
    v = data.draw(st.sampled_from(values))
    check_same(pdef, v)


@SEQUENCES
@given(st.lists(pattern_defs(depth=2), min_size=1, max_size=4), dags())
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


@SEQUENCES
@given(pattern_and_term(well_moded=False))
def test_shared_strategies_terms(pt):
    pdef, t = pt
    check_same(pdef, t)


@SEQUENCES
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
