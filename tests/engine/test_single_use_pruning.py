"""Single use refused a match at a root: the rest of the search leaves out the matches that
cover a *doomed* value (read outside every match there), and rewrites as the full search.

The driver (``_Driver.doomed``, ``MatchRun.forbid``) must fire exactly what the full search
fires: these tests compare it with the full search and with the reference engine on random
rules and graphs, run both on generated code and on the machine (which honours ``forbid``).
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    EAttr,
    ECall,
    EConst,
    GuardFn,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PExists,
    PGuard,
    PVar,
    RApp,
    RConst,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax.core.errors import PyPMError
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import Operator
from pypm_jax.engine import rewrite as _rewrite
from pypm_jax.engine.rewrite import rewrite
from pypm_testing.draws import BOOLS, ints, sampled
from pypm_testing.engine import (
    F1,
    F2,
    G2,
    A,
    B,
    dags,
    guards,
    machine_backend,
    pattern_defs,
    same_type,
)

X, Y = PVar("x"), PVar("y")
FUSED = Operator("fused_p", 1, namespace="pruning_tests", infer=same_type)


@contextlib.contextmanager
def full_search():
    """The driver without pruning: nothing is doomed."""
    with mock.patch.object(_rewrite._Driver, "doomed", lambda self, root: None):
        yield


def single(name: str, pdef: PatternDef, result, guard=None) -> RuleDef:
    branch = RuleBranch(EConst(True) if guard is None else guard, result)
    return RuleDef(name, pdef, (branch,), True)


def _outcome(g_terms, rules, engine="fast"):
    g = Graph(g_terms)
    try:
        report = rewrite(g, rules, engine=engine, max_iterations=60).report
        return str(g), [(r.rule, r.root, r.replaced, r.created) for r in report]
    except PyPMError as exc:
        return type(exc).__name__, str(exc)


# --------------------------------------------------------------------------- examples

D = F1(A)  # read by the root g2(d, d) and by f2(d), which no match at the root covers
ROOT = G2(D, D)
OTHER = F2(D)


def test_a_solution_whose_parameters_a_left_out_one_had_does_not_fire():
    # a: g2(f1(x), y) covers d: refused (the root is blocked, pruning starts)
    # b: ∃z w. g2(f1(z), w) covers d: refused in the full search, left out when pruning
    # c: ∃z. g2(z, z) has b's parameters (none bound): the full search drops it as a
    #    repeat, so nothing fires; left to itself, the pruned search would fire it
    a = PApp(G2, (PApp(F1, (X,)), Y))
    b = PExists("z", PExists("w", PApp(G2, (PApp(F1, (PVar("z"),)), PVar("w")))))
    c = PExists("z", PApp(G2, (PVar("z"), PVar("z"))))
    pdef = PatternDef("abc", (Param("x"), Param("y")), PAlt(PAlt(a, b), c))
    rules = [single("abc", pdef, RConst(2.0))]
    calls = []
    try_all = _rewrite._Driver.try_all

    def counted(self, *args):
        calls.append(args[0])
        return try_all(self, *args)

    with machine_backend(), mock.patch.object(_rewrite._Driver, "try_all", counted):
        pruned = _outcome([ROOT, OTHER], rules)
    assert calls == [0]  # c would have fired: the search ran again in full
    with machine_backend(), full_search():
        assert pruned == _outcome([ROOT, OTHER], rules)
    assert pruned == _outcome([ROOT, OTHER], rules, engine="reference")
    assert pruned[1] == []  # nothing fired


def test_matches_covering_a_doomed_value_are_not_searched_after_a_refusal():
    # the second alternate's guard sits below d: the full search checks it (and single use
    # refuses the match), the pruned search never reaches it
    seen = []
    probe = GuardFn("probe", lambda term: seen.append(term) or True)
    first = PApp(G2, (PApp(F1, (X,)), Y))
    second = PApp(G2, (PGuard(PApp(F1, (X,)), ECall(probe, (EAttr("x", "term"),))), PVar("z")))
    pdef = PatternDef("two", (Param("x"), Param("y")), PAlt(first, PExists("z", second)))
    rules = [single("two", pdef, RApp(FUSED, (RVar("x"),)))]
    with machine_backend():
        pruned = _outcome([ROOT, OTHER], rules)
    assert seen == []
    with machine_backend(), full_search():
        full = _outcome([ROOT, OTHER], rules)
    assert len(seen) == 1
    assert pruned == full and full[1] == []


def test_a_reader_ranked_before_the_root_is_outside_when_the_root_does_not_read_it():
    # x + 1 read by neg(x + 1) and by (x + 1) * 0.5 built first: the exact GELU's shape
    d = F1(A)
    early = G2(d, B)  # read first, ranked before the root
    root = F2(d)
    out = G2(early, root)
    pdef = PatternDef("f2f1", (Param("x"),), PApp(F2, (PApp(F1, (X,)),)))
    rules = [single("f2f1", pdef, RApp(FUSED, (RVar("x"),)))]
    g = Graph([out])
    driver = _rewrite._Driver(g, tuple(rules), "fast", 100)
    driver.mark0, driver.rank_of = g.next_id, None
    if not g.id_ordered:
        driver.rank_of = {n.id: i for i, n in enumerate(g.nodes())}
    (v,) = [n.outputs[0] for n in g.nodes() if n.op is F2]
    doomed = driver.doomed(v)
    d_value = v.inputs[0]
    assert doomed is not None and doomed(d_value)
    assert not doomed(v)  # the root itself never is
    # a value only the root reads is not doomed
    g1 = Graph([F1(G2(A, B))])
    only = _rewrite._Driver(g1, tuple(rules), "fast", 100)
    only.mark0, only.rank_of = g1.next_id, None
    (top,) = g1.outputs
    assert not only.doomed(top)(top.inputs[0])
    with full_search():
        assert _outcome([out], rules) == _outcome([out], rules, engine="reference")


# ---------------------------------------------------------------------------- properties


def pruned_and_full(outs, rules, machine: bool) -> tuple:
    """The outcome of rewriting ``outs`` with ``rules`` (compiled for the machine or not),
    and with the pruning switched off."""
    with machine_backend(machine):
        pruned = _outcome(outs, rules)
        with full_search():
            return pruned, _outcome(outs, rules)


@st.composite
def shared_dags(draw) -> list:
    """Terms of f1 and g2 over a and b, later ones reading earlier ones (much sharing)."""
    pool = [A, B]
    for _ in range(draw(ints(3, 12))):
        pick = sampled(pool)
        pool.append(F1(draw(pick)) if draw(BOOLS) else G2(draw(pick), draw(pick)))
    return pool


_VARS = st.sampled_from(("x", "y", "e"))


@functools.cache  # (one strategy object per arguments: drawn unvalidated)
@st.composite
def covering(draw, depth: int = 2, app: bool = False):
    """A pattern of f1 and g2 down to variables (x, y, or the ∃-bound e); ``app``: an
    application here (below a root: a match that covers an interior value)."""
    if not app and (depth <= 0 or draw(ints(0, 2)) == 0):
        return PVar(draw(_VARS))
    if draw(BOOLS):
        return PApp(F1, (draw(covering(depth - 1)),))
    below = [draw(covering(depth - 1)), draw(covering(depth - 1))]
    return PApp(G2, tuple(below if draw(BOOLS) else below[::-1]))


@st.composite
def alternates(draw) -> PatternDef:
    """Two to four ways of matching a root, some binding the same parameters (so the
    driver drops repeats), maybe guarded."""
    body = None
    for _ in range(draw(ints(2, 4))):
        below = [draw(covering(draw(ints(1, 2)), app=True)), draw(covering(1))]
        if draw(BOOLS):
            root = PApp(F1, (below[0],))
        else:
            root = PApp(G2, tuple(below if draw(BOOLS) else below[::-1]))
        alt = PExists("e", root)
        if draw(ints(0, 3)) == 0:
            alt = PGuard(alt, draw(guards(("x", "y"), ("F",))))
        body = alt if body is None else PAlt(body, alt)
    return PatternDef("alts", (Param("x"), Param("y")), body)


@given(
    st.lists(alternates(), min_size=1, max_size=3),
    shared_dags(),
    st.data(),
    st.booleans(),
)
def test_pruning_on_shared_values_rewrites_as_the_full_search(pdefs, pool, data, machine):
    """Rules with several matches per root over a graph with much sharing (and values read
    by graph outputs), so that single use refuses and the pruned search leaves matches out;
    results that read a parameter or none."""
    outs = pool[-2:] + data.draw(st.lists(st.sampled_from(pool[2:]), max_size=3))
    rules = [
        single(f"r{i}", p, RApp(FUSED, (RVar("x"),)) if i % 2 else RConst(2.0))
        for i, p in enumerate(pdefs)
    ]
    pruned, full = pruned_and_full(outs, rules, machine)
    assert pruned == full
    assert pruned == _outcome(outs, rules, engine="reference")


@given(
    st.lists(st.tuples(pattern_defs(depth=2), guards(("x", "y"), ("F",))), min_size=1, max_size=3),
    dags(max_nodes=8),
    st.data(),
    st.booleans(),
)
def test_pruned_rewrites_are_the_full_searchs_and_the_references(rules_, pool, data, machine):
    """Every rule single-use; graph outputs that read interior values (so single use
    refuses); patterns compiled to generated code or run on the machine."""
    outs = pool[-3:] + data.draw(st.lists(st.sampled_from(pool), max_size=3))
    rules = [
        single(f"r{i}", p, RApp(FUSED, (RVar("x"),)), guard=g) for i, (p, g) in enumerate(rules_)
    ]
    pruned, full = pruned_and_full(outs, rules, machine)
    assert pruned == full
    assert pruned == _outcome(outs, rules, engine="reference")
