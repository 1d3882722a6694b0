"""The paper's algorithmic semantics: a small-step backtracking machine.

This module transcribes the appendix figures "Algorithmic Semantics Part 1/2" of the PyPM
paper. A state is ``Running(θ, φ, stk, k)``, ``Success(θ, φ)`` or ``Failure``; the
continuation ``k`` is a list of actions and the stack ``stk`` holds backtrack nodes
``⟨θ, φ, k⟩`` saved at alternates. :func:`step` applies exactly one ST-* rule.

Everything a state holds is persistent: the continuation and the stack are cons lists
(``(head, tail)`` pairs, ``None`` for the empty list) and substitutions are dicts that are
never mutated (binding copies: ``θ ∪ {x ↦ t}``). So a stack entry is a real snapshot, as in
the figures, and backtracking is just "continue from the saved state".

Decisions the figures leave open follow ``docs/SEMANTICS.md``: ``checkName(x)`` and
``matchConstr(x, p)`` with ``x`` unbound backtrack; a literal is a 0-ary symbol matched by
``const_equal``; operator variables check arity, output index and (when given) output count.

Beside each state, outside the paper's, the machine keeps the terms its path has matched
by applications and literals (``covered``; ST-Match-Fun adds its term), so that a solution
says which terms its match covers: the rewrite driver's reference path replaces those.

The driver loop is iterative, so the depth of the term never reaches the Python stack; this
is the reference engine behind ``pypm_jax.engine.select`` (``engine="reference"``) and the
rewrite driver's ``engine="reference"``.
"""

from __future__ import annotations

__all__ = [
    "AMatch",
    "AGuard",
    "ACheckName",
    "AMatchConstr",
    "Action",
    "Cont",
    "Frame",
    "Stack",
    "Running",
    "Success",
    "Failure",
    "FAILURE",
    "State",
    "Covered",
    "initial",
    "backtrack",
    "step",
    "run",
    "successes",
    "solutions",
    "covered",
    "match_first",
    "match_all",
    "match_all_covered",
]

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from ..core.calculus import (
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
    show,
)
from ..core.errors import MatchBudgetError, PatternDefinitionError
from ..core.match import Match
from ..core.terms import Operator, const_equal
from .guards import guard_holds
from .subst import FreshNames, unfold

Subst: TypeAlias = Mapping[str, Any]
"""θ: term variables to terms. Never mutated once built."""

OpSubst: TypeAlias = Mapping[str, Operator]
"""φ: operator (function) variables to operators. Never mutated once built."""

# ------------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class AMatch:
    """``match(p, t)``: match pattern p against term t."""

    pat: Pattern
    term: Any


@dataclass(frozen=True, slots=True)
class AGuard:
    """``guard(g)``: the guard g must hold under the current θ, φ."""

    guard: Expr


@dataclass(frozen=True, slots=True)
class ACheckName:
    """``checkName(x)``: the existential x must have been bound (in θ, or φ for kind "op")."""

    var: str
    kind: Literal["term", "op"] = "term"


@dataclass(frozen=True, slots=True)
class AMatchConstr:
    """``matchConstr(x, p)``: the term bound to x must match p."""

    var: str
    pat: Pattern


Action: TypeAlias = AMatch | AGuard | ACheckName | AMatchConstr

Cont: TypeAlias = "tuple[Action, Cont] | None"
"""k ::= [] | a :: k, as nested pairs; ``None`` is the empty continuation."""


Covered: TypeAlias = "tuple[Any, Covered] | None"
"""The terms a path has matched by applications and literals, latest first, as nested
pairs: kept beside each state (not part of the paper's), so that a solution can say which
terms its match covers (the rewrite driver replaces those)."""


@dataclass(frozen=True, slots=True)
class Frame:
    """A backtrack node ⟨θ, φ, k⟩: where to resume when the current path fails."""

    theta: Subst
    phi: OpSubst
    k: Cont
    covered: Covered = field(default=None, compare=False, repr=False)


Stack: TypeAlias = "tuple[Frame, Stack] | None"
"""stk ::= · | stk, ⟨θ, φ, k⟩ as nested pairs, top first; ``None`` is the empty stack."""

# -------------------------------------------------------------------------------- states


@dataclass(frozen=True, slots=True)
class Running:
    theta: Subst
    phi: OpSubst
    stack: Stack
    k: Cont
    covered: Covered = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Success:
    """``Success(θ, φ)``. The stack at success is kept beside it (not part of the paper's
    state) so that :func:`solutions` can resume by backtracking into it."""

    theta: Subst
    phi: OpSubst
    stack: Stack = field(default=None, compare=False, repr=False)
    covered: Covered = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Failure:
    pass


FAILURE = Failure()

State: TypeAlias = Running | Success | Failure


def initial(p: Pattern, t: Any) -> Running:
    """``Running(∅, ∅, ·, [match(p, t)])``."""
    return Running({}, {}, None, (AMatch(p, t), None))


def backtrack(stk: Stack) -> Running | Failure:
    """backtrack(·) = Failure; backtrack(stk, ⟨θ, φ, k⟩) = Running(θ, φ, stk, k)."""
    if stk is None:
        return FAILURE
    frame, rest = stk
    return Running(frame.theta, frame.phi, rest, frame.k, frame.covered)


def _matches(pats: tuple[Pattern, ...], terms: tuple[Any, ...], k: Cont) -> Cont:
    """``[match(p1, t1), ..., match(pn, tn)] ++ k``."""
    for p, t in zip(reversed(pats), reversed(terms), strict=True):
        k = (AMatch(p, t), k)
    return k


# ---------------------------------------------------------------------------------- step


def step(st: Running, fresh: FreshNames) -> State:
    """One transition ``st ↦ st'`` by the ST-* rule that applies to the head of ``k``.

    ``fresh`` names the existentials of each unfolding (ST-Match-Mu); one supply serves a
    whole match run, so the names are deterministic.
    """
    theta, phi, stk, ts = st.theta, st.phi, st.stack, st.covered
    if st.k is None:
        return Success(theta, phi, stk, ts)  # ST-Success
    action, k = st.k
    match action:
        case AMatch(PVar(x), t):
            bound = theta.get(x)
            if bound is None:
                return Running({**theta, x: t}, phi, stk, k, ts)  # ST-Match-Var-Bind
            if bound is t:
                return Running(theta, phi, stk, k, ts)  # ST-Match-Var-Bound
            return backtrack(stk)  # ST-Match-Var-Conflict

        case AMatch(PApp(f, args, index), t):
            if t.op is f and t.index == index and len(t.inputs) == len(args):
                return Running(
                    theta, phi, stk, _matches(args, t.inputs, k), (t, ts)
                )  # ST-Match-Fun
            return backtrack(stk)  # ST-Match-Fun-Conflict

        case AMatch(PConst(value), t):
            # A literal is a 0-ary function symbol: ST-Match-Fun / ST-Match-Fun-Conflict.
            if const_equal(value, t):
                return Running(theta, phi, stk, k, (t, ts))
            return backtrack(stk)

        case AMatch(PAlt(p, p2), t):  # ST-Match-Alt
            saved = Frame(theta, phi, (AMatch(p2, t), k), ts)
            return Running(theta, phi, (saved, stk), (AMatch(p, t), k), ts)

        case AMatch(PGuard(p, g), t):  # ST-Match-Guard
            return Running(theta, phi, stk, (AMatch(p, t), (AGuard(g), k)), ts)

        case AGuard(g):
            if guard_holds(g, theta, phi):
                return Running(theta, phi, stk, k, ts)  # ST-CheckGuard-Continue
            return backtrack(stk)  # ST-CheckGuard-Backtrack (False or undefined)

        case ACheckName(x, kind):
            if x in (phi if kind == "op" else theta):
                return Running(theta, phi, stk, k, ts)  # ST-CheckName
            return backtrack(stk)  # unbound existential: SEMANTICS.md §3

        case AMatchConstr(x, p):
            bound = theta.get(x)
            if bound is not None:
                return Running(theta, phi, stk, (AMatch(p, bound), k), ts)  # ST-MatchConstr
            return backtrack(stk)  # unbound: SEMANTICS.md §3

        case AMatch(PExists(x, p, kind), t):  # ST-Match-Exists
            return Running(theta, phi, stk, (AMatch(p, t), (ACheckName(x, kind), k)), ts)

        case AMatch(PConstr(p, x, p2), t):  # ST-Match-MatchConstr
            return Running(theta, phi, stk, (AMatch(p, t), (AMatchConstr(x, p2), k)), ts)

        case AMatch(PFunVar(var, args, index, n_out), t):
            f = t.op
            if (
                len(t.inputs) != len(args)
                or t.index != index
                or (n_out is not None and f.n_out != n_out)
                or not f.pure  # opaque/effectful operators are outside Σ for F (SEMANTICS 11)
            ):
                return backtrack(stk)  # ST-Match-Fun-Var-Conflict (m ≠ n)
            bound = phi.get(var)
            if bound is None:  # ST-Match-Fun-Var-Bind
                return Running(theta, {**phi, var: f}, stk, _matches(args, t.inputs, k), (t, ts))
            if bound is f:  # ST-Match-Fun-Var-Bound
                return Running(theta, phi, stk, _matches(args, t.inputs, k), (t, ts))
            return backtrack(stk)  # ST-Match-Fun-Var-Conflict (φ(F) ≠ f)

        case AMatch(PMu() as mu, t):  # ST-Match-Mu
            return Running(theta, phi, stk, (AMatch(unfold(mu, fresh), t), k), ts)

        case AMatch(PCall() as call, _):
            raise PatternDefinitionError(
                f"recursive reference {show(call)} outside a definition μ{call.name}"
            )
        case AMatch(p, _):
            raise TypeError(f"not a pattern: {p!r}")
    raise TypeError(f"not a machine action: {action!r}")


# ------------------------------------------------------------------------------- driving


def _drive(st: State, fresh: FreshNames) -> Success | Failure:
    """Step until a terminal state. A loop, never recursion: depth costs heap, not stack."""
    while isinstance(st, Running):
        st = step(st, fresh)
    return st


def run(p: Pattern, t: Any) -> Success | Failure:
    """``Running(∅, ∅, ·, [match(p, t)]) ↦⁺ Success(θ, φ) | Failure``."""
    return _drive(initial(p, t), FreshNames())


def successes(p: Pattern, t: Any, budget: int | None = None) -> Iterator[Success]:
    """Every ``Success`` the machine reaches, in exploration order.

    After each success the machine resumes by backtracking into the stack saved beside it,
    which is what trying the remaining alternates means. Solutions may repeat. ``budget``:
    raise ``MatchBudgetError`` after that many transitions.
    """
    fresh = FreshNames()
    st: State = initial(p, t)
    steps = 0
    while True:
        while isinstance(st, Running):
            steps += 1
            if budget is not None and steps > budget:
                raise MatchBudgetError(
                    f"the match ran past its budget of {budget} machine steps", budget
                )
            st = step(st, fresh)
        if not isinstance(st, Success):
            return
        yield st
        st = backtrack(st.stack)


def solutions(
    p: Pattern, t: Any, budget: int | None = None
) -> Iterator[tuple[dict[str, Any], dict[str, Operator]]]:
    """Every ``(θ, φ)`` the machine reaches, in exploration order (repeats included)."""
    for s in successes(p, t, budget):
        yield dict(s.theta), dict(s.phi)


def covered(s: Success) -> tuple[Any, ...]:
    """The terms a solution's applications and literals matched, in the order matched."""
    out = []
    ts = s.covered
    while ts is not None:
        t, ts = ts
        out.append(t)
    return tuple(reversed(out))


def match_first(pdef: PatternDef, t: Any, *, budget: int | None = None) -> Match | None:
    """The machine's first solution for ``pdef`` at ``t``, or None."""
    for theta, phi in solutions(pdef.body, t, budget):
        return Match(pdef, t, theta, phi)
    return None


def match_all(pdef: PatternDef, t: Any, *, budget: int | None = None) -> Iterator[Match]:
    """Every solution in exploration order, dropping those whose parameters repeat."""
    for m, _ in match_all_covered(pdef, t, budget=budget):
        yield m


def match_all_covered(
    pdef: PatternDef, t: Any, *, budget: int | None = None
) -> Iterator[tuple[Match, tuple[Any, ...]]]:
    """``match_all`` with the terms each match covers (:func:`covered`)."""
    seen: set[tuple[tuple[str, int], ...]] = set()
    for s in successes(pdef.body, t, budget):
        m = Match(pdef, t, dict(s.theta), dict(s.phi))
        key = m.key()
        if key not in seen:
            seen.add(key)
            yield m, covered(s)
