"""The fast matching engine: each pattern compiled once, patterns indexed by root operator.

It returns exactly what the reference machine (:mod:`pypm_jax.semantics.machine`) returns: the same
first solution, the same ``match_all`` order, the same θ and φ (fresh names included). It
gets there by running that machine ahead of time instead of at match time:

* **Generated code** (patterns without recursion, i.e. without ``PCall``). The compiler
  executes the machine *symbolically*: the continuation is known statically, so every match
  action becomes a line of straight Python (``if t3.op is not MatMul: break``) and every
  alternate becomes a ``while True:`` block that a failure leaves with ``break`` — which is
  exactly "pop the backtrack stack". Along each generated path it is statically known which
  variables are bound, so a binding is a Python local, a nonlinear check is ``is``, and
  backtracking undoes nothing. Calls to other patterns (non-recursive ``PMu``) are unfolded
  at compile time with :func:`pypm_jax.semantics.subst.unfold`; the fresh-name counter the machine
  keeps at run time becomes a local integer, so fresh names match the reference exactly.
  Guards are inlined where "undefined" and "false" coincide (a conjunction of rank, dtype
  and constant comparisons at the top of a guard); anything else becomes a small generated
  function with the evaluation rules of :mod:`pypm_jax.semantics.guards`.
  A recursive sub-pattern inside a generated pattern becomes a ``for`` loop over the
  solutions of the iterative machine run from it (``_sub``): a failure after it resumes the
  machine, which is the reference machine's backtracking into the recursion. Both share one
  fresh-name counter, so names still match the reference.
* **An iterative machine** (patterns that are one recursive definition, and patterns too
  branchy to generate): the paper's machine with a trail instead of copied substitutions,
  so backtracking costs the bindings it undoes, and an explicit continuation and stack, so
  a 100 000-deep chain never touches the Python stack. It never copies a μ-body: entering
  a definition makes an environment (parameters -> arguments, each ∃ -> its fresh name),
  so an unfolding costs what the match visits, not the body's size.
* **A structural pre-check** in front of the machine: the operators and arities a match
  must have at its root and the four levels below (``x <= q`` constraints included),
  computed once per pattern; a term that fails it has no match, so the machine is not
  started.

:class:`Matcher` indexes many patterns by the operators their root can have; a value is only
tried against the patterns of its operator (plus those whose root can be anything), and most
values of a graph cost one dict lookup.
"""

from __future__ import annotations

__all__ = [
    "CompiledPattern",
    "MatchRun",
    "Matcher",
    "compile_pattern",
    "match_first",
    "match_all",
    "solutions",
    "root_operators",
    "compile_guard",
    "summary",
    "from_summary",
]

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    children,
    show,
)
from ..core.dtypes import DType
from ..core.errors import PatternDefinitionError
from ..core.match import Match
from ..core.terms import CONST, UNDEFINED, Operator, const_equal, term_attr
from ..semantics.guards import Refusal, guard_holds, op_attr
from ..semantics.guards import binary as guard_binary
from ..semantics.subst import FreshNames, unfold

RawSolution = tuple[dict[str, Any], dict[str, Operator], tuple[Any, ...]]
"""(θ, φ, the terms the pattern's applications and literals matched)."""

# Python refuses more than 20 statically nested blocks in one function; each alternate on a
# generated path opens one. Patterns deeper than this run on the iterative machine.
_MAX_BLOCKS = 18
# Generated paths duplicate the continuation after an alternate; cap the code size.
_MAX_LINES = 1000
# Entries kept per compile cache (patterns, guards, μ-bodies) before it is cleared.
_CACHE_LIMIT = 4096


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
    """

    __slots__ = ("steps", "budget", "distinct", "every", "on_check")

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


# ----------------------------------------------------------------------- runtime helpers


class _Undef(Exception):
    """A guard has no value (the generated counterpart of ``_guards.Undefined``)."""


def _truth(v: Any) -> bool:
    if v is True:
        return True
    if v is False:
        return False
    if isinstance(v, bool | int | np.bool_ | np.integer):
        return bool(v)
    if isinstance(v, Refusal):
        return False
    raise _Undef


def _undef() -> Any:
    raise _Undef


def _attr(t: Any, name: str) -> Any:
    v = term_attr(t, name)
    if v is UNDEFINED:
        raise _Undef
    return v


def _rank(t: Any) -> int:
    s = t.shape
    if s is None:
        raise _Undef
    return len(s)


def _dtype(t: Any) -> Any:
    d = t.dtype
    if d is None:
        raise _Undef
    return d


def _sub(
    mu: PMu,
    args: tuple,
    t: Any,
    theta: dict[str, Any],
    phi: dict[str, Any],
    cell: list[int],
    run: MatchRun | None,
) -> Any:
    """Generated code's call of a recursive sub-pattern: the trail machine from ``mu`` with
    ``args`` (its arguments' names at run time: fresh names are only known then) at ``t``,
    with the caller's bindings of them, the caller's fresh-name counter and its run."""
    return _trail_machine(PMu(mu.name, mu.params, args, mu.body), t, theta, phi, cell, run)


_RUNTIME = {
    "_sub": _sub,
    "CONST": CONST,
    "const_equal": const_equal,
    "_T": _truth,
    "_undef": _undef,
    "_attr": _attr,
    "_rank": _rank,
    "_dtype": _dtype,
    "op_attr": op_attr,
    "_binary": guard_binary,
}

# Guard operators evaluated through ``_guards.binary``, which refuses a result beyond the
# evaluation limits (``7 ** 30000000``) instead of computing it; the others run inline.
_BOUNDED_OPS = frozenset({"**", "*", "+", "%"})


# ------------------------------------------------------------------- compile-time names


class _Fresh(str):
    """A fresh name whose number is known only at run time: ``base#(b<k> + offset)``.

    It is a ``str`` so that :func:`pypm_jax.semantics.subst.unfold` and ``rename_expr`` treat it as
    an ordinary variable name; its text is unique per unfolding site and never clashes with
    a user's name (user names never contain ``#`` on this path).
    """

    base: str
    counter: str
    offset: int


class _FreshSupply:
    """The compile-time stand-in for ``FreshNames`` during one unfolding."""

    def __init__(self, counter: str):
        self.counter = counter
        self.count = 0

    def __call__(self, name: str) -> str:
        base = name.split("#", 1)[0]
        f = _Fresh(f"{base}#{{{self.counter}+{self.count}}}")
        f.base, f.counter, f.offset = base, self.counter, self.count
        self.count += 1
        return f


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
            case PApp(_, args, _):
                stack.extend(args)
            case PFunVar(var, args, _, _):
                out.add(var)
                stack.extend(args)
            case PAlt(left, right):
                stack += [left, right]
            case PGuard(pat, _):
                stack.append(pat)
            case PExists(var, body, _):
                out.add(var)
                stack.append(body)
            case PConstr(pat, var, constraint):
                out.add(var)
                stack += [pat, constraint]
            case PMu(_, params, args, body):
                out.update(x.name for x in params)
                out.update(a for a in args if isinstance(a, str))
                stack.append(body)
            case PCall(_, args):
                out.update(a for a in args if isinstance(a, str))
        if isinstance(q, PGuard):
            _expr_names(q.guard, out)


def _expr_names(e: Expr, out: set[str]) -> None:
    """Collect the variable names a guard reads."""
    stack = [e]
    while stack:
        x = stack.pop()
        match x:
            case EAttr(var, _) | EOpAttr(var, _):
                out.add(var)
            case EIndex(base, index):
                stack += [base, index]
            case EBin(_, left, right) | ECmp(_, left, right):
                stack += [left, right]
            case EUnary(_, operand) | ENot(operand):
                stack.append(operand)
            case EAnd(items) | EOr(items) | ETuple(items) | ECall(_, items):
                stack.extend(items)


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
        elif cls is PApp:
            stack.extend((a, names) for a in p.args)
        elif cls is PFunVar:
            closed = closed and p.var in names
            stack.extend((a, names) for a in p.args)
        elif cls is PAlt:
            stack += [(p.left, names), (p.right, names)]
        elif cls is PGuard:
            used: set[str] = set()
            _expr_names(p.guard, used)
            closed = closed and used <= names
            stack.append((p.pat, names))
        elif cls is PExists:
            has_exists = True
            stack.append((p.body, names | {p.var}))
        elif cls is PConstr:
            closed = closed and p.var in names
            stack += [(p.pat, names), (p.constraint, names)]
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
        elif cls is not PConst:
            closed = False
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


# ------------------------------------------------------------------------ code generation


class _State:
    """What is statically known on one generated path: bound variables and matched terms."""

    __slots__ = ("tvars", "ovars", "struct", "extra_theta", "extra_phi")

    def __init__(self) -> None:
        self.tvars: dict[str, str] = {}  # θ name -> Python local holding the term
        self.ovars: dict[str, str] = {}  # φ name -> Python local holding the operator
        self.struct: list[str] = []  # locals of terms matched by applications/literals
        self.extra_theta: list[str] = []  # θ dicts of sub-machine solutions on this path
        self.extra_phi: list[str] = []

    def copy(self) -> _State:
        s = _State()
        s.tvars, s.ovars, s.struct = dict(self.tvars), dict(self.ovars), list(self.struct)
        s.extra_theta, s.extra_phi = list(self.extra_theta), list(self.extra_phi)
        return s


def _name_expr(name: str) -> str:
    """Python source for the run-time θ/φ key of a (possibly fresh) name."""
    if isinstance(name, _Fresh):
        number = name.counter if name.offset == 0 else f"{name.counter} + {name.offset}"
        if name.base.isidentifier():
            return f"f'{name.base}#{{{number}}}'"
        return f"{name.base + '#'!r} + str({number})"
    return repr(str(name))


class _Codegen:
    """Emits one Python function that runs the machine on a fixed pattern.

    ``mode`` is ``"first"`` (return the first solution or None) or ``"all"`` (a generator of
    ``(θ, φ, matched terms)`` in exploration order).
    """

    def __init__(
        self, mode: str, ns: dict[str, Any], counter: itertools.count, dynamic: bool = False
    ):
        self.mode = mode
        self.dynamic = dynamic  # variables may hold None (unbound) at run time
        self.ns = ns
        self.counter = counter
        self.lines: list[str] = []
        self.helpers: list[str] = []
        self.blocks = 0  # alternates emitted: none means at most one solution
        self._consts: dict[int, str] = {}
        self.ctr = "ctr"  # the fresh-name counter: a local, or a cell shared with machines

    # -- small utilities

    def local(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    def const(self, value: Any) -> str:
        key = id(value)
        name = self._consts.get(key)
        if name is None:
            name = f"K{next(self.counter)}"
            self._consts[key] = name
            self.ns[name] = value
        return name

    def line(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)
        if len(self.lines) > _MAX_LINES:
            raise _Unsupported("generated code too large")

    # -- the machine, symbolically

    def function(self, body: Pattern) -> str:
        name = "_first" if self.mode == "first" else "_all"
        self.lines.append(f"def {name}(t0, R=None):")
        if _has_call(body):  # recursive sub-patterns run on machines sharing the counter
            self.ctr = "C[0]"
            self.line(1, "C = [1]")
        else:
            self.line(1, "ctr = 1")
        fail = "return None" if self.mode == "first" else "return"
        self.emit([("m", body, "t0")], _State(), 1, fail, 0)
        if self.mode == "all":
            self.line(1, "yield  # unreachable; makes this a generator even with no solution")
        return "\n".join(self.helpers + self.lines) + "\n"

    def emit(self, k: list[tuple], st: _State, ind: int, fail: str, depth: int) -> None:
        """Emit code for continuation ``k`` (a stack, head last) on the current path."""
        line = self.line
        while k:
            act = k.pop()
            tag = act[0]
            if tag == "m":
                p, t = act[1], act[2]
                cls = type(p)
                if cls is PVar:
                    name = p.name
                    bound = st.tvars.get(name)
                    if bound is None:
                        st.tvars[name] = t  # ST-Match-Var-Bind
                    elif bound != t:
                        line(ind, f"if {t} is not {bound}: {fail}")  # -Bound / -Conflict
                elif cls is PApp:
                    op = self.const(p.op)
                    n = len(p.args)
                    st.struct.append(t)
                    if n == 0:
                        line(
                            ind,
                            f"if {t}.op is not {op} or {t}.index != {p.index} or {t}.inputs: {fail}",
                        )
                    else:
                        cond = f"{t}.op is not {op} or {t}.index != {p.index}"
                        line(ind, f"if {cond} or len(a := {t}.inputs) != {n}: {fail}")
                        self._unpack(p.args, k, ind)
                elif cls is PConst:
                    st.struct.append(t)
                    c = self.const(p.value)
                    line(ind, f"if {t}.op is not CONST or not const_equal({c}, {t}): {fail}")
                elif cls is PAlt:  # ST-Match-Alt: a block the left path leaves by `break`
                    if depth >= _MAX_BLOCKS:
                        raise _Unsupported("too many nested alternates")
                    line(ind, "while True:")
                    self.blocks += 1
                    left = k.copy()
                    left.append(("m", p.left, t))
                    self.emit(left, st.copy(), ind + 1, "break", depth + 1)
                    k.append(("m", p.right, t))
                elif cls is PGuard:  # ST-Match-Guard
                    k.append(("g", p.guard))
                    k.append(("m", p.pat, t))
                elif cls is PExists:  # ST-Match-Exists
                    k.append(("c", p.var, p.kind))
                    k.append(("m", p.body, t))
                elif cls is PConstr:  # ST-Match-MatchConstr
                    k.append(("k", p.var, p.constraint))
                    k.append(("m", p.pat, t))
                elif cls is PFunVar:
                    st.struct.append(t)
                    n = len(p.args)
                    # opaque (impure) operators are outside the range of F (SEMANTICS 11)
                    cond = (
                        f"len(a := {t}.inputs) != {n} or {t}.index != {p.index} or not {t}.op.pure"
                    )
                    if p.n_out is not None:
                        cond += f" or {t}.op.n_out != {p.n_out}"
                    bound = st.ovars.get(p.var)
                    if bound is None:  # ST-Match-Fun-Var-Bind
                        line(ind, f"if {cond}: {fail}")
                        o = self.local("o")
                        line(ind, f"{o} = {t}.op")
                        st.ovars[p.var] = o
                    else:  # ST-Match-Fun-Var-Bound / -Conflict
                        line(ind, f"if {cond} or {t}.op is not {bound}: {fail}")
                    if n:
                        self._unpack(p.args, k, ind)
                elif cls is PMu and _calls_self(p):  # recursive: a machine, in a loop
                    self.submachine(p, t, k, st, ind, fail, depth)
                    return
                elif cls is PMu:  # ST-Match-Mu, unfolded now; fresh numbers at run time
                    counter = self.local("b")
                    supply = _FreshSupply(counter)
                    try:
                        q = unfold(p, supply)  # type: ignore[arg-type]
                    except TypeError as exc:  # the machine raises this at run time
                        raise _Unsupported(str(exc)) from None
                    if supply.count:
                        line(ind, f"{counter} = {self.ctr}")
                        line(ind, f"{self.ctr} += {supply.count}")
                    k.append(("m", q, t))
                else:  # PCall, or something unknown: the machine decides
                    raise _Unsupported(f"cannot generate code for {type(p).__name__}")
            elif tag == "g":  # checkGuard
                line(ind, f"if not ({self.positive(act[1], st)}): {fail}")
            elif tag == "c":  # checkName
                var, kind = act[1], act[2]
                if var not in (st.ovars if kind == "op" else st.tvars):
                    line(ind, fail)
                    return
            else:  # matchConstr
                var, pat = act[1], act[2]
                bound = st.tvars.get(var) if isinstance(var, str) else None
                if bound is None:
                    line(ind, fail)
                    return
                k.append(("m", pat, bound))
        self.success(st, ind, fail)

    def submachine(
        self, p: PMu, t: str, k: list[tuple], st: _State, ind: int, fail: str, depth: int
    ) -> None:
        """A recursive sub-pattern: ``for`` each solution of the trail machine run from
        ``p`` at ``t`` (given the arguments bound so far), the rest of the continuation.

        A failure in the rest resumes the machine (``continue``): its next solution is the
        reference machine's next backtrack point inside ``p``. After the loop, the
        enclosing failure. The machine's θ and φ (its fresh names included) and matched
        terms join the solution. Needs ``p`` closed (it reads no variable of the caller but
        its arguments) and every argument unbound at the call bound by every solution.
        """
        if depth >= _MAX_BLOCKS:
            raise _Unsupported("too many nested alternates")
        if not _closed(p):
            raise _Unsupported(f"recursive {p.name} reads variables it is not passed")
        definite = _definitely_bound(p)
        theta_in: list[str] = []
        phi_in: list[str] = []
        after: list[tuple[str, str, str]] = []  # (kind, caller name, runtime key expr)
        for i, (param, arg) in enumerate(zip(p.params, p.args, strict=True)):
            if not isinstance(arg, str):
                continue  # an operator: the machine's unfolding substitutes it
            is_op = param.kind == "op"
            bound = (st.ovars if is_op else st.tvars).get(arg)
            key = _name_expr(arg)
            if bound is not None:
                (phi_in if is_op else theta_in).append(f"{key}: {bound}")
            elif i in definite:
                after.append(("op" if is_op else "term", arg, key))
            else:
                raise _Unsupported(f"recursive {p.name} may leave {arg} unbound")
        mu = self.const(p)
        args = "".join(
            f"{_name_expr(a) if isinstance(a, str) else self.const(a)}, " for a in p.args
        )
        sol, th, ph, sx = (self.local(x) for x in ("s", "th", "ph", "sx"))
        self.blocks += 1
        self.line(
            ind,
            f"for {sol} in _sub({mu}, ({args}), {t}, {{{', '.join(theta_in)}}}, "
            f"{{{', '.join(phi_in)}}}, C, R):",
        )
        inner = st.copy()
        self.line(ind + 1, f"{th}, {ph}, {sx} = {sol}")
        for kind, arg, key in after:
            loc = self.local("o" if kind == "op" else "t")
            self.line(ind + 1, f"{loc} = {ph if kind == 'op' else th}[{key}]")
            (inner.ovars if kind == "op" else inner.tvars)[arg] = loc
        inner.extra_theta.append(th)
        inner.extra_phi.append(ph)
        inner.struct.append(f"*{sx}")
        self.emit(k, inner, ind + 1, "continue", depth + 1)
        self.line(ind, fail)

    def _unpack(self, args: tuple[Pattern, ...], k: list[tuple], ind: int) -> None:
        locs = [self.local("t") for _ in args]
        self.line(ind, f"{', '.join(locs)}, = a")
        for arg, loc in zip(reversed(args), reversed(locs), strict=True):
            k.append(("m", arg, loc))

    def success(self, st: _State, ind: int, fail: str) -> None:
        theta = ", ".join(
            [f"**{x}" for x in st.extra_theta]
            + [f"{_name_expr(n)}: {v}" for n, v in st.tvars.items()]
        )
        phi = ", ".join(
            [f"**{x}" for x in st.extra_phi]
            + [f"{_name_expr(n)}: {v}" for n, v in st.ovars.items()]
        )
        struct = "".join(f"{s}, " for s in st.struct)
        if self.mode == "first":
            self.line(ind, f"return {{{theta}}}, {{{phi}}}, ({struct})")
        else:
            self.line(ind, f"yield {{{theta}}}, {{{phi}}}, ({struct})")
            self.line(ind, fail)  # resume = backtrack into the innermost alternate

    # -- guards

    def positive(self, g: Expr, st: _State) -> str:
        """Inline Python deciding ⟦g[θ, φ]⟧ = True, for a guard in *positive* position.

        At the top of a guard, and inside a conjunction there, "undefined" and "false" mean
        the same (the guard does not hold), and ``and`` stops at the first of either. So a
        conjunction of simple comparisons (ranks, dtypes, constants) can be inlined with
        "undefined" spelled as False; anything else becomes a call of a generated function
        with the full evaluation rules.
        """
        if isinstance(g, EAnd) and g.items:
            return " and ".join(f"({self.positive(i, st)})" for i in g.items)
        if isinstance(g, EConst):
            try:
                return repr(_truth(g.value))
            except _Undef:
                return "False"
        if isinstance(g, ECmp):
            inline = self._inline_cmp(g, st)
            if inline is not None:
                return inline
        return self.guard(g, st)

    def _inline_cmp(self, g: ECmp, st: _State) -> str | None:
        """``x.rank == 2``, ``x.dtype in (f32, bf16)``, ... as inline Python, or None."""
        conds: list[str] = []
        sides: list[str] = []
        for e in (g.left, g.right):
            if isinstance(e, EConst) and _simple_const(e.value):
                sides.append(self.const(e.value))
            elif isinstance(e, ETuple) and all(
                isinstance(i, EConst) and _simple_const(i.value) for i in e.items
            ):
                sides.append(self.const(tuple(i.value for i in e.items)))
            elif isinstance(e, EAttr) and e.attr in ("rank", "dtype", "eltType"):
                t = st.tvars.get(e.var) if isinstance(e.var, str) else None
                if t is None:
                    return "False"  # reads an unbound variable: undefined
                if self.dynamic:
                    conds.append(f"{t} is not None")
                if e.attr == "rank":
                    conds.append(f"{t}.shape is not None")
                    sides.append(f"len({t}.shape)")
                else:
                    conds.append(f"{t}.dtype is not None")
                    sides.append(f"{t}.dtype")
            else:
                return None
        test = f"{sides[0]} {g.op} {sides[1]}"
        return " and ".join([*conds, test if g.op in ("in", "not in") else f"bool({test})"])

    def guard(self, g: Expr, st: _State) -> str:
        """A call to a generated function deciding ⟦g[θ, φ]⟧ = True on this path."""
        refs: dict[str, None] = {}
        src = self.expr(g, st, refs)
        name = self.local("_g")
        params = ", ".join(refs)
        self.helpers.append(
            f"def {name}({params}):\n    try:\n        return _T({src})\n"
            "    except Exception:\n        return False\n"
        )
        return f"{name}({params})"

    def expr(self, e: Expr, st: _State, refs: dict[str, None]) -> str:
        """Python source with the semantics of ``_guards.eval_expr`` (undefined = raise)."""
        rec = self.expr
        match e:
            case EConst(value):
                return self.const(value)
            case EAttr(var, attr):
                t = st.tvars.get(var) if isinstance(var, str) else None
                if t is None:
                    return "_undef()"
                refs[t] = None
                if attr == "rank":
                    return f"_rank({t})"
                if attr in ("dtype", "eltType"):
                    return f"_dtype({t})"
                return f"_attr({t}, {attr!r})"
            case EOpAttr(var, attr):
                o = st.ovars.get(var) if isinstance(var, str) else None
                if o is None:
                    return "_undef()"
                refs[o] = None
                return f"op_attr({o}, {attr!r})"
            case EIndex(base, index):
                return f"({rec(base, st, refs)})[{rec(index, st, refs)}]"
            case EBin(op, left, right) if op in _BOUNDED_OPS:
                # (the operators whose result can grow without bound: _guards.binary checks)
                return f"_binary({op!r}, {rec(left, st, refs)}, {rec(right, st, refs)})"
            case EBin(op, left, right):
                return f"(({rec(left, st, refs)}) {op} ({rec(right, st, refs)}))"
            case EUnary(op, operand):
                return f"({op}({rec(operand, st, refs)}))"
            case ECmp(op, left, right):
                src = f"({rec(left, st, refs)}) {op} ({rec(right, st, refs)})"
                return f"({src})" if op in ("in", "not in") else f"bool({src})"
            case EAnd(items):
                if not items:
                    return "True"
                return "(" + " and ".join(f"_T({rec(i, st, refs)})" for i in items) + ")"
            case EOr(items):
                if not items:
                    return "False"
                return "(" + " or ".join(f"_T({rec(i, st, refs)})" for i in items) + ")"
            case ENot(operand):
                return f"(not _T({rec(operand, st, refs)}))"
            case ECall(fn, args):
                f = self.const(fn.fn)
                return f"{f}({', '.join(rec(a, st, refs) for a in args)})"
            case ETuple(items):
                return "(" + "".join(f"{rec(i, st, refs)}, " for i in items) + ")"
        raise _Unsupported(f"not an expression: {e!r}")


def _simple_const(value: Any) -> bool:
    """Constants whose comparisons with ranks and dtypes cannot raise."""
    if isinstance(value, tuple):
        return all(_simple_const(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | DType)


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


def _generate(body: Pattern) -> tuple[Callable, Callable, str, bool]:
    """Generated ``first`` and ``all`` functions for a recursion-free pattern, and whether
    it has at most one solution (no alternate anywhere)."""
    paths, nodes = _paths(body, [_MAX_LINES])  # (code has at least a line per node)
    if paths * nodes > 8 * _MAX_LINES:
        raise _Unsupported("generated code would be too large")
    names: set[str] = set()
    _plain_names(body, names)
    if any("#" in n for n in names):
        raise _Unsupported("user variable names contain '#'")
    ns: dict[str, Any] = dict(_RUNTIME)
    counter = itertools.count(1)
    src_first = _Codegen("first", ns, counter).function(body)
    gen_all = _Codegen("all", ns, counter)
    src_all = gen_all.function(body)
    source = src_first + "\n" + src_all
    try:
        code = compile(source, "<pypm-fast>", "exec")
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise _Unsupported(f"generated code does not compile: {exc}") from None
    exec(code, ns)
    return ns["_first"], ns["_all"], source, gen_all.blocks == 0


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


def _enter(
    name: str, params: tuple, args: tuple, body: Pattern, ctx: tuple, cell: list[int]
) -> tuple[Pattern, tuple]:
    """ST-Match-Mu: the pattern and context that run one unfolding of a definition."""
    env, _, _, scope = ctx
    resolved = tuple(env.get(a, a) if isinstance(a, str) else a for a in args)
    info = _body_info(body)
    if info.shared:  # ambiguous ∃ offsets: unfold it the reference's way
        q = unfold(PMu(name, params, resolved, body), _CellFresh(cell))
        return q, ({}, None, 0, scope)
    new_env = {x.name: y for x, y in zip(params, resolved, strict=True)}
    for v in info.pvars:
        op = new_env.get(v)
        if isinstance(op, Operator):
            raise TypeError(f"term variable {v} instantiated with operator {op.name}")
    base = cell[0]
    cell[0] = base + info.count
    return body, (new_env, info, base, {**scope, name: (params, body)})


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


def _tabling(name: str, params: tuple, body: Pattern) -> tuple[bool, bool]:
    """(may a call of this definition be tabled: it is recursive and closed; has it an ∃
    anywhere, so that only the ``distinct`` mode tables it)."""
    closed, free, has_exists, _ = _def_facts(name, params, body)
    return closed and free == {name}, has_exists


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


def _trail_machine(
    body: Pattern,
    t0: Any,
    theta: dict[str, Any] | None = None,
    phi: dict[str, Operator] | None = None,
    cell: list[int] | None = None,
    run: MatchRun | None = None,
) -> Iterator[RawSolution]:
    """The paper's machine with a trail: yields ``(θ, φ, matched terms)`` per solution.

    Bindings live in two dicts that are changed in place; the trail records each binding so
    that backtracking to a saved point undoes exactly the bindings made since. ``theta`` and
    ``phi`` (copied) are bindings made before ``body`` is reached (generated code running a
    recursive sub-pattern passes the arguments it has bound); ``cell`` is the fresh-name
    counter ``[next number]``, shared with that code; ``run`` counts steps (budget, progress)
    and says whether solutions are kept per parameters only (``MatchRun.distinct``).

    ST-Match-Mu does not copy the body: entering ``μP(xs)[ys]. p`` makes a context whose
    environment maps ``xs`` to ``ys`` (and each ∃ met later to its fresh name), and every
    variable is looked up there when reached: the unfolding ``p[μP.p/P][ys/xs]`` with fresh
    ∃ names, exactly, at the cost of what the match visits rather than of the body's size.

    A call of a recursive definition is *tabled* (``docs/SEMANTICS.md``, "Tabling"): its
    answers at a term, for given bindings of its arguments, are computed once, lazily, by
    a producer (the same loop, run on its own bindings, trail and stack), and replayed at
    every call with that key. The producers waiting on each other are a list, not the
    Python stack.
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
                        theta[name] = t
                        trail.append((theta, name))
                    elif bound is not t:
                        ok = False
                elif cls is PApp:
                    ins = t.inputs
                    args = a.args
                    if t.op is a.op and t.index == a.index and len(ins) == len(args):
                        struct.append(t)
                        for i in range(len(args) - 1, -1, -1):
                            k = ((_MATCH, args[i], ins[i], ctx), k)
                    else:
                        ok = False
                elif cls is PConst:
                    if const_equal(a.value, t):
                        struct.append(t)
                    else:
                        ok = False
                elif cls is PAlt:
                    stack.append((len(trail), len(struct), ((_MATCH, a.right, t, ctx), k)))
                    k = ((_MATCH, a.left, t, ctx), k)
                elif cls is PGuard:
                    k = ((_MATCH, a.pat, t, ctx), ((_GUARD, a.guard, None, ctx), k))
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
                    if ok:
                        struct.append(t)
                        for i in range(len(args) - 1, -1, -1):
                            k = ((_MATCH, args[i], ins[i], ctx), k)
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
                ok = _env_guard(a)(theta, phi, ctx[0])
            elif tag == _CHECK:
                ok = a in (phi if b == "op" else theta)
            elif tag == _CONSTR:
                bound = theta.get(a)
                if bound is None:
                    ok = False
                else:
                    k = ((_MATCH, b, bound, ctx), k)
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
                break
            if not frames:
                run.steps = steps
                return
            entry = frames[-1][6][0]  # the producer is exhausted: its consumer fails
            entry[1], entry[2], entry[3] = True, False, None
            theta, phi, trail, struct, stack, k, _, _ = frames.pop()


# -------------------------------------------------------------------- compiled patterns


def _root_ops(p: Pattern, budget: list[int]) -> frozenset[Operator] | None:
    """The operators a term matched by ``p`` can have at its root; None = any."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    match p:
        case PApp(op, _, _):
            return frozenset((op,))
        case PConst():
            return frozenset((CONST,))
        case PAlt(left, right):
            a = _root_ops(left, budget)
            b = _root_ops(right, budget) if a is not None else None
            return None if a is None or b is None else a | b
        case PConstr(pat, var, constraint):
            a = _root_ops(pat, budget)
            if _root_var(pat) != var:
                return a
            # `x <= q` where x is the root itself: the root matches q too
            b = _root_ops(constraint, budget)
            return b if a is None else a if b is None else a & b
        case PGuard(pat, _) | PExists(_, pat, _):
            return _root_ops(pat, budget)
        case PMu():
            try:
                return _root_ops(unfold(p, FreshNames()), budget)
            except TypeError:
                return None
    return None  # PVar, PFunVar, PCall: anything


def _root_var(p: Pattern) -> str | None:
    """The variable that the first action of matching ``p`` binds to the root, if any."""
    while True:
        match p:
            case PVar(name):
                return name
            case PGuard(pat, _) | PExists(_, pat, _) | PConstr(pat, _, _):
                p = pat
            case _:
                return None


def root_operators(pdef: PatternDef) -> frozenset[Operator] | None:
    """Operators a match of ``pdef`` can be rooted at, or None when it can be any."""
    try:
        return _root_ops(pdef.body, [1000])
    except RecursionError:  # a pattern too deep to walk this way: any root
        return None


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


class CompiledPattern:
    """A pattern ready to match: ``first(t)`` and ``solutions(t)`` give raw solutions
    ``(θ, φ, matched terms)``, the first one being the same in both.

    ``backend`` says which engine runs it ("generated" or "machine"); ``source`` holds the
    generated Python for inspection (empty for the machine).
    """

    __slots__ = ("pdef", "backend", "source", "root_ops", "unique", "_first", "_all", "_shape")

    def __init__(self, pdef: PatternDef, *, backend: str | None = None):
        self.pdef = pdef
        self.root_ops = root_operators(pdef)
        self.source = ""
        self.backend = "machine"
        self.unique = False  # True: at most one solution, so first() is all there is
        body = pdef.body
        if backend != "machine" and not (isinstance(body, PMu) and _calls_self(body)):
            # (a pattern that is one recursive definition gains nothing from a wrapper)
            try:
                self._first, self._all, self.source, self.unique = _generate(body)
                self.backend = "generated"
            except _Unsupported:
                if backend == "generated":
                    raise
            except RecursionError:  # too deep to compile: the machine runs it
                if backend == "generated":
                    raise _Unsupported("pattern too deep to generate") from None
        if self.backend == "machine":
            self._shape = _prefilter(body)
            self._all = self._machine_all
            self._first = self._machine_first

    def _machine_first(self, t: Any, run: MatchRun | None = None) -> RawSolution | None:
        if self._shape is not None and not _fits(self._shape, t):
            return None
        for sol in _trail_machine(self.pdef.body, t, run=run):
            return sol
        return None

    def _machine_all(self, t: Any, run: MatchRun | None = None) -> Iterator[RawSolution]:
        if self._shape is not None and not _fits(self._shape, t):
            return iter(())
        return _trail_machine(self.pdef.body, t, run=run)

    def first(self, t: Any, run: MatchRun | None = None) -> RawSolution | None:
        """The machine's first (θ, φ, matched terms) at ``t``, or None."""
        return self._first(t, run)

    def solutions(self, t: Any, run: MatchRun | None = None) -> Iterator[RawSolution]:
        """Every (θ, φ, matched terms) in exploration order, repeats included.

        The matched terms are those the pattern's applications and literals matched (the
        match's structure, used by the rewrite driver to know which nodes a match covers).
        ``run`` (a :class:`MatchRun`) bounds and observes the work; with
        ``run.distinct`` repeats of a tabled call's answers are left out (the solutions'
        parameters, deduplicated, are the same in the same order).
        """
        return self._all(t, run)

    def __repr__(self) -> str:
        return f"<CompiledPattern {self.pdef.name} ({self.backend})>"


_compiled = _ByIdentity(CompiledPattern)


# ------------------------------------------------------- summaries of compiled patterns
#
# What compiling a pattern for the machine decides (no generated code; its root operators;
# its pre-check) is data: a summary in JSON values, operators by qualified name. Summaries
# shipped with the package (the standard rules', pypm_jax.rules._prebuilt) let a new process
# skip deciding again; they hold no code, and a summary that does not fit its pattern is
# refused, so the pattern is compiled as usual.


def summary(cp: CompiledPattern) -> dict[str, Any] | None:
    """``cp``'s decisions as JSON values, or None for generated code (not summarized)."""
    if cp.backend != "machine":
        return None

    def shape(sh: _Shape) -> Any:
        if sh is None:
            return None
        return [
            [
                None if op is None else op.qualname,
                n,
                None if kids is None else [shape(k) for k in kids],
            ]
            for op, n, kids in sh
        ]

    roots = None if cp.root_ops is None else sorted(op.qualname for op in cp.root_ops)
    return {"backend": "machine", "root_ops": roots, "shape": shape(cp._shape)}


def _operators_of(p: Pattern) -> dict[str, Operator]:
    """The operators a pattern names (applications, and operator arguments of definitions
    and references), by qualified name."""
    found: dict[str, Operator] = {}
    seen: set[int] = set()
    stack = [p]
    while stack:
        q = stack.pop()
        if id(q) in seen:
            continue
        seen.add(id(q))
        if isinstance(q, PApp):
            found[q.op.qualname] = q.op
        elif isinstance(q, PMu | PCall):
            for a in q.args:
                if isinstance(a, Operator):
                    found[a.qualname] = a
        stack.extend(children(q))
    return found


def from_summary(pdef: PatternDef, data: Any) -> CompiledPattern | None:
    """The compiled form of ``pdef`` that ``data`` (from :func:`summary`) describes, made
    the one ``compile_pattern(pdef)`` returns; None (nothing changed) when ``data`` is not a
    well-formed summary naming only operators of ``pdef``."""
    ops = _operators_of(pdef.body)
    ops[CONST.qualname] = CONST

    def op_of(name: Any) -> Operator | None:
        if name is None:
            return None
        return ops[name]  # KeyError: an operator the pattern does not name

    def shape(raw: Any, depth: int) -> _Shape:
        if raw is None:
            return None
        if type(raw) is not list or not raw or depth > _SHAPE_DEPTH:
            raise ValueError("not a shape")
        out = []
        for alt in raw:
            if type(alt) is not list or len(alt) != 3:
                raise ValueError("not a shape alternative")
            name, n, kids = alt
            if n is not None and (type(n) is not int or n < 0):
                raise ValueError("not an arity")
            if kids is not None:
                if type(kids) is not list or n is None or len(kids) != n:
                    raise ValueError("kids do not match the arity")
                kids = tuple(shape(k, depth + 1) for k in kids)
            out.append((op_of(name), n, kids))
        return out

    try:
        if type(data) is not dict or data.get("backend") != "machine":
            return None
        roots = data.get("root_ops")
        if roots is not None and type(roots) is not list:
            return None
        root_ops = None if roots is None else frozenset(op_of(n) for n in roots)
        pre = shape(data.get("shape"), 0)
    except (KeyError, ValueError, TypeError):
        return None
    if root_ops is not None and None in root_ops:
        return None
    cp = CompiledPattern.__new__(CompiledPattern)
    cp.pdef = pdef
    cp.root_ops = root_ops
    cp.source = ""
    cp.backend = "machine"
    cp.unique = False
    cp._shape = pre
    cp._all = cp._machine_all
    cp._first = cp._machine_first
    return _compiled.put(pdef, cp)


def compile_pattern(pdef: PatternDef) -> CompiledPattern:
    """The compiled form of ``pdef``, built once per definition object.

    Cached by identity, not by value: dataclass equality calls ``EConst(1)`` and
    ``EConst(1.0)`` equal, yet a guard such as ``str(c) == "1"`` tells them apart, so two
    equal-looking definitions may not share generated code.
    """
    return _compiled(pdef)


# ---------------------------------------------------------------------- compiled guards


def compile_guard(g: Expr) -> Callable[[Mapping[str, Any], Mapping[str, Any]], bool]:
    """``guard_holds(g, θ, φ)`` as generated Python (cached per expression object)."""
    return _compiled_guards(g)


def _compile_guard(g: Expr) -> Callable[[Mapping[str, Any], Mapping[str, Any]], bool]:
    names: set[str] = set()
    _expr_names(g, names)
    ns: dict[str, Any] = dict(_RUNTIME)
    gen = _Codegen("first", ns, itertools.count(1), dynamic=True)
    st = _State()
    lines = ["def _guard(theta, phi):"]
    for n in sorted(names):
        t, o = gen.local("t"), gen.local("o")
        st.tvars[n], st.ovars[n] = t, o
        lines.append(f"    {t} = theta.get({n!r})")
        lines.append(f"    {o} = phi.get({n!r})")
    try:
        body = gen.positive(g, st)
    except _Unsupported:
        fn = lambda theta, phi, _g=g: guard_holds(_g, theta, phi)  # noqa: E731
    else:
        lines.append(f"    return bool({body})")
        exec(compile("\n".join(gen.helpers + lines) + "\n", "<pypm-guard>", "exec"), ns)
        fn = ns["_guard"]
    return fn


_compiled_guards = _ByIdentity(_compile_guard)


def _make_env_guard(g: Expr) -> Callable[[dict, dict, Mapping[str, Any]], bool]:
    """``guard_holds(rename_expr(g, env), θ, φ)``, compiled once per guard: the machine runs
    a μ-body's guard with the body's variables standing for the names (or operators) its
    environment gives them. Rather than rename the expression at each evaluation, give the
    compiled guard views of θ and φ under its own names, read through ``env`` exactly as
    ``rename_expr`` would rename them: a name looks its renamed name up; a variable the
    environment maps to an operator keeps its own name for terms (``EAttr`` is left as it
    is) and is that operator for operator attributes."""
    names: set[str] = set()
    _expr_names(g, names)
    order = tuple(sorted(names))
    compiled = compile_guard(g)

    def holds(theta: dict, phi: dict, env: Mapping[str, Any]) -> bool:
        if not env:
            return compiled(theta, phi)
        th: dict[str, Any] = {}
        ph: dict[str, Any] = {}
        for n in order:
            new = env.get(n, n)
            if isinstance(new, str):
                th[n] = theta.get(new)
                ph[n] = phi.get(new)
            else:
                th[n] = theta.get(n)
                ph[n] = new
        return compiled(th, ph)

    return holds


_env_guard = _ByIdentity(_make_env_guard)


# ------------------------------------------------------------------------- the public API


def match_first(pdef: PatternDef, t: Any, *, budget: int | None = None) -> Match | None:
    """The reference machine's first solution for ``pdef`` at ``t``, or None.

    Its parameters are the reference's; θ leaves out the local variables bound inside
    tabled recursive calls. ``budget``: raise ``MatchBudgetError`` past that many steps."""
    sol = compile_pattern(pdef).first(t, MatchRun(budget, distinct=True))
    return None if sol is None else Match(pdef, t, sol[0], sol[1], owned=True)


def match_all(pdef: PatternDef, t: Any, *, budget: int | None = None) -> Iterator[Match]:
    """Every solution in the machine's exploration order, dropping repeated parameters."""
    seen: set[tuple[tuple[str, int], ...]] = set()
    for theta, phi, _ in compile_pattern(pdef).solutions(t, MatchRun(budget, distinct=True)):
        m = Match(pdef, t, theta, phi, owned=True)
        key = m.key()
        if key not in seen:
            seen.add(key)
            yield m


def solutions(p: Pattern, t: Any) -> Iterator[tuple[dict[str, Any], dict[str, Operator]]]:
    """Every (θ, φ) of a bare pattern in exploration order, as ``_machine.solutions``."""
    cp = compile_pattern(PatternDef("<pattern>", (), p))
    for theta, phi, _ in cp.solutions(t):
        yield theta, phi


# ------------------------------------------------------------------------------ the index

Candidate = tuple[int, PatternDef, CompiledPattern]


class Matcher:
    """Many patterns, indexed by the operator their root can have.

    ``candidates(op)`` lists, in pattern order, the patterns that can match a value whose
    operator is ``op``: those rooted at ``op`` and those whose root can be anything (a
    variable, an operator variable, or an alternate with such a branch). Finding that list
    is one dict lookup, so values no pattern can match cost almost nothing.
    """

    __slots__ = ("patterns", "compiled", "_table", "_wild")

    def __init__(self, patterns: Sequence[PatternDef]):
        self.patterns = tuple(patterns)
        self.compiled = tuple(compile_pattern(p) for p in self.patterns)
        entries = [
            (i, p, c) for i, (p, c) in enumerate(zip(self.patterns, self.compiled, strict=True))
        ]
        self._wild: tuple[Candidate, ...] = tuple(e for e in entries if e[2].root_ops is None)
        table: dict[Operator, list[Candidate]] = {}
        for e in entries:
            for op in e[2].root_ops or ():
                table.setdefault(op, []).append(e)
        self._table: dict[Operator, tuple[Candidate, ...]] = {
            op: tuple(sorted(es + list(self._wild), key=lambda e: e[0])) for op, es in table.items()
        }

    def candidates(self, op: Operator) -> tuple[Candidate, ...]:
        """Patterns (index, definition, compiled) that can match a value of operator ``op``."""
        return self._table.get(op, self._wild)

    @property
    def table(self) -> dict[Operator, tuple[Candidate, ...]]:
        """The index itself: operator -> candidates (operators not in it get the wildcards)."""
        return self._table

    @property
    def wildcards(self) -> tuple[Candidate, ...]:
        return self._wild

    def match_first(self, value: Any) -> tuple[int, Match] | None:
        """The first pattern (in order) matching ``value``, with its first match."""
        for i, pdef, cp in self._table.get(value.op, self._wild):
            sol = cp.first(value)
            if sol is not None:
                return i, Match(pdef, value, sol[0], sol[1], owned=True)
        return None

    def match_all(self, value: Any) -> Iterator[tuple[int, Match]]:
        """Every pattern's every match at ``value``: patterns in order, matches in order."""
        for i, pdef, _ in self._table.get(value.op, self._wild):
            for m in match_all(pdef, value):
                yield i, m

    def scan(self, values: Any) -> list[tuple[Any, int, Match]]:
        """The first match of each value (a Graph's values or any iterable of terms)."""
        nodes = getattr(values, "nodes", None)
        if callable(nodes):
            values = [v for n in nodes() for v in n.outputs]
        get = self._table.get
        wild = self._wild
        found = []
        for v in values:
            cands = get(v.op, wild)
            if not cands:
                continue
            for i, pdef, cp in cands:
                sol = cp._first(v)
                if sol is not None:
                    found.append((v, i, Match(pdef, v, sol[0], sol[1], owned=True)))
                    break
        return found
