"""Bounded matching: tabled recursive calls, the step budget, progress by time, and
patterns 10 000 levels deep (issue 20, items 4 and 8).

Work is asserted in machine steps (``MatchRun.steps``), never in seconds.
"""

from __future__ import annotations

import itertools
import logging
import re
import warnings

import pytest

import pypm_jax as pm
from pypm_jax.core.calculus import PApp, Param, PatternDef, PMu, PVar
from pypm_jax.engine import fast as _fast
from pypm_jax.engine import rewrite as _rewrite
from pypm_jax.engine.fast import MatchRun, compile_pattern
from pypm_jax.engine.rewrite import guarded_pattern
from pypm_jax.semantics import machine as _machine
from pypm_testing.paper_patterns import P  # the paper's P(x, f, g): locals, constraints


@pm.op
def Mul(x, y):
    return 1


@pm.op
def Neg(x):
    return 1


@pm.op
def Bin(x, y):
    return 1


@pm.op
def Done(x):
    return 1


@pm.op
def Top(x):
    return 1


@pm.pattern
def MulTree(x):
    return Mul(MulTree(x), MulTree(x))


@pm.pattern
def MulTree(x):  # noqa: F811
    return x


@pm.rule(MulTree)
def never(x):
    assert x.rank == 99
    return Done(x)


@pm.rule(MulTree)
def at_input(x):
    assert x.rank == 1
    return Done(x)


@pm.rule(P)
def never_p(x, f, g):
    assert x.rank == 99
    return Done(x)


def squares(n: int):
    """x1 = x0 * x0, x2 = x1 * x1, ...: a DAG of n nodes whose tree has 2**n leaves."""
    t = pm.leaf("x0", shape=(2,), dtype="f32")
    for _ in range(n):
        t = Mul(t, t)
    return t


def full_tree(depth: int):
    """A complete binary tree of ``Bin`` nodes (2**(depth+1) - 1 nodes, distinct leaves)."""
    level = [pm.leaf(f"a{i}", shape=(2,), dtype="f32") for i in range(2**depth)]
    while len(level) > 1:
        level = [Bin(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def steps_of_all(pdef, t, *, distinct: bool, budget: int | None = None) -> tuple[list, int]:
    run = MatchRun(budget, distinct=distinct)
    sols = [(th, ph) for th, ph, _ in compile_pattern(pdef).solutions(t, run)]
    return sols, run.steps


def key(theta, phi):
    return (
        tuple(sorted((k, id(v)) for k, v in theta.items())),
        tuple(sorted((k, id(v)) for k, v in phi.items())),
    )


# ------------------------------------------------------------------------ (a) a DAG


def test_recursive_pattern_over_a_dag_is_polynomial():
    pdef = MulTree.definition
    t = squares(40)
    sols, steps = steps_of_all(pdef, t, distinct=False, budget=200_000)
    # x is each of the 41 values, each once: the tree unfoldings are not enumerated
    assert len(sols) == 41
    assert steps < 200_000
    m = pm.match(MulTree, t)
    assert m is not None and m["x"].op is not Mul  # the leftmost leaf, x0


def test_tabled_solutions_are_the_reference_machines_exactly():
    pdef = MulTree.definition
    for n in range(1, 7):
        t = squares(n)
        ref = [key(th, ph) for th, ph in _machine.solutions(pdef.body, t)]
        got = [key(th, ph) for th, ph, _ in compile_pattern(pdef).solutions(t)]
        assert got == ref


def test_rewrite_of_a_deep_dag_with_a_guard_never_true_returns():
    t = squares(40)
    g = pm.Graph([Neg(t)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # and within the default budget
        result = pm.rewrite(g, [never])
    assert len(result.report) == 0
    # and fires where the guard holds: the first solution whose x has rank 1
    result = pm.rewrite(pm.Graph([Neg(squares(40))]), [at_input])
    assert result.report.counts() == {"at_input": 1}


# ------------------------------------------------------------------ (b) P(x, f, g)


def test_paper_p_on_a_63_node_tree_is_polynomial():
    t = full_tree(5)  # 63 nodes
    pdef = guarded_pattern(never_p.definition)  # what the rewrite driver matches
    sols, steps = steps_of_all(pdef, t, distinct=True, budget=100_000)
    assert sols == [] and steps < 100_000
    assert len(pm.rewrite(pm.Graph([Neg(t)]), [never_p]).report) == 0
    found = [(m["f"], m["g"]) for m in pm.match_all(P, t, budget=100_000)]
    assert found == [(None, Bin), (None, None)]


def test_distinct_solutions_of_p_are_the_reference_machines():
    for depth in range(4):
        t = full_tree(depth)
        ref = [m.key() for m in _machine.match_all(P.definition, t)]
        got = [m.key() for m in _fast.match_all(P.definition, t)]
        assert got == ref


# ---------------------------------------------------------------------- (c) budget


def test_match_raises_a_named_error_past_its_budget():
    t = squares(12)
    for engine in ("fast", "reference"):
        with pytest.raises(pm.MatchBudgetError, match="budget of 50"):
            list(pm.match_all(MulTree, t, engine=engine, budget=50))
    assert issubclass(pm.MatchBudgetError, pm.PyPMError)
    assert pm.match(MulTree, t) is not None  # no budget by default


def test_a_match_past_the_rewrite_budget_warns_and_the_rest_still_rewrites():
    @pm.pattern
    def NegOf(x):
        return Neg(x)

    @pm.rule(NegOf)
    def neg_neg(x):
        return Done(x)

    t = squares(12)
    g = pm.Graph([Neg(t)])
    with pytest.warns(RuntimeWarning) as caught:
        result = pm.rewrite(g, [never, neg_neg], match_budget=30)
    messages = [str(w.message) for w in caught]
    assert messages, "no warning"
    text = messages[0]
    assert "rule never" in text and "test_match_bound.py:" in text and "machine steps" in text
    assert re.search(r"at %\d+ Mul", text), text  # the node
    assert result.report.counts() == {"neg_neg": 1}  # the program still rewrites


def test_the_module_budget_applies_when_rewrite_is_given_none(monkeypatch):
    monkeypatch.setattr(_rewrite, "MATCH_BUDGET", 30)
    with pytest.warns(RuntimeWarning, match="rule never"):
        pm.rewrite(pm.Graph([Neg(squares(12))]), [never])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pm.rewrite(pm.Graph([Neg(squares(12))]), [never], match_budget=None)


# ------------------------------------------------------------ progress by the clock


def test_progress_is_logged_during_one_long_match(monkeypatch, caplog):
    """Fewer than _PROGRESS_STRIDE nodes, one long match: the log still comes."""
    monkeypatch.setattr(_rewrite, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(_rewrite, "_PROGRESS_STEPS", 8)
    with caplog.at_level(logging.INFO, logger="pypm_jax.rewrite"):
        pm.rewrite(pm.Graph([Neg(squares(8))]), [never])
    assert any("rewriting:" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------- deep patterns

DEPTH = 10_000


def deep_patterns():
    """``Top(Neg(Neg(...(x))))`` 10 000 deep, as nested applications and as a chain of
    sub-patterns (rooted at ``Top`` so that a rewrite tries one node)."""
    flat = PVar("x")
    chain = PVar("x")
    for i in range(DEPTH):
        flat = PApp(Neg, (flat,))
        chain = PMu(f"P{i}", (Param("x"),), ("x",), PApp(Neg, (chain,)))
    return (
        PatternDef("Flat", (Param("x"),), PApp(Top, (flat,))),
        PatternDef("Chain", (Param("x"),), PApp(Top, (chain,))),
    )


def negs(n: int, t):
    for _ in range(n):
        t = Neg(t)
    return Top(t)


@pytest.mark.parametrize("engine", ["fast", "reference"])
def test_patterns_ten_thousand_deep_match(engine):
    a = pm.leaf("a", shape=(2,), dtype="f32")
    t = negs(DEPTH, a)
    for pdef in deep_patterns():
        m = pm.match(pdef, t, engine=engine)
        assert m is not None and m["x"] is a
        assert pm.match(pdef, negs(DEPTH - 1, Mul(a, a)), engine=engine) is None


@pytest.mark.slow  # (about 5 s on a quiet machine)
def test_patterns_ten_thousand_deep_explain_and_rewrite():
    a = pm.leaf("a", shape=(2,), dtype="f32")
    for pdef in deep_patterns():
        assert pm.explain(pdef, negs(DEPTH, a)).matched
        why = pm.explain(pdef, negs(DEPTH - 1, Mul(a, a)))
        assert not why.matched and "expected Neg, found Mul" in str(why)

        @pm.rule(pdef)
        def unwrap(x):
            return Done(x)

        result = pm.rewrite(pm.Graph([negs(DEPTH, a)]), [unwrap])
        assert result.report.counts() == {"unwrap": 1}


def test_budget_does_not_change_results():
    """The same solutions with a budget that is not reached (the design is independent of
    the budget: a table is never cut short)."""
    t = squares(8)
    free = [m.key() for m in pm.match_all(MulTree, t)]
    bounded = [m.key() for m in pm.match_all(MulTree, t, budget=10**6)]
    assert free == bounded == [m.key() for m in itertools.islice(free_iter(t), 100)]


def free_iter(t):
    return _machine.match_all(MulTree.definition, t)
