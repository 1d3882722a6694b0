"""The structural pre-checks in front of the machine.

The operators and arities a match must have at its root and the four levels below
(``x <= q`` constraints included), computed once per pattern; a term that fails it has no
match, so the machine is not started.

The deep pre-check looks further along fewer paths: where a pattern constrains a variable
on its spine (the machine's early refusals, :func:`pypm_jax.engine.machine._early_shapes`),
the paths from the root down to the places that variable is matched, up to eight levels,
each ending in the shape its term must have. An attention whose logits are spelt another
way (a bias where the pattern wants a scale) is refused there, before the softmax above
the logits is matched once per spelling of it.
"""

from __future__ import annotations

from collections.abc import Callable
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
from .analysis import _ByIdentity, _def_facts, _error_free
from .machine import _EARLY_DEPTH, _TOP_CTX, _definition, _early_shapes, _enter, _exists_ctx

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
        return _shape(p.body, depth, budget, cons, cell, _exists_ctx(p, ctx)[1])
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
    """Does ``t`` have the shape ``shape``? The shape read as it is: what its test's
    function (``_check_of(_test_of(shape))``, which the pre-checks run) says."""
    top = t.op
    for op, n, kids in shape:
        if op is not None and top is not op:
            continue
        ins = t.inputs
        if n is not None and len(ins) != n:
            continue
        if kids is None:
            return True
        for k, i in zip(kids, ins):  # noqa: B905 (kids only with an arity: n inputs)
            if k is not None and not _fits(k, i):
                break
        else:
            return True
    return False


# A shape's test: what ``_passes`` reads, the shape made into a tuple of its alternatives
# (op or None, arity or None, kids), kids being None or the pairs (input index, test) of the
# inputs the shape looks at; a summary writes it back as its shape. The pre-checks run its
# function (``_make_check``), which says what ``_passes`` says.
def _make_test(shape: list, memo: dict[int, tuple] | None = None) -> tuple:
    if memo is None:
        memo = {}  # (a sub-shape shared within the shape: one test)
    test = memo.get(id(shape))
    if test is None:
        test = memo[id(shape)] = tuple(
            (op, n, None if kids is None else _pairs(kids, memo)) for op, n, kids in shape
        )
    return test


def _pairs(kids: tuple, memo: dict[int, tuple]) -> tuple:
    return tuple((i, _make_test(k, memo)) for i, k in enumerate(kids) if k is not None)


_test_of = _ByIdentity(_make_test)


def _shape_of_test(test: tuple | None) -> list | None:
    """The shape ``test`` was made from (its equal)."""
    if test is None:
        return None
    shape = []
    for op, n, pairs in test:
        kids = None
        if pairs is not None:
            read = {i: _shape_of_test(k) for i, k in pairs}
            kids = tuple(read.get(i) for i in range(n))
        shape.append((op, n, kids))
    return shape


def _passes(test: tuple, t: Any) -> bool:
    """``_fits`` of the shape ``test`` was made from."""
    top = t.op
    for op, n, pairs in test:
        if op is not None and top is not op:
            continue
        ins = t.inputs
        if n is not None and len(ins) != n:
            continue
        if pairs is None:
            return True
        for i, k in pairs:
            if not _passes(k, ins[i]):
                break
        else:
            return True
    return False


def _make_check(test: tuple, memo: dict[int, Callable[[Any], bool]] | None = None) -> Callable:
    """A function of a term saying what ``_passes(test, ·)`` says, made of closures: the
    alternatives are grouped by operator (one dict look-up picks those a term's operator
    can pass, the wildcards among them), and each reads only the arity and inputs it
    checks. ``_passes`` reads the test anew at every term; the pre-checks run at most of a
    pass's starts. (No code is generated: making one costs microseconds.)"""
    if memo is None:
        memo = {}  # (a sub-test shared within the test: one function)
    found = memo.get(id(test))
    if found is not None:
        return found
    by_op: dict[int, list[Callable]] = {}  # (by identity, as ``_passes`` compares)
    ops: dict[int, Any] = {}
    wild: list[Callable] = []
    for op, n, pairs in test:
        if op is None and n is None and pairs is None:
            memo[id(test)] = _anything
            return _anything
        alt = _alternative(n, pairs, memo)
        if op is None:
            wild.append(alt)
        else:
            ops[id(op)] = op
            by_op.setdefault(id(op), []).append(alt)
    keep = tuple(ops.values())  # (the functions keep the operators their keys are ids of)
    if not wild and all(len(alts) == 1 for alts in by_op.values()):
        if len(keep) == 1:  # (one alternative: the common case below the root)
            check = _one(keep[0], by_op[id(keep[0])][0])
        else:
            get = {k: alts[0] for k, alts in by_op.items()}.get

            def check(t: Any, _ops: tuple = keep) -> bool:
                alt = get(id(t.op))
                return alt is not None and alt(t.inputs)

    else:
        table = {k: tuple(alts + wild) for k, alts in by_op.items()}
        rest = tuple(wild) or None
        get = table.get

        def check(t: Any, _ops: tuple = keep) -> bool:
            alts = get(id(t.op), rest)
            if alts is None:
                return False
            ins = t.inputs
            for alt in alts:
                if alt(ins):
                    return True
            return False

    memo[id(test)] = check
    return check


def _anything(t: Any) -> bool:
    return True


def _one(op: Any, alt: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """A test of one alternative, ``op`` with ``alt`` of its inputs."""
    return lambda t: t.op is op and alt(t.inputs)


def _alternative(n: int | None, pairs: tuple | None, memo: dict) -> Callable[[Any], bool]:
    """One alternative of a test, of a term's inputs: its arity and the inputs it reads.
    The inputs' functions are made when the alternative first gets past the arity: most
    of a deep test is never reached (a term's operator refuses it above)."""
    if pairs is None:
        if n is None:
            return _anything
        return lambda ins: len(ins) == n
    if n is not None and len(pairs) == 1:
        ((i, test),) = pairs
        k: Callable[[Any], bool] | None = None

        def one_input(ins: Any) -> bool:
            nonlocal k
            if len(ins) != n:
                return False
            if k is None:
                k = _make_check(test, memo)
            return k(ins[i])

        return one_input
    if n is not None and len(pairs) == 2:
        (i, test_i), (j, test_j) = pairs
        ki: Callable[[Any], bool] | None = None
        kj: Callable[[Any], bool] | None = None

        def two_inputs(ins: Any) -> bool:
            nonlocal ki, kj
            if len(ins) != n:
                return False
            if ki is None:
                ki, kj = _make_check(test_i, memo), _make_check(test_j, memo)
            return ki(ins[i]) and kj(ins[j])  # type: ignore[misc]

        return two_inputs
    kids: tuple | None = None

    def reads(ins: Any) -> bool:
        nonlocal kids
        if n is not None and len(ins) != n:  # (kids come with an arity: as ``_passes``)
            return False
        if kids is None:
            kids = tuple((i, _make_check(k, memo)) for i, k in pairs)
        for i, k in kids:
            if not k(ins[i]):
                return False
        return True

    return reads


# a test's function (``_make_check``), made once per test
_check_of = _ByIdentity(_make_check)


def _admits(test: tuple, op: Any, kids: tuple) -> bool:
    """Can a term pass ``test`` whose operator is ``op`` and whose inputs' (operator, arity)
    pairs are ``kids`` (flat: operator, arity, operator, arity, ...)? ``_passes`` read two
    levels deep, from what a term's signature (:class:`~pypm_jax.engine.index.ByInputs`)
    holds: False only where ``_passes`` is False."""
    for top, n, pairs in test:
        if top is not None and top is not op:
            continue
        if n is not None and 2 * n != len(kids):
            continue
        if pairs is None:
            return True
        for i, k in pairs:
            kop, kn = kids[2 * i], kids[2 * i + 1]
            for o, m, _ in k:
                if (o is None or o is kop) and (m is None or m == kn):
                    break
            else:
                break
        else:
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


# The deep pre-check: levels it follows a path down (the focus's own shape adds up to
# machine._EARLY_DEPTH more), pattern nodes one computation may visit, and how often a
# path enters one definition (a recursive one, such as attention's Probs, would otherwise
# repeat its alternates at every level: a cast of a cast of the probabilities is left to
# the machine).
_DEEP_DEPTH = 8
_DEEP_BUDGET = 4000
_DEEP_REENTRY = 2
_DEEP_LIMIT = _DEEP_DEPTH + _EARLY_DEPTH  # the deepest level a deep shape looks at


class _OverBudget(Exception):
    pass


def _focus(
    p: Pattern,
    depth: int,
    budget: list[int],
    cons: Any,
    cell: list[int],
    ctx: tuple,
    focus: dict[str, list],
    path: tuple = (),
) -> tuple[_Shape, bool]:
    """``_shape`` along the paths to the variables of ``focus`` (variable -> the shape its
    term has in every solution): (a necessary shape, or None; does it reach a focus).

    An application keeps one input's shape, the first that reaches a focus, and drops the
    others' (any term); an application cut off by the depth is its operator alone, and a
    definition none of whose arguments is a focus or a constrained variable is not
    entered (a closed definition reaches a focus only through them), nor one the path
    entered ``_DEEP_REENTRY`` times."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _OverBudget
    cls = type(p)
    if cls is PExists:
        return _focus(p.body, depth, budget, cons, cell, _exists_ctx(p, ctx)[1], focus, path)
    if cls is PConstr:
        cons = (ctx[0].get(p.var, p.var), (p.constraint, ctx), cons)
        return _focus(p.pat, depth, budget, cons, cell, ctx, focus, path)
    if cls is PApp or cls is PFunVar:
        if cls is PApp:
            op = p.op
        else:
            f = ctx[0].get(p.var, p.var)
            op = f if isinstance(f, Operator) else None
        args = p.args
        n = len(args)
        if depth > 0:
            for i, a in enumerate(args):
                kid, hit = _focus(a, depth - 1, budget, cons, cell, ctx, focus, path)
                if hit:
                    return [(op, n, (None,) * i + (kid,) + (None,) * (n - i - 1))], True
        return [(op, n, None)], False
    if cls is PVar:
        key = ctx[0].get(p.name, p.name)
        shape = focus.get(key) if type(key) is str else None
        if shape is not None:
            return shape, True
        link = cons
        while link is not None and not (link[0] is key or link[0] == key):
            link = link[2]
        if link is None or link[1] is None:
            return None, False
        q, q_ctx = link[1]
        return _focus(q, depth, budget, (key, None, cons), cell, q_ctx, focus, path)
    if cls is PGuard:
        return _focus(p.pat, depth, budget, cons, cell, ctx, focus, path)
    if cls is PAlt:
        a, hit_a = _focus(p.left, depth, budget, cons, cell, ctx, focus, path)
        if a is None:
            return None, False
        b, hit_b = _focus(p.right, depth, budget, cons, cell, ctx, focus, path)
        if b is None or len(a) + len(b) > _SHAPE_ALTS:
            return None, False
        return a + b, hit_a or hit_b
    if cls is PMu or cls is PCall:
        definition = _definition(p, ctx)
        if definition is None:
            return None, False
        params, body = definition
        closed, free, _, _ = _def_facts(p.name, params, body)
        if (
            closed
            and free <= {p.name}
            and not any(_may_reach(a, ctx[0], cons, focus) for a in p.args)
        ):
            return None, False
        if path.count(p.name) >= _DEEP_REENTRY:
            return None, False
        try:
            q, inner = _enter(p.name, params, p.args, body, ctx, cell)
        except TypeError:
            return None, False
        return _focus(q, depth, budget, cons, cell, inner, focus, (*path, p.name))
    return None, False  # PConst: nothing to follow


def _may_reach(arg: Any, env: dict, cons: Any, focus: dict[str, list]) -> bool:
    """Can a definition's parameter bound to ``arg`` lead to a focus: is ``arg`` one, or a
    variable with a constraint (whose pattern may)?"""
    if not isinstance(arg, str):
        return False  # an operator
    key = env.get(arg, arg)
    if type(key) is not str:
        return False
    if key in focus:
        return True
    link = cons
    while link is not None:
        if link[0] is key or link[0] == key:
            return link[1] is not None
        link = link[2]
    return False


def _deep_prefilter(body: Pattern) -> list | None:
    """The deep pre-check of ``body`` (see the module's docstring): a shape every match's
    root fits, or None where there is none beyond the depth of :func:`_prefilter`'s."""
    try:
        if not _error_free(body):
            return None
        focus = _early_shapes(body)
        if not focus:
            return None
        shape, hit = _focus(body, _DEEP_DEPTH, [_DEEP_BUDGET], None, [1], _TOP_CTX, focus)
    except (RecursionError, _OverBudget):
        return None
    if shape is None or not hit or _depth(shape) <= _SHAPE_DEPTH:
        return None  # (no deeper than the pre-check: it decides as much)
    return shape


def _depth(shape: _Shape, memo: dict[int, int] | None = None) -> int:
    """Levels below the root a shape looks at (-1: none). ``memo`` (per shape object) keeps
    a shape that shares sub-shapes linear to measure."""
    if shape is None:
        return -1
    if memo is None:
        memo = {}
    known = memo.get(id(shape))
    if known is not None:
        return known
    deepest = 0
    for _, _, kids in shape:
        if kids is not None:
            deepest = max(deepest, 1 + max(_depth(k, memo) for k in kids))
    memo[id(shape)] = deepest
    return deepest
