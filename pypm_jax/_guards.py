"""Evaluation of guard expressions: the paper's ⟦g[θ]⟧, shared by every matcher.

A guard holds only when it evaluates to true. Reading an attribute a term lacks, a variable
that is not bound, or an ill-typed operation (``None + 1``) makes the guard undefined, and an
undefined guard does not hold — the declarative rule P-Guard demands ⟦g[θ]⟧ = True.
"""

from __future__ import annotations

__all__ = ["Undefined", "eval_expr", "guard_holds", "op_attr"]

import operator as _operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._calculus import (
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
)
from ._terms import UNDEFINED, Operator, term_attr


class Undefined(Exception):
    """Raised inside evaluation when ⟦g[θ]⟧ has no value."""


_BIN = {
    "+": _operator.add,
    "-": _operator.sub,
    "*": _operator.mul,
    "/": _operator.truediv,
    "//": _operator.floordiv,
    "%": _operator.mod,
    "**": _operator.pow,
}
_CMP = {
    "==": _operator.eq,
    "!=": _operator.ne,
    "<": _operator.lt,
    "<=": _operator.le,
    ">": _operator.gt,
    ">=": _operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
}


def op_attr(op: Operator, attr: str) -> Any:
    """An attribute of an operator (what ``F.op_class`` reads for an operator variable F)."""
    if attr == "op_class":
        value = op.op_class
    elif attr == "name":
        value = op.name
    elif attr in ("n_in", "arity"):
        value = op.n_in
    elif attr == "n_out":
        value = op.n_out
    else:
        value = None
    if value is None:
        raise Undefined(f"operator {op.name} has no attribute {attr}")
    return value


def _truth(value: Any) -> bool:
    if isinstance(value, bool | np.bool_ | int | np.integer):
        return bool(value)
    raise Undefined(f"{value!r} is not a truth value")


def eval_expr(e: Expr, theta: Mapping[str, Any], phi: Mapping[str, Operator]) -> Any:
    """⟦e[θ, φ]⟧, raising :class:`Undefined` where it has no value."""
    match e:
        case EConst(value):
            return value
        case EAttr(var, attr):
            term = theta.get(var)
            if term is None:
                raise Undefined(f"{var} is not bound")
            value = term_attr(term, attr)
            if value is UNDEFINED:
                raise Undefined(f"{var} has no attribute {attr}")
            return value
        case EOpAttr(var, attr):
            op = phi.get(var)
            if op is None:
                raise Undefined(f"operator variable {var} is not bound")
            return op_attr(op, attr)
        case ECmp(op, left, right):
            try:
                return bool(_CMP[op](eval_expr(left, theta, phi), eval_expr(right, theta, phi)))
            except Undefined:
                raise
            except Exception as exc:
                raise Undefined(str(exc)) from None
        case EAnd(items):
            return all(_truth(eval_expr(i, theta, phi)) for i in items)
        case EOr(items):
            return any(_truth(eval_expr(i, theta, phi)) for i in items)
        case ENot(operand):
            return not _truth(eval_expr(operand, theta, phi))
        case ETuple(items):
            return tuple(eval_expr(i, theta, phi) for i in items)
        case _:
            try:
                match e:
                    case EBin(op, left, right):
                        return _BIN[op](eval_expr(left, theta, phi), eval_expr(right, theta, phi))
                    case EUnary(op, operand):
                        v = eval_expr(operand, theta, phi)
                        return -v if op == "-" else +v
                    case EIndex(base, index):
                        return eval_expr(base, theta, phi)[eval_expr(index, theta, phi)]
                    case ECall(fn, args):
                        return fn.fn(*(eval_expr(a, theta, phi) for a in args))
            except Undefined:
                raise
            except Exception as exc:
                raise Undefined(f"{type(exc).__name__}: {exc}") from None
    raise TypeError(f"not an expression: {e!r}")


def guard_holds(g: Expr, theta: Mapping[str, Any], phi: Mapping[str, Operator]) -> bool:
    """Does ⟦g[θ, φ]⟧ = True?"""
    try:
        return _truth(eval_expr(g, theta, phi))
    except Undefined:
        return False
