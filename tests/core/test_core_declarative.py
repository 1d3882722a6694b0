"""The declarative checker rule by rule: each test is one P-* rule of the paper's appendix."""

from __future__ import annotations

import pytest

from pypm_jax.core.calculus import (
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
    PVar,
)
from pypm_jax.core.errors import PatternDefinitionError
from pypm_jax.core.terms import const, leaf
from pypm_jax.semantics.declarative import candidate_terms, holds, holds_def
from pypm_testing.paper import PTREE, UNARY_CHAIN, Div, Mul, Neg, Relu, Split, half, rank_is

a = leaf("a", shape=(2, 3), dtype="f32")
b = leaf("b", shape=(3,), dtype="f32")
X, Y = PVar("x"), PVar("y")


def test_p_var():
    assert holds(X, a, {"x": a})
    assert not holds(X, a, {"x": b})
    assert not holds(X, a, {})  # θ must map x to t


def test_p_fun():
    t = Mul(a, b)
    assert holds(PApp(Mul, (X, Y)), t, {"x": a, "y": b})
    assert not holds(PApp(Mul, (X, Y)), t, {"x": b, "y": a})
    assert not holds(PApp(Div, (X, Y)), t, {"x": a, "y": b})  # another symbol
    assert not holds(PApp(Relu, (X,)), a, {"x": a})  # another arity


def test_p_fun_respects_the_output_index():
    s0, s1 = Split(a)
    assert holds(PApp(Split, (X,), 1), s1, {"x": a})
    assert not holds(PApp(Split, (X,), 1), s0, {"x": a})


def test_literal():
    assert holds(PConst(2), const(2))
    assert holds(PConst(1.4142135623730951), const(1.4142135, dtype="f32"))
    assert not holds(PConst(1.4142135623730951), const(1.4142135, dtype="f64"))
    assert not holds(PConst(2), a)


def test_p_alt_1_and_2():
    t = Mul(a, b)
    p = PAlt(PApp(Mul, (X, Y)), PApp(Mul, (Y, X)))
    assert holds(p, t, {"x": a, "y": b})  # P-Alt-1
    assert holds(p, t, {"x": b, "y": a})  # P-Alt-2: what the first machine run never returns
    assert not holds(p, t, {"x": a, "y": a})


def test_p_guard():
    p = PGuard(X, rank_is("x", 2))
    assert holds(p, a, {"x": a})
    assert not holds(p, b, {"x": b})  # ⟦g[θ]⟧ = False
    assert not holds(PGuard(X, rank_is("y", 2)), a, {"x": a})  # undefined is not True


def test_p_exists_searches_a_witness():
    p = PExists("y", PApp(Relu, (Y,)))
    assert holds(p, Relu(a))
    assert not holds(p, Neg(a))
    # the witness may come from the terms in θ as well as from t
    p = PExists("y", PConstr(X, "y", PApp(Relu, (PVar("z"),))))
    assert holds(p, a, {"x": a, "z": b, "w": Relu(b)})
    # a witness pinned by a variable pattern: ∃y. y ; (y ≈ Relu(z))
    p = PExists("y", PConstr(Y, "y", PApp(Relu, (PVar("z"),))))
    assert holds(p, Relu(b), {"z": b})
    assert not holds(p, Relu(a), {"z": b})
    assert not holds(p, a, {"z": a})


def test_p_exists_for_an_operator_variable():
    p = PExists("F", PApp(Mul, (PFunVar("F", (X,)), PFunVar("F", (Y,)))), "op")
    assert holds(p, Mul(Relu(a), Relu(b)), {"x": a, "y": b})
    assert not holds(p, Mul(Relu(a), Neg(b)), {"x": a, "y": b})


def test_p_matchconstr():
    p = PConstr(X, "x", PApp(Relu, (Y,)))
    assert holds(p, Relu(a), {"x": Relu(a), "y": a})
    assert not holds(p, Relu(a), {"x": Relu(a), "y": b})
    assert not holds(PConstr(X, "z", Y), a, {"x": a, "y": a})  # θ(z) must exist


def test_p_fun_var():
    p = PFunVar("F", (X,))
    assert holds(p, Relu(a), {"x": a}, {"F": Relu})
    assert not holds(p, Relu(a), {"x": a}, {"F": Neg})
    assert not holds(p, Relu(a), {"x": a}, {})  # φ(F) must exist
    assert not holds(p, Mul(a, b), {"x": a}, {"F": Mul})  # arity
    assert holds(PFunVar("F", (X,), 1, 2), Split(a)[1], {"x": a}, {"F": Split})
    assert not holds(PFunVar("F", (X,), 0, 1), Split(a)[0], {"x": a}, {"F": Split})


def test_p_mu_unfolds_a_call():
    assert holds(half("y"), Div(b, const(2)), {"y": b})
    assert holds(half("y"), Mul(b, const(0.5)), {"y": b})
    assert not holds(half("y"), Mul(b, const(2)), {"y": b})


def test_p_mu_recursion_every_cut_of_a_unary_chain():
    t = Relu(Relu(Relu(a)))
    for x in (a, Relu(a), Relu(Relu(a))):
        assert holds_def(UNARY_CHAIN, t, {"x": x, "f": Relu})
    assert not holds_def(UNARY_CHAIN, t, {"x": t, "f": Relu})
    assert not holds_def(UNARY_CHAIN, t, {"x": a, "f": Neg})


def test_p_mu_with_existentials_and_constraints():
    t = Mul(Relu(a), b)
    assert holds_def(PTREE, t, {"x": t, "f": Relu, "g": Mul})
    assert holds_def(PTREE, t, {"x": t})  # the last alternate binds x only
    assert not holds_def(PTREE, t, {"x": b})


def test_unbound_recursive_reference_is_an_error():
    with pytest.raises(PatternDefinitionError):
        holds(PCall("P", ("x",)), a, {"x": a})


def test_holds_def_checks_its_bindings():
    pdef = PatternDef("P", (Param("x"), Param("f", "op")), PFunVar("f", (X,)))
    assert holds_def(pdef, Relu(a), {"x": a, "f": Relu})
    with pytest.raises(ValueError, match="no parameter"):
        holds_def(pdef, Relu(a), {"z": a})
    with pytest.raises(TypeError, match="operator parameter"):
        holds_def(pdef, Relu(a), {"f": a})


def test_candidate_terms_visit_shared_nodes_once():
    r = Relu(a)
    assert candidate_terms([Mul(r, r)]) == [Mul(r, r), r, a]
