"""The structural pre-check in front of the machine.

The operators and arities a match must have at its root and the four levels below
(``x <= q`` constraints included), computed once per pattern; a term that fails it has no
match, so the machine is not started.
"""

from __future__ import annotations

from typing import Any

from ..core.calculus import (
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
from ..core.terms import CONST, Operator
from .analysis import _error_free
from .machine import _TOP_CTX, _enter

# A shape: None (any term) or a list of alternatives (op or None, arity or None, kids), kids
# being None (not looked at) or one shape per input. A necessary condition for a match.
_Shape = list | None
_SHAPE_DEPTH = 4
_SHAPE_ALTS = 64
# Pattern nodes one pre-check computation may visit (constraints are visited where read).
_SHAPE_BUDGET = 4000


def _shape(
    p: Pattern, depth: int, budget: list[int], cons: Any, cell: list[int], ctx: tuple = _TOP_CTX
) -> _Shape:
    """What every term ``p`` matches looks like, ``depth`` levels down. ``cons`` holds the
    constraints ``x <= q`` that every match of the enclosing pattern checks, as a chain
    ``(x, (q, the context q is read in) or None for "x is out", rest) | None`` (innermost
    first): θ is global, so wherever ``x`` occurs the term there is θ(x), which must match
    ``q``.

    A definition is entered as the machine enters it (:func:`_enter`: its body read through
    an environment, not copied), with one fresh-name counter ``cell`` for the whole walk, so
    the names are those of unfolding it with :func:`pypm_jax.semantics.subst.unfold` and only the
    levels looked at are visited."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    cls = type(p)
    if cls is PExists:
        env, info, base, scope = ctx
        if info is not None:  # in an entered body: the ∃'s fresh name
            var = p.var
            name = f"{var.split('#', 1)[0]}#{base + info.offsets[id(p)]}"
            if name != env.get(var, var):
                ctx = ({**env, var: name}, info, base, scope)
        return _shape(p.body, depth, budget, cons, cell, ctx)
    if cls is PConstr:
        cons = (ctx[0].get(p.var, p.var), (p.constraint, ctx), cons)
        return _shape(p.pat, depth, budget, cons, cell, ctx)
    if cls is PApp or cls is PFunVar:
        args = p.args
        kids = None
        if depth > 0:
            kids = tuple(_shape(a, depth - 1, budget, cons, cell, ctx) for a in args)
            if all(k is None for k in kids):
                kids = None
        if cls is PApp:
            op = p.op
        else:  # an operator variable instantiated with an operator is an application
            f = ctx[0].get(p.var, p.var)
            op = f if isinstance(f, Operator) else None
        return [(op, len(args), kids)]
    if cls is PVar:
        key = ctx[0].get(p.name, p.name)
        link = cons
        while link is not None and not (link[0] is key or link[0] == key):
            link = link[2]
        if link is None or link[1] is None:
            return None
        q, q_ctx = link[1]
        return _shape(q, depth, budget, (key, None, cons), cell, q_ctx)
    if cls is PGuard:
        return _shape(p.pat, depth, budget, cons, cell, ctx)
    if cls is PAlt:
        a = _shape(p.left, depth, budget, cons, cell, ctx)
        b = _shape(p.right, depth, budget, cons, cell, ctx) if a is not None else None
        if a is None or b is None or len(a) + len(b) > _SHAPE_ALTS:
            return None
        return a + b
    if cls is PConst:
        return [(CONST, None, None)]
    if cls is PMu:
        try:
            q, inner = _enter(p.name, p.params, p.args, p.body, ctx, cell)
        except TypeError:  # a term variable bound to an operator: unfolding fails
            return None
        return _shape(q, depth, budget, cons, cell, inner)
    if cls is PCall:
        definition = ctx[3].get(p.name)
        if definition is None:
            return None  # a reference outside its definition: anything
        try:
            q, inner = _enter(p.name, definition[0], p.args, definition[1], ctx, cell)
        except TypeError:
            return None
        return _shape(q, depth, budget, cons, cell, inner)
    return None


def _fits(shape: list, t: Any) -> bool:
    for op, n, kids in shape:
        if op is not None and t.op is not op:
            continue
        ins = t.inputs
        if n is not None and len(ins) != n:
            continue
        if kids is None or all(k is None or _fits(k, i) for k, i in zip(kids, ins, strict=True)):
            return True
    return False


def _prefilter(body: Pattern) -> list | None:
    """A cheap structural test of the first few levels below a root that every match
    passes (None: no useful test). Used in front of the machine only."""
    try:
        if not _error_free(body):
            return None
        shape = _shape(body, _SHAPE_DEPTH, [_SHAPE_BUDGET], None, [1])
    except RecursionError:
        return None
    if shape is None or all(kids is None for _, _, kids in shape):
        return None  # the root operator index already does this much
    return shape
