"""Hypothesis strategies for random *closed* items of the calculus: pattern definitions
(every construct, lexically scoped, recursion under applications), rules and operators,
with random literals and source locations. Complements ``pypm_testing.strategies`` (which builds
patterns by abstracting terms, for matching) with what the format must carry: all literal
kinds, all expression kinds, locations, rules, operator items.
"""

from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

from pypm_jax.core.calculus import (
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
    PAlt,
    PApp,
    Param,
    PatternDef,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    RApp,
    RConst,
    RTuple,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax.core.dtypes import DTYPES
from pypm_jax.core.errors import SourceLoc
from pypm_jax.core.terms import OpClass
from pypm_jax.lang.registry import GUARD_FNS
from pypm_jax.semantics.guards import MAX_EXPONENT, power_problem
from pypm_testing.format_samples import FRESH, OPS

ALL_OPS = (*OPS, FRESH)
TERM_NAMES = ("x", "y", "z", "w", "μ", "a#1")
OP_NAMES = ("F", "G", "H")

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(10**60), max_value=10**60),
    st.floats(allow_nan=False),
    st.just(math.nan),
    st.text(max_size=8),
    st.sampled_from(list(DTYPES.values())),
    st.builds(OpClass, st.text(min_size=1, max_size=6)),
    st.sampled_from(ALL_OPS),
)
literals = st.recursive(
    scalars, lambda inner: st.tuples() | st.lists(inner, max_size=3).map(tuple), max_leaves=8
)
locs = st.none() | st.builds(
    SourceLoc, st.text(max_size=10), st.integers(min_value=0, max_value=10**6), st.text(max_size=10)
)
# Strategies are built once: the generators draw thousands of times, and building (and
# validating) a strategy at each draw costs more than the draw. The draws are the same.
loc_lists = st.lists(locs, max_size=3)
n_outs = st.none() | st.integers(1, 3)
param_names = st.lists(st.sampled_from(TERM_NAMES + OP_NAMES), unique=True, max_size=3)
_PICKS: dict[tuple[Any, ...], Any] = {}
_SUBSETS: dict[tuple[Any, ...], Any] = {}


def pick(choices: Any) -> Any:
    """``st.sampled_from(choices)``, built once per sequence of choices."""
    key = tuple(choices)
    found = _PICKS.get(key)
    if found is None:
        found = _PICKS[key] = st.sampled_from(key)
    return found


def subset(choices: tuple[Any, ...]) -> Any:
    """``st.lists(st.sampled_from(choices), unique=True)``, built once per ``choices``."""
    found = _SUBSETS.get(choices)
    if found is None:
        found = _SUBSETS[choices] = st.lists(st.sampled_from(choices), unique=True)
    return found


def exprs(draw: Any, scope: list[str], depth: int) -> Any:
    choices = ["const"] + (["attr", "op_attr"] if scope else [])
    if depth > 0:
        choices += ["index", "bin", "unary", "cmp", "and", "or", "not", "call", "tuple"]
    kind = draw(pick(choices))
    sub = lambda: exprs(draw, scope, depth - 1)  # noqa: E731
    many = lambda: tuple(sub() for _ in range(draw(st.integers(0, 3))))  # noqa: E731
    match kind:
        case "const":
            return EConst(draw(literals))
        case "attr":
            return EAttr(
                draw(pick(scope)),
                draw(pick(["rank", "shape", "dtype", "stride"])),
            )
        case "op_attr":
            return EOpAttr(draw(pick(scope)), draw(pick(["op_class", "name"])))
        case "index":
            return EIndex(sub(), sub())
        case "bin":
            op = draw(pick(["+", "-", "*", "/", "//", "%", "**"]))
            left, right = sub(), sub()
            if op == "**" and power_problem(right) is not None:
                # the format refuses constant exponents beyond MAX_EXPONENT: valid items only
                right = EConst(draw(st.integers(-MAX_EXPONENT, MAX_EXPONENT)))
            return EBin(op, left, right)
        case "unary":
            return EUnary(draw(pick(["-", "+"])), sub())
        case "cmp":
            ops = ["==", "!=", "<", "<=", ">", ">=", "in", "not in"]
            return ECmp(draw(pick(ops)), sub(), sub())
        case "and":
            return EAnd(many())
        case "or":
            return EOr(many())
        case "not":
            return ENot(sub())
        case "call":
            return ECall(
                GUARD_FNS[draw(pick(["len", "min", "max", "abs", "tests.format.is_square"]))],
                many(),
            )
        case _:
            return ETuple(many())


class _Scope:
    def __init__(self, terms: frozenset[str], ops: frozenset[str]):
        self.terms, self.ops = terms, ops

    def all(self) -> list[str]:
        return sorted(self.terms | self.ops)


def patterns(
    draw: Any, sc: _Scope, mus: tuple[tuple[str, tuple[Param, ...], bool], ...], depth: int
) -> Any:
    """A pattern closed under ``sc``; ``mus`` are enclosing μs (name, params, callable)."""
    choices = ["const"] + (["var"] if sc.terms else [])
    callable_mus = [m for m in mus if m[2] and _args_possible(sc, m[1])]
    if callable_mus:
        choices.append("call")
    if depth > 0:
        choices += ["app", "app", "alt", "guard", "exists", "exists_op", "mu"]
        if sc.terms:
            choices.append("constr")
        if sc.ops:
            choices.append("fun_var")
    kind = draw(pick(choices))
    sub = lambda s=sc, m=mus: patterns(draw, s, m, depth - 1)  # noqa: E731
    under_app = tuple((n, ps, True) for n, ps, _ in mus)
    match kind:
        case "const":
            return PConst(draw(literals))
        case "var":
            return PVar(draw(pick(sorted(sc.terms))))
        case "app":
            op = draw(pick(ALL_OPS))
            n = op.n_in if op.n_in is not None else draw(st.integers(0, 3))
            args = tuple(patterns(draw, sc, under_app, depth - 1) for _ in range(n))
            return PApp(op, args, draw(st.integers(0, op.n_out - 1)))
        case "fun_var":
            n_out = draw(n_outs)
            index = draw(st.integers(0, (n_out or 3) - 1))
            args = tuple(
                patterns(draw, sc, under_app, depth - 1) for _ in range(draw(st.integers(0, 2)))
            )
            return PFunVar(draw(pick(sorted(sc.ops))), args, index, n_out)
        case "alt":
            return PAlt(sub(), sub())
        case "guard":
            return PGuard(sub(), exprs(draw, sc.all(), 2), draw(locs))
        case "exists" | "exists_op":
            name = draw(pick(TERM_NAMES if kind == "exists" else OP_NAMES))
            inner = (
                _Scope(sc.terms | {name}, sc.ops)
                if kind == "exists"
                else _Scope(sc.terms, sc.ops | {name})
            )
            return PExists(name, sub(inner), "term" if kind == "exists" else "op")
        case "constr":
            return PConstr(sub(), draw(pick(sorted(sc.terms))), sub(), draw(locs))
        case "mu":
            params = _params(draw)
            name = f"M{depth}_{draw(st.integers(0, 2))}"
            args = _args(draw, sc, params)
            if args is None:
                return PConst(0)
            inner = _Scope(
                frozenset(p.name for p in params if p.kind == "term"),
                frozenset(p.name for p in params if p.kind == "op"),
            )
            inner_mus = (*mus, (name, params, False))
            return PMu(name, params, args, patterns(draw, inner, inner_mus, depth - 1))
        case _:  # "call"
            name, params, _ = draw(pick(callable_mus))
            # the nearest μ of that name decides the parameters
            params = next(ps for n, ps, _ in reversed(mus) if n == name)
            args = _args(draw, sc, params)
            if args is None or not next(c for n, _, c in reversed(mus) if n == name):
                return PConst(1)
            return PCall(name, args)


def _params(draw: Any) -> tuple[Param, ...]:
    names = draw(param_names)
    return tuple(Param(n, "op" if n in OP_NAMES else "term") for n in names)


def _args_possible(sc: _Scope, params: tuple[Param, ...]) -> bool:
    return all(p.kind == "op" or sc.terms for p in params)


def _args(draw: Any, sc: _Scope, params: tuple[Param, ...]) -> tuple[Any, ...] | None:
    if not _args_possible(sc, params):
        return None
    out: list[Any] = []
    for p in params:
        if p.kind == "term":
            out.append(draw(pick(sorted(sc.terms))))
        else:
            out.append(draw(pick([*sorted(sc.ops), *ALL_OPS])))
    return tuple(out)


@st.composite
def pattern_defs(draw: Any, depth: int = 4) -> PatternDef:
    params = _params(draw)
    sc = _Scope(
        frozenset(p.name for p in params if p.kind == "term"),
        frozenset(p.name for p in params if p.kind == "op"),
    )
    name = draw(pick(["P", "Q", "Attention", "μ"]))
    if draw(st.booleans()):  # the frontend's shape for recursive definitions
        body = PMu(
            name,
            params,
            tuple(p.name for p in params),
            patterns(draw, sc, ((name, params, False),), depth),
        )
    else:
        body = patterns(draw, sc, (), depth)
    alt_locs = tuple(draw(loc_lists))
    return PatternDef(name, params, body, draw(locs), alt_locs)


def rhs(draw: Any, terms: list[str], scope: list[str], depth: int) -> Any:
    choices = ["const"] + (["var"] if terms else []) + (["app", "tuple"] if depth > 0 else [])
    kind = draw(pick(choices))
    match kind:
        case "const":
            return RConst(draw(literals))
        case "var":
            return RVar(draw(pick(terms)))
        case "tuple":
            return RTuple(
                tuple(rhs(draw, terms, scope, depth - 1) for _ in range(draw(st.integers(0, 3))))
            )
        case _:
            op = draw(pick(ALL_OPS))
            n = op.n_in if op.n_in is not None else draw(st.integers(0, 3))
            names = draw(subset(op.attrs)) if op.attrs else []
            attrs = tuple((a, exprs(draw, scope, 1)) for a in names)
            args = tuple(rhs(draw, terms, scope, depth - 1) for _ in range(n))
            return RApp(op, args, attrs, draw(st.integers(0, op.n_out - 1)))


@st.composite
def rule_defs(draw: Any) -> RuleDef:
    pdef = draw(pattern_defs(depth=3))
    terms = [p.name for p in pdef.params if p.kind == "term"]
    scope = [p.name for p in pdef.params]
    branches = tuple(
        RuleBranch(
            exprs(draw, scope, 2),
            rhs(draw, terms, scope, 3),
            draw(locs),
            tuple(draw(loc_lists)),
        )
        for _ in range(draw(st.integers(1, 3)))
    )
    return RuleDef(
        draw(st.text(min_size=1, max_size=6)), pdef, branches, draw(st.booleans()), draw(locs)
    )


items = st.lists(st.one_of(pattern_defs(), rule_defs(), st.sampled_from(ALL_OPS)), max_size=4)
