"""Why a pattern does not match: the deepest partial match and what stopped it, as data.

:func:`explain` runs the matcher's iterative machine (:mod:`pypm_jax.engine.machine`) with an
observer, on the reference's transitions (definitions unfolded as :mod:`pypm_jax.semantics.machine`
unfolds them, no tabling): every action that succeeds extends the current *path* (which
sub-pattern met which term, which variable got which value, which guard held), backtracking
shortens it, and every failure is compared with the deepest one seen so far. When the search
ends without a match, the deepest failure is the explanation: an operator mismatch (expected
vs found), a guard that was false (with the guard as the user wrote it: file, line, source
text, and the attribute values it read), a variable bound to two different values, a literal
that differs, an existential never bound. The matchers run the same machine unobserved.

Explaining a *rule* goes one step further, the way the rewrite driver does: where the pattern
matches, the rule's branches are tried in order on each solution; the rule fires if a branch's
guard holds (and, for a single-use rule in a graph, nothing outside the match reads an interior
value). Where it does not fire, the failure names the first false condition of the branch that
got furthest: the ``assert`` or ``if`` as written (file, line, text) and the values it read.
"""

from __future__ import annotations

__all__ = ["Attempt", "Explanation", "Failure", "Step", "explain"]

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..core.calculus import (
    EAnd,
    EAttr,
    ECall,
    EOpAttr,
    Expr,
    PApp,
    Pattern,
    PatternDef,
    PConst,
    PFunVar,
    PVar,
    RuleBranch,
    RuleDef,
    expr_children,
    show,
    show_expr,
)
from ..core.errors import MatchBudgetError, SourceLoc
from ..core.graph import Graph, Value
from ..core.match import Match
from ..core.terms import CONST, LEAF, Operator
from ..semantics.guards import Refusal, Undefined, eval_expr, guard_holds
from .fast import MatchRun, admits, root_set, show_roots
from .machine import _observed
from .rewrite import _Driver
from .select import match_all

_WIDTH = 72


def _clip(text: str, width: int = _WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _shown(p: Pattern, width: int) -> str:
    """``p`` shown, clipped to ``width`` (rendering only what is shown)."""
    return _clip(show(p, width), width)


def describe(t: Any) -> str:
    """A short description of a term or graph value, with its type and source line."""
    if isinstance(t, Value):
        node = t.node
        if node.op is LEAF and not node.inputs:
            return f"input {t.name}"
        if node.op is CONST:
            return f"{t.name} = const {node.attrs.get('value')!r}"
        args = ", ".join(v.name for v in node.inputs)
        ty = "?" if t.dtype is None else t.dtype.name
        ty += "[?]" if t.shape is None else "[" + ",".join(map(str, t.shape)) + "]"
        where = f" @ {node.loc}" if node.loc is not None else ""
        return f"{t.name} = {node.op.name}({args}) : {ty}{where}"
    return _clip(_term_text(t, 3))


def _term_text(t: Any, depth: int) -> str:
    """A term printed to a bounded depth (``repr`` would walk all of a deep term)."""
    if t.op is LEAF and not t.inputs:
        return str(t.attrs.get("name"))
    if t.op is CONST and not t.inputs:
        return repr(t.attrs.get("value"))
    if depth == 0:
        return f"{t.op.name}(…)"
    args = ", ".join(_term_text(x, depth - 1) for x in t.inputs)
    idx = f"#{t.index}" if t.op.n_out > 1 else ""
    return f"{t.op.name}({args}){idx}"


# ------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class Step:
    """One successful action of the partial match."""

    kind: str  # "match", "bind", "same", "guard", "check", "constraint"
    fragment: Any  # the sub-pattern (or guard expression) involved
    term: Any  # the term it met (None for guards and checks)
    text: str  # the step rendered

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True, slots=True)
class Failure:
    """What stopped the deepest partial match."""

    kind: str  # op_mismatch, arity_mismatch, index_mismatch, const_mismatch, var_conflict,
    #            opvar_conflict, opaque_operator, guard_failed, unbound, single_use
    message: str
    fragment: Any = None
    term: Any = None
    expected: Any = None
    found: Any = None
    guard: str | None = None  # the guard in the calculus' notation
    loc: SourceLoc | None = None  # where the user wrote it
    values: tuple[tuple[str, str], ...] = ()  # what the guard read: ("x.rank", "3")
    reason: str | None = None  # why, in words, where a guard function said (pm.Refusal)

    def __str__(self) -> str:
        lines = [self.message]
        if self.loc is not None:
            text = f": {self.loc.text.strip()}" if self.loc.text else ""
            lines.append(f"  written at {self.loc.file}:{self.loc.line}{text}")
        if self.values:
            lines.append("  with " + ", ".join(f"{k} = {v}" for k, v in self.values))
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Attempt:
    """The pattern (or rule) tried at one term: a match, or the deepest partial match and
    its end. For a rule whose pattern matched but which does not fire, ``pattern_match`` is
    the pattern's match, ``steps`` the conditions that held and ``failure`` the one that did
    not (or the single-use refusal)."""

    target: Any
    matched: bool
    match: Match | None = None
    steps: tuple[Step, ...] = ()
    failure: Failure | None = None
    rule: RuleDef | None = None  # the rule explained, if one was
    pattern_match: Match | None = None  # the pattern's match the rule refused

    @property
    def depth(self) -> int:
        return len(self.steps)

    def __str__(self) -> str:
        head = describe(self.target)
        if self.match is not None:
            verb = "fires at" if self.rule is not None else "matches"
            return f"{verb} {head}: {_show_bindings(self.match)}"
        if self.pattern_match is not None:
            lines = [
                f"does not fire at {head}",
                f"  the pattern matches: {_show_bindings(self.pattern_match)}",
            ]
            steps = f"conditions that hold ({len(self.steps)})"
        else:
            lines = [f"does not match {head}"]
            steps = f"deepest partial match ({len(self.steps)} steps)"
        if self.steps:
            lines.append(f"  {steps}:")
            lines += [f"    {s.text}" for s in self.steps]
        if self.failure is not None:
            fail = str(self.failure).replace("\n", "\n    ")
            lines.append(f"  then: {fail}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Explanation:
    """Per candidate term, why the pattern does (not) match; the closest first."""

    pattern: PatternDef
    attempts: tuple[Attempt, ...]
    note: str = ""
    shown: int = field(default=3, compare=False)
    rule: RuleDef | None = None  # the rule explained (its pattern is ``pattern``)

    @property
    def matched(self) -> bool:
        return any(a.matched for a in self.attempts)

    @property
    def best(self) -> Attempt | None:
        """The attempt that got furthest (a match if there is one)."""
        return self.attempts[0] if self.attempts else None

    def __str__(self) -> str:
        where = f" ({self.pattern.loc})" if self.pattern.loc is not None else ""
        lines = [f"pattern {self.pattern.name}{where}"]
        if self.rule is not None:
            at = f" ({self.rule.loc})" if self.rule.loc is not None else ""
            lines = [f"rule {self.rule.name}{at} for {lines[0]}"]
        if self.note:
            lines.append(self.note)
        for a in self.attempts[: self.shown]:
            lines.append(str(a))
        rest = len(self.attempts) - self.shown
        if rest > 0:
            lines.append(f"... and {rest} more candidate(s) that got less far")
        return "\n".join(lines)


def _show_binding(v: Any) -> str:
    return v.name if isinstance(v, Operator) else describe(v)


def _show_bindings(m: Match) -> str:
    return ", ".join(f"{k} = {_show_binding(v)}" for k, v in m.items())


# ------------------------------------------------------------------------------ the tracer


def _guard_reads(g: Expr) -> list[Expr]:
    """The attribute reads of a guard (``x.rank``, ``F.op_class``) and the calls inside it
    (``attention_plan(...)`` in ``attention_supported(attention_plan(...))``), in order,
    each once."""
    out: list[Expr] = []
    stack = [g]
    while stack:
        e = stack.pop()
        if (isinstance(e, ECall) and e is not g or isinstance(e, EAttr | EOpAttr)) and e not in out:
            out.append(e)
        stack.extend(reversed(expr_children(e)))
    return out


def _read(e: Expr, theta: dict, phi: dict) -> str:
    try:
        return repr(eval_expr(e, theta, phi))
    except Undefined as exc:
        return f"undefined ({exc})"


def _reads(g: Expr, theta: dict, phi: dict) -> tuple[tuple[str, str], ...]:
    """What a false guard read, as (expression, value) pairs; a call is named, not shown."""
    return tuple(
        (f"{e.fn.name}(…)" if isinstance(e, ECall) else show_expr(e), _read(e, theta, phi))
        for e in _guard_reads(g)
    )


class _Tracer:
    """The machine's observer (:class:`pypm_jax.engine.machine.Observer`): the current path
    of successful steps, and the deepest failure seen."""

    def __init__(self) -> None:
        self.path: list[Step] = []
        self.marks: list[int] = []  # the path's length at each backtrack point
        self.best_depth = -1
        self.best: tuple[tuple[Step, ...], Failure] | None = None

    def choice(self) -> None:
        self.marks.append(len(self.path))

    def backtrack(self) -> None:
        del self.path[self.marks.pop() :]

    def record(self, failure: Failure) -> None:
        if len(self.path) > self.best_depth:
            self.best_depth = len(self.path)
            self.best = (tuple(self.path), failure)

    def step(self, kind: str, a: Any, b: Any, theta: dict, phi: dict) -> None:
        if kind == "bind":
            text = f"{a.name} := {describe(b)}"
        elif kind == "same":
            text = f"{a.name} is again {describe(b)}"
        elif kind == "match":
            shown = f"{a.value!r}" if isinstance(a, PConst) else _shown(a, 40)
            text = f"{shown}   on {describe(b)}"
        elif kind == "guard":
            self.path.append(Step("guard", a.guard, None, f"guard {show_expr(a.guard)} holds"))
            return
        elif kind == "check":
            self.path.append(Step("check", a, None, f"{a} is bound"))
            return
        else:  # constraint: the term bound to a must match b
            bound = theta[a]
            text = f"{a} ≈ {_shown(b, 48)}   on {describe(bound)}"
            self.path.append(Step("constraint", b, bound, text))
            return
        self.path.append(Step(kind, a, b, text))

    def fail(self, kind: str, a: Any, b: Any, theta: dict, phi: dict) -> None:
        if kind == "match":
            failure = _mismatch(a, b, theta, phi)
        elif kind == "guard":
            failure = Failure(
                "guard_failed",
                f"guard {show_expr(a.guard)} is false",
                fragment=a,
                guard=show_expr(a.guard),
                loc=a.loc,
                values=_reads(a.guard, theta, phi),
            )
        elif kind == "check":
            failure = Failure("unbound", f"local variable {a} was never bound")
        else:  # constraint
            failure = Failure(
                "unbound", f"{a} is unbound where {a} ≈ {_shown(b, _WIDTH)} is checked"
            )
        self.record(failure)


def _mismatch(p: Pattern, t: Any, theta: dict, phi: dict) -> Failure:
    """Why the match of ``p`` at ``t`` failed (the first check of its rule that did)."""
    if isinstance(p, PVar):
        bound = theta[p.name]
        return Failure(
            "var_conflict",
            f"{p.name} is {describe(bound)} but must also be {describe(t)}",
            fragment=p,
            term=t,
            expected=bound,
            found=t,
        )
    if isinstance(p, PApp):
        if t.op is not p.op:
            return Failure(
                "op_mismatch",
                f"expected {p.op.name}, found {t.op.name}: {describe(t)}",
                fragment=p,
                term=t,
                expected=p.op,
                found=t.op,
            )
        if t.index != p.index:
            return Failure(
                "index_mismatch",
                f"expected output {p.index} of {p.op.name}, found output {t.index}",
                fragment=p,
                term=t,
                expected=p.index,
                found=t.index,
            )
        return Failure(
            "arity_mismatch",
            f"expected {p.op.name} with {len(p.args)} inputs, found {len(t.inputs)}",
            fragment=p,
            term=t,
            expected=len(p.args),
            found=len(t.inputs),
        )
    if isinstance(p, PConst):
        return Failure(
            "const_mismatch",
            f"expected the literal {p.value!r}, found {describe(t)}",
            fragment=p,
            term=t,
            expected=p.value,
            found=t,
        )
    assert isinstance(p, PFunVar)  # (the machine reports no other failed match)
    f = t.op
    if not f.pure:  # SEMANTICS 11: opaque operators are outside the range of F
        return Failure(
            "opaque_operator",
            f"{p.var} ranges over pure operators only; {describe(t)} applies the "
            f"opaque operator {f.name}",
            fragment=p,
            term=t,
            found=f,
        )
    if len(t.inputs) != len(p.args) or (p.n_out is not None and f.n_out != p.n_out):
        return Failure(
            "arity_mismatch",
            f"{p.var} takes {len(p.args)} inputs, found {f.name} with "
            f"{len(t.inputs)}: {describe(t)}",
            fragment=p,
            term=t,
            expected=len(p.args),
            found=len(t.inputs),
        )
    if t.index != p.index:
        return Failure(
            "index_mismatch",
            f"expected output {p.index}, found output {t.index}",
            fragment=p,
            term=t,
        )
    bound = phi[p.var]
    return Failure(
        "opvar_conflict",
        f"{p.var} is {bound.name} but {describe(t)} applies {f.name}",
        fragment=p,
        term=t,
        expected=bound,
        found=f,
    )


def _attempt(pdef: PatternDef, t: Any, budget: int) -> Attempt:
    """The matcher's machine run at ``t``, observed: its first solution, or its deepest
    partial match and the failure that ended it."""
    tracer = _Tracer()
    try:
        sol = next(_observed()(pdef.body, t, run=MatchRun(budget + 1), observer=tracer), None)
    except MatchBudgetError:
        tracer.record(Failure("budget", f"gave up after {budget} steps"))
        sol = None
    if sol is not None:
        return Attempt(t, True, Match(pdef, t, sol[0], sol[1]))
    steps, failure = tracer.best if tracer.best is not None else ((), None)
    return Attempt(t, False, None, steps, failure)


# ------------------------------------------------------------------------------- rules


def _conditions(b: RuleBranch) -> list[tuple[Expr, SourceLoc | None]]:
    """A branch's conditions in the order the body tested them, each with where it was
    written (``guard_locs``; the branch's own location where those are missing)."""
    g, locs = b.guard, b.guard_locs
    if len(locs) == 1:
        return [(g, locs[0])]
    if isinstance(g, EAnd) and len(locs) == len(g.items):
        return list(zip(g.items, locs, strict=True))
    items = g.items if isinstance(g, EAnd) else (g,)
    return [(c, b.loc) for c in items]


def _first_false(e: Expr, theta: dict, phi: dict) -> Expr:
    """Inside a false condition ``a and b``, the first conjunct that is false."""
    while isinstance(e, EAnd):
        item = next((i for i in e.items if not guard_holds(i, theta, phi)), None)
        if item is None:
            break
        e = item
    return e


def _refusal(rule: RuleDef, m: Match, theta: dict, phi: dict) -> tuple[tuple[Step, ...], Failure]:
    """Why no branch of ``rule`` holds on this solution: the branch whose conditions held
    the longest (the first of those), and its first false condition."""
    best: tuple[tuple[Step, ...], Expr, SourceLoc | None] | None = None
    for b in rule.branches:
        held: list[Step] = []
        for cond, loc in _conditions(b):
            if not guard_holds(cond, theta, phi):
                if best is None or len(held) > len(best[0]):
                    best = (tuple(held), cond, loc)
                break
            at = f" (line {loc.line})" if loc is not None else ""
            held.append(Step("guard", cond, None, f"{show_expr(cond)} holds{at}"))
    if best is None:  # (each condition holds alone: cannot be; show the first guard whole)
        best = ((), rule.branches[0].guard, rule.branches[0].loc)
    steps, cond, loc = best
    false = _first_false(cond, theta, phi)
    reads = _reads(false, theta, phi)
    several = f" (no branch of {len(rule.branches)} applies)" if len(rule.branches) > 1 else ""
    reason = _reason(false, theta, phi)
    because = f": {reason}" if reason is not None else ""
    failure = Failure(
        "guard_failed",
        f"rule {rule.name}: guard {_clip(show_expr(false))} is false{several}{because}",
        fragment=false,
        term=m.root,
        guard=show_expr(false),
        loc=loc,
        values=reads,
        reason=reason,
    )
    return steps, failure


def _reason(e: Expr, theta: dict, phi: dict) -> str | None:
    """The words of a false guard that is a guard function's :class:`Refusal`, else None."""
    try:
        value = eval_expr(e, theta, phi)
    except Undefined:
        return None
    return value.reason if isinstance(value, Refusal) else None


def _single_use_refusal(rule: RuleDef, driver: _Driver, root: Value, region: list) -> Failure:
    """The driver refused a single-use rule here: name what outside the match reads."""
    inside = {n.id for n in region}
    outputs = {id(v) for v in driver.g._outputs}
    shared = [
        v
        for n in region
        for v in n.outputs
        if v is not root
        and not driver.constant_only(n)
        and (id(v) in outputs or any(u.id not in inside for u in v.readers))
    ]
    names = ", ".join(v.name for v in shared) or "an interior value"
    return Failure(
        "single_use",
        f"rule {rule.name} is single-use, but {names} inside the match is also read outside it",
        term=root,
        loc=rule.loc,
    )


def _rule_attempt(rule: RuleDef, a: Attempt, graph: Graph | None) -> Attempt:
    """The rule at a term where its pattern matched: each solution in the machine's order,
    each branch in order, as the rewrite driver tries them."""
    if not a.matched:
        return Attempt(a.target, False, None, a.steps, a.failure, rule)
    pdef, t = rule.pattern, a.target
    driver = None
    if rule.single_use and graph is not None:
        driver = _Driver(graph, (rule,), "reference", 0)
        sols: Any = driver.reference_solutions(pdef, t)
    else:
        sols = ((m.theta, m.phi, ()) for m in match_all(pdef, t, engine="reference"))
    first: Attempt | None = None
    for theta, phi, struct in sols:
        m = Match(pdef, t, theta, phi)
        b = next((b for b in rule.branches if guard_holds(b.guard, theta, phi)), None)
        if b is None:
            steps, failure = _refusal(rule, m, theta, phi)
        elif driver is not None and not driver.single_use_ok(t, region := driver.region(t, struct)):
            steps, failure = (), _single_use_refusal(rule, driver, t, region)
        else:
            return Attempt(t, True, m, rule=rule)
        if first is None:
            first = Attempt(t, False, None, steps, failure, rule, m)
    assert first is not None  # the pattern matched, so there is a solution
    return first


def explain(
    target_def: PatternDef | RuleDef, target: Any, *, shown: int = 3, budget: int = 1_000_000
) -> Explanation:
    """Why a pattern does (not) match ``target`` (a term, a graph value, or a whole graph),
    or why a rule does (not) fire there.

    For a graph, every value whose operator the pattern's root can have is a candidate; the
    attempts come sorted: matches (the rule fires) first, then places where the pattern
    matched but the rule did not fire, then by how far the match got.
    """
    rule = target_def if isinstance(target_def, RuleDef) else None
    pdef = rule.pattern if rule is not None else target_def
    if not isinstance(target, Graph):
        a = _attempt(pdef, target, budget)
        if rule is not None:
            graph = target.node._graph if isinstance(target, Value) else None
            a = _rule_attempt(rule, a, graph)
        return Explanation(pdef, (a,), shown=shown, rule=rule)
    roots = root_set(pdef)
    values: Iterable[Value] = (
        v for n in target.nodes() if admits(roots, n.op, len(n.inputs)) for v in n.outputs
    )
    attempts = [_attempt(pdef, v, budget) for v in values]
    n_pattern = sum(a.matched for a in attempts)
    if rule is not None:
        attempts = [_rule_attempt(rule, a, target) for a in attempts]
    order = sorted(
        range(len(attempts)),
        key=lambda i: (
            not attempts[i].matched,
            attempts[i].pattern_match is None,
            -attempts[i].depth,
            i,
        ),
    )
    note = ""
    if not attempts:
        note = (
            f"no node of the graph applies {show_roots(roots)}, the operator(s) the pattern "
            "starts with"
        )
    elif rule is None:
        note = f"{len(attempts)} candidate node(s), {n_pattern} match(es)"
    else:
        n_fire = sum(a.matched for a in attempts)
        note = (
            f"{len(attempts)} candidate node(s), {n_pattern} pattern match(es), "
            f"the rule fires at {n_fire}"
        )
    return Explanation(pdef, tuple(attempts[i] for i in order), note, shown, rule)
