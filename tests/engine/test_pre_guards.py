"""Guards before the machine's first choice, evaluated before it starts (``_pre_guards``).

A pattern whose first actions at a root check guards on the root alone (a constraint on
the root whose definition is guards on its parameter: the region rule's ``FedByGemm``) has
those guards evaluated in front of the machine; where one fails the machine is not started.
These tests hold the shortcut to the reference machine on random patterns of that form,
and check that it calls the same guards in the same order, keeps the step budget's error
and reaches patterns loaded from summaries.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    EAttr,
    ECall,
    ECmp,
    EConst,
    GuardFn,
    PAlt,
    PApp,
    Param,
    Pattern,
    PatternDef,
    PConstr,
    PExists,
    PGuard,
    PMu,
    PVar,
)
from pypm_jax.core.errors import MatchBudgetError
from pypm_jax.engine.compiled import CompiledPattern, from_summary, summary
from pypm_jax.engine.machine import MatchRun, _find_pre_guards
from pypm_jax.semantics import machine as _machine
from pypm_testing.engine import F1, G2, PARAMS, A, B, dags, guards, patterns, solution_key

P = Param


@st.composite
def root_guarded_prefix(draw) -> PatternDef:
    """``x <= D(x)`` (D's body: guards on its parameter, maybe under an ∃, a nested
    definition or another constraint), maybe a guard on x, then the rest of a pattern.
    Guards are true, false or undefined, and some read variables other than the root (the
    shortcut must stop there)."""

    def body(depth: int, v: str) -> Pattern:
        kind = draw(st.integers(0, 4 if depth < 2 else 2))
        if kind == 0:
            return PGuard(PVar(v), draw(guards((v,), ("H",))))
        if kind == 1:
            inner = PGuard(PVar(v), draw(guards((v,), ("H",))))
            return PGuard(inner, draw(guards((v, "e"), ("H",))))
        if kind == 2:  # a guard after an existential left unbound (the machine fails there)
            return PExists("e", PGuard(PVar(v), draw(guards((v,), ("H",)))))
        w = f"q{depth}"
        nested = PMu(f"N{next(_names)}", (P(w),), (v,), body(depth + 1, w))
        if kind == 3:  # a nested definition on the same term
            return nested
        return PConstr(PVar(v), v, nested)

    fed = PMu(f"D{next(_names)}", (P("p"),), ("x",), body(0, "p"))
    top: Pattern = PConstr(PVar("x"), "x", fed)
    if draw(st.booleans()):
        top = PGuard(top, draw(guards(("x", "y"), ("F",))))
    rest = draw(patterns(2))
    if draw(st.booleans()):
        top = PConstr(top, "x", rest)
    else:
        top = PAlt(top, rest) if draw(st.integers(0, 4)) == 0 else PConstr(top, "y", rest)
    return PatternDef("P", PARAMS, top)


_names = itertools.count()


def _keys(sols) -> list:
    return [solution_key(theta, phi) for theta, phi, *_ in itertools.islice(sols, 50)]


@given(root_guarded_prefix(), dags(), st.data())
def test_machine_with_pre_guards_gives_the_reference_solutions(pdef, pool, data):
    t = data.draw(st.sampled_from(pool[-4:]))
    expected = _keys(_machine.solutions(pdef.body, t))
    cp = CompiledPattern(pdef, backend="machine")
    assert _keys(cp.solutions(t)) == expected
    first = cp.first(t)
    assert (None if first is None else solution_key(*first[:2])) == (expected[:1] or [None])[0]


# A guard function that logs its calls: the pre-guards call the guards the machine would.
_LOG: list[tuple[str, int]] = []


def _logged(tag: str, result) -> GuardFn:
    return GuardFn(f"logged_{tag}", lambda term: _LOG.append((tag, id(term))) or result(term))


RANK2 = _logged("rank2", lambda t: t.shape is not None and len(t.shape) == 2)
IS_F1 = _logged("is_f1", lambda t: t.op is F1)


def _fed(*fns: GuardFn) -> PMu:
    body: Pattern = PVar("v")
    for fn in fns:
        body = PGuard(body, ECall(fn, (EAttr("v", "term"),)))
    return PMu("Fed", (P("v"),), ("r",), body)


REGIONISH = PatternDef(
    "Regionish",
    (P("r"), P("y")),
    PConstr(PConstr(PVar("r"), "r", _fed(RANK2, IS_F1)), "r", PApp(F1, (PVar("y"),))),
)


def test_the_pre_guards_are_the_root_constraints_guards_in_order():
    pre = _find_pre_guards(REGIONISH.body)
    assert pre is not None and len(pre.items) == 2
    # (each reads the μ-body's v, which its environment makes the root r)
    assert [names for _, names in pre.items] == [("v",), ("v",)]
    # a guard reading another variable, or one after a choice, is not a pre-guard
    other = PGuard(PConstr(PVar("r"), "r", PApp(F1, (PVar("y"),))), ECmp("==", EAttr("y", "rank"),
                   EConst(2)))  # fmt: skip
    assert _find_pre_guards(other) is None
    after_alt = PConstr(PVar("r"), "r", PAlt(PGuard(PVar("r"), ECall(RANK2, (EAttr("r", "term"),))),
                        PVar("r")))  # fmt: skip
    assert _find_pre_guards(after_alt) is None


@pytest.mark.parametrize("term", [F1(A), F1(B), G2(A, B), A])
def test_pre_guards_call_what_the_machine_calls_and_skip_its_steps(term):
    _LOG.clear()
    ref = _keys(_machine.solutions(REGIONISH.body, term))
    ref_log = list(_LOG)
    _LOG.clear()
    cp = CompiledPattern(REGIONISH, backend="machine")
    run = MatchRun()
    got = _keys(cp.solutions(term, run))
    assert got == ref
    assert _LOG == ref_log  # each guard once, in the machine's order
    if not ref:  # refused before the machine: no machine step
        assert run.steps == 0


def test_a_budget_the_prefix_would_exceed_still_raises():
    cp = CompiledPattern(REGIONISH, backend="machine")
    with pytest.raises(MatchBudgetError):
        cp.first(G2(A, B), MatchRun(3))
    assert cp.first(G2(A, B), MatchRun(50)) is None


def test_patterns_loaded_from_summaries_have_them_too():
    data = summary(CompiledPattern(REGIONISH, backend="machine"))
    loaded = from_summary(REGIONISH, data)
    assert loaded is not None
    run = MatchRun()
    assert loaded.first(G2(A, B), run) is None and run.steps == 0
