"""The paper's declarative semantics: a checker for ``p @ ⟨θ, φ⟩ ≈ t``.

This module transcribes the appendix figure "Declarative Semantics" (rules P-*) as a
recursive predicate. It is the specification the matchers are tested against, written for
clarity, not speed: the nondeterminism of the rules becomes exhaustive search, and the
check recurses on the Python stack, so it is meant for the small terms of tests.

Two rules invent a value from nowhere. P-Exists needs a witness t' for ``∃x. p``; the checker
searches the *candidate terms*: every subterm of the matched term and of the terms in the
initial θ (for an operator variable, every operator of those terms and of φ). That search is
exact for the patterns our matchers accept, where an existential is bound by matching it
against part of a term; a witness that no variable pattern ever meets could be any term,
which no finite search can enumerate. P-Alt-1/2 become "either alternate holds".

Bound variable names are assumed distinct from each other and from the free variables (the
frontend and :func:`pypm_jax.semantics.subst.unfold` guarantee it); an inner ``∃x`` shadows.
"""

from __future__ import annotations

__all__ = ["holds", "holds_def", "candidate_terms", "candidate_ops"]

from collections.abc import Iterable, Mapping
from typing import Any

from ..core.calculus import (
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
from ..core.errors import PatternDefinitionError
from ..core.terms import Operator, const_equal
from .guards import guard_holds
from .subst import FreshNames, unfold


def candidate_terms(roots: Iterable[Any]) -> list[Any]:
    """Every subterm of ``roots`` (each shared node once), in first-visit order."""
    seen: set[int] = set()
    out: list[Any] = []
    todo = list(roots)
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append(t)
        todo.extend(reversed(t.inputs))
    return out


def candidate_ops(terms: Iterable[Any], extra: Iterable[Operator] = ()) -> list[Operator]:
    """The distinct operators of ``terms`` followed by those in ``extra``."""
    out: dict[int, Operator] = {}
    for op in [*(t.op for t in terms), *extra]:
        out.setdefault(id(op), op)
    return list(out.values())


class _Checker:
    """``p @ ⟨θ, φ⟩ ≈ t`` over a fixed universe of witnesses."""

    def __init__(self, terms: list[Any], ops: list[Operator]) -> None:
        self.terms = terms
        self.ops = ops
        self.fresh = FreshNames()

    def holds(
        self, p: Pattern, t: Any, theta: Mapping[str, Any], phi: Mapping[str, Operator]
    ) -> bool:
        match p:
            case PVar(x):  # P-Var
                return theta.get(x) is t
            case PApp(f, args, index):  # P-Fun
                return (
                    t.op is f
                    and t.index == index
                    and len(t.inputs) == len(args)
                    and self.each(args, t.inputs, theta, phi)
                )
            case PConst(value):  # a literal is a 0-ary symbol (P-Fun with n = 0)
                return const_equal(value, t)
            case PAlt(left, right):  # P-Alt-1, P-Alt-2
                return self.holds(left, t, theta, phi) or self.holds(right, t, theta, phi)
            case PGuard(pat, g):  # P-Guard
                return self.holds(pat, t, theta, phi) and guard_holds(g, theta, phi)
            case PExists(x, body, "op"):  # P-Exists, for an operator variable
                return any(self.holds(body, t, theta, {**phi, x: f}) for f in self.ops)
            case PExists(x, body, _):  # P-Exists
                return any(self.holds(body, t, {**theta, x: w}, phi) for w in self.terms)
            case PConstr(pat, x, constraint):  # P-MatchConstr
                bound = theta.get(x)
                return (
                    bound is not None
                    and self.holds(pat, t, theta, phi)
                    and self.holds(constraint, bound, theta, phi)
                )
            case PFunVar(var, args, index, n_out):  # P-Fun-Var
                f = phi.get(var)
                return (
                    f is not None
                    and t.op is f
                    and f.pure  # opaque/effectful operators are outside Σ for F
                    and t.index == index
                    and (n_out is None or f.n_out == n_out)
                    and len(t.inputs) == len(args)
                    and self.each(args, t.inputs, theta, phi)
                )
            case PMu() as mu:  # P-Mu
                return self.holds(unfold(mu, self.fresh), t, theta, phi)
            case PCall() as call:
                raise PatternDefinitionError(
                    f"recursive reference {show(call)} outside a definition μ{call.name}"
                )
        raise TypeError(f"not a pattern: {p!r}")

    def each(
        self, pats: tuple[Pattern, ...], terms: tuple[Any, ...], theta: Mapping, phi: Mapping
    ) -> bool:
        """``∀i. pᵢ @ ⟨θ, φ⟩ ≈ tᵢ`` (the premise of P-Fun and P-Fun-Var)."""
        return all(self.holds(p, t, theta, phi) for p, t in zip(pats, terms, strict=True))


def holds(
    p: Pattern,
    t: Any,
    theta: Mapping[str, Any] | None = None,
    phi: Mapping[str, Operator] | None = None,
) -> bool:
    """Is ``p @ ⟨θ, φ⟩ ≈ t`` derivable by the rules P-*?

    ``theta`` and ``phi`` bind the free variables of ``p`` (a pattern definition's
    parameters); existentials inside ``p`` are searched among the candidate terms.
    """
    theta = dict(theta or {})
    phi = dict(phi or {})
    terms = candidate_terms([t, *theta.values()])
    return _Checker(terms, candidate_ops(terms, phi.values())).holds(p, t, theta, phi)


def holds_def(pdef: PatternDef, t: Any, bindings: Mapping[str, Any]) -> bool:
    """``holds`` for a pattern definition, its parameters bound by name.

    An operator parameter takes an :class:`Operator`; a parameter left out is unbound.
    """
    kinds = {p.name: p.kind for p in pdef.params}
    theta: dict[str, Any] = {}
    phi: dict[str, Operator] = {}
    for name, value in bindings.items():
        kind = kinds.get(name)
        if kind is None:
            raise ValueError(f"{pdef.name} has no parameter {name!r}")
        if kind == "op":
            if not isinstance(value, Operator):
                raise TypeError(f"operator parameter {name} bound to {value!r}")
            phi[name] = value
        else:
            theta[name] = value
    return holds(pdef.body, t, theta, phi)
