"""Explain: the deepest partial match and the reason it stopped, as data and as text."""

from __future__ import annotations

from engine_helpers import F1, F2, G2, H2, A, B

from pypm_jax._calculus import (
    EAttr,
    ECmp,
    EConst,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PCall,
    PConst,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
)
from pypm_jax._errors import SourceLoc
from pypm_jax._explain import explain
from pypm_jax._graph import Graph
from pypm_jax._terms import Operator, const, leaf

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
