"""The paper's running examples written directly in the core calculus.

Import as ``from pypm_testing.paper import ...``. Operators are plain :class:`Operator` objects
(namespace "paper"); patterns are :class:`PatternDef` values, so these tests depend on no
frontend. Figures: MMxyT (cuBLAS example), Half / Gelu (pattern alternates), UnaryChain
(recursive function pattern), P(x, f, g) (local variables and match constraints).
"""

from __future__ import annotations

from typing import Any

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    ECmp,
    EConst,
    PAlt,
    PApp,
    Param,
    Pattern,
    PatternDef,
    PConst,
    PGuard,
    PMu,
    PVar,
)
from pypm_jax.core.terms import Operator, Term
from pypm_testing.strategies import ptree, unary_chain


def _same(x: Term, *rest: Term) -> tuple[Any, Any]:
    return x.shape, x.dtype


def _matmul(x: Term, y: Term) -> tuple[Any, Any]:
    if x.shape is None or y.shape is None:
        return None, x.dtype
    return (x.shape[0], y.shape[-1]), x.dtype


def _trans(x: Term) -> tuple[Any, Any]:
    return (None if x.shape is None else tuple(reversed(x.shape))), x.dtype


_NS = "paper"
MatMul = Operator("MatMul", 2, namespace=_NS, infer=_matmul)
Trans = Operator("Trans", 1, namespace=_NS, infer=_trans)
Relu = Operator("Relu", 1, op_class="unary_pointwise", namespace=_NS, infer=_same)
Neg = Operator("Neg", 1, op_class="unary_pointwise", namespace=_NS, infer=_same)
Erf = Operator("Erf", 1, op_class="unary_pointwise", namespace=_NS, infer=_same)
Div = Operator("Div", 2, op_class="binary", namespace=_NS, infer=_same)
Mul = Operator("Mul", 2, op_class="binary", namespace=_NS, infer=_same)
Plus = Operator("Plus", 2, op_class="binary", namespace=_NS, infer=_same)
Split = Operator("Split", 1, n_out=2, namespace=_NS, infer=lambda x: [_same(x), _same(x)])
Concat = Operator("Concat", None, namespace=_NS)

X, Y = PVar("x"), PVar("y")


def rank_is(var: str, r: int) -> ECmp:
    return ECmp("==", EAttr(var, "rank"), EConst(r))


# MMxyT(x, y): assert x.shape.rank == 2 and y.shape.rank == 2; return MatMul(x, Trans(y))
MMXYT = PatternDef(
    "MMxyT",
    (Param("x"), Param("y")),
    PGuard(PApp(MatMul, (X, PApp(Trans, (Y,)))), EAnd((rank_is("x", 2), rank_is("y", 2)))),
)


def half(arg: str) -> PMu:
    """``Half(arg)``: ``Div(x, 2) ‖ Mul(x, 0.5)``, a call to a pattern with alternates."""
    body = PAlt(PApp(Div, (X, PConst(2))), PApp(Mul, (X, PConst(0.5))))
    return PMu("Half", (Param("x"),), (arg,), body)


def _gelu_body() -> Pattern:
    erf = PApp(Erf, (PApp(Div, (X, PConst(1.4142135623730951))),))
    return PApp(Mul, (half("x"), PApp(Plus, (PConst(1), erf))))


GELU = PatternDef("Gelu", (Param("x"),), _gelu_body())

UNARY_CHAIN = PatternDef(
    "UnaryChain", (Param("x"), Param("f", "op")), unary_chain("UnaryChain", "x", "f")
)

PTREE = PatternDef("P", (Param("x"), Param("f", "op"), Param("g", "op")), ptree("P", "x", "f", "g"))
