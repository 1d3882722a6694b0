"""``children`` and ``expr_children``: the one place that knows each construct's children."""

from __future__ import annotations

import typing

import pytest

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    EBin,
    ECall,
    ECmp,
    EConst,
    EIndex,
    ENot,
    EOpAttr,
    EOr,
    ETuple,
    EUnary,
    Expr,
    GuardFn,
    PAlt,
    PApp,
    Param,
    Pattern,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    children,
    expr_children,
)
from pypm_jax.core.terms import Operator

F = Operator("children_f", 2)
X, Y = PVar("x"), PVar("y")
A, B = EAttr("x", "rank"), EConst(2)

EXPRS: dict[type, tuple[Expr, tuple[Expr, ...]]] = {
    EConst: (B, ()),
    EAttr: (A, ()),
    EOpAttr: (EOpAttr("f", "name"), ()),
    EIndex: (EIndex(A, B), (A, B)),
    EBin: (EBin("+", A, B), (A, B)),
    EUnary: (EUnary("-", A), (A,)),
    ECmp: (ECmp("==", A, B), (A, B)),
    EAnd: (EAnd((A, B, A)), (A, B, A)),
    EOr: (EOr((B, A)), (B, A)),
    ENot: (ENot(A), (A,)),
    ECall: (ECall(GuardFn("len", len), (A, B)), (A, B)),
    ETuple: (ETuple((A,)), (A,)),
}

PATTERNS: dict[type, tuple[Pattern, tuple[Pattern, ...]]] = {
    PVar: (X, ()),
    PConst: (PConst(1), ()),
    PApp: (PApp(F, (X, Y)), (X, Y)),
    PFunVar: (PFunVar("f", (Y, X)), (Y, X)),
    PAlt: (PAlt(X, Y), (X, Y)),
    PGuard: (PGuard(X, B), (X,)),
    PExists: (PExists("y", Y), (Y,)),
    PConstr: (PConstr(X, "x", Y), (X, Y)),
    PMu: (PMu("P", (Param("x"),), ("x",), X), (X,)),
    PCall: (PCall("P", ("x",)), ()),
}


def test_every_expression_kind_has_its_children_left_to_right():
    assert set(EXPRS) == set(typing.get_args(Expr))  # a new kind must be added here too
    for e, kids in EXPRS.values():
        got = expr_children(e)
        assert len(got) == len(kids) and all(g is k for g, k in zip(got, kids, strict=True))
    with pytest.raises(TypeError, match="not an expression"):
        expr_children(X)  # type: ignore[arg-type]


def test_every_pattern_kind_has_its_children_in_matching_order():
    assert set(PATTERNS) == set(typing.get_args(Pattern))
    for p, kids in PATTERNS.values():
        got = children(p)
        assert len(got) == len(kids) and all(g is k for g, k in zip(got, kids, strict=True))
    mu = PATTERNS[PMu][0]
    assert children(mu, into_mu=False) == ()  # a definition's body is its own scope
