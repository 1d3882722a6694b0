"""Static analyses of patterns for the fast engine, each computed once per pattern object.

Which definitions are recursive, closed, or bind which parameters on every solution
(``_def_facts``, ``_definitely_bound``); how large generated code for a pattern would be
(``_paths``); the operators a match can be rooted at (``root_set``, :class:`OpSpec`); whether
matching a pattern can raise (``_error_free``); which recursive calls the machine may
table (``_tabling``); a rule's anchor, the variable its guards need and the operators that
bind it (``rule_anchor``). Walks are loops over :func:`pypm_jax.core.calculus.children`
wherever a construct's children are all that matters.
"""

from __future__ import annotations

__all__ = [
    "OpSpec",
    "Roots",
    "admits",
    "has_recursion",
    "root_operators",
    "root_set",
    "rule_anchor",
    "rule_roots",
    "show_roots",
]

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..core.calculus import (
    EAnd,
    EAttr,
    ECmp,
    EConst,
    EOpAttr,
    EOr,
    ETuple,
    Expr,
    PAlt,
    PApp,
    Pattern,
    PatternDef,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    RuleDef,
    children,
    expr_children,
)
from ..core.terms import CONST, OpClass, Operator
from ..semantics.subst import FreshNames, unfold

# Entries kept per compile cache (patterns, guards, μ-bodies) before it is cleared.
_CACHE_LIMIT = 4096


class _ByIdentity:
    """A cache keyed by an object's identity (patterns are compared by identity: equal-
    looking ones may differ, see ``compile_pattern``). It holds the key object, so its id is
    not reused while its entry lives; bounded by clearing when full."""

    __slots__ = ("make", "entries")

    def __init__(self, make: Callable[[Any], Any]):
        self.make = make
        self.entries: dict[int, tuple[Any, Any]] = {}

    def __call__(self, key: Any) -> Any:
        hit = self.entries.get(id(key))
        if hit is not None and hit[0] is key:
            return hit[1]
        return self.put(key, self.make(key))

    def put(self, key: Any, value: Any) -> Any:
        """Make ``value`` the entry of ``key`` (as if made for it); returns it."""
        if len(self.entries) >= _CACHE_LIMIT:
            self.entries.clear()
        self.entries[id(key)] = (key, value)
        return value

    def clear(self) -> None:
        self.entries.clear()


class _Unsupported(Exception):
    """This pattern is left to the iterative machine."""


def _plain_names(p: Pattern, out: set[str]) -> None:
    """Collect every variable name written in a pattern (to check none contains ``#``)."""
    stack = [p]
    while stack:
        q = stack.pop()
        match q:
            case PVar(name):
                out.add(name)
            case PFunVar(var) | PExists(var) | PConstr(_, var):
                out.add(var)
            case PGuard(_, guard):
                _expr_names(guard, out)
            case PMu(_, params, args):
                out.update(x.name for x in params)
                out.update(a for a in args if isinstance(a, str))
            case PCall(_, args):
                out.update(a for a in args if isinstance(a, str))
        stack.extend(children(q))


def _expr_names(e: Expr, out: set[str]) -> None:
    """Collect the variable names a guard reads."""
    stack = [e]
    while stack:
        x = stack.pop()
        if isinstance(x, EAttr | EOpAttr):
            out.add(x.var)
        stack.extend(expr_children(x))


def _has_call(p: Pattern) -> bool:
    stack = [p]
    while stack:
        q = stack.pop()
        if isinstance(q, PCall):
            return True
        stack.extend(children(q))
    return False


def _calls_self(mu: PMu) -> bool:
    """Does ``mu``'s body refer to ``mu`` itself (a recursive definition)?"""
    return mu.name in _def_facts(mu.name, mu.params, mu.body)[1]


def _closed(mu: PMu) -> bool:
    """Does ``mu`` (its arguments aside) mention only its parameters, variables it binds
    with ∃ and definitions inside it? Then a machine run of it needs only the caller's
    bindings of its arguments."""
    closed, free, _, _ = _def_facts(mu.name, mu.params, mu.body)
    return closed and free <= {mu.name}


def has_recursion(mu: PMu) -> bool:
    """Is there a recursive reference anywhere in ``mu``'s body (nested definitions too)?"""
    return _def_facts(mu.name, mu.params, mu.body)[3]


# Per definition body: (body, params, (closed, free references, has ∃)) -- see _def_facts.
_FACTS: dict[int, tuple[Pattern, tuple, tuple[bool, frozenset[str], bool, bool]]] = {}


def _def_facts(name: str, params: tuple, body: Pattern) -> tuple[bool, frozenset[str], bool, bool]:
    """Facts about a definition ``μname(params). body``, computed bottom-up over the
    definitions nested in it (each once, cached per body, with loops, never recursion):
    whether every variable it reads is a parameter or bound by an ∃ in scope (nested
    definitions alike, with their own parameters); the names of the recursive references
    it leaves free; whether it has an ∃ anywhere; whether it has a recursive reference
    anywhere."""
    hit = _FACTS.get(id(body))
    if hit is not None and hit[0] is body and hit[1] == params:
        return hit[2]
    order: list[tuple[tuple, Pattern]] = []
    todo: list[tuple[tuple, Pattern]] = [(params, body)]
    while todo:
        d = todo.pop()
        order.append(d)
        for m in _nested_defs(d[1]):
            got = _FACTS.get(id(m.body))
            if got is None or got[0] is not m.body or got[1] != m.params:
                todo.append((m.params, m.body))
    facts = (False, frozenset(), True, True)
    for d_params, d_body in reversed(order):  # nested definitions first
        facts = _local_facts(d_params, d_body)
        if len(_FACTS) >= _CACHE_LIMIT:
            _FACTS.clear()
        _FACTS[id(d_body)] = (d_body, d_params, facts)
    return facts


def _nested_defs(body: Pattern) -> list[PMu]:
    """The definitions directly inside ``body`` (not inside their own bodies)."""
    found: list[PMu] = []
    stack = [body]
    while stack:
        q = stack.pop()
        if isinstance(q, PMu):
            found.append(q)
            continue
        stack.extend(children(q))
    return found


def _local_facts(params: tuple, body: Pattern) -> tuple[bool, frozenset[str], bool, bool]:
    """``_def_facts`` of one body, those of the definitions inside it read from the cache."""
    closed = True
    free: set[str] = set()
    has_exists = has_call = False
    stack: list[tuple[Pattern, frozenset[str]]] = [(body, frozenset(x.name for x in params))]
    while stack:
        p, names = stack.pop()
        cls = type(p)
        if cls is PVar:
            closed = closed and p.name in names
        elif cls is PFunVar or cls is PConstr:
            closed = closed and p.var in names
        elif cls is PGuard:
            used: set[str] = set()
            _expr_names(p.guard, used)
            closed = closed and used <= names
        elif cls is PExists:
            has_exists = True
            names = names | {p.var}
        elif cls is PMu:
            closed = closed and all(not isinstance(a, str) or a in names for a in p.args)
            hit = _FACTS.get(id(p.body))
            if hit is None or hit[0] is not p.body:
                inner = _def_facts(p.name, p.params, p.body)  # (only if evicted meanwhile)
            else:
                inner = hit[2]
            closed = closed and inner[0]
            free |= inner[1] - {p.name}
            has_exists = has_exists or inner[2]
            has_call = has_call or inner[3]
        elif cls is PCall:
            has_call = True
            free.add(p.name)
            closed = closed and all(not isinstance(a, str) or a in names for a in p.args)
        elif cls is not PApp and cls is not PAlt and cls is not PConst:
            closed = False  # (not a pattern)
        stack.extend((c, names) for c in children(p, into_mu=False))
    return closed, frozenset(free), has_exists, has_call


def _definitely_bound(mu: PMu) -> frozenset[int]:
    """Indices of ``mu``'s parameters that every solution of it binds (greatest fixpoint
    over the recursive references), so generated code knows them bound after a call."""

    def binds(p: Pattern, assumed: dict[str, tuple[tuple[str, ...], frozenset[int]]]) -> set:
        match p:
            case PVar(name):
                return {name}
            case PConst():
                return set()
            case PApp(_, args, _):
                return set().union(*(binds(a, assumed) for a in args))
            case PFunVar(var, args, _, _):
                return {var}.union(*(binds(a, assumed) for a in args))
            case PAlt(left, right):
                return binds(left, assumed) & binds(right, assumed)
            case PGuard(pat, _):
                return binds(pat, assumed)
            case PExists(var, body, _):
                return binds(body, assumed) - {var}
            case PConstr(pat, _, constraint):
                return binds(pat, assumed) | binds(constraint, assumed)
            case PMu(name, params, args, body):
                got = fixpoint(name, params, body, assumed)
                return {args[i] for i in got if isinstance(args[i], str)}
            case PCall(name, args):
                entry = assumed.get(name)
                if entry is None:
                    return set()
                return {args[i] for i in entry[1] if isinstance(args[i], str)}
        return set()

    def fixpoint(name, params, body, assumed) -> frozenset[int]:
        names = tuple(x.name for x in params)
        current = frozenset(range(len(params)))
        while True:
            inner = {**assumed, name: (names, current)}
            got = binds(body, inner)
            new = frozenset(i for i, n in enumerate(names) if n in got) & current
            if new == current:
                return current
            current = new

    try:
        return fixpoint(mu.name, mu.params, mu.body, {})
    except RecursionError:
        return frozenset()


def _paths(p: Pattern, budget: list[int]) -> tuple[int, int]:
    """(code paths, pattern nodes) of the generated code for ``p``, roughly: each alternate
    duplicates what follows it, so paths multiply along a sequence and add across an
    alternate. Lets ``_generate`` give up before spending time on hopeless patterns."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _Unsupported("pattern too large to generate")
    match p:
        case PApp(_, args, _) | PFunVar(_, args, _, _):
            paths, nodes = 1, 1
            for a in args:
                ap, an = _paths(a, budget)
                paths, nodes = paths * ap, nodes + an
            return paths, nodes
        case PAlt(left, right):
            lp, ln = _paths(left, budget)
            rp, rn = _paths(right, budget)
            return lp + rp, ln + rn + 1
        case PConstr(pat, _, constraint):
            pp, pn = _paths(pat, budget)
            cp, cn = _paths(constraint, budget)
            return pp * cp, pn + cn + 1
        case PGuard(pat, _) | PExists(_, pat, _):
            pp, pn = _paths(pat, budget)
            return pp, pn + 1
        case PMu():
            return _mu_paths(p, budget)
    return 1, 1


# _paths of a definition depends on its body, name and parameters, and on which arguments
# are operators (renaming turns F(...) into an application and fails on a term variable
# bound to an operator), never on the names: (body, paths, nodes, budget spent) per such
# key, so a definition used at many sites is unfolded and walked once.
_MU_PATHS: dict[tuple, tuple[Pattern, int, int, int]] = {}


def _mu_paths(mu: PMu, budget: list[int]) -> tuple[int, int]:
    key = (id(mu.body), mu.name, mu.params, tuple(isinstance(a, Operator) for a in mu.args))
    hit = _MU_PATHS.get(key)
    if hit is not None and hit[0] is mu.body:
        budget[0] -= hit[3]
        if budget[0] < 0:  # where the walk would have run out
            raise _Unsupported("pattern too large to generate")
        return hit[1], hit[2]
    before = budget[0]
    if _calls_self(mu):  # a recursive definition: not unfolded (the machine runs it)
        paths, nodes = 1, 1
    else:
        try:
            paths, nodes = _paths(unfold(mu, FreshNames()), budget)
        except TypeError:
            paths, nodes = 1, 1
    if len(_MU_PATHS) >= _CACHE_LIMIT:
        _MU_PATHS.clear()
    _MU_PATHS[key] = (mu.body, paths, nodes, before - budget[0])
    return paths, nodes


# Per definition body: (body, params, name, _tabling's answer). The machine reads it inline
# at every call it makes (~1,000 a pass on BERT-base), ``_tabling`` on a miss.
_TABLED: dict[int, tuple[Pattern, tuple, str, tuple[bool, bool]]] = {}


def _tabling(name: str, params: tuple, body: Pattern) -> tuple[bool, bool]:
    """(may a call of this definition be tabled: it is recursive and closed; has it an ∃
    anywhere, so that only the ``distinct`` mode tables it)."""
    closed, free, has_exists, _ = _def_facts(name, params, body)
    found = (closed and free == {name}, has_exists)
    if len(_TABLED) >= _CACHE_LIMIT:
        _TABLED.clear()
    _TABLED[id(body)] = (body, params, name, found)
    return found


@dataclass(frozen=True, slots=True)
class OpSpec:
    """Any operator that meets every field set: the root an operator variable leaves
    possible (``F(x)`` matches a node of any pure operator with one input; a guard
    ``F.name == "split"`` or ``F.op_class == C`` on it narrows that).

    ``n_in``: the node's number of inputs (an operator's arity; a variadic operator's node
    may have any number, so only the node can tell); ``n_out``: the operator's output
    count; ``index``: the root is that output of its node, so the operator has more outputs;
    ``names``: the operator's name is one of them; ``op_class``: the operator's class;
    ``pure``: the operator is pure (opaque operators are outside the range of an operator
    variable, docs/SEMANTICS.md)."""

    n_in: int | None = None
    n_out: int | None = None
    index: int = 0
    names: frozenset[str] | None = None
    op_class: OpClass | None = None
    pure: bool = False

    def admits(self, op: Operator, n_inputs: int | None = None) -> bool:
        """Can a node of ``op`` (with ``n_inputs`` inputs, where known) be such a root?
        A variadic operator's node of unknown input count is admitted whatever ``n_in``."""
        if self.n_in is not None:
            n = op.n_in if n_inputs is None else n_inputs
            if n is not None and n != self.n_in:
                return False
        return (
            (self.n_out is None or op.n_out == self.n_out)
            and op.n_out > self.index
            and (self.names is None or op.name in self.names)
            and (self.op_class is None or op.op_class is self.op_class)
            and (op.pure or not self.pure)
        )


Roots = frozenset[Operator | OpClass | OpSpec]
"""Where a pattern's matches can be rooted: a term whose operator is in it, whose
operator's class is (an :class:`OpClass` member stands for every operator of that class),
or whose node an :class:`OpSpec` member admits."""


def admits(roots: Roots | None, op: Operator, n_inputs: int | None = None) -> bool:
    """Can a match rooted at a term of operator ``op`` exist (``roots`` None: any)?
    ``n_inputs``: the term's number of inputs, where known (it tells a variadic operator's
    nodes apart; without it they are admitted whatever their count)."""
    if roots is None or op in roots or (op.op_class is not None and op.op_class in roots):
        return True
    return any(type(r) is OpSpec and r.admits(op, n_inputs) for r in roots)


def show_roots(roots: Roots | None) -> str:
    """``roots`` in words, for messages: operators by name, then classes, then specs
    ("any operator of 1 input named split"); empty for None (any root)."""
    parts = sorted(r.name for r in roots or () if isinstance(r, Operator))
    parts += sorted(f"any {r.name} operator" for r in roots or () if isinstance(r, OpClass))
    specs = []
    for r in roots or ():
        if isinstance(r, OpSpec):
            words = ["any"]
            if r.pure:
                words.append("pure")
            if r.op_class is not None:
                words.append(r.op_class.name)
            words.append("operator")
            if r.n_in is not None:
                words.append(f"of {r.n_in} input{'' if r.n_in == 1 else 's'}")
            if r.n_out is not None:
                words.append(f"with {r.n_out} output{'' if r.n_out == 1 else 's'}")
            if r.names is not None:
                words.append("named " + " or ".join(sorted(r.names)))
            specs.append(" ".join(words))
    return ", ".join(parts + sorted(specs))


def _both(x: Operator | OpClass | OpSpec, y: Operator | OpClass | OpSpec) -> Any:
    """The roots both ``x`` and ``y`` admit, as one member (None: none). Operators before
    classes before specs: an operator stays where the other admits it (a variadic one
    whatever its count of inputs), a class and a spec become the spec of that class."""
    if _rank(x) > _rank(y):
        x, y = y, x
    if isinstance(x, Operator):
        if isinstance(y, Operator):
            return x if x is y else None
        if isinstance(y, OpClass):
            return x if x.op_class is y else None
        return x if y.admits(x) else None
    if isinstance(x, OpClass):
        if isinstance(y, OpClass):
            return x if x is y else None
        if y.op_class is None:
            return replace(y, op_class=x)
        return y if y.op_class is x else None

    def one(a: Any, b: Any) -> Any:  # (a field both set must agree; None: unset)
        if a is None or b is None:
            return b if a is None else a
        return a if a == b else _CLASH

    n_in, n_out, op_class = one(x.n_in, y.n_in), one(x.n_out, y.n_out), one(x.op_class, y.op_class)
    if _CLASH in (n_in, n_out, op_class):
        return None
    index = max(x.index, y.index)
    names = x.names if y.names is None else y.names if x.names is None else x.names & y.names
    if (n_out is not None and n_out <= index) or (names is not None and not names):
        return None
    return OpSpec(n_in, n_out, index, names, op_class, x.pure or y.pure)


_CLASH = object()


def _rank(r: Operator | OpClass | OpSpec) -> int:
    return 0 if isinstance(r, Operator) else 1 if isinstance(r, OpClass) else 2


def _meet(a: Roots | None, b: Roots | None) -> Roots | None:
    """The roots both ``a`` and ``b`` admit (None admits any)."""
    if a is None:
        return b
    if b is None:
        return a
    both = (_both(x, y) for x in a for y in b)
    return frozenset(r for r in both if r is not None)


def _root_ops(p: Pattern, budget: list[int], guards: bool) -> Roots | None:
    """The operators (and op classes) a term matched by ``p`` can have at its root; None =
    any. ``guards``: read a guard on the root's operator (``F.op_class == opclass(..)``,
    ``x.op == op``...) as a constraint on the root too (see :func:`_guard_roots`)."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    match p:
        case PApp(op, _, _):
            return frozenset((op,))
        case PConst():
            return frozenset((CONST,))
        case PAlt(left, right):
            a = _root_ops(left, budget, guards)
            b = _root_ops(right, budget, guards) if a is not None else None
            return None if a is None or b is None else a | b
        case PConstr(pat, var, constraint):
            a = _root_ops(pat, budget, guards)
            if _root_var(pat) != var:
                return a
            # `x <= q` where x is the root itself: the root matches q too
            return _meet(a, _root_ops(constraint, budget, guards))
        case PGuard(pat, guard):
            a = _root_ops(pat, budget, guards)
            if not guards:
                return a
            return _meet(a, _guard_roots(guard, _root_var(pat), _root_fun_var(pat)))
        case PExists(_, pat, _):
            return _root_ops(pat, budget, guards)
        case PFunVar(_, args, index, n_out):  # (its variable unbound here, or bound to one)
            return frozenset((OpSpec(len(args), n_out, index, pure=True),))
        case PMu():
            try:
                return _root_ops(unfold(p, FreshNames()), budget, guards)
            except TypeError:
                return None
    return None  # PVar, PCall: anything


def _root_var(p: Pattern) -> str | None:
    """The variable that the first action of matching ``p`` binds to the root, if any."""
    while True:
        match p:
            case PVar(name):
                return name
            case PGuard(pat, _) | PExists(_, pat, _) | PConstr(pat, _, _):
                p = pat  # (∃x.p reads x as the x around it: θ is global, see SEMANTICS)
            case _:
                return None


def _root_fun_var(p: Pattern) -> str | None:
    """The operator variable bound to the root's operator once ``p`` matched, if any: an
    operator variable applied at the root, also as ``x <= F(...)`` on the root variable
    ``x``, and on alternates the one both bind."""
    while True:
        match p:
            case PFunVar(var):
                return var if isinstance(var, str) else None
            case PGuard(pat, _) | PExists(_, pat, _):
                p = pat
            case PConstr(pat, var, constraint):
                found = _root_fun_var(pat)
                if found is not None or _root_var(pat) != var:
                    return found
                p = constraint  # (x, the root, matched ``constraint`` after ``pat``)
            case PAlt(left, right):
                found = _root_fun_var(left)
                return found if found is not None and found == _root_fun_var(right) else None
            case _:
                return None


def _guard_roots(g: Expr, var: str | None, fun_var: str | None) -> Roots | None:
    """The roots a guard that holds leaves possible, ``var`` being bound to the root and
    ``fun_var`` to its operator when it is checked (None: the guard does not say).

    It reads comparisons of ``F.op_class`` (``fun_var``) or ``x.op_class`` (``var``) with
    op classes, of ``F.name`` with strings, and of ``x.op`` with operators: ``==`` and
    ``in`` a tuple of constants,
    under ``and`` (every item holds) and ``or`` (one does). A guard that holds is True, so
    each such comparison was True (an attribute without a value makes it undefined: not
    True either)."""
    match g:
        case EAnd(items):
            found = None
            for item in items:
                found = _meet(found, _guard_roots(item, var, fun_var))
            return found
        case EOr(items):
            union: set[Operator | OpClass] = set()
            for item in items:
                r = _guard_roots(item, var, fun_var)
                if r is None:
                    return None
                union |= r
            return frozenset(union)
        case ECmp("==", left, right):
            attr = _root_attr(left, var, fun_var)
            value = right
            if attr is None:
                attr, value = _root_attr(right, var, fun_var), left
            if attr is None or not isinstance(value, EConst):
                return None
            return _roots_of(attr, (value.value,))
        case ECmp("in", left, right):
            attr = _root_attr(left, var, fun_var)
            if attr is None:
                return None
            if isinstance(right, EConst) and type(right.value) is tuple:
                return _roots_of(attr, right.value)
            if isinstance(right, ETuple) and all(isinstance(i, EConst) for i in right.items):
                return _roots_of(attr, tuple(i.value for i in right.items))  # type: ignore[union-attr]
    return None


def _root_attr(e: Expr, var: str | None, fun_var: str | None) -> str | None:
    """``"op_class"``, ``"name"`` or ``"op"`` where ``e`` reads that attribute of the root
    (``F.op_class``, ``x.op_class``, ``F.name``, ``x.op``), else None."""
    if isinstance(e, EOpAttr) and e.var == fun_var and e.attr in ("op_class", "name"):
        return e.attr
    if isinstance(e, EAttr) and e.var == var and e.attr in ("op_class", "op"):
        return e.attr
    return None


def _roots_of(attr: str, values: tuple[Any, ...]) -> Roots | None:
    """The roots whose ``attr`` is one of ``values``; None where a value is not one this
    reads (equality with anything else is left to the guard)."""
    want = {"op_class": OpClass, "op": Operator, "name": str}[attr]
    if not all(type(v) is want for v in values):
        return None
    if attr == "name":
        return frozenset((OpSpec(names=frozenset(values)),)) if values else frozenset()
    return frozenset(values)


def root_operators(pdef: PatternDef) -> frozenset[Operator] | None:
    """Operators a match of ``pdef`` can be rooted at, or None when it can be any (or
    any of an op class, or any an :class:`OpSpec` admits: see :func:`root_set`)."""
    roots = root_set(pdef)
    if roots is None or any(not isinstance(r, Operator) for r in roots):
        return None
    return roots  # type: ignore[return-value]


def root_set(pdef: PatternDef) -> Roots | None:
    """The operators and op classes a match of ``pdef`` can be rooted at (see
    :func:`admits`), or None when it can be any.

    The structure at the root says so (an application, alternates, ``x <= q`` on the root
    itself, an operator variable: any pure operator of its arity and output count), and so
    do guards on the root's operator (the paper's ``UnaryOp``: an operator variable ``F``
    applied at the root and ``F.op_class == opclass("unary_pointwise")``; ``F.name ==
    "split"``): a root of another class or name has no match. Such a guard is checked only after ``F``'s
    operands are matched, which may raise (an unbound reference, a definition
    instantiated with an operator) where skipping the pattern would not; so guards are read
    only in patterns that cannot raise (:func:`_error_free`).
    """
    body = pdef.body
    try:
        return _root_ops(body, [1000], _error_free(body))
    except RecursionError:  # a pattern too deep to walk this way: any root
        return None


def _rule_roots(rule: RuleDef) -> Roots | None:
    """The roots at which ``rule`` can fire, as its branches' guards tell (None: any).

    A branch fires only where its guard holds, and a guard that holds says, as in
    :func:`_guard_roots`, what the root's operator is (``f.name == "tanh"`` for the
    pattern's root ``y <= f(r)``): the rule fires only at the roots one of them admits. Read
    only where matching the pattern cannot raise (as :func:`root_set`)."""
    body = rule.pattern.body
    try:
        var, fun_var = _root_var(body), _root_fun_var(body)
        if not rule.branches or (var is None and fun_var is None):
            return None
        union: set[Operator | OpClass | OpSpec] = set()
        for branch in rule.branches:
            found = _guard_roots(branch.guard, var, fun_var)
            if found is None:
                return None
            union |= found
        return frozenset(union) if _error_free(body) else None  # (the walk last: it costs most)
    except RecursionError:
        return None


rule_roots = _ByIdentity(_rule_roots)  # once per rule object


# ---------------------------------------------------------------------------- anchors
#
# A rule's *anchor*: a variable every branch guard reads (so a match fires, or is refused by
# single use where a branch guard holds, only where it is bound) and the operators of the
# applications that bind it (every place the pattern binds it is an operand of one). A match
# covers those applications' terms and, as it reaches each term it binds from the root
# through the inputs of terms it covers, a path of covered terms from the root down to
# them. The rewrite driver reads it where covered values are doomed
# (:meth:`pypm_jax.engine.rewrite._Driver.anchored`).


def _guard_needs(e: Expr) -> frozenset[str]:
    """The term variables that are bound wherever ``e`` holds: reading an unbound one is
    undefined (docs/SEMANTICS.md, item 4), and a guard that holds read every item of an
    ``and``, the first item of an ``or`` and the item that holds, and every operand of
    anything else."""
    if type(e) is EAttr:
        return frozenset((e.var,)) if isinstance(e.var, str) else frozenset()
    if type(e) is EOr:
        if not e.items:
            return frozenset()
        each = [_guard_needs(i) for i in e.items]
        return each[0] | frozenset.intersection(*each)
    found: frozenset[str] = frozenset()
    for c in expr_children(e):
        found |= _guard_needs(c)
    return found


class _NotKnown(Exception):
    """The anchor analysis cannot tell (a binding it does not read, its budget spent)."""


def _binders(body: Pattern, var: str) -> Roots:
    """The roots of the applications that bind ``var`` (a variable of the top-level body
    ``body``) wherever a match of ``body`` binds it: each binding is an operand of such an
    application. Raises :class:`_NotKnown` where ``var`` can be bound otherwise (the
    matched term itself, the term a constraint reads) or the walk does not know.

    Definitions are entered with their parameters standing for the caller's arguments; a
    name a body does not bind (no parameter, no ∃) is the global one, and outside every
    definition an ∃ binds the global name too (``_exists_ctx``). A definition entered
    again in the same context (the names standing for ``var``, the application above, the
    definitions in scope) adds nothing: its bindings are those its first entry found,
    whether that walk is over (they are in ``found``) or under way, the entry above it in a
    recursion (the union over finite derivations)."""
    budget = [_ANCHOR_BUDGET]
    found: set[Operator | OpClass | OpSpec] = set()
    seen: set[tuple] = set()  # definitions entered, with what stands for ``var`` there

    def walk(p: Pattern, names: frozenset[str], parent: Roots | None,
             narrow: Roots | None, scope: dict | None) -> None:  # fmt: skip
        budget[0] -= 1
        if budget[0] < 0:
            raise _NotKnown
        cls = type(p)
        if cls is PVar:
            if p.name in names:
                if parent is None:
                    raise _NotKnown  # bound as a matched term or a constraint's term
                found.update(parent)
        elif cls is PApp or cls is PFunVar:
            if cls is PApp:
                roots: Roots | None = frozenset((p.op,))
            else:
                roots = frozenset((OpSpec(len(p.args), p.n_out, p.index, pure=True),))
            roots = _meet(roots, narrow)
            for a in p.args:
                walk(a, names, roots, None, scope)
        elif cls is PAlt:
            walk(p.left, names, parent, narrow, scope)
            walk(p.right, names, parent, narrow, scope)
        elif cls is PGuard:
            here = _guard_roots(p.guard, _root_var(p.pat), _root_fun_var(p.pat))
            walk(p.pat, names, parent, _meet(narrow, here), scope)
        elif cls is PExists:  # (outside every definition θ is global: ∃x is that x)
            walk(p.body, names if scope is None else names - {p.var}, parent, narrow, scope)
        elif cls is PConstr:
            walk(p.pat, names, parent, narrow, scope)
            walk(p.constraint, names, None, None, scope)
        elif cls is PMu or cls is PCall:
            if any(not isinstance(a, str) for a in p.args):
                raise _NotKnown  # (an operator argument)
            if cls is PMu:
                params, dbody = p.params, p.body
                scope = {**(scope or {}), p.name: (params, dbody)}
            else:
                entry = None if scope is None else scope.get(p.name)
                if entry is None:
                    raise _NotKnown
                params, dbody = entry
            own = {x.name for x in params}
            inner = frozenset(x.name for x, a in zip(params, p.args, strict=True) if a in names)
            if var not in own:  # (a name the body does not bind is the global one)
                inner |= {var}
            key = (id(dbody), inner, parent, narrow, frozenset(
                (n, id(d[1])) for n, d in scope.items()))  # fmt: skip
            if inner and key not in seen:
                seen.add(key)
                walk(dbody, inner, parent, narrow, scope)
        # (PConst binds nothing)

    walk(body, frozenset((var,)), None, None, None)
    return frozenset(found)


_ANCHOR_BUDGET = 4000


def _rule_anchor(rule: RuleDef) -> tuple[str, Roots] | None:
    """``rule``'s anchor (see above): ``(var, roots)``, or None. Read only where matching
    the pattern cannot raise (a search skipped must be one that would not have raised)."""
    if not rule.branches:
        return None
    needed = frozenset.intersection(*(_guard_needs(b.guard) for b in rule.branches))
    if not needed:
        return None
    body = rule.pattern.body
    try:
        if not _error_free(body):
            return None
        for param in rule.pattern.params:
            if param.kind == "term" and param.name in needed:
                try:
                    return param.name, _binders(body, param.name)
                except _NotKnown:
                    continue
    except RecursionError:
        return None
    return None


rule_anchor = _ByIdentity(_rule_anchor)  # once per rule object


def _error_free(body: Pattern) -> bool:
    """Can matching ``body`` never raise (every recursive reference bound, no definition
    instantiated with an operator)? Only then may a pre-check skip running it: the machine
    must raise where the reference would."""
    try:
        return _unbound_calls(body) == frozenset()
    except RecursionError:  # definitions nested too deep for the memo's recursion
        return _error_free_walk(body)


# The names of the recursive references a definition's body leaves unbound, or None when a
# reference or definition in it takes an operator argument: per body object, so a body
# shared by many call sites (a sub-pattern's definition) is walked once.
_UNBOUND: dict[int, tuple[Pattern, frozenset[str] | None]] = {}


def _unbound_calls(p: Pattern) -> frozenset[str] | None:
    """What ``_error_free_walk`` checks, bottom-up: the reference names ``p`` leaves unbound
    (None: some definition or reference in ``p`` takes an operator argument)."""
    free: set[str] = set()
    stack = [p]
    while stack:
        q = stack.pop()
        if isinstance(q, PMu | PCall):
            if any(not isinstance(a, str) for a in q.args):
                return None
            if isinstance(q, PCall):
                free.add(q.name)
                continue
            hit = _UNBOUND.get(id(q.body))
            if hit is None or hit[0] is not q.body:
                hit = (q.body, _unbound_calls(q.body))
                if len(_UNBOUND) >= _CACHE_LIMIT:
                    _UNBOUND.clear()
                _UNBOUND[id(q.body)] = hit
            if hit[1] is None:
                return None
            free |= hit[1] - {q.name}
            continue
        stack.extend(children(q))
    return frozenset(free)


def _error_free_walk(body: Pattern) -> bool:
    stack: list[tuple[Pattern, frozenset[str]]] = [(body, frozenset())]
    while stack:
        q, defs = stack.pop()
        if isinstance(q, PMu | PCall):
            if any(not isinstance(a, str) for a in q.args):
                return False
            if isinstance(q, PCall) and q.name not in defs:
                return False
            if isinstance(q, PMu):
                defs = defs | {q.name}
        stack.extend((c, defs) for c in children(q))
    return True


def _find_draws_names(p: Pattern) -> bool:
    """May matching ``p`` draw a fresh name: enter a definition of ``p`` whose unfolding
    renames an ∃ (ST-Match-Mu), or call a definition ``p`` does not contain (whose
    unfolding may)? A cut that skips a failing part of the search (an early refusal, a
    side of an alternate not tried) changes no later fresh name only where that part
    draws none: the machine's exact solutions (θ with the reference's fresh names) need
    it, the distinct ones (parameters only) do not."""
    inside: dict[str, int] = {}  # the definitions of p entered, by name (a count: nesting)
    depth = 0
    stack: list[tuple[Pattern, bool]] = [(p, False)]
    while stack:
        q, leaving = stack.pop()
        cls = type(q)
        if leaving:  # (q: a definition whose body has been walked)
            inside[q.name] -= 1
            depth -= 1
        elif cls is PExists and depth:
            return True
        elif cls is PCall and not inside.get(q.name):
            return True
        elif cls is PMu:
            inside[q.name] = inside.get(q.name, 0) + 1
            depth += 1
            stack.append((q, True))
            stack.append((q.body, False))
        else:
            stack.extend((c, False) for c in children(q))
    return False


_draws_names = _ByIdentity(_find_draws_names)
