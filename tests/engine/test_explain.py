"""Explain: the deepest partial match and the reason it stopped, as data and as text."""

from __future__ import annotations

import inspect
import os
import re
import runpy

import pypm_jax as pm
from pypm_jax.core.calculus import (
    EAttr,
    ECmp,
    EConst,
    EOpAttr,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
)
from pypm_jax.core.errors import SourceLoc
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import Operator, const, leaf
from pypm_jax.engine.explain import explain
from pypm_testing.engine import F1, F2, G2, H2, A, B

X, Y = PVar("x"), PVar("y")
GUARD_LOC = SourceLoc("attention_rules.py", 42, "    assert q.rank == 4")
PATTERN_LOC = SourceLoc("attention_rules.py", 39, "def Scores(q, k):")


def scores() -> PatternDef:
    """g2(q, f1(k)) with a guard on q's rank, written at attention_rules.py:42."""
    guard = ECmp("==", EAttr("q", "rank"), EConst(4))
    body = PGuard(PApp(G2, (PVar("q"), PApp(F1, (PVar("k"),)))), guard, GUARD_LOC)
    return PatternDef("Scores", (Param("q"), Param("k")), body, PATTERN_LOC)


def test_near_miss_on_a_guard_shows_the_guard_as_written():
    t = G2(A, F1(B))  # a has rank 2, the guard wants 4
    e = explain(scores(), t)
    assert not e.matched
    attempt = e.best
    assert [s.kind for s in attempt.steps] == ["match", "bind", "match", "bind"]
    failure = attempt.failure
    assert failure.kind == "guard_failed"
    assert failure.loc == GUARD_LOC
    assert failure.guard == "q.rank = 4"
    assert failure.values == (("q.rank", "2"),)
    text = str(e)
    assert "attention_rules.py:42" in text and "assert q.rank == 4" in text
    assert "q.rank = 2" in text and "pattern Scores (attention_rules.py:39)" in text


def test_operator_mismatch_expected_and_found():
    e = explain(scores(), G2(A, F2(B)))
    f = e.best.failure
    assert f.kind == "op_mismatch" and f.expected is F1 and f.found is F2
    assert "expected f1, found f2" in str(e)
    root = explain(scores(), H2(A, B)).best
    assert root.depth == 0 and root.failure.kind == "op_mismatch"


def test_the_deepest_alternate_is_reported():
    shallow = PApp(H2, (X, Y))
    deep = PApp(G2, (X, PApp(F1, (PConst(2),))))
    p = PatternDef("Alt", (Param("x"),), PAlt(shallow, deep))
    f = explain(p, G2(A, F1(const(3)))).best.failure
    assert f.kind == "const_mismatch" and f.expected == 2


def test_variable_conflict_and_unbound_existential():
    p = PatternDef("Same", (Param("x"),), PApp(G2, (X, X)))
    f = explain(p, G2(A, B)).best.failure
    assert f.kind == "var_conflict" and f.expected is A and f.found is B
    q = PatternDef("E", (Param("x"),), PExists("e", PApp(F1, (X,))))
    assert explain(q, F1(A)).best.failure.kind == "unbound"


def test_a_match_is_reported_as_such():
    e = explain(scores(), G2(leaf("q4", shape=(1, 2, 3, 4)), F1(B)))
    assert e.matched and e.best.match["k"] is B
    assert str(e).splitlines()[1].startswith("matches")


def test_whole_graph_candidates_sorted_by_progress():
    q4 = leaf("q4", shape=(1, 2, 3, 4))
    g = Graph([G2(A, F2(B)), G2(A, F1(B)), G2(q4, F1(B)), H2(A, B)])
    e = explain(scores(), g)
    assert len(e.attempts) == 3  # only the g2 nodes are candidates
    assert e.attempts[0].matched
    assert e.attempts[1].failure.kind == "guard_failed"
    assert e.attempts[2].failure.kind == "op_mismatch"
    assert "3 candidate node(s), 1 match(es)" in str(e)
    none = explain(scores(), Graph([H2(A, B)]))
    assert not none.attempts and "applies g2" in str(none)


def test_whole_graph_candidates_of_an_operator_variable():
    # F(x, y) with F.name == "g2": only the nodes of two inputs named g2 are candidates (the
    # index's admission test), and the note says so where there are none
    name_is = ECmp("==", EOpAttr("F", "name"), EConst("g2"))
    p = PatternDef(
        "Named", (Param("x"), Param("y")), PGuard(PFunVar("F", (PVar("x"), PVar("y"))), name_is)
    )
    g = Graph([G2(A, F2(B)), G2(F1(A), B), H2(A, B)])
    e = explain(p, g)
    assert len(e.attempts) == 2 and all(a.matched for a in e.attempts)
    none = explain(p, Graph([H2(A, B), F1(A)]))
    assert not none.attempts
    assert "applies any pure operator of 2 inputs named g2" in str(none)


def test_graph_nodes_show_their_source_line():
    g = Graph([G2(A, F1(B))])
    g.outputs[0].node.loc = SourceLoc("model.py", 12, "s = q @ k")
    text = str(explain(scores(), g))
    assert "@ model.py:12" in text


def test_deep_recursive_patterns_explain_without_recursion_error():
    body = PMu(
        "U",
        (Param("x"), Param("f", "op")),
        ("x", "f"),
        PAlt(PFunVar("f", (PCall("U", ("x", "f")),)), PGuard(PFunVar("f", (X,)), EConst(False))),
    )
    p = PatternDef("Chain", (Param("x"), Param("f", "op")), body)
    t = A
    for _ in range(5000):
        t = F1(t)
    f = explain(p, t).best.failure
    assert f.kind in ("guard_failed", "arity_mismatch")


def test_operator_variables_do_not_look_through_opaque_operators():
    rng = Operator("rng", 1, pure=False)
    p = PatternDef("AnyUnary", (Param("x"),), PFunVar("F", (X,)))
    f = explain(p, rng(A)).best.failure
    assert f.kind == "opaque_operator" and f.found is rng


# ------------------------------------------------------------------------------- rules


@pm.pattern
def Scaled(q, k):
    return G2(q, F1(k))


@pm.rule(Scaled)
def needs_rank4(q, k):
    assert q.dtype == pm.f32
    assert q.rank == 4
    return H2(q, k)


@pm.rule(Scaled)
def any_rank(q, k):
    return H2(q, k)


@pm.rule(Scaled)
def by_rank(q, k):
    if q.rank == 4:
        return H2(q, k)
    assert q.rank == 2 and q.dtype == pm.i8
    return H2(k, q)


@pm.rule(Scaled, single_use=True)
def scaled_once(q, k):
    return H2(q, k)


@pm.guard_fn("tests.explain.toy_plan")
def toy_plan(rank):
    return ("BSHD", rank) if rank == 4 else None


@pm.guard_fn("tests.explain.toy_supported")
def toy_supported(plan):
    return plan is not None


@pm.rule(Scaled)
def planned(q, k):
    plan = toy_plan(q.rank)
    assert toy_supported(plan)
    return H2(q, k)


def line_of(rule, text: str) -> int:
    """The line of the rule body's source line containing ``text``."""
    lines, first = inspect.getsourcelines(rule.fn)
    (i,) = [i for i, line in enumerate(lines) if text in line]
    return first + i


Q4 = leaf("q4", shape=(1, 2, 3, 4), dtype="f32")
Q3 = leaf("q3", shape=(1, 2, 3), dtype="f32")


def test_a_rule_whose_assert_fails_names_the_assert_and_what_it_read():
    g = Graph([G2(A, F2(B)), G2(A, F1(B))])  # a: f32, rank 2; the first is no match at all
    e = pm.explain(needs_rank4, g)
    assert not e.matched and e.rule is needs_rank4.definition
    assert len(e.attempts) == 2
    best = e.best
    assert not best.matched and best.pattern_match is not None
    assert best.pattern_match["q"] is g.outputs[1].node.inputs[0]
    failure = best.failure
    assert failure.kind == "guard_failed"
    assert failure.loc.file == __file__
    assert failure.loc.line == line_of(needs_rank4, "assert q.rank == 4")
    assert failure.guard == "q.rank = 4" and failure.values == (("q.rank", "2"),)
    assert [s.kind for s in best.steps] == ["guard"]  # the dtype assert held
    # the pattern's own near miss comes after the match the rule refused
    assert e.attempts[1].pattern_match is None and e.attempts[1].failure.kind == "op_mismatch"
    text = str(e)
    assert f"test_explain.py:{failure.loc.line}: assert q.rank == 4" in text
    assert "with q.rank = 2" in text and "does not fire at" in text
    assert text.startswith("rule needs_rank4 (")
    assert "2 candidate node(s), 1 pattern match(es), the rule fires at 0" in text


def test_a_rule_that_fires_is_a_match():
    e = pm.explain(any_rank, Graph([G2(A, F1(B))]))
    assert e.matched and e.best.match["k"] is not None
    assert str(e).splitlines()[2].startswith("fires at")
    assert pm.explain(needs_rank4, G2(Q4, F1(B))).matched  # a term, not a graph


def test_the_second_branch_of_a_rule_fires_when_the_first_does_not():
    b8 = leaf("b8", shape=(2, 2), dtype="i8")
    assert pm.explain(by_rank, G2(b8, F1(B))).matched  # rank 2, i8: the second branch
    assert pm.explain(by_rank, G2(leaf("b4", shape=(1, 1, 1, 1)), F1(B))).matched  # the first
    # no branch: the one that got further (past `if q.rank == 4`) is reported, narrowed to
    # the conjunct of `assert ... and ...` that is false
    f = pm.explain(by_rank, G2(A, F1(B))).best.failure
    assert f.kind == "guard_failed" and f.guard == "q.dtype = i8"
    assert f.loc.line == line_of(by_rank, "assert q.rank == 2")
    assert f.values == (("q.dtype", "f32"),) and "no branch of 2 applies" in f.message
    assert pm.explain(by_rank, G2(Q3, F1(B))).best.failure.guard == "q.rank = 2"


def test_a_failed_call_of_a_guard_function_shows_what_the_inner_call_returned():
    e = pm.explain(planned, G2(A, F1(B)))
    f = e.best.failure
    assert f.kind == "guard_failed" and f.loc.line == line_of(planned, "assert toy_supported")
    assert f.values == (("tests.explain.toy_plan(…)", "None"), ("q.rank", "2"))
    assert "with tests.explain.toy_plan(…) = None, q.rank = 2" in str(e)
    assert pm.explain(planned, G2(Q4, F1(B))).matched


def test_a_single_use_rule_does_not_fire_where_the_match_is_shared():
    shared = Graph([G2(A, F1(B)), F1(B)])  # f1(b) is also a graph output
    f = pm.explain(scaled_once, shared).best.failure
    assert f.kind == "single_use" and "%" in f.message
    assert pm.explain(scaled_once, Graph([G2(A, F1(B))])).matched
    assert pm.explain(any_rank, shared).matched  # not single-use


def test_a_loaded_rule_explains_with_its_assert_locations():
    (loaded,) = pm.deserialize(pm.serialize([needs_rank4]), ops=[G2, F1, H2])
    f = pm.explain(loaded, G2(A, F1(B))).best.failure
    assert f.loc.line == line_of(needs_rank4, "assert q.rank == 4")


def test_the_semantics_doc_example_runs(tmp_path, capsys):
    doc = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "SEMANTICS.md")
    with open(doc, encoding="utf-8") as fh:
        blocks = re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)
    script = tmp_path / "semantics_md_example.py"  # rules compile from a real source file
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "semantics_md_example.py" in out and ": assert x.rank == 2" in out
    assert "with x.rank = 3" in out


# ------------------------------------------------------------------ the observed machine


class _Recorder:
    """An observer that writes down what the machine reports."""

    def __init__(self):
        self.events = []

    def step(self, kind, a, b, theta, phi):
        self.events.append(("step", kind, a))

    def fail(self, kind, a, b, theta, phi):
        self.events.append(("fail", kind, a))

    def choice(self):
        self.events.append(("choice",))

    def backtrack(self):
        self.events.append(("backtrack",))


def test_the_machine_reports_each_transition_to_its_observer():
    from pypm_jax.engine.machine import _observed

    g = PGuard(X, ECmp("==", EAttr("x", "rank"), EConst(2)))  # a has rank 2
    left, right = PApp(G2, (X, PConst(2))), PApp(G2, (X, Y))
    body = PConstr(PAlt(left, right), "x", g)
    rec = _Recorder()
    t = G2(A, B)
    theta, _, struct = next(_observed()(body, t, observer=rec))
    assert theta == {"x": A, "y": B} and struct == (t,)
    assert rec.events == [
        ("choice",),
        ("step", "match", left),
        ("step", "bind", X),
        ("fail", "match", PConst(2)),  # b is not the literal 2
        ("backtrack",),
        ("step", "match", right),
        ("step", "bind", X),
        ("step", "bind", Y),
        ("step", "constraint", "x"),
        ("step", "same", X),
        ("step", "guard", g),
    ]


def test_the_unobserved_machine_carries_no_observer_code():
    import dis

    from pypm_jax.engine import machine

    plain = {i.argval for i in dis.get_instructions(machine._trail_machine)}
    observed = {i.argval for i in dis.get_instructions(machine._observed())}
    assert "observer" not in plain and "_OBSERVED" not in plain
    assert {"observer", "step", "fail", "choice", "backtrack"} <= observed
    assert machine._observed().__globals__["_OBSERVED"] and not machine._OBSERVED
