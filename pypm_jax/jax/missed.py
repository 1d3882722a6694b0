""" "Why not": the attention-like and GEMM+activation-like sites of a program that no rule
rewrote, each with the deepest check that stopped the rules, in words.

A site is found by its shape in the rewritten program, whatever the spelling: *attention-like*
is a ``dot_general`` of matrices whose operand comes, through elementwise ops, reductions and
products with vectors (a head mask), from an ``exp`` normalized by a ``reduce_sum`` (a softmax)
of another such ``dot_general``;
*GEMM+activation-like* is a ``dot_general`` whose value reaches a nonlinear pointwise op
(``tanh``, ``logistic``, ``erf``, ``max``, ...) through a few elementwise ops. Sites the rules
rewrote are gone from the rewritten program, so every site found was missed.

Each missed site is explained with :func:`pm.explain`'s machinery for every rule at every
value near the site where the rule's pattern can start; the attempt that got furthest (a
pattern that matched but whose rule refused, before any partial match; then the longest
partial match) names the rule and its failure: the guard function's own words where it gives
them (a :class:`~pypm_jax.Refusal`: "head dim 300 outside the supported range [1, 256]"),
else the guard or operator mismatch as ``pm.explain`` prints it.
"""

from __future__ import annotations

__all__ = ["MissedSite", "MissedReport", "missed_sites"]

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.calculus import RuleDef
from ..core.errors import SourceLoc
from ..core.graph import Graph, Node, Value
from ..engine.explain import Attempt, _attempt, _rule_attempt
from ..engine.fast import admits, root_set
from ..engine.report import short_path
from ..engine.rewrite import printable
from .lift import LiftedProgram

# Elementwise ops a softmax or an activation is made of, between the sites' anchors.
_NONLINEAR = frozenset({"tanh", "logistic", "erf", "erfc", "max", "exp", "log1p", "log"})
_THROUGH = frozenset(
    {
        "add", "sub", "mul", "div", "neg", "max", "min", "exp", "log", "tanh", "logistic",
        "erf", "erfc", "integer_pow", "pow", "sqrt", "rsqrt", "convert_element_type",
        "broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "select_n",
        "stop_gradient", "reduce_max", "reduce_sum", "copy", "copy_p", "pjit", "custom_jvp_call",
    }
)  # fmt: skip
_REACH = 24  # how many nodes a backward walk from the values' dot_general may visit
_ACT_HOPS = 3  # how many elementwise ops may stand between a GEMM and its activation
_NEAR = 4  # how far from a site's anchors a rule's root may be


@dataclass(frozen=True)
class MissedSite:
    """One site no rule rewrote: ``kind`` (``attention`` or ``gemm``), the anchor node (the
    values' ``dot_general`` of an attention, the GEMM's ``dot_general``), where the program
    wrote it, and why: the ``rule`` that got furthest and its ``reason``."""

    kind: str
    node: int
    source: SourceLoc | None
    module_path: str | None
    rule: str | None
    reason: str
    attempt: Attempt | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        where = f"{short_path(self.source.file)}:{self.source.line}" if self.source else "?"
        module = f" [{self.module_path}]" if self.module_path else ""
        rule = f" (rule {self.rule})" if self.rule else ""
        return printable(f"{self.kind} at {where}{module}: {self.reason}{rule}")


class MissedReport(list[MissedSite]):
    """The missed sites in program order (outer program first, then scan/while/cond bodies);
    ``str()`` is one line per site."""

    def __str__(self) -> str:
        if not self:
            return (
                "no missed sites: every attention-like and GEMM+activation-like site was rewritten"
            )
        return "\n".join(str(s) for s in self)

    def to_dict(self) -> list[dict[str, Any]]:
        return [
            {
                "kind": s.kind,
                "module": s.module_path,
                "source": None
                if s.source is None
                else {"file": short_path(s.source.file), "line": s.source.line},
                "rule": s.rule,
                "reason": s.reason,
            }
            for s in self
        ]


# ----------------------------------------------------------------------------- sites


def _producers(n: Node) -> Iterator[Node]:
    for v in n.inputs:
        if v.node.inputs or v.node.op.name not in ("leaf", "const"):
            yield v.node


def _users(g: Graph, n: Node) -> Iterator[Node]:
    for v in n.outputs:
        yield from g.users(v)


def _contraction(n: Node) -> bool:
    """A ``dot_general`` of two matrices or more: a GEMM or an attention product (a product
    with a vector, such as a per-head mask ``einsum("bhqk,h->bhqk")``, only scales)."""
    return (
        n.op.name == "dot_general"
        and n.op.namespace == "jax"
        and all(v.shape is not None and len(v.shape) >= 2 for v in n.inputs)
    )


def _softmax_source(d2: Node) -> Node | None:
    """The scores' ``dot_general`` behind the softmax one of ``d2``'s operands is, or None."""
    seen: set[int] = set()
    ops: set[str] = set()
    stack = list(_producers(d2))
    while stack and len(seen) < _REACH:
        n = stack.pop()
        if n.id in seen:
            continue
        seen.add(n.id)
        name = n.op.name
        if _contraction(n):
            if {"exp", "reduce_sum"} <= ops:
                return n
            continue
        if name in _THROUGH or name == "dot_general":
            ops.add(name)
            stack.extend(_producers(n))
    return None


def _activation(g: Graph, d: Node) -> Node | None:
    """The nonlinear pointwise op ``d``'s value reaches through a few elementwise ops."""
    frontier, seen = [d], {d.id}
    for _ in range(_ACT_HOPS):
        nxt = []
        for n in frontier:
            for u in _users(g, n):
                if u.id in seen or u.op.name not in _THROUGH:
                    continue
                if u.op.name in _NONLINEAR:
                    return u
                seen.add(u.id)
                nxt.append(u)
        frontier = nxt
    return None


def _sites(g: Graph) -> list[tuple[str, Node, list[Node]]]:
    """(kind, anchor, starts) of the attention-like and GEMM+activation-like sites: the
    anchor is the site's (values') ``dot_general``; a rule for the site starts at a start
    or below it (the values' ``dot_general``, the activation)."""
    dots = [n for n in g.nodes() if _contraction(n)]
    out: list[tuple[str, Node, list[Node]]] = []
    in_attention: set[int] = set()
    for d2 in dots:
        d1 = _softmax_source(d2)
        if d1 is not None:
            out.append(("attention", d2, [d2]))
            in_attention |= {d1.id, d2.id}
    for d in dots:
        if d.id not in in_attention and (act := _activation(g, d)) is not None:
            out.append(("gemm", d, [act]))
    return sorted(out, key=lambda s: s[1].id)


def _near(g: Graph, anchors: Sequence[Node]) -> list[Value]:
    """The values a rule for the site may start at: the anchors and what reads them, up to
    a few elementwise ops away."""
    seen = {n.id: n for n in anchors}
    frontier = list(anchors)
    for _ in range(_NEAR):
        frontier = [u for n in frontier for u in _users(g, n) if u.id not in seen]
        for u in frontier:
            seen[u.id] = u
    return [v for n in seen.values() for v in n.outputs]


# ------------------------------------------------------------------------------ why not


def _rank(a: Attempt) -> tuple[int, int]:
    return (a.pattern_match is not None, a.depth)


def _why(rules: Sequence[RuleDef], g: Graph, anchors: Sequence[Node]) -> tuple[Any, Attempt | None]:
    """The rule that got furthest near the site and its attempt (None: no rule can start)."""
    best: tuple[RuleDef, Attempt] | None = None
    values = _near(g, anchors)
    for rule in rules:
        roots = root_set(rule.pattern)
        for v in values:
            if not admits(roots, v.op, len(v.node.inputs)):
                continue
            a = _rule_attempt(rule, _attempt(rule.pattern, v, 200_000), g)
            if a.matched:
                return rule, a  # it would fire now: another rule's rewrite stood in its way
            if best is None or _rank(a) > _rank(best[1]):
                best = (rule, a)
    return best if best is not None else (None, None)


def _reason(rule: RuleDef | None, a: Attempt | None) -> str:
    if rule is None or a is None:
        return "no rule starts at an operator of this site"
    if a.matched:
        return "the rule matches here now, but did not fire (another rewrite came first)"
    f = a.failure
    if f is None:
        return "no match"
    if f.reason:
        return f.reason
    text = f.message.split("\n", 1)[0]
    for prefix, instead in ((f"rule {rule.name}: ", ""), (f"rule {rule.name} ", "the rule ")):
        if text.startswith(prefix):
            text = instead + text[len(prefix) :]
    if f.loc is not None:
        text += f" ({short_path(f.loc.file)}:{f.loc.line})"
    return text


def _graphs(prog: LiftedProgram | Graph) -> Iterator[Graph]:
    """The program's graph, then its scan/while/cond bodies', depth first."""
    stack: list[Any] = [prog]
    while stack:
        t = stack.pop()
        g = t.graph if isinstance(t, LiftedProgram) else t
        yield g
        bodies = []
        for node in g.nodes():
            for value in node.attrs.values():
                items = value if isinstance(value, tuple) else (value,)
                bodies.extend(b for b in items if isinstance(b, LiftedProgram))
        stack.extend(reversed(bodies))


def missed_sites(prog: LiftedProgram | Graph, rules: Iterable[RuleDef]) -> MissedReport:
    """The attention-like and GEMM+activation-like sites left in a rewritten program, each
    with why the rules did not rewrite it."""
    rules = list(rules)
    out = MissedReport()
    for g in _graphs(prog):
        for kind, anchor, anchors in _sites(g):
            rule, a = _why(rules, g, anchors)
            meta = anchor.metadata
            out.append(
                MissedSite(
                    kind=kind,
                    node=anchor.id,
                    source=anchor.loc,
                    module_path=meta.get("module_path") or None,
                    rule=None if rule is None else rule.name,
                    reason=_reason(rule, a),
                    attempt=a,
                )
            )
    return out
