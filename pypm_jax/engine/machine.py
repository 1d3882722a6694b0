"""The iterative machine: the paper's machine with a trail, lazy unfolding and tabling.

It runs patterns that are one recursive definition, patterns too branchy to generate
code for, and the recursive sub-patterns of generated code. Backtracking costs the
bindings it undoes (a trail instead of copied substitutions); an explicit continuation
and stack keep a 100 000-deep chain off the Python stack; entering a definition makes an
environment instead of copying its body; tabled recursive calls compute their answers
once (``docs/SEMANTICS.md``, "Tabling"). Where a pattern constrains a variable on its
spine (``x <= q`` outside alternates), binding x to a term that cannot match q's structure
ends the branch at once (``_early_shapes``), and at an alternate a side the term cannot
match by its structure (two levels, read from that side alone) is not tried
(``_alt_checks``): no solution is lost or moved.
"""

from __future__ import annotations

__all__ = ["MatchRun", "Observer", "RawSolution"]

import functools
import linecache
import re
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

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
    children,
    show,
)
from ..core.errors import PatternDefinitionError
from ..core.terms import Operator, const_equal
from ..semantics.subst import unfold
from .analysis import (
    _TABLED,
    _ByIdentity,
    _draws_names,
    _error_free,
    _expr_names,
    _root_var,
    _tabling,
)
from .guard_code import _compiled_guards, _env_guard


class Observer(Protocol):
    """What an observed run of the machine reports, transition by transition (the tracer of
    :func:`pypm_jax.engine.explain.explain` is one).

    ``step`` after an action succeeds, ``fail`` when one fails (the machine backtracks
    next), with the action's operands ``a``, ``b`` and the bindings after it:

    * ``"bind"``, ``"same"`` (a variable met a term: bound now, or bound to it already),
      ``"match"`` (an application, literal or operator variable matched): ``a`` the
      pattern, ``b`` the term; a failed match of any of them is ``fail("match", ...)``;
    * ``"guard"``: ``a`` the :class:`PGuard` whose guard held (or not), ``b`` None;
    * ``"check"``: ``a`` an existential's name, ``b`` its kind ("term" or "op");
    * ``"constraint"``: ``a`` the constrained variable, ``b`` the pattern its term must
      match next.

    ``choice`` when an alternate pushes a backtrack point, ``backtrack`` when the machine
    resumes at the latest one.
    """

    def step(self, kind: str, a: Any, b: Any, theta: dict, phi: dict) -> None: ...

    def fail(self, kind: str, a: Any, b: Any, theta: dict, phi: dict) -> None: ...

    def choice(self) -> None: ...

    def backtrack(self) -> None: ...


RawSolution = tuple[dict[str, Any], dict[str, Operator], tuple[Any, ...]]
"""(θ, φ, the terms the pattern's applications and literals matched)."""


# ----------------------------------------------------------------------- the run of a match


class MatchRun:
    """What a match (or a rewrite driver's matches) shares across its machines: the steps
    taken, the step budget, how often to call back, and what a solution must keep.

    ``steps`` counts transitions of the iterative machine (each action it runs, each
    backtrack and each tabled answer it replays); generated code runs a bounded number of
    lines per solution, so the machine's steps bound the work of a match. When ``steps``
    reaches ``budget`` the machine raises :class:`pypm_jax.MatchBudgetError`; every
    ``every`` steps it calls ``on_check`` (the rewrite driver logs its progress there).

    ``distinct``: the caller keeps only solutions whose *parameters* differ (``match_all``,
    ``pm.match``, the rewrite driver). Then a tabled recursive call also answers each
    binding of its arguments once (see ``docs/SEMANTICS.md``, "Tabling"), and a solution's
    θ leaves out the local variables bound inside tabled calls.

    ``forbid``: None, or a predicate on terms: while it is set, an application or operator
    variable does not match a term it holds for, so solutions covering such a term are left
    out and the search below it is skipped (the others keep their order). The machine reads
    it when it starts and after each solution it yields. The rewrite driver sets it where
    every solution covering such a term is one it refuses (single use).

    ``on_start``: None, or a callable on the root term that the machine calls (and clears)
    when it starts, after the pre-checks, before it reads ``forbid``: it may set
    ``forbid``, and False says that no solution the caller would keep exists there, so the
    machine does not run. The rewrite driver sets it for a search that leaves doomed
    matches out (:meth:`pypm_jax.engine.rewrite._Driver.start`).
    """

    __slots__ = ("steps", "budget", "distinct", "every", "on_check", "forbid", "on_start")

    def __init__(
        self,
        budget: int | None = None,
        *,
        distinct: bool = False,
        every: int = 4096,
        on_check: Callable[[], None] | None = None,
    ):
        self.steps = 0
        self.budget = budget
        self.distinct = distinct
        self.every = every
        self.on_check = on_check
        self.forbid: Callable[[Any], bool] | None = None
        self.on_start: Callable[[Any], bool] | None = None

    def limit(self) -> int | float:
        """The step count at which the machine next calls :meth:`check`."""
        lim: int | float = self.steps + self.every if self.on_check is not None else _INF
        if self.budget is not None and self.budget < lim:
            lim = self.budget
        return lim

    def check(self) -> None:
        if self.budget is not None and self.steps >= self.budget:
            from ..core.errors import MatchBudgetError

            raise MatchBudgetError(
                f"the match ran past its budget of {self.budget} machine steps", self.budget
            )
        if self.on_check is not None:
            self.on_check()


_INF = float("inf")
_EXACT = MatchRun()  # no budget, no callback: every raw solution (the machine's own θ)


# ------------------------------------------------------------------ the iterative machine

# Actions: (tag, a, b, ctx) with tag 0 = match(a, b), 1 = guard(a), 2 = checkName(a, kind b),
# 3 = matchConstr(a, b); ``ctx`` is the context they run in (see below). The continuation is
# a cons list (action, rest) | None.
_MATCH, _GUARD, _CHECK, _CONSTR = 0, 1, 2, 3


class _BodyInfo:
    """What entering a μ-definition's body needs, computed once per body object.

    ``offsets``: each ∃ of the body (outside nested definitions) -> its place in the order
    in which an unfolding draws fresh names (``_subst._rename``'s pre-order), so its name is
    ``var#(base + offset)``; ``count``: how many names an unfolding draws; ``pvars``: the
    variables used as terms, in that order and not shadowed by an ∃ (an unfolding that
    binds one of them to an operator is an error); ``shared``: an ∃ node occurs twice, so
    offsets are ambiguous and this body is unfolded the slow way.
    """

    __slots__ = ("offsets", "count", "pvars", "shared")

    def __init__(self, body: Pattern):
        self.offsets: dict[int, int] = {}
        self.pvars: list[str] = []
        self.shared = False
        seen_pvars: set[str] = set()
        stack: list[tuple[Pattern, frozenset[str]]] = [(body, frozenset())]
        while stack:  # pre-order, left to right, as _rename draws names
            q, shadow = stack.pop()
            if isinstance(q, PVar):
                if q.name not in shadow and q.name not in seen_pvars:
                    seen_pvars.add(q.name)
                    self.pvars.append(q.name)
            elif isinstance(q, PExists):
                if id(q) in self.offsets:
                    self.shared = True
                self.offsets[id(q)] = len(self.offsets)
                shadow = shadow | {q.var}
            stack.extend((c, shadow) for c in reversed(children(q, into_mu=False)))
        self.count = len(self.offsets)  # (unused when shared: such bodies are unfolded)


_body_info = _ByIdentity(_BodyInfo)


class _CellFresh:
    """``FreshNames`` drawing from a counter cell ``[next number]``."""

    __slots__ = ("cell",)

    def __init__(self, cell: list[int]):
        self.cell = cell

    def __call__(self, name: str) -> str:
        n = self.cell[0]
        self.cell[0] = n + 1
        return f"{name.split('#', 1)[0]}#{n}"


# A context: (env, body info, fresh base, scope). ``env`` maps the variables of the body
# being run to the names (or operators) they stand for — an unfolding's substitution,
# applied lazily; ``scope`` maps the names of the enclosing definitions to (params, body),
# which is how a recursive reference finds its definition. At the top: no renaming.
_TOP_CTX: tuple = ({}, None, 0, {})


def _exists_ctx(a: PExists, ctx: tuple) -> tuple[str, tuple]:
    """The name the machine binds ``∃x.p``'s ``x`` to in ``ctx`` (in an entered body, the
    fresh name unfolding would give it), and the context reading ``x`` as that name. The
    machine's loop does this inline; the walkers that follow it (pre-checks, pre-guards)
    call this."""
    env, info, base, scope = ctx
    name = a.var if info is None else f"{a.var.split('#', 1)[0]}#{base + info.offsets[id(a)]}"
    if name != env.get(a.var, a.var):
        ctx = ({**env, a.var: name}, info, base, scope)
    return name, ctx


def _definition(a: PMu | PCall, ctx: tuple) -> tuple[tuple, Pattern] | None:
    """The parameters and body of the definition ``a`` enters (a reference's from the
    scope of ``ctx``), or None for a reference outside its definition (the machine raises
    there). Inline in the machine's loop, as ``_exists_ctx``."""
    if type(a) is PMu:
        return a.params, a.body
    return ctx[3].get(a.name)


def _enter(
    name: str, params: tuple, args: tuple, body: Pattern, ctx: tuple, cell: list[int]
) -> tuple[Pattern, tuple]:
    """ST-Match-Mu: the pattern and context that run one unfolding of a definition."""
    env, _, _, scope = ctx
    hit = _body_info.entries.get(id(body))  # (_body_info(body), inline: ~45 entries a match)
    info = hit[1] if hit is not None and hit[0] is body else _body_info(body)
    if info.shared:  # ambiguous ∃ offsets: unfold it the reference's way
        resolved = tuple(env.get(a, a) if isinstance(a, str) else a for a in args)
        q = unfold(PMu(name, params, resolved, body), _CellFresh(cell))
        return q, ({}, None, 0, scope)
    new_env = {}
    operators = False  # (an argument is a name or an operator)
    for x, a in zip(params, args, strict=True):
        if isinstance(a, str):
            a = env.get(a, a)
        if not isinstance(a, str):
            operators = True
        new_env[x.name] = a
    if operators:
        for v in info.pvars:
            op = new_env.get(v)
            if isinstance(op, Operator):
                raise TypeError(f"term variable {v} instantiated with operator {op.name}")
    base = cell[0]
    cell[0] = base + info.count
    known = scope.get(name)  # (a recursive call: its scope already holds the definition)
    if known is None or known[0] is not params or known[1] is not body:
        scope = {**scope, name: (params, body)}
    return body, (new_env, info, base, scope)


# Tabling (see ``docs/SEMANTICS.md``, "Tabling"): two more actions. ``replay`` gives the
# answers of a tabled call, one per backtrack, pulling them from the call's producer as
# needed; ``return`` ends a producer's run of the call's body with one answer.
_REPLAY, _RET = 4, 5


class _Chunk:
    """The terms a tabled call's answer matched, spliced into a solution's matched terms
    (shared by every replay of the answer, so a replay costs O(1), not O(terms))."""

    __slots__ = ("items",)

    def __init__(self, items: tuple):
        self.items = items


def _flat(struct: list) -> tuple:
    """A solution's matched terms with each chunk spliced in (a chunk once: the matched
    terms say which nodes a match covers, a set)."""
    out: list[Any] = []
    seen: set[int] = set()
    iters = [iter(struct)]
    while iters:
        for x in iters[-1]:
            if type(x) is _Chunk:
                if id(x) not in seen:
                    seen.add(id(x))
                    iters.append(iter(x.items))
                    break
            else:
                out.append(x)
        else:
            iters.pop()
    return tuple(out)


_PLACEHOLDERS = tuple(f"\x00{i}" for i in range(64))  # a tabled call's parameters
_SEEN: list = []  # a table's mark of a call requested once (run as usual)


def _table_key(
    params: tuple, args: tuple, body: Pattern, t: Any, env: Mapping, theta: dict, phi: dict
) -> tuple | None:
    """The table key of a call: the definition, the term, and per parameter the value it is
    bound to, the operator it is instantiated with, or (unbound) the first parameter that
    shares its variable. None: not tabled (an argument the unfolding refuses is left to
    the machine, which raises where the reference does)."""
    key: list[Any] = [id(body), id(t)]
    names: list[Any] = []
    for param, arg in zip(params, args, strict=True):
        is_op = param.kind == "op"
        r = env.get(arg, arg) if isinstance(arg, str) else arg
        if not isinstance(r, str):
            if not is_op or not isinstance(r, Operator):
                return None
            key.append(id(r))
            names.append(None)
            continue
        bound = (phi if is_op else theta).get(r)
        if bound is not None:
            key.append(id(bound))
        else:
            key.append(-1 - names.index((r, is_op)) if (r, is_op) in names else -1 - len(names))
        names.append((r, is_op))
    return tuple(key)


def _table_entry(
    name: str,
    params: tuple,
    args: tuple,
    body: Pattern,
    t: Any,
    ctx: tuple,
    theta: dict,
    phi: dict,
    cell: list[int],
) -> list:
    """A new table entry for a call: its producer ready to start (the body entered with a
    placeholder per parameter, bound ones bound to the caller's values)."""
    env = ctx[0]
    ph_args: list[Any] = []
    th0: dict[str, Any] = {}
    ph0: dict[str, Any] = {}
    outs: list[tuple[str, bool]] = []  # unbound arguments: (placeholder, is_op)
    first: dict[tuple[str, bool], str] = {}
    for i, (param, arg) in enumerate(zip(params, args, strict=True)):
        is_op = param.kind == "op"
        r = env.get(arg, arg) if isinstance(arg, str) else arg
        if not isinstance(r, str):  # an operator (checked by _table_key)
            ph_args.append(r)
            continue
        ph = first.get((r, is_op))
        if ph is None:
            ph = first[(r, is_op)] = _PLACEHOLDERS[i] if i < 64 else f"\x00{i}"
            bound = (phi if is_op else theta).get(r)
            if bound is None:
                outs.append((ph, is_op))
            else:
                (ph0 if is_op else th0)[ph] = bound
        ph_args.append(ph)
    q, inner = _enter(name, params, tuple(ph_args), body, _TOP_CTX, cell)
    start = ((_MATCH, q, t, inner), ((_RET, None, None, None), None))
    # [answers, done, running, producer state (θ, φ, trail, struct, stack, k), seen, outputs]
    return [[], False, False, (th0, ph0, [], [], [], start), None, tuple(outs)]


def _outputs(params: tuple, args: tuple, env: Mapping, theta: dict, phi: dict) -> tuple:
    """The caller's variables a tabled call binds, in the order of its entry's outputs
    (callers with one key may name them differently)."""
    out: list[tuple[str, bool]] = []
    for param, arg in zip(params, args, strict=True):
        r = env.get(arg, arg) if isinstance(arg, str) else arg
        is_op = param.kind == "op"
        if isinstance(r, str) and (r, is_op) not in out:
            if (phi if is_op else theta).get(r) is None:
                out.append((r, is_op))
    return tuple(out)


# Early refusals: a constraint ``x <= q`` on the spine of a pattern (outside alternates and
# definitions) is checked by every solution, on the term x is bound to. So when the machine
# binds x, a term that cannot match q (by the structural pre-check's shape of q, read
# through the other spine constraints) ends that branch at once: no solution is lost, the
# solutions keep their order, and the search below the binding (a softmax explored before
# its input's spelling is checked) is skipped.
_EARLY_DEPTH = 3
_EARLY_BUDGET = 2000


def _spine_constraints(body: Pattern) -> list[tuple[str, Pattern]]:
    """The constraints ``(x, q)`` every solution of ``body`` checks, with x a name of the
    top level (not renamed by an unfolding)."""
    found: list[tuple[str, Pattern]] = []
    stack = [body]
    while stack:
        q = stack.pop()
        cls = type(q)
        if cls is PConstr:
            found.append((q.var, q.constraint))
            stack.append(q.constraint)
            stack.append(q.pat)
        elif cls is PGuard or cls is PExists or cls is PApp or cls is PFunVar:
            stack.extend(children(q))
        # PAlt: not every solution; PMu, PCall: names renamed inside
    return found


def _find_early_shapes(body: Pattern) -> dict[str, list] | None:
    """Per top-level variable with a spine constraint (the root's aside), the structural
    shape (:mod:`pypm_jax.engine.precheck`) every term it is bound to in a solution has
    (None: none worth checking). Only for patterns whose matching never raises: the
    machine must raise where the reference does, so no branch may be cut that would."""
    from .precheck import _shape  # (precheck builds on this module)

    try:
        found = _spine_constraints(body)
        if not found or not _error_free(body):
            return None
        cons = None
        for var, q in found:
            cons = (var, (q, _TOP_CTX), cons)
        root = _root_var(body)
        shapes: dict[str, list] = {}
        for var, q in found:
            if var == root or var in shapes:
                continue
            shape = _shape(q, _EARLY_DEPTH, [_EARLY_BUDGET], cons, [1], _TOP_CTX)
            if shape is not None:
                shapes[var] = shape
    except RecursionError:
        return None
    return shapes or None


_early_shapes = _ByIdentity(_find_early_shapes)


def _make_early_checks(body: Pattern) -> dict[str, Callable[[Any], bool]] | None:
    from .precheck import _check_of, _test_of

    shapes = _early_shapes(body)
    if shapes is None:
        return None
    return {var: _check_of(_test_of(shape)) for var, shape in shapes.items()}


_early = _ByIdentity(_make_early_checks)


# Look-ahead at alternates: per alternate ``p ‖ q``, the structural shape (two levels) every
# term that p (q) matches has, read from p alone; where the term cannot match one side,
# that side is not tried. No solution is lost or moved; only in patterns whose matching
# never raises (a skipped side cannot have raised).
_ALT_DEPTH = 2
_ALT_BUDGET = 400


def _make_alt_checks(alt: PAlt) -> tuple:
    from .precheck import _check_of, _shape, _test_of

    checks = []
    for side in (alt.left, alt.right):
        try:
            shape = _shape(side, _ALT_DEPTH, [_ALT_BUDGET], None, [1], _TOP_CTX)
        except RecursionError:
            shape = None
        checks.append(None if shape is None else _check_of(_test_of(shape)))
    return tuple(checks)


def _make_exact_alt_checks(alt: PAlt) -> tuple:
    """``_alt_checks`` for runs that keep the reference's fresh names: a side that may draw
    names (:func:`~pypm_jax.engine.analysis._draws_names`) is always tried, since skipping
    it would renumber the names drawn after it."""
    return tuple(
        None if check is None or _draws_names(side) else check
        for check, side in zip(_alt_checks(alt), (alt.left, alt.right), strict=True)
    )


_alt_checks = _ByIdentity(_make_alt_checks)
_exact_alt_checks = _ByIdentity(_make_exact_alt_checks)
_looks_ahead = _ByIdentity(_error_free)


# Guards before the first choice: the machine's first actions at a root, up to its first
# alternate, application or literal, bind variables to the root itself, enter definitions
# and check guards. A guard there that reads only variables bound to the root is evaluated
# on the root alone, and when it fails the machine stops with no solution, having done
# nothing else. So these guards, evaluated in that order before the machine starts, tell
# that the run would find nothing (``CompiledPattern`` does, in front of the machine), and
# where they hold the machine takes them as held (``held``): the same guards are evaluated,
# once, in the same order, and the machine is not started for nothing.
_PREFIX_STEPS = 64


class _PreGuards:
    """The guards the machine evaluates on the root alone before its first choice (see
    above): ``items`` holds per guard (its compiled form, the names it reads), in
    evaluation order; ``steps`` is the machine's step count once the last of them is
    evaluated. Each name a guard reads is, through its μ-body's environment, a variable
    bound to the root then (``_find_pre_guards`` stops at any other guard), so its θ is
    the root under each of its names and its φ is empty: what ``_env_guard(g)`` would
    give it, read through that environment, without building the views."""

    __slots__ = ("items", "steps")

    def __init__(self, items: tuple, steps: int):
        self.items = items
        self.steps = steps

    def check(self, t: Any, run: MatchRun) -> int | None:
        """None where a guard before the first choice fails at ``t`` (the machine would stop
        there with no solution), else how many of them hold (the machine, run next, takes
        them as held): 0 where the machine would reach its step budget first (it runs and
        raises)."""
        if run.budget is not None and run.steps + self.steps >= run.budget:
            return 0
        for holds, names in self.items:
            if not holds(dict.fromkeys(names, t), {}):
                return None
        return len(self.items)


def _find_pre_guards(body: Pattern) -> _PreGuards | None:
    """Run the machine's first actions symbolically (as ``_machine`` runs them at a root
    term) and collect the guards of :class:`_PreGuards`; None when there are none. Stops at
    the first action that could branch, look below the root, fail other than by a guard,
    raise or refuse a binding early."""
    early = None if type(body) is PMu else _early(body)
    cell = [1]
    k: Any = ((_MATCH, body, _TOP_CTX), None)
    bound: list[str] = []  # the variables bound (to the root), in binding order
    found: list[tuple] = []
    steps = 0
    last = 0
    while k is not None and steps < _PREFIX_STEPS:
        (tag, a, ctx), k = k
        steps += 1
        if tag == _MATCH:
            cls = type(a)
            if cls is PVar:
                name = ctx[0].get(a.name, a.name)
                if not isinstance(name, str):
                    break
                if name not in bound:
                    if early is not None and name in early:
                        break
                    bound.append(name)
            elif cls is PGuard:
                k = ((_MATCH, a.pat, ctx), ((_GUARD, a.guard, ctx), k))
            elif cls is PExists:
                name, ctx = _exists_ctx(a, ctx)
                k = ((_MATCH, a.body, ctx), ((_CHECK, (name, a.kind), ctx), k))
            elif cls is PConstr:
                var = ctx[0].get(a.var, a.var)
                k = ((_MATCH, a.pat, ctx), ((_CONSTR, (var, a.constraint), ctx), k))
            elif cls is PMu or cls is PCall:
                d = _definition(a, ctx)
                if d is None:
                    break  # (the machine raises here)
                params, dbody = d
                try:
                    q, inner = _enter(a.name, params, a.args, dbody, ctx, cell)
                except TypeError:
                    break
                k = ((_MATCH, q, inner), k)
            else:  # an application, a literal, an operator variable, an alternate
                break
        elif tag == _GUARD:
            names: set[str] = set()
            _expr_names(a, names)
            env = ctx[0]
            if not all(env.get(n, n) in bound for n in names):
                break  # (reads an operator, or a variable not bound to the root)
            found.append((_compiled_guards(a), tuple(sorted(names))))
            last = steps
        elif tag == _CHECK:
            name, kind = a
            if kind != "term" or name not in bound:
                break
        else:  # _CONSTR
            var, q = a
            if var not in bound:
                break
            k = ((_MATCH, q, ctx), k)
    if not found:
        return None
    return _PreGuards(tuple(found), last)


_pre_guards = _ByIdentity(_find_pre_guards)


def _machine(
    body: Pattern,
    t0: Any,
    theta: dict[str, Any] | None = None,
    phi: dict[str, Operator] | None = None,
    cell: list[int] | None = None,
    run: MatchRun | None = None,
    observer: Observer | None = None,
    held: int = 0,
) -> Iterator[RawSolution]:
    """The paper's machine with a trail: yields ``(θ, φ, matched terms)`` per solution.

    Bindings live in two dicts that are changed in place; the trail records each binding so
    that backtracking to a saved point undoes exactly the bindings made since. ``theta`` and
    ``phi`` (copied) are bindings made before ``body`` is reached (generated code running a
    recursive sub-pattern passes the arguments it has bound); ``cell`` is the fresh-name
    counter ``[next number]``, shared with that code; ``run`` counts steps (budget, progress)
    and says whether solutions are kept per parameters only (``MatchRun.distinct``).
    ``held``: the first guards the run reaches are known to hold, checked before it started
    (:class:`_PreGuards`), and are not evaluated again.

    ST-Match-Mu does not copy the body: entering ``μP(xs)[ys]. p`` makes a context whose
    environment maps ``xs`` to ``ys`` (and each ∃ met later to its fresh name), and every
    variable is looked up there when reached: the unfolding ``p[μP.p/P][ys/xs]`` with fresh
    ∃ names, exactly, at the cost of what the match visits rather than of the body's size.

    A call of a recursive definition is *tabled* (``docs/SEMANTICS.md``, "Tabling"): its
    answers at a term, for given bindings of its arguments, are computed once, lazily, by
    a producer (the same loop, run on its own bindings, trail and stack), and replayed at
    every call with that key. The producers waiting on each other are a list, not the
    Python stack.

    Written once, run two ways: ``_trail_machine`` (:func:`_instantiate`), where the
    ``if _OBSERVED:`` blocks are compiled away, and :func:`_observed`'s, which reports
    each transition to ``observer`` (an :class:`Observer`) and runs the reference's
    transitions exactly: definitions unfolded with :func:`pypm_jax.semantics.subst.unfold`
    (so the patterns it reports are the reference's) and no tabling.
    """
    if cell is None:
        cell = [1]
    if run is None:
        run = _EXACT
    distinct = run.distinct
    theta = {} if theta is None else dict(theta)
    phi = {} if phi is None else dict(phi)
    trail: list[tuple[dict, str]] = []
    struct: list[Any] = []
    stack: list[tuple[int, int, Any]] = []  # (trail length, struct length, continuation)
    k: Any = ((_MATCH, body, t0, _TOP_CTX), None)
    # tabled calls: key -> [answers, done, running, producer state, seen, outputs]
    table: dict[tuple, list] = {}
    # suspended consumers, innermost last: (θ, φ, trail, struct, stack, k, replay, index)
    frames: list[tuple] = []
    steps = run.steps
    limit = run.limit()
    forbid = run.forbid
    # early refusals at the top of a pattern (not where generated code runs a recursive
    # sub-pattern, a μ); none where explain watches the reference's transitions
    early = None if _OBSERVED or type(body) is PMu else _early(body)
    # (runs that keep θ exact keep its fresh names the reference's: no cut may skip a
    # part of the search that draws names)
    if early is not None and not distinct and _draws_names(body):
        early = None
    look = not _OBSERVED and _looks_ahead(body)
    alt_checks = _alt_checks if distinct else _exact_alt_checks
    alts = alt_checks.entries

    while True:
        steps += 1
        if steps >= limit:
            run.steps = steps
            run.check()
            limit = run.limit()
        if k is None:  # ST-Success
            run.steps = steps
            yield dict(theta), dict(phi), _flat(struct) if table else tuple(struct)
            steps = run.steps
            limit = run.limit()
            forbid = run.forbid
            ok = False
        else:
            (tag, a, b, ctx), k = k
            ok = True
            if tag == _MATCH:
                cls = type(a)
                t = b
                if cls is PVar:
                    name = ctx[0].get(a.name, a.name)
                    bound = theta.get(name)
                    if bound is None:
                        if early is not None:
                            check = early.get(name)
                            if check is not None and not check(t):
                                ok = False
                        if ok:
                            theta[name] = t
                            trail.append((theta, name))
                        if _OBSERVED:
                            observer.step("bind", a, t, theta, phi)
                    elif bound is not t:
                        ok = False
                        if _OBSERVED:
                            observer.fail("match", a, t, theta, phi)
                    elif _OBSERVED:
                        observer.step("same", a, t, theta, phi)
                elif cls is PApp:
                    ins = t.inputs
                    args = a.args
                    if (
                        t.op is a.op
                        and t.index == a.index
                        and len(ins) == len(args)
                        and (forbid is None or not forbid(t))
                    ):
                        struct.append(t)
                        for i in range(len(args) - 1, -1, -1):
                            k = ((_MATCH, args[i], ins[i], ctx), k)
                        if _OBSERVED:
                            observer.step("match", a, t, theta, phi)
                    else:
                        ok = False
                        if _OBSERVED:
                            observer.fail("match", a, t, theta, phi)
                elif cls is PConst:
                    if const_equal(a.value, t):
                        struct.append(t)
                        if _OBSERVED:
                            observer.step("match", a, t, theta, phi)
                    else:
                        ok = False
                        if _OBSERVED:
                            observer.fail("match", a, t, theta, phi)
                elif cls is PAlt:
                    if look:
                        hit = alts.get(id(a))
                        left, right = hit[1] if hit is not None and hit[0] is a else alt_checks(a)
                        if left is not None and not left(t):
                            if right is None or right(t):
                                k = ((_MATCH, a.right, t, ctx), k)
                            else:
                                ok = False
                        elif right is not None and not right(t):
                            k = ((_MATCH, a.left, t, ctx), k)
                        else:
                            stack.append((len(trail), len(struct), ((_MATCH, a.right, t, ctx), k)))
                            k = ((_MATCH, a.left, t, ctx), k)
                    else:
                        stack.append((len(trail), len(struct), ((_MATCH, a.right, t, ctx), k)))
                        k = ((_MATCH, a.left, t, ctx), k)
                    if _OBSERVED:
                        observer.choice()
                elif cls is PGuard:
                    k = ((_MATCH, a.pat, t, ctx), ((_GUARD, a.guard, a, ctx), k))
                elif cls is PExists:
                    env, info, base, scope = ctx
                    if info is None:  # at the top, or in a body unfolded already
                        name = a.var
                    else:
                        name = f"{a.var.split('#', 1)[0]}#{base + info.offsets[id(a)]}"
                    if name != env.get(a.var, a.var):
                        ctx = ({**env, a.var: name}, info, base, scope)
                    k = ((_MATCH, a.body, t, ctx), ((_CHECK, name, a.kind, ctx), k))
                elif cls is PConstr:
                    var = ctx[0].get(a.var, a.var)
                    k = ((_MATCH, a.pat, t, ctx), ((_CONSTR, var, a.constraint, ctx), k))
                elif cls is PFunVar:
                    f = t.op
                    ins = t.inputs
                    args = a.args
                    var = ctx[0].get(a.var, a.var)
                    if isinstance(var, Operator):  # instantiated: an application of it
                        ok = f is var and t.index == a.index and len(ins) == len(args)
                    elif (
                        len(ins) != len(args)
                        or t.index != a.index
                        or (a.n_out is not None and f.n_out != a.n_out)
                        or not f.pure  # opaque operators are outside the range of F
                    ):
                        ok = False
                    else:
                        bound = phi.get(var)
                        if bound is None:
                            phi[var] = f
                            trail.append((phi, var))
                        elif bound is not f:
                            ok = False
                    if ok and forbid is not None and forbid(t):
                        ok = False
                    if ok:
                        struct.append(t)
                        for i in range(len(args) - 1, -1, -1):
                            k = ((_MATCH, args[i], ins[i], ctx), k)
                        if _OBSERVED:
                            observer.step("match", a, t, theta, phi)
                    elif _OBSERVED:
                        observer.fail("match", a, t, theta, phi)
                elif _OBSERVED and cls is PMu:  # ST-Match-Mu exactly as the reference
                    k = ((_MATCH, unfold(a, _CellFresh(cell)), t, ctx), k)
                elif cls is PMu or cls is PCall:
                    if cls is PMu:
                        params, dbody = a.params, a.body
                    else:
                        d = ctx[3].get(a.name)
                        if d is None:
                            raise PatternDefinitionError(
                                f"recursive reference {show(a)} outside a definition μ{a.name}"
                            )
                        params, dbody = d
                    entry = None
                    if a is not body:  # (the top of the match is not worth a table)
                        hit = _TABLED.get(id(dbody))  # (``_tabling``, remembered)
                        if (
                            hit is not None
                            and hit[0] is dbody
                            and hit[1] is params
                            and hit[2] == a.name
                        ):
                            info = hit[3]
                        else:
                            info = _tabling(a.name, params, dbody)
                        if info[0] and (distinct or not info[1]):
                            key = _table_key(params, a.args, dbody, t, ctx[0], theta, phi)
                            if key is not None:
                                entry = table.get(key)
                                if entry is None:  # the first request runs as usual
                                    table[key] = _SEEN
                                elif entry is _SEEN:  # the second: tabled from now on
                                    entry = table[key] = _table_entry(
                                        a.name, params, a.args, dbody, t, ctx, theta, phi, cell
                                    )
                                elif entry[2]:  # it reached itself (through a constraint)
                                    entry = None
                    if entry is not None and entry is not _SEEN:
                        out = _outputs(params, a.args, ctx[0], theta, phi)
                        k = ((_REPLAY, (entry, out), 0, None), k)
                    else:
                        q, inner = _enter(a.name, params, a.args, dbody, ctx, cell)
                        k = ((_MATCH, q, t, inner), k)
                else:
                    raise TypeError(f"not a pattern: {a!r}")
            elif tag == _GUARD:
                if held:  # (one of the guards checked before the run: it holds)
                    held -= 1
                else:
                    ok = _env_guard(a)(theta, phi, ctx[0])
                if _OBSERVED:
                    if ok:
                        observer.step("guard", b, None, theta, phi)
                    else:
                        observer.fail("guard", b, None, theta, phi)
            elif tag == _CHECK:
                ok = a in (phi if b == "op" else theta)
                if _OBSERVED:
                    if ok:
                        observer.step("check", a, b, theta, phi)
                    else:
                        observer.fail("check", a, b, theta, phi)
            elif tag == _CONSTR:
                bound = theta.get(a)
                if bound is None:
                    ok = False
                    if _OBSERVED:
                        observer.fail("constraint", a, b, theta, phi)
                else:
                    k = ((_MATCH, b, bound, ctx), k)
                    if _OBSERVED:
                        observer.step("constraint", a, b, theta, phi)
            elif tag == _REPLAY:  # answer b of a tabled call, or pull it from its producer
                entry, callers = a
                answers = entry[0]
                if b < len(answers):
                    if b + 1 < len(answers) or not entry[1]:
                        stack.append((len(trail), len(struct), ((_REPLAY, a, b + 1, None), k)))
                    vals, chunk = answers[b]
                    for (name, is_op), v in zip(callers, vals, strict=True):
                        if v is not None:
                            dct = phi if is_op else theta
                            dct[name] = v
                            trail.append((dct, name))
                    if chunk.items:
                        struct.append(chunk)
                elif entry[1]:
                    ok = False
                else:  # suspend this consumer, resume the producer
                    frames.append((theta, phi, trail, struct, stack, k, a, b))
                    entry[2] = True
                    theta, phi, trail, struct, stack, k = entry[3]
                    if k is None:
                        ok = False  # resume by backtracking into it
            else:  # _RET: the producer on top found an answer
                entry = frames[-1][6][0]
                vals = tuple((phi if is_op else theta).get(ph) for ph, is_op in entry[5])
                if distinct and entry[0]:  # were these arguments answered already?
                    seen = entry[4]
                    if seen is None:
                        if len(entry[0]) < 8:
                            ok = not any(
                                all(x is y for x, y in zip(vals, old[0], strict=True))
                                for old in entry[0]
                            )
                        else:
                            seen = entry[4] = {tuple(map(id, old[0])) for old in entry[0]}
                    if seen is not None:
                        seen_key = tuple(map(id, vals))
                        ok = seen_key not in seen
                        seen.add(seen_key)
                if ok:
                    entry[0].append((vals, _Chunk(tuple(struct))))
                    entry[3] = (theta, phi, trail, struct, stack, None)
                    entry[2] = False
                    theta, phi, trail, struct, stack, k, a, b = frames.pop()
                    k = ((_REPLAY, a, b, None), k)
        while not ok:  # backtrack(stk)
            if stack:
                n_trail, n_struct, k = stack.pop()
                while len(trail) > n_trail:
                    d, name = trail.pop()
                    del d[name]
                del struct[n_struct:]
                if _OBSERVED:
                    observer.backtrack()
                break
            if not frames:
                run.steps = steps
                return
            entry = frames[-1][6][0]  # the producer is exhausted: its consumer fails
            entry[1], entry[2], entry[3] = True, False, None
            theta, phi, trail, struct, stack, k, _, _ = frames.pop()


def _instantiate(fn: Callable) -> Callable:
    """``fn`` compiled again from its source with ``_OBSERVED`` the constant False.

    Python drops an ``if False:`` block when it compiles, so this machine carries no trace
    of the observer, not even a test per step (about 2 ms, once, at import). Without the
    source (a build that ships bytecode only) it is ``fn`` itself, which tests the
    module's ``_OBSERVED`` (False).
    """
    code = fn.__code__
    lines = linecache.getlines(code.co_filename)
    last = max((line for _, _, line in code.co_lines() if line is not None), default=0)
    source = "".join(lines[code.co_firstlineno - 1 : last])
    if not source.startswith("def "):
        return fn
    source = "\n" * (code.co_firstlineno - 1) + re.sub(r"\b_OBSERVED\b", "False", source)
    made: dict[str, Any] = {}
    exec(compile(source, code.co_filename, "exec"), fn.__globals__, made)
    return made[fn.__name__]


_OBSERVED = False  # true only in the globals of _observed()'s machine

_trail_machine = _instantiate(_machine)


@functools.cache
def _observed() -> Callable[..., Iterator[RawSolution]]:
    """The machine that reports to its ``observer``: ``_machine`` run with ``_OBSERVED``
    true (made on first use: only explanations need it)."""
    scope = {**_machine.__globals__, "_OBSERVED": True}
    return types.FunctionType(_machine.__code__, scope, "_observed_machine", _machine.__defaults__)
