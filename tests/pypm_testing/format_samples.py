"""Hand-built items for the format tests: every calculus construct, expression kind and
literal kind, plus the same patterns written in the DSL.

Operators live in namespace ``tests.format`` and are registered at import (the registry is
filled at import time only; no test resets it). ``FRESH`` is deliberately *not* registered.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pypm_jax as pm
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
    RApp,
    RConst,
    RTuple,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax.core.dtypes import DTYPES
from pypm_jax.core.errors import SourceLoc
from pypm_jax.core.terms import OpClass, Operator
from pypm_jax.lang.registry import GUARD_FNS, register_guard_fn, register_op

NS = "tests.format"
MatMul = register_op(Operator("MatMul", 2, namespace=NS, op_class="matmul"))
Trans = register_op(Operator("Trans", 1, namespace=NS))
Relu = register_op(Operator("Relu", 1, namespace=NS, op_class="unary_pointwise"))
Exp = register_op(Operator("Exp", 1, namespace=NS, op_class="unary_pointwise"))
Split = register_op(Operator("Split", 1, 2, namespace=NS))
Concat = register_op(Operator("Concat", None, namespace=NS))
Conv = register_op(Operator("Conv", 2, attrs=("stride", "padding"), op_class="conv", namespace=NS))
Fused = register_op(Operator("Fused", 2, attrs=("alpha",), namespace=NS))
Noise = register_op(Operator("Noise", 0, namespace=NS, pure=False))
FRESH = Operator("Unregistered", 3, 2, attrs=("k",), op_class="odd", namespace=NS, pure=False)
OPS = (MatMul, Trans, Relu, Exp, Split, Concat, Conv, Fused, Noise)

IS_SQUARE: GuardFn = register_guard_fn(
    "tests.format.is_square", lambda s: len(s) == 2 and s[0] == s[1]
)


def loc(line: int, text: str = "") -> SourceLoc:
    return SourceLoc("tests/pypm_testing/format_samples.py", line, text or f"line {line}")


# Every literal kind, with the awkward floats and strings.
LITERALS: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -5,
    10**40,
    -(10**40),
    1.5,
    0.0,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    5e-324,
    1.7976931348623157e308,
    0.1,
    "",
    "x",
    'μ∀ — \u0000 "quoted" \\ \ud800 lone surrogate',
    *DTYPES.values(),
    OpClass("conv"),
    OpClass("brand-new class"),
    MatMul,
    FRESH,
    (),
    (1,),
    (1, 1.0, True, "1", None),
    ((), ((), (2, (3, (pm.f32, OpClass("conv"), Split))))),
)

# Every expression kind (12) with every operator of the expression language.
GUARD = EAnd(
    (
        ECmp("==", EAttr("x", "rank"), EConst(2)),
        EOr(
            (
                ECmp(
                    "<",
                    EBin("+", EIndex(EAttr("x", "shape"), EConst(0)), EUnary("-", EConst(1))),
                    EConst(10**30),
                ),
                ENot(ECmp("in", EAttr("y", "dtype"), EConst((pm.f32, pm.bf16)))),
            )
        ),
        ECmp("==", EOpAttr("F", "op_class"), EConst(OpClass("unary_pointwise"))),
        ECall(IS_SQUARE, (EAttr("x", "shape"),)),
        ECmp("!=", ETuple((EAttr("x", "rank"), EConst(None))), EConst(LITERALS)),
        ECmp(">=", EBin("-", EAttr("x", "rank"), EConst(1)), EUnary("+", EConst(0))),
        ECmp("<=", EBin("*", EConst(2), EConst(3.0)), EBin("/", EConst(7), EConst(2))),
        ECmp(">", EBin("//", EConst(7), EConst(2)), EBin("%", EConst(7), EConst(4))),
        ECmp("not in", EBin("**", EConst(2), EConst(10)), ETuple(())),
        ECall(GUARD_FNS["len"], (EAttr("y", "shape"),)),
    )
)

PARAMS = (Param("x"), Param("y"), Param("F", "op"))

_ALTS = [
    # ∃z. (MatMul(x, Trans(z)) ; (z ≈ F(y))) ; guard(...)
    PExists(
        "z",
        PGuard(
            PConstr(
                PApp(MatMul, (PVar("x"), PApp(Trans, (PVar("z"),)))),
                "z",
                PFunVar("F", (PVar("y"),)),
                loc(10, "z <= F(y)"),
            ),
            GUARD,
            loc(11, "assert ..."),
        ),
    ),
    # ∃G:op. G(x, 2.5)#1 with two outputs; a guard without a location
    PExists(
        "G",
        PGuard(
            PFunVar("G", (PVar("x"), PConst(2.5)), 1, 2),
            ECmp("==", EOpAttr("G", "name"), EConst("Split")),
            None,
        ),
        "op",
    ),
    # recursion under an application, on the second output of a multi-output op
    PApp(Split, (PApp(Relu, (PCall("Everything", ("x", "y", "F")),)),), 1),
    # an instantiated sub-pattern with a concrete operator for an operator parameter
    PMu(
        "Inner",
        (Param("a"), Param("H", "op")),
        ("x", Relu),
        PApp(Concat, (PVar("a"), PFunVar("H", (PVar("a"),)), PConst(1))),
    ),
    # the same sub-pattern with an operator variable, and a constraint without a location
    PConstr(
        PMu(
            "Inner",
            (Param("a"), Param("H", "op")),
            ("y", "F"),
            PApp(Concat, (PVar("a"), PFunVar("H", (PVar("a"),)), PConst(1))),
        ),
        "x",
        PApp(Concat, ()),
    ),
    # every literal kind as a pattern constant
    *[PApp(Exp, (PConst(v),)) for v in LITERALS],
    PFunVar("F", (PVar("x"),), 0, None),
    PApp(MatMul, (PApp(Noise, ()), PVar("y"))),
]


def _alternates(ps: list[Any]) -> Any:
    body = ps[-1]
    for p in reversed(ps[:-1]):
        body = PAlt(p, body)
    return body


EVERYTHING = PatternDef(
    "Everything",
    PARAMS,
    PMu("Everything", PARAMS, ("x", "y", "F"), _alternates(_ALTS)),
    loc(1, "@pm.pattern"),
    tuple(loc(100 + i) if i % 3 else None for i in range(len(_ALTS))),
)

MMXYT = PatternDef(
    "MMxyT",
    (Param("x"), Param("y")),
    PGuard(
        PApp(MatMul, (PVar("x"), PApp(Trans, (PVar("y"),)))),
        EAnd(
            (ECmp("==", EAttr("x", "rank"), EConst(2)), ECmp("==", EAttr("y", "rank"), EConst(2)))
        ),
        loc(20),
    ),
    loc(19),
    (loc(19),),
)

RULE = RuleDef(
    "fuse",
    EVERYTHING,
    (
        RuleBranch(
            ECmp("==", EAttr("x", "dtype"), EConst(pm.f32)),
            RApp(
                Fused,
                (RVar("x"), RApp(Relu, (RVar("y"),))),
                (("alpha", EBin("*", EAttr("x", "rank"), EConst(0.5))),),
                0,
            ),
            loc(30),
        ),
        RuleBranch(
            ENot(EConst(False)),
            RTuple((RApp(Split, (RVar("x"),), (), 1), RConst(1.0), RConst(math.nan))),
            None,
        ),
        RuleBranch(
            EConst(True),
            RApp(
                Conv, (RVar("x"), RVar("y")), (("padding", EConst((1, 1))), ("stride", EConst(2)))
            ),
            loc(32),
        ),
    ),
    True,
    loc(29),
)

RULE2 = RuleDef(
    "mm", MMXYT, (RuleBranch(EConst(True), RApp(FRESH, (RVar("x"), RVar("y"), RConst(0)))),)
)

ITEMS: list[Any] = [MatMul, EVERYTHING, RULE, FRESH, MMXYT, RULE2, EVERYTHING, Concat]


# ------------------------------------------------------------------ comparing with locs


def _same_float(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def assert_same(a: Any, b: Any, *, ops_identical: bool = True) -> None:
    """Deep equality *including* compare=False fields (SourceLocs), exact literal types,
    signed zeros and NaNs; operators identical (or, if not, of equal signature)."""
    todo = [(a, b, "item")]
    while todo:
        x, y, path = todo.pop()
        if isinstance(x, Operator):
            assert isinstance(y, Operator), path
            if ops_identical or y is x:
                assert y is x, f"{path}: operator {x.qualname} is not the same object"
            else:
                sig = lambda o: (o.qualname, o.n_in, o.n_out, o.attrs, o.op_class, o.pure)  # noqa: E731
                assert sig(x) == sig(y), path
            continue
        assert type(x) is type(y), f"{path}: {type(x).__name__} != {type(y).__name__}"
        if isinstance(x, GuardFn):
            assert x.name == y.name and x.fn is y.fn, path
        elif dataclasses.is_dataclass(x):
            for f in dataclasses.fields(x):
                todo.append((getattr(x, f.name), getattr(y, f.name), f"{path}.{f.name}"))
        elif isinstance(x, tuple):
            assert len(x) == len(y), path
            todo.extend((u, v, f"{path}[{i}]") for i, (u, v) in enumerate(zip(x, y, strict=True)))
        elif isinstance(x, float):
            assert _same_float(x, y), f"{path}: {x!r} != {y!r}"
        else:
            assert x is y or x == y, f"{path}: {x!r} != {y!r}"
