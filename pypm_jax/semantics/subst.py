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
from typing import Any

from ..core.calculus import (
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
    children,
)
from ..core.terms import Operator
from .guards import Undefined, op_attr


class FreshNames:
    """A deterministic supply of fresh variable names: ``y`` → ``y#1``, ``y#2``, ..."""

    __slots__ = ("_counter",)

    def __init__(self) -> None:
        self._counter = itertools.count(1)

    def __call__(self, name: str) -> str:
        return f"{name.split('#', 1)[0]}#{next(self._counter)}"


# Per definition body: (body, the names of the recursive references it leaves free).
_FREE: dict[int, tuple[Pattern, frozenset[str]]] = {}


def free_references(body: Pattern) -> frozenset[str]:
    """The names of the recursive references a body leaves free (those of a nested
    definition are bound by it), computed bottom-up over the nested definitions, each once,
    with loops: a 10 000-deep chain of definitions costs a walk of it, not its square."""
    hit = _FREE.get(id(body))
    if hit is not None and hit[0] is body:
        return hit[1]
    order: list[Pattern] = []
    todo = [body]
    while todo:  # the uncached bodies, outermost first
        b = todo.pop()
        order.append(b)
        stack = [b]
        while stack:
            q = stack.pop()
            if isinstance(q, PMu):
                got = _FREE.get(id(q.body))
                if got is None or got[0] is not q.body:
                    todo.append(q.body)
                continue
            stack.extend(children(q, into_mu=False))
    free: frozenset[str] = frozenset()
    for b in reversed(order):  # innermost first
        names: set[str] = set()
        stack = [b]
        while stack:
            q = stack.pop()
            if isinstance(q, PCall):
                names.add(q.name)
            elif isinstance(q, PMu):
                got = _FREE.get(id(q.body))
                inner = got[1] if got is not None and got[0] is q.body else free_references(q.body)
                names |= inner - {q.name}
            else:
                stack.extend(children(q, into_mu=False))
        free = frozenset(names)
        if len(_FREE) >= 4096:
            _FREE.clear()
        _FREE[id(b)] = (b, free)
    return free


def _replace_calls(p: Pattern, mu: PMu) -> Pattern:
    """Replace each reference ``P(ys)`` to ``mu``'s name by ``μP(xs)[ys]. body``.

    A loop with an explicit stack (post-order), never recursion: a pattern 10 000 levels
    deep unfolds like a shallow one."""
    out: list[Pattern] = []
    todo: list[tuple[Pattern, bool]] = [(p, False)]
    while todo:
        q, built = todo.pop()
        if built:
            if isinstance(q, PMu):
                body = out.pop()
                out.append(PMu(q.name, q.params, q.args, body))
                continue
            kids = children(q, into_mu=False)
            n = len(kids)
            new = out[len(out) - n :]
            del out[len(out) - n :]
            out.append(_rebuild(q, new))
            continue
        match q:
            case PCall(name, args) if name == mu.name:
                out.append(PMu(mu.name, mu.params, args, mu.body))
            case PVar() | PConst() | PCall():
                out.append(q)
            case PMu(name, _, _, body):
                if name == mu.name or mu.name not in free_references(body):
                    out.append(q)  # shadowed by an inner definition, or not referred to
                else:
                    todo.append((q, True))
                    todo.append((body, False))
            case PApp() | PFunVar() | PAlt() | PGuard() | PExists() | PConstr():
                todo.append((q, True))
                todo.extend((c, False) for c in reversed(children(q, into_mu=False)))
            case _:
                raise TypeError(f"not a pattern: {q!r}")
    return out[0]


def _rebuild(q: Pattern, kids: list[Pattern]) -> Pattern:
    """``q`` with its sub-patterns (its ``children(q, into_mu=False)``) replaced by ``kids``."""
    match q:
        case PApp(op, _, index):
            return PApp(op, tuple(kids), index)
        case PFunVar(var, _, index, n_out):
            return PFunVar(var, tuple(kids), index, n_out)
        case PAlt():
            return PAlt(kids[0], kids[1])
        case PGuard(_, guard, loc):
            return PGuard(kids[0], guard, loc)
        case PExists(var, _, kind):
            return PExists(var, kids[0], kind)
        case PConstr(_, var, _, loc):
            return PConstr(kids[0], var, kids[1], loc)
    raise TypeError(f"not a pattern: {q!r}")


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
    """``p`` with its variables renamed by ``env`` and each ∃ given a fresh name, drawn in
    pre-order, left to right. A loop with an explicit stack, never recursion."""
    out: list[Pattern] = []
    todo: list[tuple[Pattern, dict[str, Arg], Any]] = [(p, env, None)]
    while todo:
        q, env, built = todo.pop()
        if built is not None:  # every sub-pattern is renamed: rebuild q
            kids = children(q, into_mu=False)
            n = len(kids)
            new = out[len(out) - n :]
            del out[len(out) - n :]
            match q:
                case PFunVar(_, _, index, n_out):
                    if isinstance(built, Operator):
                        out.append(PApp(built, tuple(new), index))
                    else:
                        out.append(PFunVar(built, tuple(new), index, n_out))
                case PGuard(_, guard, loc):
                    out.append(PGuard(new[0], rename_expr(guard, env), loc))
                case PExists(_, _, kind):
                    out.append(PExists(built, new[0], kind))
                case PConstr(_, var, _, loc):
                    out.append(PConstr(new[0], env.get(var, var), new[1], loc))
                case _:
                    out.append(_rebuild(q, new))
            continue
        match q:
            case PVar(name):
                new_name = env.get(name, name)
                if isinstance(new_name, Operator):
                    raise TypeError(
                        f"term variable {name} instantiated with operator {new_name.name}"
                    )
                out.append(PVar(new_name))
                continue
            case PConst():
                out.append(q)
                continue
            case PMu(name, params, args, body):
                out.append(PMu(name, params, tuple(_rename_arg(a, env) for a in args), body))
                continue
            case PCall(name, args):
                out.append(PCall(name, tuple(_rename_arg(a, env) for a in args)))
                continue
            case PFunVar(var):
                todo.append((q, env, env.get(var, var)))
            case PExists(var):
                new_var = fresh(var)
                todo.append((q, env, new_var))
                env = {**env, var: new_var}
            case PApp() | PAlt() | PGuard() | PConstr():
                todo.append((q, env, True))
            case _:
                raise TypeError(f"not a pattern: {q!r}")
        todo.extend((c, env, None) for c in reversed(children(q, into_mu=False)))
    return out[0]


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
