"""The small-step machine rule by rule: each test is one ST-* rule of the paper's appendix.

These exercise ``pypm_jax.semantics.machine.step`` on hand-built states and compare the successor
state exactly (substitutions, stack and continuation), so they are reference-only; the
engine-parametrized behaviour tests live in test_core_matching.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from pypm_jax.core.calculus import (
    PAlt,
    PApp,
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
from pypm_jax.semantics import machine as M
from pypm_jax.semantics.subst import FreshNames, unfold
from pypm_testing.paper import Div, Mul, Neg, Relu, Split, half, rank_is
from pypm_testing.strategies import spine

a = leaf("a", shape=(2, 3), dtype="f32")
b = leaf("b", shape=(3,), dtype="f32")
REST = (M.AGuard(rank_is("a_rest", 0)), None)  # a continuation tail the rules must keep
SAVED = (M.Frame({"s": b}, {}, None), None)  # a non-empty stack to backtrack into


def running(theta: dict[str, Any], head: M.Action, phi: dict | None = None, stack=SAVED):
    return M.Running(theta, phi or {}, stack, (head, REST))


def step(st: M.Running) -> M.State:
    return M.step(st, FreshNames())


def backtracked() -> M.State:
    return M.Running({"s": b}, {}, None, None)


def test_st_success():
    st = M.Running({"x": a}, {"f": Relu}, SAVED, None)
    out = step(st)
    assert out == M.Success({"x": a}, {"f": Relu})
    assert out.stack is SAVED  # kept beside the success state, to resume later


def test_backtrack_metafunction():
    assert M.backtrack(None) is M.FAILURE
    assert M.backtrack(SAVED) == backtracked()


def test_st_match_var_bind():
    out = step(running({}, M.AMatch(PVar("x"), a)))
    assert out == M.Running({"x": a}, {}, SAVED, REST)


def test_st_match_var_bind_does_not_mutate_the_saved_substitution():
    theta = {"y": b}
    out = step(running(theta, M.AMatch(PVar("x"), a)))
    assert theta == {"y": b} and out.theta == {"y": b, "x": a}


def test_st_match_var_bound():
    assert step(running({"x": a}, M.AMatch(PVar("x"), a))) == M.Running({"x": a}, {}, SAVED, REST)


def test_st_match_var_conflict_backtracks():
    assert step(running({"x": a}, M.AMatch(PVar("x"), b))) == backtracked()


def test_st_match_var_conflict_with_empty_stack_fails():
    assert step(running({"x": a}, M.AMatch(PVar("x"), b), stack=None)) is M.FAILURE


def test_st_match_fun_pushes_argument_matches_in_order():
    t = Mul(a, b)
    out = step(running({}, M.AMatch(PApp(Mul, (PVar("x"), PVar("y"))), t)))
    expected_k = (M.AMatch(PVar("x"), a), (M.AMatch(PVar("y"), b), REST))
    assert out == M.Running({}, {}, SAVED, expected_k)


@pytest.mark.parametrize(
    "pattern, term",
    [
        (PApp(Relu, (PVar("x"),)), Neg(a)),  # f ≠ g
        (PApp(Relu, (PVar("x"),)), a),  # m ≠ n
        (PApp(Split, (PVar("x"),), 1), Split(a)[0]),  # another output of the same node
    ],
)
def test_st_match_fun_conflict(pattern, term):
    assert step(running({}, M.AMatch(pattern, term))) == backtracked()


def test_literal_is_a_nullary_symbol():
    two = const(2, dtype="i32")
    assert step(running({}, M.AMatch(PConst(2), two))) == M.Running({}, {}, SAVED, REST)
    assert step(running({}, M.AMatch(PConst(3), two))) == backtracked()
    assert step(running({}, M.AMatch(PConst(2), a))) == backtracked()


def test_st_match_alt_saves_the_second_alternate():
    p, p2 = PVar("x"), PVar("y")
    theta, phi = {"z": b}, {"f": Relu}
    out = step(running(theta, M.AMatch(PAlt(p, p2), a), phi))
    frame = M.Frame(theta, phi, (M.AMatch(p2, a), REST))
    assert out == M.Running(theta, phi, (frame, SAVED), (M.AMatch(p, a), REST))


def test_st_match_guard_checks_after_the_pattern():
    g = rank_is("x", 2)
    out = step(running({}, M.AMatch(PGuard(PVar("x"), g), a)))
    assert out == M.Running({}, {}, SAVED, (M.AMatch(PVar("x"), a), (M.AGuard(g), REST)))


def test_st_checkguard_continue():
    assert step(running({"x": a}, M.AGuard(rank_is("x", 2)))) == M.Running(
        {"x": a}, {}, SAVED, REST
    )


@pytest.mark.parametrize("guard_var, rank", [("x", 1), ("unbound", 2)])
def test_st_checkguard_backtrack_on_false_or_undefined(guard_var, rank):
    assert step(running({"x": a}, M.AGuard(rank_is(guard_var, rank)))) == backtracked()


def test_st_checkname():
    assert step(running({"y": a}, M.ACheckName("y"))) == M.Running({"y": a}, {}, SAVED, REST)
    op_state = running({}, M.ACheckName("F", "op"), {"F": Relu})
    assert step(op_state) == M.Running({}, {"F": Relu}, SAVED, REST)


def test_checkname_of_an_unbound_existential_backtracks():
    assert step(running({}, M.ACheckName("y"))) == backtracked()
    assert step(running({"F": a}, M.ACheckName("F", "op"))) == backtracked()  # θ is not φ


def test_st_matchconstr_matches_the_bound_term():
    p = PApp(Relu, (PVar("y"),))
    out = step(running({"x": a}, M.AMatchConstr("x", p)))
    assert out == M.Running({"x": a}, {}, SAVED, (M.AMatch(p, a), REST))


def test_matchconstr_on_an_unbound_variable_backtracks():
    assert step(running({}, M.AMatchConstr("x", PVar("y")))) == backtracked()


def test_st_match_exists():
    out = step(running({}, M.AMatch(PExists("y", PVar("y")), a)))
    assert out == M.Running({}, {}, SAVED, (M.AMatch(PVar("y"), a), (M.ACheckName("y"), REST)))
    out = step(running({}, M.AMatch(PExists("F", PVar("z"), "op"), a)))
    assert out.k == (M.AMatch(PVar("z"), a), (M.ACheckName("F", "op"), REST))


def test_st_match_matchconstr():
    p, p2 = PVar("x"), PVar("y")
    out = step(running({}, M.AMatch(PConstr(p, "x", p2), a)))
    assert out == M.Running({}, {}, SAVED, (M.AMatch(p, a), (M.AMatchConstr("x", p2), REST)))


def test_st_match_fun_var_bind():
    out = step(running({}, M.AMatch(PFunVar("F", (PVar("x"),)), Relu(a))))
    assert out == M.Running({}, {"F": Relu}, SAVED, (M.AMatch(PVar("x"), a), REST))


def test_st_match_fun_var_bound():
    out = step(running({}, M.AMatch(PFunVar("F", (PVar("x"),)), Relu(a)), {"F": Relu}))
    assert out == M.Running({}, {"F": Relu}, SAVED, (M.AMatch(PVar("x"), a), REST))


@pytest.mark.parametrize(
    "pattern, term, phi",
    [
        (PFunVar("F", (PVar("x"),)), Neg(a), {"F": Relu}),  # φ(F) ≠ f
        (PFunVar("F", (PVar("x"),)), Mul(a, b), {}),  # m ≠ n
        (PFunVar("F", (PVar("x"),)), Split(a)[1], {}),  # another output index
        (PFunVar("F", (PVar("x"),), 0, 2), Relu(a), {}),  # n_out given and different
    ],
)
def test_st_match_fun_var_conflict(pattern, term, phi):
    assert step(running({}, M.AMatch(pattern, term), phi)) == backtracked()


def test_fun_var_with_n_out_matches_a_multi_output_node():
    out = step(running({}, M.AMatch(PFunVar("F", (PVar("x"),), 1, 2), Split(a)[1])))
    assert out == M.Running({}, {"F": Split}, SAVED, (M.AMatch(PVar("x"), a), REST))


def test_st_match_mu_unfolds_once():
    mu = half("z")
    out = step(running({}, M.AMatch(mu, a)))
    assert out == M.Running({}, {}, SAVED, (M.AMatch(unfold(mu, FreshNames()), a), REST))
    assert out.k[0].pat == PAlt(
        PApp(Div, (PVar("z"), PConst(2))), PApp(Mul, (PVar("z"), PConst(0.5)))
    )


def test_recursive_reference_outside_its_definition_is_an_error():
    with pytest.raises(PatternDefinitionError, match="outside a definition"):
        step(running({}, M.AMatch(PCall("P", ("x",)), a)))


def test_solutions_resume_by_backtracking():
    # f(x, y) ‖ f(y, x): the paper's example of what one run cannot see; resuming can.
    t = Mul(a, b)
    p = PAlt(PApp(Mul, (PVar("x"), PVar("y"))), PApp(Mul, (PVar("y"), PVar("x"))))
    assert list(M.solutions(p, t)) == [({"x": a, "y": b}, {}), ({"y": a, "x": b}, {})]
    assert M.run(p, t) == M.Success({"x": a, "y": b}, {})
    assert M.run(PApp(Relu, (PVar("x"),)), t) is M.FAILURE


def test_each_unfolding_names_its_existentials_afresh_and_deterministically():
    c = leaf("c")
    t = Mul(Mul(a, b), c)
    first = [theta for theta, _ in M.solutions(spine("S", Mul, "x"), t)]
    again = [theta for theta, _ in M.solutions(spine("S", Mul, "x"), t)]
    assert first == again  # one FreshNames per run: names do not depend on history
    theta = first[0]
    assert theta["x"] is a
    locals_ = {name: term for name, term in theta.items() if name != "x"}
    assert all("#" in name for name in locals_)  # fresh copies of the bound z
    assert sorted(locals_.values(), key=id) == sorted([b, c], key=id)  # one z per level


def test_a_non_pattern_is_a_type_error():
    with pytest.raises(TypeError, match="not a pattern"):
        step(running({}, M.AMatch("x", a)))


def test_a_solution_keeps_the_terms_its_applications_and_literals_matched():
    two, neg = const(2), Neg(a)
    t = Mul(neg, two)
    st = step(running({}, M.AMatch(PApp(Mul, (PVar("x"), PConst(2))), t)))
    assert st.covered == (t, None)  # ST-Match-Fun adds its term beside the state
    p = PAlt(PApp(Mul, (PApp(Relu, (PVar("x"),)), PVar("y"))), PApp(Mul, (PVar("x"), PConst(2))))
    ((m, covered),) = M.match_all_covered(PatternDef("P", (), p), t)
    assert m.theta == {"x": neg} and covered == (t, two)  # the failed branch's Mul is gone
    assert [M.covered(s) for s in M.successes(PApp(Neg, (PVar("x"),)), neg)] == [(neg,)]
