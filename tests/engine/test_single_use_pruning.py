"""Single use refused a match at a root: the rest of the search leaves out the matches that
cover a *doomed* value (read outside every match there), and rewrites as the full search.

The driver (``_Driver.doomed``, ``MatchRun.forbid``) must fire exactly what the full search
fires: these tests compare it with the full search and with the reference engine on random
rules and graphs, run both on generated code and on the machine (which honours ``forbid``).
A rule with an *anchor* (a variable its guards read, bound only as an operand of some
operators: ``rule_anchor``) does not start the machine where no such operator is reached
from the root without crossing a doomed value (``_Driver.anchored``).
"""

from __future__ import annotations

import contextlib
import functools
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    ECall,
    ECmp,
    EConst,
    EOr,
    GuardFn,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PCall,
    PConstr,
    PExists,
    PGuard,
    PMu,
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
from pypm_jax.engine import compiled as _compiled_module
from pypm_jax.engine import rewrite as _rewrite
from pypm_jax.engine.analysis import _binders, _guard_needs, _NotKnown, admits, rule_anchor
from pypm_jax.engine.rewrite import rewrite
from pypm_testing import budget
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


# ---------------------------------------------------------------------------- anchors

HOLDS = GuardFn("holds", lambda term: True)
READS_X = ECall(HOLDS, (EAttr("x", "term"),))  # (holds wherever x is bound)


def test_what_a_guard_that_holds_has_read():
    x, y, z = (EAttr(v, "rank") for v in "xyz")
    assert _guard_needs(EAnd((ECmp("==", x, EConst(1)), y))) == {"x", "y"}
    # an ``or`` that holds read its first item and the one that holds
    assert _guard_needs(EOr((x, EAnd((y, z)), z))) == {"x"}
    assert _guard_needs(EOr((EAnd((x, z)), EAnd((y, z)), z))) == {"x", "z"}
    assert _guard_needs(ECall(HOLDS, (EAttr("y", "term"),))) == {"y"}
    assert _guard_needs(EConst(True)) == frozenset()


def test_the_operators_that_bind_a_variable():
    body = PAlt(PApp(F1, (PApp(G2, (X, Y)),)), PExists("e", PApp(F2, (PApp(G2, (Y, X)),))))
    assert _binders(body, "x") == {G2}
    # through a definition's parameters, and its recursion
    down = PAlt(PApp(F1, (PVar("p"),)), PApp(F2, (PCall("Down", ("p",)),)))
    mu = PMu("Down", (Param("p"),), ("x",), down)
    assert _binders(mu, "x") == {F1}
    # bound as the matched term itself, or as the term a constraint reads: not known
    for unknown in (PAlt(PApp(F1, (X,)), X), PConstr(PApp(F1, (Y,)), "y", X)):
        try:
            _binders(unknown, "x")
        except _NotKnown:
            continue
        raise AssertionError(f"{unknown} binds x where no operator says")


def test_the_region_rules_anchor_is_the_gemm():
    from pypm_jax.lang.frontend import as_rule_def
    from pypm_jax.rules import default_rules
    from pypm_jax.rules._kernels import GemmRegion
    from pypm_jax.vocab import primitives as P

    (rule,) = [r for r in default_rules() if r.name == "gemm_epilogue_region"]
    var, roots = rule_anchor(as_rule_def(rule))
    assert var == "x"
    assert admits(roots, P.dot_general, 2) and admits(roots, GemmRegion, 3)
    assert not admits(roots, P.mul, 2) and not admits(roots, P.erfc, 1)


def test_a_search_that_cannot_reach_its_anchor_is_not_started():
    # d = g2(a, b) is read by two chains; each chain's match covers d, which the other
    # chain reads: refused at the first root (the rule arms), then at the second root the
    # anchor (x, bound only under g2) lies below d, which is doomed there: no machine
    d = G2(A, B)
    first, second = F1(F1(d)), F1(F2(d))
    pdef = PatternDef("chain", (Param("x"), Param("y")), PAlt(
        PApp(F1, (PApp(F1, (PApp(G2, (X, Y)),)),)),
        PApp(F1, (PApp(F2, (PApp(G2, (X, Y)),)),))))  # fmt: skip
    rules = [single("chain", pdef, RApp(FUSED, (RVar("x"),)), guard=READS_X)]
    starts = []
    machine = _compiled_module._trail_machine

    def counted(body, t, **kw):
        starts.append(t)
        return machine(body, t, **kw)

    with machine_backend(), mock.patch.object(_compiled_module, "_trail_machine", counted):
        pruned = _outcome([first, second], rules)
        anchored = len(starts)
        with mock.patch.object(_rewrite._Driver, "anchored", lambda self, *_: True):
            assert _outcome([first, second], rules) == pruned
        assert len(starts) == 2 * anchored + 1  # the second root's search, unanchored
    assert anchored == 1
    with machine_backend(), full_search():
        assert pruned == _outcome([first, second], rules)
    assert pruned == _outcome([first, second], rules, engine="reference")
    assert pruned[1] == []  # single use refuses both


@st.composite
def chains(draw) -> PatternDef:
    """Two or three ways of matching a unary root: chains of f1 and f2 (each link one of
    them or either) down to ``g2`` of variables (x only there: the rules' anchor is g2) or
    down to a variable."""
    body = None
    for _ in range(draw(ints(2, 3))):
        if draw(ints(0, 3)) == 0:
            p = PVar("e")
        else:
            p = PApp(G2, (PVar(draw(_VARS)), PVar(draw(_VARS))))
        for _ in range(draw(ints(1, 3))):
            k = draw(ints(0, 2))  # f1, f2 or either
            p = PApp((F1, F2)[k], (p,)) if k < 2 else PAlt(PApp(F1, (p,)), PApp(F2, (p,)))
        alt = PExists("e", p)
        body = alt if body is None else PAlt(body, alt)
    return PatternDef("chain", (Param("x"), Param("y")), body)


@st.composite
def chain_dags(draw) -> list:
    """The outputs of a graph of chains: f1 and f2 links over ``g2`` nodes (of a, b or
    each other) that several chains share (a chain's match covers a base that other chains
    read: single use refuses it, and the next chain's anchor lies below a doomed value),
    and over each other's links; some of the bases are outputs too."""
    bases: list = []
    for _ in range(draw(ints(1, 3))):
        pick = sampled([A, B, *bases])
        bases.append(G2(draw(pick), draw(pick)))
    tops: list = []
    for _ in range(draw(ints(2, 5))):
        t = draw(sampled(bases + tops))
        for _ in range(draw(ints(1, 3))):
            t = (F1, F2)[draw(ints(0, 1))](t)
        tops.append(t)
    return tops + draw(st.lists(sampled(bases), max_size=1))


@settings(max_examples=budget.examples(ci=600, dev=100, fast=20))  # (a third skip: ~200)
@given(st.lists(chains(), min_size=1, max_size=3), chain_dags())
def test_anchored_searches_rewrite_as_the_full_search(pdefs, outs):
    """Single-use rules whose guards read x, which only g2 binds, over shared chains: where
    the driver starts no machine, the full search fires nothing there either."""
    rules = [
        single(f"r{i}", p, RApp(FUSED, (RVar("x"),)) if i % 2 else RConst(2.0), READS_X)
        for i, p in enumerate(pdefs)
    ]
    pruned, full = pruned_and_full(outs, rules, True)
    assert pruned == full
    assert pruned == _outcome(outs, rules, engine="reference")


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
