"""Matching behaviour every engine must show, written directly in the core calculus.

Each test runs once per engine (fixture ``engine`` in conftest.py) through the one switch,
``pypm_jax.engine.select``, and checks the bindings by identity.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pypm_jax.core.calculus import (
    ECall,
    ECmp,
    EConst,
    EOpAttr,
    GuardFn,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
)
from pypm_jax.core.terms import OpClass, const, leaf
from pypm_jax.engine.select import match_all, match_first
from pypm_jax.semantics.declarative import holds_def
from pypm_testing.paper import (
    GELU,
    MMXYT,
    PTREE,
    UNARY_CHAIN,
    Concat,
    Div,
    Erf,
    MatMul,
    Mul,
    Neg,
    Plus,
    Relu,
    Split,
    Trans,
    half,
    rank_is,
)
from pypm_testing.strategies import unary_chain

a = leaf("a", shape=(4, 8), dtype="f32")
b = leaf("b", shape=(8, 8), dtype="f32")
v = leaf("v", shape=(8,), dtype="f32")
X, Y, Z = PVar("x"), PVar("y"), PVar("z")


def pdef(body, *params: str | tuple[str, str]) -> PatternDef:
    """A pattern definition; a parameter is a name, or (name, "op")."""
    ps = tuple(Param(p) if isinstance(p, str) else Param(*p) for p in params)
    return PatternDef("T", ps, body)


def sols(pattern: PatternDef, t, engine: str) -> list[dict]:
    return [dict(m) for m in match_all(pattern, t, engine=engine)]


def same(found: dict, expected: dict) -> bool:
    """Bindings equal by identity (terms and operators are compared with ``is``)."""
    return found.keys() == expected.keys() and all(found[k] is expected[k] for k in expected)


# ------------------------------------------------------------------------ basic patterns


def test_variable_binds_the_whole_term(engine):
    t = Relu(a)
    m = match_first(pdef(X, "x"), t, engine=engine)
    assert m is not None and m["x"] is t and m.root is t


def test_application_needs_the_same_operator_and_arity(engine):
    p = pdef(PApp(MatMul, (X, PApp(Trans, (Y,)))), "x", "y")
    m = match_first(p, MatMul(a, Trans(b)), engine=engine)
    assert m is not None and m["x"] is a and m["y"] is b
    assert match_first(p, MatMul(a, b), engine=engine) is None
    assert match_first(p, Plus(a, Trans(b)), engine=engine) is None


def test_variadic_operator_is_matched_by_its_actual_input_count(engine):
    p2 = pdef(PApp(Concat, (X, Y)), "x", "y")
    assert match_first(p2, Concat(a, b), engine=engine) is not None
    assert match_first(p2, Concat(a, b, v), engine=engine) is None
    f3 = pdef(PFunVar("F", (X, Y, Z)), ("F", "op"), "x", "y", "z")
    m = match_first(f3, Concat(a, b, v), engine=engine)
    assert m is not None and m["F"] is Concat and m["z"] is v


def test_mmxyt_from_the_paper(engine):
    m = match_first(MMXYT, MatMul(a, Trans(b)), engine=engine)
    assert m is not None and (m["x"], m["y"]) == (a, b)
    assert match_first(MMXYT, MatMul(v, Trans(b)), engine=engine) is None  # rank guard


def test_nonlinear_variable_needs_the_identical_term(engine):
    p = pdef(PApp(MatMul, (X, X)), "x")
    m = match_first(p, MatMul(a, a), engine=engine)
    assert m is not None and m["x"] is a
    assert match_first(p, MatMul(a, b), engine=engine) is None
    # hash-consing: two Relu(a) built separately are one term, so they are "the same value"
    m = match_first(p, MatMul(Relu(a), Relu(a)), engine=engine)
    assert m is not None and m["x"] is Relu(a)


# ------------------------------------------------------------------------------ literals


def test_literals(engine):
    p = pdef(PApp(Div, (X, PConst(2))), "x")
    assert match_first(p, Div(a, const(2)), engine=engine) is not None
    assert match_first(p, Div(a, const(2.0, dtype="f32")), engine=engine) is not None
    assert match_first(p, Div(a, const(3)), engine=engine) is None
    assert match_first(p, Div(a, b), engine=engine) is None  # a literal is not a variable


def test_literal_equal_after_rounding_to_the_terms_float_type(engine):
    sqrt2 = pdef(PConst(1.4142135623730951))
    assert match_first(sqrt2, const(1.4142135, dtype="f32"), engine=engine) is not None
    assert match_first(sqrt2, const(1.4142135, dtype="f64"), engine=engine) is None
    assert match_first(sqrt2, const(1.4142135), engine=engine) is None  # no type: exact only
    bf16_one = pdef(PConst(1.00390625))  # 1 + 2^-8 rounds to 1.0 in bf16, not in f32
    assert match_first(bf16_one, const(1.0, dtype="bf16"), engine=engine) is not None
    assert match_first(bf16_one, const(1.0, dtype="f32"), engine=engine) is None


def test_gelu_with_both_forms_of_half(engine):
    for half_of_x in (Div(a, const(2)), Mul(a, const(0.5))):
        t = Mul(half_of_x, Plus(const(1), Erf(Div(a, const(1.4142135, dtype="f32")))))
        m = match_first(GELU, t, engine=engine)
        assert m is not None and m["x"] is a
    wrong = Mul(Div(a, const(2)), Plus(const(1), Erf(Div(b, const(1.4142135, dtype="f32")))))
    assert match_first(GELU, wrong, engine=engine) is None  # x is used nonlinearly


# --------------------------------------------------------------------- multi-output nodes


def test_multi_output_index(engine):
    s0, s1 = Split(a)
    second = pdef(PApp(Split, (X,), 1), "x")
    m = match_first(second, s1, engine=engine)
    assert m is not None and m["x"] is a
    assert match_first(second, s0, engine=engine) is None
    both = pdef(PApp(Plus, (PApp(Split, (X,), 0), PApp(Split, (X,), 1))), "x")
    m = match_first(both, Plus(s0, s1), engine=engine)
    assert m is not None and m["x"] is a
    assert match_first(both, Plus(s1, s0), engine=engine) is None


def test_operator_variable_checks_index_and_output_count(engine):
    s0, s1 = Split(a)
    any_second = pdef(PFunVar("F", (X,), 1), ("F", "op"), "x")
    m = match_first(any_second, s1, engine=engine)
    assert m is not None and m["F"] is Split
    assert match_first(any_second, s0, engine=engine) is None
    two_outputs = pdef(PFunVar("F", (X,), 0, 2), ("F", "op"), "x")
    assert match_first(two_outputs, s0, engine=engine) is not None
    assert match_first(two_outputs, Relu(a), engine=engine) is None
    unary = pdef(PFunVar("F", (X,)), ("F", "op"), "x")
    assert match_first(unary, Relu(a), engine=engine)["F"] is Relu
    assert match_first(unary, Plus(a, b), engine=engine) is None  # arity


# ---------------------------------------------------------------------------- alternates


def test_first_solution_comes_from_the_first_alternate_that_succeeds(engine):
    p = pdef(PAlt(PApp(Neg, (X,)), PAlt(PApp(Plus, (X, Y)), PApp(Plus, (Y, X)))), "x", "y")
    m = match_first(p, Plus(a, b), engine=engine)
    assert m is not None and m["x"] is a and m["y"] is b
    assert match_first(p, Neg(a), engine=engine)["y"] is None  # unbound by that alternate


def test_guard_failure_backtracks_into_the_alternates_of_a_called_pattern(engine):
    # Either(x) = ∃o. Mul(x, o) ‖ ∃o. Mul(o, x); the caller wants x of rank 2.
    either = PMu(
        "Either",
        (Param("x"),),
        ("x",),
        PAlt(PExists("o", PApp(Mul, (X, PVar("o")))), PExists("o", PApp(Mul, (PVar("o"), X)))),
    )
    p = pdef(PGuard(either, rank_is("x", 2)), "x")
    t = Mul(v, a)  # the first alternate binds x = v (rank 1): the guard sends us back
    assert [m["x"] for m in match_all(p, t, engine=engine)] == [a]
    assert match_first(p, t, engine=engine)["x"] is a


def test_guard_backtracks_into_half_inside_a_larger_pattern(engine):
    # Plus(Half(x), y) ; guard(x.rank == 1): Half's alternates are tried in order.
    p = pdef(PGuard(PApp(Plus, (half("x"), Y)), rank_is("x", 1)), "x", "y")
    assert match_first(p, Plus(Div(v, const(2)), a), engine=engine)["x"] is v
    assert match_first(p, Plus(Mul(v, const(0.5)), a), engine=engine)["x"] is v
    assert match_first(p, Plus(Mul(a, const(0.5)), a), engine=engine) is None


def test_match_all_order_and_distinctness(engine):
    t = Plus(a, b)
    p = pdef(PAlt(PApp(Plus, (X, Y)), PAlt(PApp(Plus, (Y, X)), PApp(Plus, (X, Y)))), "x", "y")
    found = sols(p, t, engine)
    assert len(found) == 2  # the third alternate repeats the first solution
    assert same(found[0], {"x": a, "y": b}) and same(found[1], {"x": b, "y": a})
    assert isinstance(match_all(p, t, engine=engine), Iterator)


def test_match_all_drops_solutions_that_differ_only_in_locals(engine):
    t = Plus(a, b)
    local = PExists("o", PApp(Plus, (X, PVar("o"))))
    p = pdef(PAlt(local, PAlt(PApp(Plus, (X, Y)), local)), "x")
    assert [m["x"] for m in match_all(p, t, engine=engine)] == [a]


def test_match_all_is_lazy(engine):
    calls = []

    def ok(x):
        calls.append(x)
        return True

    g = ECall(GuardFn("ok", ok), (EConst(1),))
    p = pdef(PGuard(PAlt(PApp(Plus, (X, Y)), PApp(Plus, (Y, X))), g), "x", "y")
    it = iter(match_all(p, Plus(a, b), engine=engine))
    next(it)
    assert len(calls) == 1  # the second alternate has not been tried yet
    next(it)
    assert len(calls) == 2


# -------------------------------------------------------------------- operator variables


def test_operator_variable_is_consistent(engine):
    ff = pdef(PFunVar("f", (PFunVar("f", (X,)),)), ("f", "op"), "x")
    m = match_first(ff, Relu(Relu(a)), engine=engine)
    assert m is not None and m["f"] is Relu and m["x"] is a
    assert match_first(ff, Relu(Neg(a)), engine=engine) is None


def test_operator_variable_guard_on_op_class(engine):
    pointwise = ECmp("==", EOpAttr("f", "op_class"), EConst(OpClass("unary_pointwise")))
    p = pdef(PGuard(PFunVar("f", (X,)), pointwise), ("f", "op"), "x")
    assert match_first(p, Relu(a), engine=engine)["f"] is Relu
    assert match_first(p, Trans(a), engine=engine) is None  # Trans has no op class


def test_local_operator_variable(engine):
    p = pdef(PExists("F", PApp(Plus, (PFunVar("F", (X,)), PFunVar("F", (Y,)))), "op"), "x", "y")
    m = match_first(p, Plus(Relu(a), Relu(b)), engine=engine)
    assert m is not None and (m["x"], m["y"]) == (a, b) and set(m) == {"x", "y"}
    assert match_first(p, Plus(Relu(a), Neg(b)), engine=engine) is None


def test_operator_parameter_instantiated_with_a_concrete_operator(engine):
    # μC(x, g)[x, Relu]. g(x): the call fixes the operator, it is not a variable any more
    call = PMu("C", (Param("x"), Param("g", "op")), ("x", Relu), PFunVar("g", (X,)))
    p = pdef(call, "x")
    assert match_first(p, Relu(a), engine=engine)["x"] is a
    assert match_first(p, Neg(a), engine=engine) is None


# --------------------------------------------------------- match constraints, existentials


def test_match_constraint_binds_the_root(engine):
    # x <= Relu(y); return x
    p = pdef(PConstr(X, "x", PApp(Relu, (Y,))), "x", "y")
    t = Relu(a)
    m = match_first(p, t, engine=engine)
    assert m is not None and m["x"] is t and m["y"] is a
    assert match_first(p, Neg(a), engine=engine) is None


def test_match_constraint_matches_the_bound_term_not_the_current_one(engine):
    p = pdef(PApp(Plus, (X, PConstr(Y, "x", PApp(Relu, (Z,))))), "x", "y", "z")
    m = match_first(p, Plus(Relu(a), b), engine=engine)
    assert m is not None and m["z"] is a and m["y"] is b
    assert match_first(p, Plus(Neg(a), b), engine=engine) is None


def test_match_constraint_on_an_unbound_variable_fails(engine):
    p = pdef(PConstr(X, "w", Y), "x", "w", "y")
    assert match_first(p, a, engine=engine) is None
    # the declarative rules would accept any w: the machine needs w bound (SEMANTICS.md §3)
    assert holds_def(p, a, {"x": a, "w": b, "y": b})


def test_existential_binds_a_local(engine):
    p = pdef(PExists("o", PApp(Relu, (PVar("o"),))))
    m = match_first(p, Relu(a), engine=engine)
    assert m is not None and dict(m) == {}
    assert a in m.theta.values()  # the local is bound under a machine-chosen name


def test_existential_must_be_bound(engine):
    # ∃o. (Relu(x) ‖ Neg(o)): the first alternate matches Relu(a) but leaves o unbound
    p = pdef(PExists("o", PAlt(PApp(Relu, (X,)), PApp(Neg, (PVar("o"),)))), "x")
    assert match_first(p, Relu(a), engine=engine) is None
    assert match_first(p, Neg(a), engine=engine) is not None
    assert holds_def(p, Relu(a), {"x": a})  # declaratively, any witness would do


# ----------------------------------------------------------------------------- recursion


def test_unary_chain_longest_chain_first(engine):
    t = Relu(Relu(Relu(a)))
    found = sols(UNARY_CHAIN, t, engine)
    expected = [a, Relu(a), Relu(Relu(a))]
    assert [s["x"] for s in found] == expected and all(s["f"] is Relu for s in found)


def test_unary_chain_with_the_base_case_first_finds_the_shortest(engine):
    p = pdef(unary_chain("U", "x", "f", recursive_first=False), "x", ("f", "op"))
    t = Relu(Relu(Relu(a)))
    assert [m["x"] for m in match_all(p, t, engine=engine)] == [Relu(Relu(a)), Relu(a), a]


def test_unary_chain_stops_where_the_operator_changes(engine):
    m = match_first(UNARY_CHAIN, Relu(Relu(Neg(a))), engine=engine)
    assert m is not None and m["x"] is Neg(a) and m["f"] is Relu
    m = match_first(UNARY_CHAIN, Neg(Relu(a)), engine=engine)
    assert m["x"] is Relu(a) and m["f"] is Neg
    assert match_first(UNARY_CHAIN, a, engine=engine) is None
    assert match_first(UNARY_CHAIN, Plus(a, b), engine=engine) is None


def test_paper_p_binds_the_root_of_a_unary_binary_tree(engine):
    t = Plus(Relu(a), Relu(Plus(b, v)))
    m = match_first(PTREE, t, engine=engine)
    assert m is not None and m["x"] is t and m["f"] is Relu and m["g"] is Plus


def test_paper_p_stops_where_a_second_unary_operator_appears(engine):
    t = Relu(Neg(a))
    m = match_first(PTREE, t, engine=engine)
    # x is the root; f = Relu; Neg(a) is then a leaf of the tree, and g is never needed
    assert m is not None and m["x"] is t and m["f"] is Relu and m["g"] is None


def test_paper_p_on_a_leaf_is_the_last_alternate(engine):
    assert dict(match_first(PTREE, a, engine=engine)) == {"x": a, "f": None, "g": None}


@pytest.mark.slow
def test_deep_chain_does_not_recurse_on_the_python_stack(engine):
    t = a
    for _ in range(100_000):
        t = Relu(t)
    m = match_first(UNARY_CHAIN, t, engine=engine)
    assert m is not None and m["x"] is a and m["f"] is Relu
