"""Operators, terms and Hypothesis strategies shared by the engine tests.

The strategies draw random DAGs (hash-consed terms with sharing, multi-output and variadic
operators, literals, typed and untyped leaves) and random patterns that use every construct
of the calculus — alternates, guards (true, false and undefined ones; comparisons of op
classes and operators, which the root index reads), existentials, match constraints,
operator variables, calls of sub-patterns with term and operator arguments, and recursion
that consumes structure (directly and through a match constraint, with existentials that
force fresh names at each unfolding).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Iterator
from typing import Any
from unittest import mock

from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    EBin,
    ECall,
    ECmp,
    EConst,
    ENot,
    EOpAttr,
    EOr,
    ETuple,
    Expr,
    PAlt,
    PApp,
    Param,
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
)
from pypm_jax.core.dtypes import as_dtype
from pypm_jax.core.terms import OpClass, Operator, Term, const, leaf
from pypm_jax.lang.registry import GUARD_FNS
from pypm_testing.draws import BOOLS, ints, sampled

F32, I8 = as_dtype("f32"), as_dtype("i8")


def same_type(*xs: Any, **_: Any) -> tuple[Any, Any]:
    return (xs[0].shape, xs[0].dtype) if xs else ((), None)


def _split_type(x: Any, **_: Any) -> list[tuple[Any, Any]]:
    return [(x.shape, x.dtype), (x.shape, x.dtype)]


F1 = Operator("f1", 1, infer=same_type, namespace="engine_tests")
F2 = Operator("f2", 1, infer=same_type, namespace="engine_tests", op_class="unary")
G2 = Operator("g2", 2, infer=same_type, namespace="engine_tests")
H2 = Operator("h2", 2, infer=same_type, namespace="engine_tests", op_class="binary")
SPLIT = Operator("split", 1, 2, infer=_split_type, namespace="engine_tests")
CAT = Operator("cat", None, infer=same_type, namespace="engine_tests")
OPS = (F1, F2, G2, H2, SPLIT, CAT)

A = leaf("a", shape=(2, 3), dtype="f32")
B = leaf("b", shape=(3,), dtype="i8")
C = leaf("c")
HALF = const(0.5, dtype="f32")
TWO = const(2)
LEAVES = (A, B, C, HALF, TWO)


# Strategies the generators draw from, made once: a strategy object made afresh at each
# draw is validated afresh, which costs more than the draw (the same choices either way).
_OPS = st.sampled_from(OPS)
_UNARY = st.sampled_from((F1, F2))
_OP_ARGS = st.sampled_from(OPS[:4])
_CONSTS = st.sampled_from((0.5, 2, 2.0, 3))
_N_OUTS = st.sampled_from((None, 1, 2))
_LEAF_KINDS = st.sampled_from(("var", "var", "const"))
_KINDS = st.sampled_from((
    "var", "var", "const", "app", "app", "app", "alt", "alt", "guard", "exists", "constr",
    "funvar", "mu", "mu_op", "rec", "rec_constr",
))  # fmt: skip
_BRANCHY_KINDS = st.sampled_from(("def", "def", "def", "app", "constr", "guard", "leaf"))
_BRANCHY_OPS = st.sampled_from((F1, F2, G2))
_OP_SETS = st.sets(_OPS)
_CLASSES = st.sampled_from(("unary", "binary"))


@functools.cache
def _arg_lists(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(ints(0, n - 1), min_size=1, max_size=3)


# ----------------------------------------------------------------------------- random DAGs


@st.composite
def dags(draw: Any, max_nodes: int = 10) -> list[Term]:
    """A list of terms built bottom-up; later terms use earlier ones (so they share)."""
    pool: list[Term] = list(LEAVES)
    for _ in range(draw(ints(1, max_nodes))):
        op = draw(_OPS)
        recent = ints(0, len(pool) - 1)
        if op is CAT:
            args = [pool[i] for i in draw(_arg_lists(len(pool)))]
        else:
            args = [pool[draw(recent)] for _ in range(op.n_in or 0)]
        out = op(*args)
        if isinstance(out, tuple):
            pool.extend(out)
        else:
            pool.append(out)
    return pool


# ------------------------------------------------------------------------- random patterns

TERM_VARS = ("x", "y", "z")
OP_VARS = ("F", "G")
PARAMS = (Param("x"), Param("y"), Param("F", "op"))
_CALL_OPS = st.sampled_from((*OP_VARS, *OPS[:3]))


@functools.cache  # (one strategy object per arguments: see _OPS)
@st.composite
def guards(draw: Any, names: tuple[str, ...], op_names: tuple[str, ...]) -> Expr:
    """A guard: an atom (true, false or undefined on a given match), maybe combined."""

    def atom() -> Expr:
        v = draw(sampled(names))
        kind = draw(ints(0, 11))
        if kind == 0:
            return ECmp("==", EAttr(v, "rank"), EConst(draw(ints(0, 2))))
        if kind == 1:
            return ECmp("==", EAttr(v, "dtype"), EConst(F32))
        if kind == 2:
            return ECmp("<", EAttr(v, "rank"), EBin("+", EConst(1), EConst(1)))
        if kind == 3:
            return ECmp("==", EAttr(v, "missing"), EConst(1))  # undefined
        if kind == 4:
            return ECmp(">", ECall(GUARD_FNS["len"], (EAttr(v, "shape"),)), EConst(1))
        if kind == 5:
            return ECmp("==", EOpAttr(draw(sampled(op_names)), "name"), EConst("f1"))
        if kind == 6:
            return EConst(True)
        if kind == 7:
            return EConst(1.5)  # not a truth value: undefined
        if kind == 11:  # the bound term itself, as guard functions take it (undefined unbound)
            return ECmp("==", ECall(GUARD_FNS["len"], (ETuple((EAttr(v, "term"),)),)), EConst(1))
        # op classes and operators (what the root index reads; F1, G2 have no class)
        cls = EConst(OpClass(draw(_CLASSES)))
        if kind == 8:
            return ECmp("==", EOpAttr(draw(sampled(op_names)), "op_class"), cls)
        if kind == 9:
            return ECmp("==", cls, EAttr(v, "op_class"))
        return ECmp("in", EAttr(v, "op"), EConst(tuple(draw(_OP_SETS))))

    combine = draw(ints(0, 5))
    if combine == 0:
        return EAnd((atom(), atom()))
    if combine == 1:
        return EOr((atom(), atom()))
    if combine == 2:
        return ENot(atom())
    return atom()


_mu_names = itertools.count()


@functools.cache  # (one strategy object per arguments: see _OPS)
@st.composite
def patterns(
    draw: Any,
    depth: int = 3,
    names: tuple[str, ...] = TERM_VARS,
    op_names: tuple[str, ...] = OP_VARS,
    exist_names: tuple[str, ...] = ("e", "x"),
) -> Pattern:
    """A random pattern over the given variable names (every construct but bare PCall)."""
    sub = lambda d=depth - 1: patterns(d, names, op_names, exist_names)  # noqa: E731
    kind = draw(_LEAF_KINDS if depth <= 0 else _KINDS)
    if kind == "var":
        return PVar(draw(sampled(names)))
    if kind == "const":
        return PConst(draw(_CONSTS))
    if kind == "app":
        op = draw(_OPS)
        n = draw(ints(1, 3)) if op is CAT else op.n_in
        index = draw(ints(0, 1)) if op is SPLIT else 0
        return PApp(op, tuple(draw(sub()) for _ in range(n)), index)
    if kind == "alt":
        return PAlt(draw(sub()), draw(sub()))
    if kind == "guard":
        return PGuard(draw(sub()), draw(guards(names, op_names)))
    if kind == "exists":
        v = draw(sampled(exist_names))
        inner = patterns(depth - 1, tuple({*names, v}), op_names, exist_names)
        return PExists(v, draw(inner))
    if kind == "constr":
        return PConstr(draw(sub()), draw(sampled(names)), draw(sub()))
    if kind == "funvar":
        n = draw(ints(0, 2))
        n_out = draw(_N_OUTS)
        index = draw(ints(0, 1)) if n_out == 2 else 0
        return PFunVar(draw(sampled(op_names)), tuple(draw(sub()) for _ in range(n)),
                       index, n_out)  # fmt: skip
    if kind in ("mu", "mu_op"):  # a call of a sub-pattern: μS(p, H)[args]. body
        name = f"S{next(_mu_names)}"
        params = (Param("p"), Param("H", "op"))
        body = draw(patterns(depth - 1, ("p",), ("H",), ("e",)))
        op_arg = draw(sampled(op_names)) if kind == "mu" else draw(_OP_ARGS)
        return PMu(name, params, (draw(sampled(names)), op_arg), body)
    # recursion that consumes structure: μR(u). op(R(u)) ‖ base, in either order
    name = f"R{next(_mu_names)}"
    base = draw(patterns(min(depth - 1, 1), ("u",), op_names, ("e",)))
    op = draw(_UNARY)
    if kind == "rec":
        step: Pattern = PApp(op, (PCall(name, ("u",)),))
        if draw(BOOLS):
            step = PFunVar(draw(sampled(op_names)), (PCall(name, ("u",)),))
    else:  # through a match constraint on an existential: fresh names per unfolding
        step = PExists("e", PConstr(PApp(op, (PVar("e"),)), "e", PCall(name, ("u",))))
    body = PAlt(step, base) if draw(BOOLS) else PAlt(base, step)
    return PMu(name, (Param("u"),), (draw(sampled(names)),), body)


@functools.cache  # (one strategy object per arguments: see _OPS)
@st.composite
def branchy_patterns(draw: Any, depth: int = 3, names: tuple[str, ...] = TERM_VARS) -> Pattern:
    """Patterns that call definitions with alternates of their own, nested in applications,
    match constraints and each other, with arguments bound before the call or by it, the
    same variable passed twice, and operators as arguments: what generated code runs as a
    generator function per definition. Each alternate binds the definition's term
    parameters (as definitions written in the DSL do), or not (then the machine runs it)."""
    sub = lambda d=depth - 1, ns=names: branchy_patterns(d, ns)  # noqa: E731
    if depth <= 0:
        return draw(sampled((*(PVar(n) for n in names), PConst(2.0))))
    kind = draw(_BRANCHY_KINDS)
    if kind == "leaf":
        return draw(patterns(1, names))
    if kind == "app":
        op = draw(_BRANCHY_OPS)
        return PApp(op, tuple(draw(sub()) for _ in range(op.n_in)))
    if kind == "constr":
        return PConstr(draw(sub()), draw(sampled(names)), draw(sub()))
    if kind == "guard":
        return PGuard(draw(sub()), draw(guards(names, OP_VARS)))
    name = f"D{next(_mu_names)}"
    params = (Param("p"), Param("q"), Param("H", "op"))

    def alternate() -> Pattern:
        pq = ("p", "q")
        form = draw(ints(0, 7))
        if form == 0:
            return PApp(G2, (PVar("p"), PVar("q")))
        if form == 1:  # a constraint reaching nested definitions
            return PConstr(PApp(G2, (PVar("p"), PVar("q"))), "p", draw(sub(depth - 1, pq)))
        if form == 2:  # through a constraint on an existential: fresh names
            return PExists(
                "e",
                PConstr(
                    PApp(G2, (PVar("e"), PVar("q"))),
                    "e",
                    PAlt(PApp(F1, (PVar("p"),)), draw(sub(depth - 1, pq))),
                ),
            )
        if form == 3:
            return PGuard(PFunVar("H", (PVar("p"), PVar("q"))), draw(guards(pq, ("H",))))
        if form == 4:
            return PApp(F1, (PApp(G2, (draw(sub(depth - 1, pq)), PVar("q"))),))
        if form == 5:  # q left unbound
            return PVar("p")
        if form == 6:  # a recursive definition inside (a machine run from the code)
            rec = f"R{next(_mu_names)}"
            step = PExists("e", PConstr(PApp(F1, (PVar("e"),)), "e", PCall(rec, ("u",))))
            chain = PMu(rec, (Param("u"),), ("q",), PAlt(step, PVar("u")))
            return PApp(G2, (chain, PVar("p")))
        return draw(sub(depth - 1, pq))

    body: Pattern = alternate()
    for _ in range(draw(ints(1, 3))):
        body = PAlt(body, alternate()) if draw(BOOLS) else PAlt(alternate(), body)
    args = (
        draw(sampled(names)),
        draw(sampled(names)),
        draw(_CALL_OPS),
    )
    call = PMu(name, params, args, body)
    return PApp(G2, (call, draw(sub()))) if draw(BOOLS) else call


@st.composite
def branchy_defs(draw: Any) -> PatternDef:
    body = draw(branchy_patterns(3))
    if draw(BOOLS):
        body = PGuard(body, draw(guards(TERM_VARS, OP_VARS)))
    return PatternDef("P", PARAMS, body)


@st.composite
def pattern_defs(draw: Any, depth: int = 3) -> PatternDef:
    body = draw(patterns(depth))
    if draw(BOOLS):
        body = PGuard(body, draw(guards(TERM_VARS, OP_VARS)))
    return PatternDef("P", PARAMS, body)


# ------------------------------------------------------------------------------- comparing


def solution_key(theta: dict[str, Any], phi: dict[str, Any]) -> tuple:
    """θ and φ compared by identity of what they bind (terms and values are identities)."""
    return (
        tuple(sorted((k, id(v)) for k, v in theta.items())),
        tuple(sorted((k, id(v)) for k, v in phi.items())),
    )


@contextlib.contextmanager
def machine_backend(on: bool = True) -> Iterator[None]:
    """Compile every pattern for the machine (which reads ``forbid`` and carries the
    pre-check), not generated code."""
    from pypm_jax.engine.compiled import CompiledPattern, _compiled

    if not on:
        yield
        return
    _compiled.clear()
    with mock.patch.object(_compiled, "make", lambda p: CompiledPattern(p, backend="machine")):
        yield
    _compiled.clear()
