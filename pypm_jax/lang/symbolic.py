"""Symbolic values: what pattern and rule bodies compute with while they are traced.

A pattern body runs once per path with a :class:`SymPattern` for each parameter. Applying an
operator to symbolic values builds a symbolic pattern; reading ``x.shape`` builds a symbolic
expression (:class:`SymExpr`) that becomes a guard. Anything Python would need a concrete
answer for (truth value, iteration, length) raises a PatternDefinitionError at the user's line.
"""

from __future__ import annotations

__all__ = ["Sym", "SymExpr", "SymPattern", "SymOp", "to_expr", "definition_error"]

import difflib
from collections.abc import Callable
from typing import Any, NoReturn

from ..core.calculus import (
    EAttr,
    EBin,
    ECall,
    ECmp,
    EConst,
    EIndex,
    EOpAttr,
    ETuple,
    EUnary,
    Expr,
)
from ..core.dtypes import DType
from ..core.errors import PatternDefinitionError
from ..core.terms import DECLARED_ATTRS, OpClass, Operator, Term
from ..semantics.guards import power_problem
from .registry import GUARD_FNS

# Set by the tracer: returns the SourceLoc of the user's line being executed.
current_loc: Callable[[], Any] = lambda: None  # noqa: E731


def definition_error(message: str) -> NoReturn:
    raise PatternDefinitionError(message, current_loc())


# What every term has (see ``_terms.term_attr``) and what an operator variable has (see
# ``_guards.op_attr``: a parameter used as both is known only once the body is traced); any
# other attribute is one an operator declares (``Operator.attrs``: a JAX primitive's
# params, a ``@pm.op``'s attributes).
TERM_ATTRS = frozenset({"shape", "rank", "dtype", "eltType", "op", "op_class", "index", "term"})
OP_ATTRS = frozenset({"op_class", "name", "n_in", "arity", "n_out"})


def _check_attr(attr: str) -> None:
    """A guard reading an attribute no term and no operator has could never
    hold (a misspelt ``x.dtpye``): say so where it is written, not by never firing."""
    if attr in TERM_ATTRS or attr in OP_ATTRS:
        return
    if attr in DECLARED_ATTRS:
        return
    known = TERM_ATTRS | OP_ATTRS | DECLARED_ATTRS
    close = difflib.get_close_matches(attr, sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    definition_error(
        f"no term or operator has an attribute {attr!r}{hint} (terms have "
        f"{', '.join(sorted(TERM_ATTRS - {'eltType'}))}, operators "
        f"{', '.join(sorted(OP_ATTRS))}; any other attribute is one an operator declares)"
    )


class Sym:
    """Base of symbolic values; refuses every concrete question Python may ask."""

    __pypm_symbolic__ = True
    __slots__ = ()

    def __bool__(self) -> bool:
        definition_error(
            "a symbolic value is used where Python needs a concrete truth value "
            "(use `assert` or `if` on guards; `while` loops and `and`/`or` outside "
            "pattern bodies are not supported)"
        )

    def __iter__(self) -> NoReturn:
        definition_error("cannot loop over a symbolic value (its length is not known)")

    def __len__(self) -> int:
        definition_error("the length of a symbolic value is not known; use `.rank`")

    def __index__(self) -> int:
        definition_error("a symbolic value cannot be used as a Python index")

    __hash__ = object.__hash__


def to_expr(value: Any) -> Expr:
    """A guard expression for a Python value used inside a guard."""
    if isinstance(value, SymExpr):
        return value.expr
    if isinstance(value, SymPattern):
        definition_error(
            "a pattern is used inside a guard; compare its attributes "
            "(x.shape, x.rank, x.dtype, ...) instead"
        )
    if isinstance(value, SymOp):
        definition_error("an operator variable is used inside a guard; compare F.op_class")
    if isinstance(value, tuple | list):
        items = tuple(to_expr(v) for v in value)
        if all(isinstance(i, EConst) for i in items):
            return EConst(tuple(i.value for i in items))
        return ETuple(items)
    if isinstance(value, Term) and value.op.name == "const":
        return EConst(value.attrs["value"])
    if value is None or isinstance(value, bool | int | float | str | DType | OpClass | Operator):
        return EConst(value)
    definition_error(f"cannot use {value!r} of type {type(value).__name__} in a guard")


def _lift(fn: Callable[[Expr, Expr], Expr]) -> Callable[[Any, Any], SymExpr]:
    return lambda a, b: SymExpr(fn(to_expr(a), to_expr(b)))


class SymExpr(Sym):
    """A symbolic guard expression (the calculus' ``e`` and ``g``)."""

    __slots__ = ("expr",)

    def __init__(self, expr: Expr):
        self.expr = expr

    __add__ = _lift(lambda a, b: EBin("+", a, b))
    __radd__ = _lift(lambda a, b: EBin("+", b, a))
    __sub__ = _lift(lambda a, b: EBin("-", a, b))
    __rsub__ = _lift(lambda a, b: EBin("-", b, a))
    __mul__ = _lift(lambda a, b: EBin("*", a, b))
    __rmul__ = _lift(lambda a, b: EBin("*", b, a))
    __truediv__ = _lift(lambda a, b: EBin("/", a, b))
    __rtruediv__ = _lift(lambda a, b: EBin("/", b, a))
    __floordiv__ = _lift(lambda a, b: EBin("//", a, b))
    __rfloordiv__ = _lift(lambda a, b: EBin("//", b, a))
    __mod__ = _lift(lambda a, b: EBin("%", a, b))
    __rmod__ = _lift(lambda a, b: EBin("%", b, a))

    def __pow__(self, other: Any) -> SymExpr:
        exponent = to_expr(other)
        problem = power_problem(exponent)
        if problem:
            definition_error(problem)
        return SymExpr(EBin("**", self.expr, exponent))

    __eq__ = _lift(lambda a, b: ECmp("==", a, b))  # type: ignore[assignment]
    __ne__ = _lift(lambda a, b: ECmp("!=", a, b))  # type: ignore[assignment]
    __lt__ = _lift(lambda a, b: ECmp("<", a, b))
    __le__ = _lift(lambda a, b: ECmp("<=", a, b))
    __gt__ = _lift(lambda a, b: ECmp(">", a, b))
    __ge__ = _lift(lambda a, b: ECmp(">=", a, b))
    __hash__ = object.__hash__

    def __neg__(self) -> SymExpr:
        return SymExpr(EUnary("-", self.expr))

    def __pos__(self) -> SymExpr:
        return self

    def __getitem__(self, index: Any) -> SymExpr:
        if isinstance(index, slice):
            definition_error("slices of symbolic shapes are not supported; index dimensions")
        return SymExpr(EIndex(self.expr, to_expr(index)))

    @property
    def rank(self) -> SymExpr:
        """``x.shape.rank``."""
        if isinstance(self.expr, EAttr) and self.expr.attr == "shape":
            return SymExpr(EAttr(self.expr.var, "rank"))
        return SymExpr(ECall(GUARD_FNS["len"], (self.expr,)))

    def __repr__(self) -> str:
        from ..core.calculus import show_expr

        return f"<symbolic {show_expr(self.expr)}>"


class SymPattern(Sym):
    """A symbolic pattern: a variable, an operator application, a call of another pattern.

    ``kind`` is one of ``"var"`` (``data = name``), ``"app"`` (``data = (op, args, index,
    attrs)``), ``"funvar"`` (``data = (SymOp-or-var, args, index)``), ``"call"`` (``data =
    (pattern_function, args)``), ``"const"`` (``data = value``).
    """

    __slots__ = ("kind", "data", "hint", "tracer")

    def __init__(self, tracer: Any, kind: str, data: Any, hint: str | None = None):
        self.tracer = tracer
        self.kind = kind
        self.data = data
        self.hint = hint

    def __getattr__(self, attr: str) -> SymExpr:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr == "eltType":
            attr = "dtype"
        _check_attr(attr)
        return SymExpr(EAttr(self.tracer.name_of(self), attr))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "var" and self.tracer.is_param(self.data):
            return self.tracer.apply_opvar(self.data, args, kwargs)
        definition_error("only operators, patterns and operator variables can be called")

    def __le__(self, other: Any) -> NoReturn:
        definition_error("a match constraint `x <= p` must be a statement on its own")

    def __eq__(self, other: Any) -> NoReturn:  # type: ignore[override]
        definition_error("patterns cannot be compared; compare their attributes instead")

    __ne__ = __eq__  # type: ignore[assignment]
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"<symbolic {self.kind} {self.data if self.kind == 'var' else ''}>"


class SymOp(Sym):
    """An operator variable: a parameter called like a function, or ``pm.Op(n_in, n_out)``."""

    # Slots are prefixed so that ``F.name`` / ``F.n_in`` in a body read the operator's
    # attributes (guards), not the variable's own bookkeeping.
    __slots__ = ("tracer", "var_name", "var_n_in", "var_n_out")

    def __init__(self, tracer: Any, name: str, n_in: int | None, n_out: int | None):
        self.tracer = tracer
        self.var_name = name
        self.var_n_in = n_in
        self.var_n_out = n_out

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tracer.apply_opvar(self.var_name, args, kwargs, self)

    def __getattr__(self, attr: str) -> SymExpr:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return SymExpr(EOpAttr(self.var_name, attr))

    def __repr__(self) -> str:
        return f"<operator variable {self.var_name}>"
