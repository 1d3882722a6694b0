"""Unfolding a recursive pattern one step: the paper's p[μP(x).p/P][yᵢ/xᵢ] (rule P-Mu).

Substitution is capture-avoiding: every variable an existential binds inside the body gets a
fresh name at each unfolding (``y`` becomes ``y#7``), so the copies of a recursive pattern
never share local variables. Both reference semantics and the fast matcher unfold with this
function; the fresh names come from a counter the caller owns, so runs are deterministic.
"""

from __future__ import annotations

__all__ = ["unfold", "FreshNames", "rename_expr"]

import itertools
from collections.abc import Mapping

from ._calculus import (
    Arg,
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
    Pattern,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
)
from ._guards import Undefined, op_attr
from ._terms import Operator


class FreshNames:
    """A deterministic supply of fresh variable names: ``y`` → ``y#1``, ``y#2``, ..."""

    __slots__ = ("_counter",)

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def __call__(self, name: str) -> str:
        return f"{name.split('#', 1)[0]}#{next(self._counter)}"


def _replace_calls(p: Pattern, mu: PMu) -> Pattern:
    """Replace each reference ``P(ys)`` to ``mu``'s name by ``μP(xs)[ys]. body``."""
    match p:
        case PCall(name, args) if name == mu.name:
            return PMu(mu.name, mu.params, args, mu.body)
        case PVar() | PConst() | PCall():
            return p
        case PApp(op, args, index):
            return PApp(op, tuple(_replace_calls(a, mu) for a in args), index)
        case PFunVar(var, args, index, n_out):
            return PFunVar(var, tuple(_replace_calls(a, mu) for a in args), index, n_out)
        case PAlt(left, right):
            return PAlt(_replace_calls(left, mu), _replace_calls(right, mu))
        case PGuard(pat, guard, loc):
            return PGuard(_replace_calls(pat, mu), guard, loc)
        case PExists(var, body, kind):
            return PExists(var, _replace_calls(body, mu), kind)
        case PConstr(pat, var, constraint, loc):
            return PConstr(_replace_calls(pat, mu), var, _replace_calls(constraint, mu), loc)
        case PMu(name, params, args, body):
            if name == mu.name:  # an inner definition of the same name shadows
                return p
            return PMu(name, params, args, _replace_calls(body, mu))
    raise TypeError(f"not a pattern: {p!r}")


def rename_expr(e: Expr, env: Mapping[str, Arg]) -> Expr:
    """Rename the variables of an expression (an operator variable may become an operator)."""
    match e:
        case EConst():
            return e
        case EAttr(var, attr):
            new = env.get(var, var)
            return EAttr(new, attr) if isinstance(new, str) else e
        case EOpAttr(var, attr):
            new = env.get(var, var)
            if isinstance(new, Operator):
                try:
                    return EConst(op_attr(new, attr))
                except Undefined:
                    return ECall(_UNDEFINED_FN, ())
            return EOpAttr(new, attr)
        case EIndex(base, index):
            return EIndex(rename_expr(base, env), rename_expr(index, env))
        case EBin(op, left, right):
            return EBin(op, rename_expr(left, env), rename_expr(right, env))
        case EUnary(op, operand):
            return EUnary(op, rename_expr(operand, env))
        case ECmp(op, left, right):
            return ECmp(op, rename_expr(left, env), rename_expr(right, env))
        case EAnd(items):
            return EAnd(tuple(rename_expr(i, env) for i in items))
        case EOr(items):
            return EOr(tuple(rename_expr(i, env) for i in items))
        case ENot(operand):
            return ENot(rename_expr(operand, env))
        case ECall(fn, args):
            return ECall(fn, tuple(rename_expr(a, env) for a in args))
        case ETuple(items):
            return ETuple(tuple(rename_expr(i, env) for i in items))
    raise TypeError(f"not an expression: {e!r}")


def _undefined() -> None:
    raise Undefined("attribute of a concrete operator that it does not have")


_UNDEFINED_FN = GuardFn("undefined", _undefined)


def _rename_arg(a: Arg, env: Mapping[str, Arg]) -> Arg:
    return env.get(a, a) if isinstance(a, str) else a


def _rename(p: Pattern, env: dict[str, Arg], fresh: FreshNames) -> Pattern:
    match p:
        case PVar(name):
            new = env.get(name, name)
            if isinstance(new, Operator):
                raise TypeError(f"term variable {name} instantiated with operator {new.name}")
            return PVar(new)
        case PConst():
            return p
        case PApp(op, args, index):
            return PApp(op, tuple(_rename(a, env, fresh) for a in args), index)
        case PFunVar(var, args, index, n_out):
            new_args = tuple(_rename(a, env, fresh) for a in args)
            new = env.get(var, var)
            if isinstance(new, Operator):
                return PApp(new, new_args, index)
            return PFunVar(new, new_args, index, n_out)
        case PAlt(left, right):
            return PAlt(_rename(left, env, fresh), _rename(right, env, fresh))
        case PGuard(pat, guard, loc):
            return PGuard(_rename(pat, env, fresh), rename_expr(guard, env), loc)
        case PExists(var, body, kind):
            new = fresh(var)
            return PExists(new, _rename(body, {**env, var: new}, fresh), kind)
        case PConstr(pat, var, constraint, loc):
            new = env.get(var, var)
            return PConstr(_rename(pat, env, fresh), new, _rename(constraint, env, fresh), loc)
        case PMu(name, params, args, body):
            return PMu(name, params, tuple(_rename_arg(a, env) for a in args), body)
        case PCall(name, args):
            return PCall(name, tuple(_rename_arg(a, env) for a in args))
    raise TypeError(f"not a pattern: {p!r}")


# Resolving the recursive references of a body depends only on (body, name, params), not on
# the arguments, and bodies live as long as their pattern definitions: memoize it, so an
# unfolding costs a walk of the body's own nodes (renaming), not of every nested definition.
# The cached body is kept in the value, so its id cannot be reused while the entry exists.
_RESOLVED: dict[tuple[int, str, tuple], tuple[Pattern, Pattern]] = {}


def _resolved_body(mu: PMu) -> Pattern:
    key = (id(mu.body), mu.name, mu.params)
    hit = _RESOLVED.get(key)
    if hit is not None and hit[0] is mu.body:
        return hit[1]
    body = _replace_calls(mu.body, mu)
    _RESOLVED[key] = (mu.body, body)
    return body


def unfold(mu: PMu, fresh: FreshNames) -> Pattern:
    """One unfolding of ``μP(xs)[ys]. body``: recursive references resolved, xs := ys,
    bound variables renamed apart."""
    body = _resolved_body(mu)
    env: dict[str, Arg] = {x.name: y for x, y in zip(mu.params, mu.args, strict=True)}
    return _rename(body, env, fresh)
