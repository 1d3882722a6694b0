"""Evaluation of guard expressions: the paper's ⟦g[θ]⟧, shared by every matcher.

A guard holds only when it evaluates to true. Reading an attribute a term lacks, a variable
that is not bound, or an ill-typed operation (``None + 1``) makes the guard undefined, and an
undefined guard does not hold — the declarative rule P-Guard demands ⟦g[θ]⟧ = True.

Guards may come from a loaded file, so arithmetic is bounded: an operation whose result would
exceed :data:`MAX_RESULT_BITS` (integers) or :data:`MAX_RESULT_ITEMS` (strings and tuples) is
not computed and is undefined (:class:`TooLarge`): ``7 ** 30000000 > 0`` does not hold, at
once, rather than computing a 10-million-digit number.
"""

from __future__ import annotations

__all__ = [
    "Refusal",
    "Undefined",
    "TooLarge",
    "MAX_RESULT_BITS",
    "MAX_RESULT_ITEMS",
    "MAX_EXPONENT",
    "binary",
    "power_problem",
    "bound_attr",
    "bound_op_attr",
    "eval_expr",
    "guard_holds",
    "op_attr",
]

import operator as _operator
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.calculus import (
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
from ..core.terms import UNDEFINED, Operator, term_attr


class Undefined(Exception):
    """Raised inside evaluation when ⟦g[θ]⟧ has no value."""


class TooLarge(Undefined):
    """An operation of a guard whose result would exceed the evaluation limits."""


MAX_RESULT_BITS = 4096  # an integer a guard computes
MAX_RESULT_ITEMS = 65_536  # a string or tuple a guard builds
MAX_EXPONENT = 1024  # a constant integer exponent of ``**``, refused beyond (definition, load)


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


def _int_bits(x: Any) -> int | None:
    """The size of a Python integer (numpy's wrap around and stay small), or None."""
    return x.bit_length() if isinstance(x, int) else None


def _seq_len(x: Any) -> int | None:
    return len(x) if isinstance(x, str | tuple | list | bytes) else None


def power_problem(exponent: Expr) -> str | None:
    """Why a guard may not raise to ``exponent`` -- a constant integer (``c``, ``-c``) beyond
    :data:`MAX_EXPONENT` -- or None. Checked where guards are defined and loaded, so such a
    guard is an error there rather than undefined at every match. (A float power costs the
    same whatever its exponent.)"""
    sign = 1
    for _ in range(4):
        if not isinstance(exponent, EUnary):
            break
        sign = -sign if exponent.op == "-" else sign
        exponent = exponent.operand
    if isinstance(exponent, EConst) and type(exponent.value) is int:
        value = sign * exponent.value
        if abs(value) > MAX_EXPONENT:
            shown = str(value) if value.bit_length() < 64 else f"of {value.bit_length()} bits"
            return (
                f"a guard raises to the constant power {shown}: exponents are limited to "
                f"{MAX_EXPONENT} (MAX_EXPONENT)"
            )
    return None


def binary(op: str, a: Any, b: Any) -> Any:
    """``a op b``, refusing (:class:`TooLarge`) a result beyond the limits before computing it."""
    bits_a, bits_b = _int_bits(a), _int_bits(b)
    if op == "**" and bits_a is not None and bits_b is not None and b > 0 and bits_a > 1:
        if b > MAX_RESULT_BITS or (bits_a - 1) * b > MAX_RESULT_BITS:
            raise TooLarge(f"a power of a {bits_a}-bit integer exceeds {MAX_RESULT_BITS} bits")
    elif op == "*" and bits_a is not None and bits_b is not None:
        if bits_a + bits_b > MAX_RESULT_BITS:
            raise TooLarge(f"a product of {bits_a} and {bits_b} bits exceeds {MAX_RESULT_BITS}")
    elif op == "*":
        n, k = (_seq_len(a), b) if bits_b is not None else (_seq_len(b), a)
        if n is not None and _int_bits(k) is not None and n * k > MAX_RESULT_ITEMS:
            raise TooLarge(f"a repetition of {n} items {k} times exceeds {MAX_RESULT_ITEMS}")
    elif op == "+":
        n, m = _seq_len(a), _seq_len(b)
        if n is not None and m is not None and n + m > MAX_RESULT_ITEMS:
            raise TooLarge(f"a concatenation of {n + m} items exceeds {MAX_RESULT_ITEMS}")
    elif op == "%" and isinstance(a, str | bytes):
        raise Undefined("guards do not format strings")  # "%099999999d" % 1
    return _BIN[op](a, b)


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


class Refusal:
    """A false truth value that says why: what a guard function returns instead of
    ``False`` (``return pm.Refusal(f"head dim {d} is outside 1..256")``) so that
    ``pm.explain`` and ``missed`` can say, in words, what stopped a rule."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = str(reason)

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Refusal) and other.reason == self.reason

    def __hash__(self) -> int:
        return hash(("Refusal", self.reason))

    def __repr__(self) -> str:
        return f"Refusal({self.reason!r})"


def _truth(value: Any) -> bool:
    if isinstance(value, bool | np.bool_ | int | np.integer):
        return bool(value)
    if isinstance(value, Refusal):
        return False
    raise Undefined(f"{value!r} is not a truth value")


def bound_attr(theta: Mapping[str, Any], var: str, attr: str) -> Any:
    """⟦var.attr⟧ under θ, raising :class:`Undefined` where it has no value."""
    term = theta.get(var)
    if term is None:
        raise Undefined(f"{var} is not bound")
    value = term_attr(term, attr)
    if value is UNDEFINED:
        raise Undefined(f"{var} has no attribute {attr}")
    return value


def bound_op_attr(phi: Mapping[str, Operator], var: str, attr: str) -> Any:
    """⟦F.attr⟧ of an operator variable under φ, raising :class:`Undefined` where unbound."""
    op = phi.get(var)
    if op is None:
        raise Undefined(f"operator variable {var} is not bound")
    return op_attr(op, attr)


def eval_expr(e: Expr, theta: Mapping[str, Any], phi: Mapping[str, Operator]) -> Any:
    """⟦e[θ, φ]⟧, raising :class:`Undefined` where it has no value."""
    match e:
        case EConst(value):
            return value
        case EAttr(var, attr):
            return bound_attr(theta, var, attr)
        case EOpAttr(var, attr):
            return bound_op_attr(phi, var, attr)
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
                        return binary(op, eval_expr(left, theta, phi), eval_expr(right, theta, phi))
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
