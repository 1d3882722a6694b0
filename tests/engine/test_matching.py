"""Matching, construct by construct, against both engines (the shared ``engine`` fixture)."""

from __future__ import annotations

import tracemalloc
from unittest import mock

import pytest

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    ECall,
    ECmp,
    EConst,
    EOpAttr,
    EOr,
    GuardFn,
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
from pypm_jax.core.errors import PatternDefinitionError
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import OpClass, Operator, const, leaf
from pypm_jax.engine import codegen as _codegen
from pypm_jax.engine import compiled as _compiled
from pypm_jax.engine import fast as _fast
from pypm_jax.engine import machine as _trail
from pypm_jax.engine import precheck as _precheck
from pypm_jax.engine.analysis import OpSpec, root_set
from pypm_jax.engine.fast import CompiledPattern, Matcher, MatchRun, compile_pattern
from pypm_jax.engine.select import match_all, match_first
from pypm_testing.engine import CAT, F1, F2, F32, G2, H2, SPLIT, A, B, C, same_type

X, Y, Z = PVar("x"), PVar("y"), PVar("z")
STR = GuardFn("str", str)


def pdef(body, *params: str | tuple[str, str]) -> PatternDef:
    ps = tuple(Param(p) if isinstance(p, str) else Param(*p) for p in params)
    return PatternDef("P", ps, body)


def rank_is(var: str, r: int) -> ECmp:
    return ECmp("==", EAttr(var, "rank"), EConst(r))


def chain_pattern() -> PatternDef:
    """μU(x, f). f(U(x, f)) ‖ f(x): a chain of one unary operator."""
    body = PMu(
        "U",
        (Param("x"), Param("f", "op")),
        ("x", "f"),
        PAlt(PFunVar("f", (PCall("U", ("x", "f")),)), PFunVar("f", (X,))),
    )
    return PatternDef("UnaryChain", (Param("x"), Param("f", "op")), body)


# ------------------------------------------------------------------------------ constructs


def test_variables_bind_and_nonlinear_means_same_value(engine):
    p = pdef(PApp(G2, (X, X)), "x")
    assert match_first(p, G2(A, A), engine=engine)["x"] is A
    assert match_first(p, G2(A, B), engine=engine) is None


def test_operator_mismatch_arity_and_index(engine):
    assert match_first(pdef(PApp(F1, (X,)), "x"), F2(A), engine=engine) is None
    s0, s1 = SPLIT(A)
    p1 = pdef(PApp(SPLIT, (X,), 1), "x")
    assert match_first(p1, s1, engine=engine)["x"] is A
    assert match_first(p1, s0, engine=engine) is None
    p_cat = pdef(PApp(CAT, (X, Y)), "x", "y")
    assert match_first(p_cat, CAT(A, B), engine=engine)["y"] is B
    assert match_first(p_cat, CAT(A, B, C), engine=engine) is None


def test_alternates_are_tried_left_to_right(engine):
    p = pdef(PAlt(PApp(G2, (X, Y)), PApp(G2, (Y, X))), "x", "y")
    t = G2(A, B)
    first = match_first(p, t, engine=engine)
    assert (first["x"], first["y"]) == (A, B)
    assert [(m["x"], m["y"]) for m in match_all(p, t, engine=engine)] == [(A, B), (B, A)]


def test_match_all_drops_repeated_parameters(engine):
    # both alternates bind the same x: one visible solution
    p = pdef(PAlt(PApp(F1, (X,)), PApp(F1, (X,))), "x")
    assert len(list(match_all(p, F1(A), engine=engine))) == 1


def test_backtracking_across_siblings(engine):
    # the first alternate of the first argument binds x wrongly for the second argument
    p = pdef(PApp(G2, (PAlt(PApp(F1, (X,)), X), X)), "x")
    t = G2(F1(A), F1(A))
    assert match_first(p, t, engine=engine)["x"] is F1(A)


def test_guards_false_and_undefined_do_not_hold(engine):
    p = pdef(PGuard(PApp(F1, (X,)), rank_is("x", 2)), "x")
    assert match_first(p, F1(A), engine=engine)["x"] is A  # a: rank 2
    assert match_first(p, F1(B), engine=engine) is None  # b: rank 1
    assert match_first(p, F1(C), engine=engine) is None  # c: no shape: undefined


def test_guard_runs_where_the_machine_puts_it(engine):
    # the guard on x reads y, which is bound only later: undefined, so no match
    inner = PGuard(X, rank_is("y", 2))
    p = pdef(PApp(G2, (inner, Y)), "x", "y")
    assert match_first(p, G2(A, A), engine=engine) is None
    p_late = pdef(PGuard(PApp(G2, (X, Y)), rank_is("y", 2)), "x", "y")
    assert match_first(p_late, G2(A, A), engine=engine) is not None


def test_existentials_must_be_bound(engine):
    p = pdef(PExists("e", PApp(F1, (PVar("e"),))))
    m = match_first(p, F1(A), engine=engine)
    assert m is not None and m.theta["e"] is A
    unbound = pdef(PExists("e", PApp(F1, (X,))), "x")
    assert match_first(unbound, F1(A), engine=engine) is None


def test_match_constraints(engine):
    p = pdef(PExists("e", PConstr(PApp(F1, (PVar("e"),)), "e", PApp(F2, (X,)))), "x")
    assert match_first(p, F1(F2(A)), engine=engine)["x"] is A
    assert match_first(p, F1(F1(A)), engine=engine) is None
    unbound = pdef(PConstr(PApp(F1, (Y,)), "x", PApp(F2, (Z,))), "y")
    assert match_first(unbound, F1(F2(A)), engine=engine) is None


def test_operator_variables(engine):
    p = pdef(PFunVar("F", (PFunVar("F", (X,)),)), "x", ("F", "op"))
    m = match_first(p, F1(F1(A)), engine=engine)
    assert m["F"] is F1 and m["x"] is A
    assert match_first(p, F1(F2(A)), engine=engine) is None
    s0, _ = SPLIT(A)
    assert match_first(pdef(PFunVar("F", (X,), 0, 2), "x"), s0, engine=engine) is not None
    assert match_first(pdef(PFunVar("F", (X,), 0, 1), "x"), s0, engine=engine) is None
    assert match_first(pdef(PFunVar("F", (X, Y, Z)), "x"), CAT(A, B, C), engine=engine)
    guard = ECmp("==", EOpAttr("F", "op_class"), EConst(F2.op_class))
    q = pdef(PGuard(PFunVar("F", (X,)), guard), "x", ("F", "op"))
    assert match_first(q, F2(A), engine=engine)["F"] is F2
    assert match_first(q, F1(A), engine=engine) is None


def test_literals_round_to_the_terms_float_type(engine):
    p = pdef(PApp(G2, (X, PConst(1.4142135623730951))), "x")
    assert match_first(p, G2(A, const(1.4142135, dtype="f32")), engine=engine) is not None
    assert match_first(p, G2(A, const(1.5, dtype="f32")), engine=engine) is None
    two = pdef(PApp(H2, (X, PConst(2))), "x")
    assert match_first(two, H2(A, const(2.0)), engine=engine) is not None


def test_sub_pattern_calls_name_their_locals_freshly(engine):
    # Half(p) = ∃e. (Div-like(p, 2) ‖ Mul-like(p, 0.5)) with e bound by a constraint
    half_body = PExists(
        "e",
        PConstr(
            PVar("e"),
            "e",
            PAlt(PApp(G2, (PVar("p"), PConst(2))), PApp(H2, (PVar("p"), PConst(0.5)))),
        ),
    )
    half = PMu("Half", (Param("p"),), ("x",), half_body)
    p = pdef(PApp(F1, (half,)), "x")
    t = F1(H2(A, const(0.5)))
    m = match_first(p, t, engine=engine)
    assert m is not None and m["x"] is A
    assert set(m.theta) == {"x", "e#1"} and m.theta["e#1"] is H2(A, const(0.5))
    # two calls: two unfoldings, two fresh names
    twice = pdef(PApp(G2, (half, half)), "x")
    m2 = match_first(twice, G2(H2(A, const(0.5)), G2(A, const(2))), engine=engine)
    assert m2 is not None and set(m2.theta) == {"x", "e#1", "e#2"}


def test_sub_pattern_with_operator_argument(engine):
    body = PFunVar("H", (PVar("p"),))
    call = PMu("S", (Param("p"), Param("H", "op")), ("x", F2), body)
    p = pdef(PApp(F1, (call,)), "x")
    assert match_first(p, F1(F2(A)), engine=engine)["x"] is A
    assert match_first(p, F1(F1(A)), engine=engine) is None


def test_recursive_chain(engine):
    p = chain_pattern()
    t = A
    for _ in range(300):
        t = F1(t)
    m = match_first(p, t, engine=engine)
    assert m["x"] is A and m["f"] is F1
    assert match_first(p, F1(F2(A)), engine=engine)["x"] is F2(A)
    solutions = list(match_all(p, F1(F1(F1(A))), engine=engine))
    assert [s["x"] for s in solutions] == [A, F1(A), F1(F1(A))]


def test_reference_outside_its_definition_is_an_error(engine):
    with pytest.raises(PatternDefinitionError):
        match_first(pdef(PApp(F1, (PCall("Q", ("x",)),)), "x"), F1(A), engine=engine)


def test_graph_values_match_like_terms(engine):
    t = G2(F1(A), const(2))
    g = Graph([t])
    (v,) = g.outputs
    p = pdef(PApp(G2, (PApp(F1, (X,)), PConst(2))), "x")
    m = match_first(p, v, engine=engine)
    assert m is not None and m["x"] is g.inputs[0]
    assert m.root is v


# ---------------------------------------------------------------------- deep recursion


@pytest.mark.slow
def test_100k_deep_chain_fast_engine_no_recursion_error():
    t = A
    for _ in range(100_000):
        t = F1(t)
    m = _fast.match_first(chain_pattern(), t)
    assert m is not None and m["x"] is A and m["f"] is F1


@pytest.mark.slow
def test_chain_memory_is_linear_in_depth():
    p = chain_pattern()
    peaks = []
    for n in (10_000, 20_000):
        t = A
        for _ in range(n):
            t = F1(t)
        tracemalloc.start()
        assert _fast.match_first(p, t) is not None
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    per_level = [peak / n for peak, n in zip(peaks, (10_000, 20_000), strict=True)]
    assert per_level[1] < 1.3 * per_level[0]  # twice as deep: about twice the memory
    assert per_level[1] < 2000  # bytes per level of the chain


def test_deep_graph_chain_matches():
    t = A
    for _ in range(20_000):
        t = F2(t)
    g = Graph([t])
    m = _fast.match_first(chain_pattern(), g.outputs[0])
    assert m is not None and m["f"] is F2 and m["x"] is g.inputs[0]


# ---------------------------------------------------------------------- compiled patterns


def test_compiled_once_per_definition():
    p = pdef(PApp(F1, (X,)), "x")
    assert compile_pattern(p) is compile_pattern(p)
    # equal-looking definitions are compiled apart: 1 and 1.0 are equal constants to a
    # dataclass, but not to a guard that prints them
    one = pdef(PGuard(X, ECmp("==", ECall(STR, (EConst(1),)), EConst("1"))), "x")
    one_f = pdef(PGuard(X, ECmp("==", ECall(STR, (EConst(1.0),)), EConst("1"))), "x")
    assert one == one_f
    assert _fast.match_first(one, A) is not None
    assert _fast.match_first(one_f, A) is None


def test_backends():
    assert compile_pattern(pdef(PApp(F1, (X,)), "x")).backend == "generated"
    assert compile_pattern(chain_pattern()).backend == "machine"
    # a recursive sub-pattern inside: generated code that runs a machine for the recursion
    inner = chain_pattern().body
    hybrid = pdef(PApp(G2, (inner, Y)), "x", ("f", "op"), "y")
    cp = compile_pattern(hybrid)
    assert cp.backend == "generated" and "_sub(" in cp.source
    t = G2(F1(F1(A)), B)
    m = _fast.match_first(hybrid, t)
    assert m is not None and m["x"] is A and m["y"] is B and m["f"] is F1
    # more alternates in a row than Python can nest: the machine takes over, same answers
    body = X
    for _ in range(25):
        body = PApp(G2, (PAlt(PApp(F1, (Y,)), Y), body))
    p = pdef(body, "x", "y")
    cp = CompiledPattern(p)
    assert cp.backend == "machine"
    t = A
    for _ in range(25):
        t = G2(A, t)
    m = _fast.match_first(p, t)
    assert m is not None and m["x"] is A and m["y"] is A


def test_generated_source_is_readable():
    cp = compile_pattern(pdef(PGuard(PApp(F1, (X,)), rank_is("x", 2)), "x"))
    assert (
        "def _first(t0, R=None):" in cp.source and ".shape is not None and bool(len(" in cp.source
    )


# ---------------------------------------------------------------------------- the index


def test_index_by_root_operator_with_wildcards_in_order():
    p_f1 = pdef(PApp(F1, (X,)), "x")
    p_any = pdef(PGuard(X, rank_is("x", 2)), "x")
    p_alt = pdef(PAlt(PApp(F2, (X,)), PApp(G2, (X, Y))), "x")
    p_fv = pdef(PAlt(PApp(F2, (X,)), PFunVar("F", (X,))), "x")
    m = Matcher([p_f1, p_any, p_alt, p_fv])
    assert [i for i, _, _ in m.candidates(F1)] == [0, 1, 3]
    assert [i for i, _, _ in m.candidates(F2)] == [1, 2, 3]
    assert [i for i, _, _ in m.candidates(G2)] == [1, 2]  # (F(x) has one input, G2 two)
    unknown = Operator("unknown", 1)
    assert [i for i, _, _ in m.candidates(unknown)] == [1, 3]
    assert [i for i, _, _ in m.candidates(Operator("unknown2", 2))] == [1]
    assert [i for i, _, _ in m.candidates(CAT)] == [1, 3]  # (variadic: any count of inputs)
    assert [i for i, _, _ in m.candidates(SPLIT)] == [1, 3]  # (F's outputs: any number)
    assert _fast.root_operators(p_alt) == frozenset({F2, G2})
    assert _fast.root_operators(p_fv) is None
    assert root_set(p_fv) == frozenset({F2, OpSpec(n_in=1, pure=True)})


def test_an_operator_variable_is_indexed_by_arity_outputs_name_and_purity():
    # F(x): any pure operator of one input; S(x)[1] with S.name == "split" and two outputs
    opaque = Operator("opaque", 1, pure=False)
    p_f = pdef(PFunVar("F", (X,)), "x")
    name_is = ECmp("==", EOpAttr("S", "name"), EConst("split"))
    p_split = pdef(PGuard(PExists("S", PFunVar("S", (X,), 1, 2), "op"), name_is), "x")
    assert root_set(p_split) == frozenset(
        {OpSpec(n_in=1, n_out=2, index=1, names=frozenset({"split"}), pure=True)}
    )
    m = Matcher([p_f, p_split])
    assert [i for i, _, _ in m.candidates(F1)] == [0]
    assert [i for i, _, _ in m.candidates(SPLIT)] == [0, 1]
    assert [i for i, _, _ in m.candidates(G2)] == [] and G2 not in m.table
    assert [i for i, _, _ in m.candidates(opaque)] == []  # (opaque: outside F's range)
    # an operator made after the index: resolved by its own arity, outputs and name
    later = Operator("split", 1, 2, namespace="elsewhere")
    assert [i for i, _, _ in m.candidates(later)] == [0, 1] and later in m.table
    assert [i for i, _, _ in m.candidates(Operator("split", 1, 3))] == [0]
    assert [i for i, _, _ in m.candidates(Operator("split", 2, 2))] == []
    assert m.match_first(SPLIT(A)[0])[0] == 0 and m.match_first(SPLIT(A)[1])[0] == 1
    assert _fast.match_first(p_split, SPLIT(A)[1])["x"] is A
    assert _fast.match_first(p_split, SPLIT(A)[0]) is None


def test_matcher_first_pattern_in_order_wins():
    p1 = pdef(PGuard(PApp(F1, (X,)), rank_is("x", 5)), "x")
    p2 = pdef(PApp(F1, (X,)), "x")
    p3 = X
    m = Matcher([p1, p2, pdef(p3, "x")])
    i, match = m.match_first(F1(A))
    assert i == 1 and match["x"] is A
    assert [i for i, _ in m.match_all(F1(A))] == [1, 2]
    assert m.match_first(F2(A))[0] == 2


def test_scan_a_graph():
    g = Graph([F1(A), F2(F1(B)), G2(A, B)])
    m = Matcher([pdef(PApp(F1, (X,)), "x"), pdef(PApp(F2, (X,)), "x")])
    found = [(v.op, i) for v, i, _ in m.scan(g)]
    assert found == [(F1, 0), (F1, 0), (F2, 1)]


def test_unknown_leaf_types_are_fine():
    x = leaf("plain")
    assert (
        _fast.match_first(pdef(PGuard(X, ECmp("==", EAttr("x", "dtype"), EConst(F32))), "x"), x)
        is None
    )


def test_recursive_sub_pattern_called_with_a_fresh_name():
    # W(x) = ∃c. g2(U(c), x) with U(u) = f1(U(u)) ‖ u: unfolding W draws a fresh name for c
    # at run time, and the generated code must hand the machine running U that name
    from pypm_jax.semantics import machine as _machine

    chain = PMu("U", (Param("u"),), ("c",), PAlt(PApp(F1, (PCall("U", ("u",)),)), PVar("u")))
    outer = PMu("W", (Param("x"),), ("x",), PExists("c", PApp(G2, (chain, PVar("x"))), "term"))
    p = PatternDef("P", (Param("x"),), PAlt(PApp(F2, (outer,)), outer))
    cp = compile_pattern(p)
    assert cp.backend == "generated" and "_sub(" in cp.source
    for t in (G2(F1(F1(A)), B), F2(G2(A, B)), G2(A, F1(B))):
        fast = list(cp.solutions(t))
        ref = [(th, ph) for th, ph in _machine.solutions(p.body, t)]
        assert [(th, ph) for th, ph, _ in fast] == ref and ref


def test_root_index_and_pre_check_see_constraints_on_the_root():
    # P(o, x) = o <= f1(f2(x)) (written `o <= ...; return o`): the root is an f1 whose input
    # is an f2, though the pattern's body is the variable o
    body = PConstr(PVar("o"), "o", PApp(F1, (PApp(F2, (X,)),)))
    p = pdef(body, "o", "x")
    assert _fast.root_operators(p) == frozenset({F1})
    cp = CompiledPattern(p, backend="machine")
    assert cp._test is not None
    assert not _precheck._passes(cp._test, F1(A)) and _precheck._passes(cp._test, F1(F2(A)))
    assert cp.first(F1(A)) is None
    m = _fast.match_first(p, F1(F2(B)))
    assert m is not None and m["x"] is B


UNARY, BINARY = OpClass("unary"), OpClass("binary")  # (F2's and H2's classes)


def op_class_is(var: str, cls: OpClass) -> ECmp:
    return ECmp("==", EOpAttr(var, "op_class"), EConst(cls))


def test_an_operator_variable_guarded_by_its_op_class_is_indexed_by_the_class():
    # the paper's UnaryOp: F(x) with F.op_class == unary; its root is a unary operator
    p_cls = pdef(PGuard(PFunVar("F", (X,)), op_class_is("F", UNARY)), "x", ("F", "op"))
    p_f1 = pdef(PApp(F1, (X,)), "x")
    p_any = pdef(X, "x")
    assert root_set(p_cls) == frozenset({OpSpec(n_in=1, op_class=UNARY, pure=True)})
    assert _fast.root_operators(p_cls) is None  # (operators only: a class is any of them)
    p_f2 = pdef(PApp(F2, (X,)), "x")
    m = Matcher([p_cls, p_f1, p_any, p_f2])
    assert [i for i, _, _ in m.candidates(F2)] == [0, 2, 3]  # (named, and of the class)
    assert [i for i, _, _ in m.candidates(F1)] == [1, 2]
    assert [i for i, _, _ in m.candidates(H2)] == [2]
    assert F2 in m.table and H2 not in m.table  # (more than the wildcards, or not)
    assert m.table.get(H2, "wild") == "wild"
    # an operator made after the index, in the class: a candidate too
    later = Operator("later", 1, op_class="unary")
    assert [i for i, _, _ in m.candidates(later)] == [0, 2] and later in m.table
    i, match = m.match_first(later(A))
    assert i == 0 and match.phi["F"] is later
    assert m.match_first(F1(A))[0] == 1


def test_the_index_keeps_every_class_candidate_of_a_rewrite():
    # the driver's sweep asks the index per node: a node of an operator made after the
    # rule (in the rule's class) is rewritten, one of another class is not
    rule_cls = pdef(PGuard(PFunVar("F", (X,)), op_class_is("F", UNARY)), "x", ("F", "op"))
    later = Operator("later_too", 1, op_class="unary", infer=same_type)
    g = Graph([G2(later(A), H2(F2(B), B))])
    found = {v.op.name for v, _, _ in Matcher([rule_cls]).scan(g)}
    assert found == {"later_too", "f2"}


def test_root_guards_are_read_through_and_or_in_and_constraints():
    x_op = EAttr("x", "op")
    x_cls = EAttr("x", "op_class")
    either = EOr((op_class_is("F", UNARY), op_class_is("F", BINARY)))
    guard = EAnd((either, ECmp(">", EConst(2), EConst(1))))
    one_input = OpSpec(n_in=1, pure=True)
    assert root_set(pdef(PGuard(PFunVar("F", (X,)), guard), "x")) == frozenset(
        {OpSpec(n_in=1, op_class=UNARY, pure=True), OpSpec(n_in=1, op_class=BINARY, pure=True)}
    )
    # `or` with something else: any root F(x) can have
    loose = EOr((op_class_is("F", UNARY), ECmp(">", EConst(2), EConst(1))))
    assert root_set(pdef(PGuard(PFunVar("F", (X,)), loose), "x")) == frozenset({one_input})
    # names, read through `in` and `and`, met with the class
    named = EAnd(
        (
            ECmp("in", EOpAttr("F", "name"), EConst(("f1", "f2"))),
            ECmp("==", EConst("f2"), EOpAttr("F", "name")),
        )
    )
    assert root_set(pdef(PGuard(PFunVar("F", (X,)), named), "x")) == frozenset(
        {OpSpec(n_in=1, names=frozenset({"f2"}), pure=True)}
    )
    clash = EAnd((op_class_is("F", UNARY), op_class_is("F", BINARY)))
    assert root_set(pdef(PGuard(PFunVar("F", (X,)), clash), "x")) == frozenset()
    # F bound by a constraint on the root variable: `x <= F(y); assert F.name == "f1"`
    on_x = PGuard(
        PConstr(X, "x", PFunVar("F", (Y,))), ECmp("==", EOpAttr("F", "name"), EConst("f1"))
    )
    assert root_set(pdef(on_x, "x", "y")) == frozenset(
        {OpSpec(n_in=1, names=frozenset({"f1"}), pure=True)}
    )
    # ... and on both alternates
    alts = PGuard(
        PAlt(PConstr(X, "x", PFunVar("F", (Y,))), PFunVar("F", (Y, Z))),
        ECmp("==", EOpAttr("F", "name"), EConst("g2")),
    )
    assert root_set(pdef(alts, "x", "y", "z")) == frozenset(
        {OpSpec(n_in=n, names=frozenset({"g2"}), pure=True) for n in (1, 2)}
    )
    # operators and classes meet: an operator stays where its class is admitted
    both = EAnd((ECmp("==", x_cls, EConst(UNARY)), ECmp("in", x_op, EConst((F1, F2, H2)))))
    assert root_set(pdef(PGuard(X, both), "x")) == frozenset({F2})
    flipped = EAnd((ECmp("in", x_op, EConst((F1, F2, H2))), ECmp("==", EConst(UNARY), x_cls)))
    assert root_set(pdef(PGuard(X, flipped), "x")) == frozenset({F2})
    # a constraint on the root and a class guard: the constraint's operators of the class
    body = PGuard(
        PConstr(X, "x", PAlt(PApp(F1, (Y,)), PApp(F2, (Y,)))), ECmp("==", x_cls, EConst(UNARY))
    )
    assert root_set(pdef(body, "x")) == frozenset({F2})
    # a guard on another variable says nothing about the root
    assert root_set(
        pdef(PGuard(PApp(G2, (X, Y)), ECmp("==", EAttr("y", "op"), EConst(F1))), "x")
    ) == frozenset({G2})


def test_a_class_guard_beside_an_exists_reads_the_same_variable():
    # ∃F.F(y) checks that F is bound, and F is the F around it (θ and φ are global); in a
    # definition's body an unfolding renames F (and the guards inside the ∃) afresh
    body = PGuard(PExists("F", PFunVar("F", (Y,)), "op"), op_class_is("F", UNARY))
    p = pdef(body, "y", ("F", "op"))
    assert root_set(p) == frozenset({OpSpec(n_in=1, op_class=UNARY, pure=True)})
    assert _fast.match_first(p, F2(A)) is not None and _fast.match_first(p, F1(A)) is None
    inner = PMu("S", (Param("z"),), ("y",), PExists("F", PFunVar("F", (PVar("z"),)), "op"))
    q = pdef(PGuard(inner, op_class_is("F", UNARY)), "y", ("F", "op"))
    # (the guard's F is not the ∃'s, renamed by the unfolding: any F(z) root)
    assert root_set(q) == frozenset({OpSpec(n_in=1, pure=True)})
    assert _fast.match_first(q, F2(A)) is None  # (F is never bound: the guard is undefined)


def test_a_class_guard_is_not_read_where_the_pattern_can_raise():
    # F's operands are matched before its guard; a reference outside its definition raises
    # there, so the pattern stays a candidate wherever F(...) matches (it must raise where it
    # did): at every pure operator of one input, of any class
    p = pdef(PGuard(PFunVar("F", (PCall("Nowhere", ("x",)),)), op_class_is("F", UNARY)), "x")
    assert root_set(p) == frozenset({OpSpec(n_in=1, pure=True)})


def test_summaries_carry_op_class_and_spec_roots():
    from pypm_jax.engine.compiled import from_summary, summary

    def summarized(p):
        return summary(CompiledPattern(p, backend="machine"))

    p = pdef(PGuard(PFunVar("F", (PApp(F1, (X,)),)), op_class_is("F", UNARY)), "x")
    data = summarized(p)
    spec = {"index": 0, "n_in": 1, "n_out": None, "names": None, "op_class": "unary", "pure": True}
    assert data["root_ops"] == [] and data["root_specs"] == [spec] and "root_classes" not in data
    assert from_summary(pdef(p.body, "x"), data).root_ops == root_set(p)
    # a class the pattern does not name, a name its guards do not, a malformed spec: refused
    # (the pattern is compiled as usual)
    bad_specs = [
        {**spec, "op_class": "binary"},
        {**spec, "names": ["f1"]},
        {**spec, "n_in": -1},
        {**spec, "n_out": 0},
        {**spec, "index": None},
        {**spec, "pure": 1},
        {**spec, "extra": 1},
        {k: v for k, v in spec.items() if k != "pure"},
        [spec],
    ]
    for bad in bad_specs:
        assert from_summary(pdef(p.body, "x"), {**data, "root_specs": [bad]}) is None, bad
    assert from_summary(pdef(p.body, "x"), {**data, "root_specs": spec}) is None
    assert from_summary(pdef(p.body, "x"), {**data, "root_ops": None}) is None
    # a class guard on the root variable: a class root
    q = pdef(PGuard(X, ECmp("==", EAttr("x", "op_class"), EConst(UNARY))), "x")
    data = summarized(q)
    assert data["root_ops"] == [] and data["root_classes"] == ["unary"]
    assert "root_specs" not in data
    assert from_summary(pdef(q.body, "x"), data).root_ops == frozenset({UNARY})
    assert from_summary(pdef(q.body, "x"), {**data, "root_classes": ["binary"]}) is None
    # a name the guards name
    r = pdef(PGuard(PFunVar("F", (X, Y)), ECmp("==", EOpAttr("F", "name"), EConst("g2"))), "x", "y")
    data = summarized(r)
    assert data["root_specs"] == [{**spec, "n_in": 2, "names": ["g2"], "op_class": None}]
    loaded = from_summary(pdef(r.body, "x", "y"), data)
    assert loaded.root_ops == root_set(r) and Matcher([loaded.pdef]).candidates(G2)
    assert not Matcher([loaded.pdef]).candidates(H2)


def test_machine_unfolds_bodies_whose_existential_nodes_are_shared():
    # one ∃ node object at two places of a recursive body: its two copies draw different
    # fresh names in an unfolding, so the machine unfolds such a body the reference's way
    from pypm_jax.semantics import machine as _machine

    e = PExists("e", PApp(F1, (PVar("e"),)), "term")
    body = PAlt(PApp(G2, (e, PCall("U", ("u",)))), PAlt(PApp(F2, (e,)), PVar("u")))
    p = pdef(PMu("U", (Param("u"),), ("x",), body), "x")
    assert _trail._body_info(body).shared
    cp = CompiledPattern(p, backend="machine")
    for t in (G2(F1(A), F2(F1(B))), G2(F1(A), B), F2(F1(C))):
        got = [(th, ph) for th, ph, _ in cp.solutions(t)]
        assert got == list(_machine.solutions(p.body, t)) and got


# ------------------------------------------------------------- early refusals, branchy code


def spine_pattern() -> PatternDef:
    """``W(x, y) ; (x ≈ F1(z))`` with ``W(p, q) = G2(F1⁴(p), U(q)) ‖ G2(U(q), F1⁴(p))``, U a chain of F2 (with
    an alternate at each level): x is bound before the chain is explored (deeper than the
    pre-check at the root looks), its constraint is checked after."""
    chain = PMu(
        "U",
        (Param("r"),),
        ("q",),
        PAlt(PApp(F2, (PCall("U", ("r",)),)), PApp(F2, (PVar("r"),))),
    )
    under = PVar("p")
    for _ in range(4):
        under = PApp(F1, (under,))
    body = PAlt(PApp(G2, (under, chain)), PApp(G2, (chain, under)))
    w = PMu("W", (Param("p"), Param("q")), ("x", "y"), body)
    return pdef(PConstr(w, "x", PApp(F1, (Z,))), "x", "y", "z")


def _reference(p: PatternDef, t) -> list:
    from pypm_jax.semantics import machine as _machine

    return [(th, ph) for th, ph in _machine.solutions(p.body, t)]


def test_early_refusal_cuts_the_search_the_solutions_stay():
    p = spine_pattern()
    deep = A
    for _ in range(12):
        deep = F2(deep)
    no_early = _trail._ByIdentity(lambda body: None)
    for x, found in ((B, 0), (F1(A), 12)):
        t = G2(F1(F1(F1(F1(x)))), deep)
        steps = {}
        for name, early in (("early", _trail._early), ("none", no_early)):
            run = MatchRun()
            # (the deep pre-check, which refuses x's term before the machine starts, off)
            with (
                mock.patch.object(_trail, "_early", early),
                mock.patch.object(_compiled, "_deep_prefilter", lambda body: None),
            ):
                cp = CompiledPattern(p, backend="machine")
                sols = [(th, ph) for th, ph, _ in cp.solutions(t, run)]
            assert sols == _reference(p, t) and len(sols) == found
            steps[name] = run.steps
        if found:
            assert steps["early"] == steps["none"]  # (nothing to cut)
        else:  # refused where x is bound, before the chain
            assert 2 * steps["early"] < steps["none"], steps
        # with the deep pre-check: the machine does not start where x's term cannot match
        run = MatchRun()
        cp = CompiledPattern(p, backend="machine")
        assert cp._deep is not None
        assert len(list(cp.solutions(t, run))) == found and (run.steps == 0) == (not found)


def test_branchy_patterns_run_generator_functions_with_early_refusals():
    p = spine_pattern()
    with mock.patch.object(_codegen, "_INLINE_PATHS", 0):
        cp = CompiledPattern(p)
    assert cp.backend == "generated"
    # W a generator function; U (linear: one reference) one calling itself, the machine
    # past _MAX_GEN_DEPTH nested calls
    assert "def _d" in cp.source and f"if D > {_codegen._MAX_GEN_DEPTH}:" in cp.source
    for n in (5, _codegen._MAX_GEN_DEPTH + 20):
        deep = A
        for _ in range(n):
            deep = F2(deep)
        for x in (B, F1(A)):
            t = G2(F1(F1(F1(F1(x)))), deep)
            got = [(th, ph) for th, ph, _ in cp.solutions(t)]
            assert got == _reference(p, t) and len(got) == (n if x is not B else 0)
            first = cp.first(t)
            assert (first is None and not got) or first[:2] == got[0]


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_generated_recursion_hands_over_to_the_machine_with_the_same_solutions(limit):
    p = spine_pattern()
    with (
        mock.patch.object(_codegen, "_INLINE_PATHS", 0),
        mock.patch.object(_codegen, "_MAX_GEN_DEPTH", limit),
    ):
        cp = CompiledPattern(p)
    for n in range(1, 6):
        deep = A
        for _ in range(n):
            deep = F2(deep)
        for x in (B, F1(A)):
            t = G2(F1(F1(F1(F1(x)))), deep)
            got = [(th, ph) for th, ph, _ in cp.solutions(t)]
            assert got == _reference(p, t)
    # the recursion's argument bound before the call: G2(x, U(x)) ‖ G2(U(x), x)
    chain = PMu(
        "U",
        (Param("r"),),
        ("p",),
        PAlt(PApp(F2, (PCall("U", ("r",)),)), PApp(F2, (PVar("r"),))),
    )
    body = PAlt(PApp(G2, (PVar("p"), chain)), PApp(G2, (chain, PVar("p"))))
    q = pdef(PMu("W", (Param("p"),), ("x",), body), "x")
    with (
        mock.patch.object(_codegen, "_INLINE_PATHS", 0),
        mock.patch.object(_codegen, "_MAX_GEN_DEPTH", limit),
    ):
        cq = CompiledPattern(q)
    assert cq.backend == "generated"
    found = 0
    for t in (G2(A, F2(F2(A))), G2(F2(F2(F2(B))), B), G2(A, F2(F2(B))), G2(B, F2(A))):
        got = [(th, ph) for th, ph, _ in cq.solutions(t)]
        assert got == _reference(q, t)
        found += len(got)
    assert found >= 2


def test_generated_recursion_hands_a_deep_chain_to_the_machine():
    p = spine_pattern()
    with mock.patch.object(_codegen, "_INLINE_PATHS", 0):
        cp = CompiledPattern(p)
    deep = A
    for _ in range(20_000):
        deep = F2(deep)
    t = G2(F1(F1(F1(F1(F1(A))))), deep)
    first = cp.first(t)  # no RecursionError: the machine keeps the chain off the stack
    assert first is not None and first[0]["x"].op is F1 and first[0]["y"] is A  # the deepest
