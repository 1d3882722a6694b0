"""The rewrite driver: order, guards, single use, shared values, cycles, reports, revisits."""

from __future__ import annotations

import dataclasses
import re
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    EAttr,
    ECall,
    ECmp,
    EConst,
    GuardFn,
    PApp,
    Param,
    PatternDef,
    PConst,
    PGuard,
    PVar,
    RApp,
    RConst,
    RTuple,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax.core.errors import PyPMError, RewriteLimitError, SourceLoc
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import Operator, const
from pypm_jax.engine import rewrite as _rewrite
from pypm_jax.engine.rewrite import RewriteRecord, guarded_pattern, rewrite, rewrite_terms
from pypm_testing.engine import (
    F1,
    F2,
    F32,
    G2,
    H2,
    SPLIT,
    A,
    B,
    dags,
    guards,
    machine_backend,
    pattern_defs,
    same_type,
)

X, Y = PVar("x"), PVar("y")
FUSED = Operator("fused", 1, namespace="engine_tests", infer=same_type)
FUSED2 = Operator("fused2", 2, attrs=("rank",), namespace="engine_tests")  # types unknown
TRUE = EConst(True)


def pdef(name: str, body, *params: str) -> PatternDef:
    return PatternDef(name, tuple(Param(p) for p in params), body)


def rule(name: str, pattern: PatternDef, *branches, single_use: bool = False) -> RuleDef:
    bs = tuple(b if isinstance(b, RuleBranch) else RuleBranch(TRUE, b) for b in branches)
    return RuleDef(name, pattern, bs, single_use)


def rank_is(var: str, r: int) -> ECmp:
    return ECmp("==", EAttr(var, "rank"), EConst(r))


F1_X = pdef("F1x", PApp(F1, (X,)), "x")
F2_X = pdef("F2x", PApp(F2, (X,)), "x")
F1_TO_F2 = rule("f1_to_f2", F1_X, RApp(F2, (RVar("x"),)))
F2_TO_F1 = rule("f2_to_f1", F2_X, RApp(F1, (RVar("x"),)))


def test_rewrites_every_match_and_reports_it():
    g = Graph([G2(F1(A), F1(B))])
    loc = SourceLoc("model.py", 3, "h = f1(a)")
    g.outputs[0].inputs[0].node.loc = loc
    g.outputs[0].inputs[0].node.meta["module_path"] = "encoder/layer_0"
    result = rewrite(g, [F1_TO_F2])
    assert result.graph is g
    assert g.to_terms() == [G2(F2(A), F2(B))]
    first = result.report[0]
    assert isinstance(first, RewriteRecord)
    assert (first.rule, first.pattern, first.op) == ("f1_to_f2", "F1x", "f1")
    assert first.source == loc and first.module_path == "encoder/layer_0"
    assert first.replaced == (first.root,)
    assert result.report.counts() == {"f1_to_f2": 2}
    table = str(result.report)
    assert "f1_to_f2" in table and "model.py:3" in table and "encoder/layer_0" in table


def test_rules_in_order_first_whose_guard_passes_fires():
    p_rank3 = pdef("F1rank3", PGuard(PApp(F1, (X,)), rank_is("x", 3)), "x")
    never = rule("never", p_rank3, RApp(FUSED, (RVar("x"),)))
    branchy = rule(
        "branchy",
        F1_X,
        RuleBranch(rank_is("x", 5), RApp(FUSED, (RVar("x"),))),
        RuleBranch(rank_is("x", 2), RApp(F2, (RVar("x"),))),
    )
    later = rule("later", F1_X, RApp(FUSED, (RVar("x"),)))
    g = Graph([F1(A), F1(B)])  # a: rank 2, b: rank 1
    report = rewrite(g, [never, branchy, later]).report
    assert [r.rule for r in report] == ["branchy", "later"]
    assert g.to_terms() == [F2(A), FUSED(B)]


def test_interior_values_used_elsewhere_survive():
    pat = pdef("F1F2", PApp(F1, (PApp(F2, (X,)),)), "x")
    fuse = rule("fuse", pat, RApp(FUSED, (RVar("x"),)))
    inner = F2(A)
    g = Graph([F1(inner), G2(inner, B)])
    report = rewrite(g, [fuse]).report
    assert g.to_terms() == [FUSED(A), G2(inner, B)]  # F2(a) stays: G2 still reads it
    assert len(report[0].replaced) == 2
    g2 = Graph([F1(inner), G2(inner, B)])
    assert not rewrite(g2, [rule("fuse1", pat, RApp(FUSED, (RVar("x"),)), single_use=True)]).report
    g3 = Graph([F1(F2(B))])
    single = rule("fuse1", pat, RApp(FUSED, (RVar("x"),)), single_use=True)
    assert len(rewrite(g3, [single]).report) == 1 and g3.to_terms() == [FUSED(B)]


def test_single_use_rule_fires_once_the_other_reader_is_gone():
    pat = pdef("F1F2", PApp(F1, (PApp(F2, (X,)),)), "x")
    single = rule("fuse1", pat, RApp(FUSED, (RVar("x"),)), single_use=True)
    drop = rule("drop", pdef("G2xy", PApp(G2, (X, Y)), "x", "y"), RVar("y"))
    inner = F2(A)
    g = Graph([F1(inner), G2(inner, B)])
    report = rewrite(g, [single, drop]).report
    assert g.to_terms() == [FUSED(A), B]
    assert [r.rule for r in report] == ["drop", "fuse1"]  # fuse1 waited for drop


def test_the_reference_driver_needs_no_compiled_pattern(monkeypatch):
    from pypm_jax.engine import compiled

    def refuse(pdef):
        raise AssertionError(f"the reference driver compiled {pdef.name}")

    monkeypatch.setattr(compiled, "_compiled", type(compiled._compiled)(refuse))
    pat = pdef("F1F2", PApp(F1, (PApp(F2, (X,)),)), "x")
    single = rule("fuse1", pat, RApp(FUSED, (RVar("x"),)), single_use=True)
    g = Graph([F1(F2(B))])
    (record,) = rewrite(g, [single], engine="reference").report
    assert len(record.replaced) == 2 and g.to_terms() == [FUSED(B)]  # the match covers F2(b)
    inner = F2(A)
    shared = Graph([F1(inner), G2(inner, B)])  # F2(a), covered, is read outside the match
    assert not rewrite(shared, [single], engine="reference").report
    with pytest.raises(AssertionError, match="compiled F1F2"):
        rewrite(Graph([F1(F2(B))]), [single], engine="fast")


def test_cycles_raise_naming_the_rules_of_the_cycle():
    unrelated = rule("g2_to_h2", pdef("G2xy", PApp(G2, (X, Y)), "x", "y"),
                     RApp(H2, (RVar("x"), RVar("y"))))  # fmt: skip
    g = Graph([G2(A, B), F1(A)])
    with pytest.raises(RewriteLimitError) as info:
        rewrite(g, [unrelated, F1_TO_F2, F2_TO_F1], max_iterations=100)
    assert info.value.rules == ("f1_to_f2", "f2_to_f1")
    assert "f1_to_f2" in str(info.value) and "100" in str(info.value)


def test_rewrites_at_new_nodes_and_downstream():
    # f1 -> f2 creates the f2 that the next rule needs; g2(f2(x), y) -> h2 downstream
    to_h2 = rule("to_h2", pdef("G2F2", PApp(G2, (PApp(F2, (X,)), Y)), "x", "y"),
                 RApp(H2, (RVar("x"), RVar("y"))))  # fmt: skip
    f2_to_fused = rule("f2_fused", pdef("F2F2", PApp(F2, (PApp(F2, (X,)),)), "x"),
                       RApp(FUSED, (RVar("x"),)))  # fmt: skip
    g = Graph([G2(F1(A), B), F2(F1(A))])
    report = rewrite(g, [to_h2, f2_to_fused, F1_TO_F2]).report
    assert g.to_terms() == [H2(A, B), FUSED(A)]
    assert [r.rule for r in report] == ["f1_to_f2", "to_h2", "f2_fused"]


def test_revisiting_upstream_users_after_a_late_change():
    # the rewrite of a later node creates an f2(f2(a)) shape higher up: revisited
    top = rule("top", pdef("F1F2", PApp(F1, (PApp(F2, (X,)),)), "x"), RApp(FUSED, (RVar("x"),)))
    lift = rule("lift", pdef("G2", PApp(G2, (X, PConst(2))), "x"), RApp(F2, (RVar("x"),)))
    g = Graph([F1(G2(A, const(2)))])
    rewrite(g, [top, lift])
    assert g.to_terms() == [FUSED(A)]


def test_result_forms_and_types():
    ident = rule("mul1", pdef("H2x1", PApp(H2, (X, PConst(1))), "x"), RVar("x"))
    zero = rule("mul0", pdef("H2x0", PApp(H2, (X, PConst(0))), "x"), RConst(0.0))
    attr = rule(
        "fused2",
        pdef("G2xy", PApp(G2, (X, Y)), "x", "y"),
        RApp(FUSED2, (RVar("x"), RVar("y")), (("rank", EAttr("x", "rank")),)),
    )
    g = Graph([H2(A, const(1)), H2(A, const(0)), G2(A, B)])
    rewrite(g, [ident, zero, attr])
    one, zero_v, fused = g.outputs
    assert one is g.inputs[0]
    assert zero_v.node.attrs["value"] == 0.0 and zero_v.dtype is F32
    assert fused.op is FUSED2 and fused.attrs == {"rank": 2}
    assert fused.shape == (2, 3) and fused.dtype is F32  # unknown type: the old root's


def test_tuple_results_replace_every_output():
    swap = rule("swap", pdef("split", PApp(SPLIT, (X,), 0), "x"),
                RTuple((RApp(F1, (RVar("x"),)), RApp(F2, (RVar("x"),)))))  # fmt: skip
    s0, s1 = SPLIT(A)
    g = Graph([G2(s0, s1)])
    rewrite(g, [swap])
    assert g.to_terms() == [G2(F1(A), F2(A))]
    bad = rule("bad", swap.pattern, RTuple((RVar("x"),)))
    with pytest.raises(PyPMError):
        rewrite(Graph([s0]), [bad])


def test_result_using_an_unbound_name_is_an_error():
    bad = rule("bad", F1_X, RApp(F2, (RVar("nope"),)))
    with pytest.raises(PyPMError, match="bad"):
        rewrite(Graph([F1(A)]), [bad])


def test_identical_results_across_runs():
    def run() -> tuple[str, str]:
        terms = [G2(F1(A), F1(B)), F1(G2(F1(A), B)), H2(F1(F1(B)), A)]
        g = Graph(terms)
        report = rewrite(g, [F1_TO_F2]).report
        return str(g), str(report)

    assert run() == run()


def test_worklist_visits_each_node_about_once():
    t = A
    for i in range(2000):
        t = G2(F1(t), B) if i % 10 == 0 else G2(t, B)
    g = Graph([t])
    candidates = sum(1 for n in g.nodes() if n.op in (F1, G2))
    to_h2 = rule("to_h2", pdef("G2", PApp(G2, (PApp(F2, (X,)), Y)), "x", "y"),
                 RApp(H2, (RVar("x"), RVar("y"))))  # fmt: skip
    result = rewrite(g, [F1_TO_F2, to_h2])
    n_rewrites = len(result.report)
    assert n_rewrites == 400  # 200 f1 -> f2, then 200 g2(f2(x), b) -> h2
    # one sweep, plus a visit of each node a rewrite made: no re-scan per rewrite
    assert result.visits <= candidates + 2 * n_rewrites


def test_rewrite_terms_helper():
    terms, report = rewrite_terms([G2(F1(A), B)], [F1_TO_F2])
    assert terms == [G2(F2(A), B)] and len(report) == 1


def _outcome(pool, pdefs, guards_, engine, fallback=True):
    """Rewrite the pool's graph with one rule per pattern: a branch under the guard, then
    (with ``fallback``) an unconditional one; without, the guarded branch alone, which the
    fast driver matches within the pattern (see ``guarded_pattern``)."""
    g = Graph(pool[-3:])
    rules = [
        rule(
            f"r{i}",
            p,
            RuleBranch(guard, RApp(FUSED, (RVar("x"),))),
            *([RApp(F2, (RVar("y"),))] if fallback else []),
            single_use=i % 2 == 1,
        )
        for i, (p, guard) in enumerate(zip(pdefs, guards_, strict=True))
    ]
    try:
        report = rewrite(g, rules, engine=engine, max_iterations=60).report
        return str(g), [(r.rule, r.root, r.replaced, r.created) for r in report]
    except PyPMError as exc:
        return type(exc).__name__, str(exc)


@given(
    st.lists(st.tuples(pattern_defs(depth=2), guards(("x", "y"), ("F",))), min_size=1, max_size=3),
    dags(max_nodes=8),
    st.booleans(),
)
def test_fast_and_reference_engines_rewrite_identically(rules_, pool, fallback):
    # and so does the fast driver with every node's candidates narrowed by its signature,
    # every pattern on the machine (which carries the pre-check the narrowing reads)
    pdefs = [p for p, _ in rules_]
    gs = [g for _, g in rules_]
    reference = _outcome(pool, pdefs, gs, "reference", fallback)
    assert _outcome(pool, pdefs, gs, "fast", fallback) == reference
    with machine_backend(), mock.patch.object(_rewrite, "_NARROW_ABOVE", 0):
        assert _outcome(pool, pdefs, gs, "fast", fallback) == reference


def test_a_rule_list_is_prepared_once_and_follows_the_compile_cache():
    # what runs of one rule list share is made once; a branch guard compiled at its first
    # evaluation is the compiled one in the next run; patterns compiled again (another
    # backend) make it again, so a run always matches with what compile_pattern gives
    fresh = EConst(True)  # (a guard no other test has compiled)
    two = rule(
        "two",
        F1_X,
        RuleBranch(rank_is("x", 7), RVar("x")),
        RuleBranch(fresh, RApp(F2, (RVar("x"),))),
    )
    rules = (two,)
    prep = _rewrite._prepared(rules, True)
    assert prep is _rewrite._prepared(rules, True) and prep.pending == [(0, 0), (0, 1)]
    rewrite(Graph([G2(F1(A), B)]), rules)  # (both guards evaluated, so compiled)
    assert _rewrite._prepared(rules, True) is prep and prep.pending == []
    for b, holds, _ in prep.branches[0]:
        assert holds is _rewrite._compiled_guards(b.guard)
    with machine_backend():
        again = _rewrite._prepared(rules, True)
        assert again is not prep and {cp.backend for cp in again.compiled} == {"machine"}
    assert _rewrite._prepared(rules, False) is not _rewrite._prepared(rules, True)


def test_the_fast_driver_matches_the_guards_within_the_pattern():
    # a rule of one guarded branch is matched as its pattern under the guard (so a match
    # the rule does not take is given up inside the matcher); a rule with several branches
    # or an unconditional one, or whose guard reads a non-parameter, is left alone
    one = rule("one", F1_X, RuleBranch(rank_is("x", 2), RVar("x")))
    guarded = guarded_pattern(one)
    assert guarded is guarded_pattern(one)  # one per rule object
    assert guarded.body == PGuard(F1_X.body, rank_is("x", 2))
    assert (guarded.name, guarded.params) == (F1_X.name, F1_X.params)
    assert guarded_pattern(F1_TO_F2) is F1_X
    two = rule("two", F1_X, RuleBranch(rank_is("x", 1), RVar("x")),
               RuleBranch(rank_is("x", 2), RVar("x")))  # fmt: skip
    assert guarded_pattern(two) is F1_X
    stray = rule("stray", F1_X, RuleBranch(rank_is("z", 1), RVar("x")))
    assert guarded_pattern(stray) is F1_X
    # a guard function is called once per match (by the matcher), not again to fire
    calls = []
    counted = GuardFn("counted", lambda shape: calls.append(shape) or len(shape) == 2)
    once = rule("once", F1_X, RuleBranch(ECall(counted, (EAttr("x", "shape"),)), RVar("x")))
    terms, _ = rewrite_terms([F2(F1(A)), F1(B)], [once], engine="fast")
    assert terms == [F2(A), F1(B)] and calls == [A.shape, B.shape]
    # and the report still names the rule's own pattern
    terms, report = rewrite_terms([F2(F1(A)), F1(B)], [one])  # A has rank 2, B rank 1
    assert terms == [F2(A), F1(B)]
    assert [(r.rule, r.pattern) for r in report] == [("one", "F1x")]


def test_results_built_from_the_root_itself_make_no_cycle():
    # g2(x, y) -> f1(g2(x, y)): the result contains the root node, which keeps its inputs
    wrap = rule("wrap", pdef("G2xy", PApp(G2, (X, Y)), "x", "y"),
                RApp(F1, (RApp(G2, (RVar("x"), RVar("y"))),)))  # fmt: skip
    g = Graph([H2(G2(A, B), A)])
    assert len(rewrite(g, [wrap]).report) == 1
    assert g.to_terms() == [H2(F1(G2(A, B)), A)]
    g.nodes()  # still a DAG (a cycle would raise here)
    wrap_any = rule("wrap_any", pdef("any", X, "x"), RApp(F1, (RVar("x"),)))
    with pytest.raises(RewriteLimitError) as info:
        rewrite(Graph([G2(A, B)]), [wrap_any], max_iterations=20)
    assert info.value.rules == ("wrap_any",)


def test_graphs_whose_ids_do_not_follow_the_order():
    g = Graph([G2(F1(A), B)])
    (out,) = g.outputs
    late = g.add_node(F1, [g.add_node(F1, [g.inputs[1]]).outputs[0]]).outputs[0]
    g.replace_all_uses(out.inputs[0], late)  # g2 (old id) now reads nodes with newer ids
    assert [n.id for n in g.nodes()] != sorted(n.id for n in g.nodes())
    twice = rule("f1f1", pdef("F1F1", PApp(F1, (PApp(F1, (X,)),)), "x"), RApp(FUSED, (RVar("x"),)))
    report = rewrite(g, [twice, F1_TO_F2]).report
    # inputs first: the inner f1 becomes f2 before the outer one is looked at
    assert repr(g.to_terms()) == repr([G2(F2(F2(B)), B)])  # (g2 keeps its old type)
    assert [r.rule for r in report] == ["f1_to_f2", "f1_to_f2"]
    g2 = Graph([G2(F1(A), B)])
    (out,) = g2.outputs
    late = g2.add_node(F1, [g2.add_node(F1, [g2.inputs[1]]).outputs[0]]).outputs[0]
    g2.replace_all_uses(out.inputs[0], late)
    assert [r.rule for r in rewrite(g2, [twice]).report] == ["f1f1"]
    assert repr(g2.to_terms()) == repr([G2(FUSED(B), B)])


_DETERMINISM_SCRIPT = """
from pypm_testing.engine import F1, F2, G2, H2, A, B
from pypm_jax.core.calculus import PApp, Param, PatternDef, PVar, RApp, RuleBranch, RuleDef, RVar
from pypm_jax.core.calculus import EConst
from pypm_jax.core.graph import Graph
from pypm_jax.engine.rewrite import rewrite
from pypm_jax.engine.explain import explain
x, y = PVar("x"), PVar("y")
p1 = PatternDef("F1x", (Param("x"),), PApp(F1, (x,)))
p2 = PatternDef("G2F2", (Param("x"), Param("y")), PApp(G2, (PApp(F2, (x,)), y)))
rules = [
    RuleDef("a", p1, (RuleBranch(EConst(True), RApp(F2, (RVar("x"),))),)),
    RuleDef("b", p2, (RuleBranch(EConst(True), RApp(H2, (RVar("x"), RVar("y")))),)),
]
t = A
for i in range(300):
    t = G2(F1(t), B) if i % 3 else H2(F1(F1(t)), G2(t, B))
g = Graph([t, F1(B)])
print(explain(p2, g))
result = rewrite(g, rules)
print(g)
print(result.report)
"""


def test_identical_across_processes_with_different_hash_seeds(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parents[1]
    script = tmp_path / "determinism.py"
    script.write_text(_DETERMINISM_SCRIPT)
    outputs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests.parent)])
        run = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
        )
        outputs.append(run.stdout)
    assert outputs[0] == outputs[1]
    assert "a " in outputs[0] and len(outputs[0].splitlines()) > 300


# -- fixpoints ---------------------------------------------------------------------------

COLLAPSE = rule(
    "collapse",
    pdef("F1F1", PApp(F1, (PApp(F1, (X,)),)), "x"),
    RApp(F1, (RVar("x"),)),
)


@pytest.mark.parametrize("depth", range(1, 8))
def test_collapsing_a_chain_reaches_the_fixpoint(depth, engine):
    # f1(f1(x)) -> f1(x) on f1^n(a): replacing f1^2 by f1 turns the f1^3 above it into a
    # hash-cons duplicate of the f1^2 being replaced; the merged node must be revisited
    t = A
    for _ in range(depth):
        t = F1(t)
    g = Graph([t])
    report = rewrite(g, [COLLAPSE], engine=engine).report
    assert g.to_terms() == [F1(A)]
    assert len(report) == depth - 1


@given(
    st.lists(st.tuples(pattern_defs(depth=2), guards(("x", "y"), ("F",))), min_size=1, max_size=3),
    dags(max_nodes=8),
)
def test_a_rewritten_graph_is_a_fixpoint(rules_, pool):
    # whatever the rules, rewriting the result again fires nothing
    g = Graph(pool[-3:])
    rules = [
        rule(f"r{i}", p, RuleBranch(guard, RApp(FUSED, (RVar("x"),))), RApp(F2, (RVar("x"),)))
        for i, (p, guard) in enumerate(rules_)
    ]
    try:
        rewrite(g, rules, max_iterations=60)
    except PyPMError:
        return  # cycling rule sets (or results using unbound names) are tested elsewhere
    before = str(g)
    assert not rewrite(g, rules, max_iterations=60).report
    assert str(g) == before


def test_a_root_read_by_its_own_result_is_revisited_when_it_gains_a_reader(engine):
    # wrap: x → fused(x) leaves x in the graph, read by fused(x) only (then it is a fixpoint
    # for wrap); unwrap: fused(x) → f2(x) gives x a new reader, so wrap applies again, and
    # again: a cycle, which the driver must report instead of stopping half way (found by
    # test_a_rewritten_graph_is_a_fixpoint)
    wrap = rule(
        "wrap",
        pdef("X", X, "x"),
        RuleBranch(ECmp("==", EAttr("x", "dtype"), EConst(F32)), RApp(FUSED, (RVar("x"),))),
    )
    unwrap = rule("unwrap", pdef("Fx", PApp(FUSED, (X,)), "x"), RApp(F2, (RVar("x"),)))
    g = Graph([const(0.5, dtype="f32"), const(2)])
    with pytest.raises(RewriteLimitError) as info:
        rewrite(g, [unwrap, wrap], max_iterations=40, engine=engine)
    assert "wrap" in str(info.value) and "unwrap" in str(info.value)


def test_a_long_run_logs_its_progress(engine, monkeypatch, caplog):
    """A run still going after ``PROGRESS_SECONDS`` says how far it got (logger
    ``pypm_jax.rewrite``, INFO); here every 2 visits, the clock never waited for."""
    import logging

    from pypm_jax.engine import rewrite as _rewrite

    monkeypatch.setattr(_rewrite, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(_rewrite, "_PROGRESS_STRIDE", 2)
    g = Graph([G2(F1(F1(A)), F1(B)), F1(F2(A)), F1(F2(B)), F1(F1(F1(B)))])
    with caplog.at_level(logging.INFO, logger="pypm_jax.rewrite"):
        report = rewrite(g, [F1_TO_F2], engine=engine).report
    lines = [r.getMessage() for r in caplog.records if r.name == "pypm_jax.rewrite"]
    form = re.compile(
        r"rewriting: (\d+) of (\d+) nodes swept, \d+ revisits queued, (\d+) rewrites, \d+ s"
    )
    found = [form.fullmatch(m) for m in lines]
    assert len(lines) >= 2 and all(found), lines  # every 2nd visit logs
    swept = [int(m[1]) for m in found]
    done = [int(m[3]) for m in found]
    assert swept == sorted(swept) and done == sorted(done) and done[-1] < len(report)
    assert {int(m[2]) for m in found} == {7}  # the F1 nodes: those the rule can start at
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pypm_jax.rewrite"):
        monkeypatch.setattr(_rewrite, "PROGRESS_SECONDS", 3600.0)
        rewrite(Graph([F1(F1(A))]), [F1_TO_F2], engine=engine)
    assert not [r for r in caplog.records if r.name == "pypm_jax.rewrite"]  # a short run: quiet


def test_guards_read_the_term_and_reports_show_what_built_nodes_describe():
    """``x.term`` hands a guard function the bound term itself; an operator's ``describe``
    is the report's detail for the nodes a rule built."""
    import pypm_jax as pm

    @pm.guard_fn("tests.depth")
    def depth(t):
        return 1 + max((depth(i) for i in t.inputs), default=0)

    @pm.op(attrs=("n",), describe=lambda n: f"{n} deep")
    def Deep(x):  # noqa: N802
        return 1

    @pm.op
    def Step(x):  # noqa: N802
        return 1

    @pm.op
    def Other(x):  # noqa: N802
        return 1

    @pm.pattern
    def TwoSteps(x):
        return Step(Step(x))

    @pm.rule(TwoSteps)
    def collapse(x):
        return Deep(x, n=depth(x.term))

    a = pm.leaf("a", shape=(2,), dtype="f32")
    result = pm.rewrite(pm.Graph([Step(Step(Other(Other(a))))]), [collapse])
    (record,) = result.report
    assert record.detail == "3 deep"  # x = Other(Other(a))
    assert str(result.report).splitlines()[-1] == "  3 deep"  # under its row
    assert str(record).endswith(": 3 deep")


def test_the_drivers_record_maker_sets_every_field():
    from pypm_jax.engine.rewrite import _record

    values = ("r", "p", 3, (3, 1), SourceLoc("f.py", 2), "m", "add", (7,), (), "d")
    fields = [f.name for f in dataclasses.fields(RewriteRecord)]
    assert len(fields) == len(values)  # a new field must be added to _record too
    made = _record(*values)
    assert [getattr(made, f) for f in fields] == list(values)
    assert made == RewriteRecord(*values)
