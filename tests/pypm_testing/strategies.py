"""Hypothesis strategies for terms and core patterns, shared by every matcher test.

Import them as ``from pypm_testing.strategies import ...``.

The signature
    Leaves ``A`` (2x3 f32), ``B`` (3, f32), ``C`` (scalar i32), ``D`` (no shape, no dtype:
    every attribute guard on it is undefined), ``E`` (2x3 f16); constants ``ONE`` (1.0 f32),
    ``HALF`` (0.5 f32), ``TWO`` (2, i32) and ``SQRT2`` (1.4142135 stored as an f32 constant, so
    the pattern literal 1.4142135623730951 matches it only after f32 rounding). Operators
    (objects of this module, namespace "strategies"): unary ``F1`` (op_class
    "unary_pointwise", keeps shape/dtype) and ``F2`` (op_class "other", no shape inference:
    its terms have undefined shape and dtype), binary ``G`` (op_class "binary"), variadic
    ``V`` (``n_in=None``, 0-3 inputs) and ``S`` with one input and two outputs.

Strategies
    ``terms()``            small hash-consed term DAGs with sharing (``G(F1(A), F1(A))``
                           holds the same ``F1(A)`` object twice), or unary chains / trees
                           that recursive patterns like to match.
    ``pattern_and_term()`` a closed :class:`PatternDef` and a term to match it against.
    ``patterns()``         just the pattern definitions.

Patterns are built by *abstracting* a random term: subterms become (linear or nonlinear)
variables, applications keep their operator or become operator variables (with and
without ``n_out``), literals stay, alternates pair the abstraction with a pattern for a
different term or with a second abstraction of the same term (in either order), guards
over rank / shape[i] / dtype / op_class / arithmetic / and / or / not are often but not
always true, existentials bind a subterm, match constraints re-match a bound variable,
subpatterns are wrapped as (non-recursive) calls ``μH(hs)[xs]. p`` (an operator parameter
sometimes instantiated with a concrete operator), and recursive templates (the paper's
UnaryChain and P(x, f, g), a chain of one fixed operator -- its recursion under the
application or in a match constraint on a variable the application binds -- a left spine of
a binary operator) appear where they fit. Recursion is always guarded: every recursive
reference sits under an application, or constrains a variable bound under one. So a good share of the pairs match (often more than once), and
the rest fail for varied reasons.

Well-modedness. With ``well_moded=True`` (the default) every guard, match constraint and
existential check reads only variables bound earlier *on every path* in the machine's
left-to-right order, and bound variables have names distinct from everything else. That
is the condition under which "the machine fails" implies "no bindings satisfy the
declarative rules": SEMANTICS.md §3-4 make the machine backtrack on an unbound variable
where the declarative rules may pick any value for it. ``well_moded=False`` lets guards and
constraints read parameters that may still be unbound (success soundness must still hold).

Parameters are at most ``max_params`` (default 3) so exhaustive enumeration of bindings
over the subterms of a term stays small.
"""

from __future__ import annotations

__all__ = [
    "A",
    "B",
    "C",
    "D",
    "E",
    "ONE",
    "HALF",
    "TWO",
    "SQRT2",
    "SQRT2_LITERAL",
    "ATOMS",
    "F1",
    "F2",
    "G",
    "V",
    "S",
    "OPERATORS",
    "terms",
    "dag_terms",
    "chain_terms",
    "tree_terms",
    "patterns",
    "pattern_and_term",
    "free_vars",
    "subterms",
    "unary_chain",
    "op_chain",
    "ptree",
    "spine",
]

import functools
import itertools
from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    Arg,
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
from pypm_jax.core.terms import CONST, OpClass, Operator, Term, const, leaf
from pypm_jax.semantics.subst import rename_expr
from pypm_testing.draws import BOOLS, ints, sampled

# ----------------------------------------------------------------------------- signature

F32, F16, I32 = as_dtype("f32"), as_dtype("f16"), as_dtype("i32")


def _keep(x: Term) -> tuple[Any, Any]:
    return x.shape, x.dtype


def _binary(x: Term, y: Term) -> tuple[Any, Any]:
    if x.shape is None or y.shape is None:
        return None, x.dtype
    return max(x.shape, y.shape, key=len), x.dtype


def _concat(*xs: Term) -> tuple[Any, Any]:
    if not xs:
        return (0,), F32
    if any(x.shape is None or len(x.shape) == 0 for x in xs):
        return None, xs[0].dtype
    return (sum(x.shape[0] for x in xs), *xs[0].shape[1:]), xs[0].dtype


def _split(x: Term) -> list[tuple[Any, Any]]:
    return [(x.shape, x.dtype), (x.shape, I32)]


_NS = "strategies"
F1 = Operator("F1", 1, op_class="unary_pointwise", namespace=_NS, infer=_keep)
F2 = Operator("F2", 1, op_class="other", namespace=_NS)
G = Operator("G", 2, op_class="binary", namespace=_NS, infer=_binary)
V = Operator("V", None, namespace=_NS, infer=_concat)
S = Operator("S", 1, n_out=2, namespace=_NS, infer=_split)
OPERATORS: tuple[Operator, ...] = (F1, F2, G, V, S)

A = leaf("A", shape=(2, 3), dtype="f32")
B = leaf("B", shape=(3,), dtype="f32")
C = leaf("C", shape=(), dtype="i32")
D = leaf("D")
E = leaf("E", shape=(2, 3), dtype="f16")
ONE = const(1.0, dtype="f32")
HALF = const(0.5, dtype="f32")
TWO = const(2, dtype="i32")
SQRT2 = const(1.4142135, dtype="f32")
ATOMS: tuple[Term, ...] = (A, B, C, D, E, ONE, HALF, TWO, SQRT2)

# A pattern literal that denotes SQRT2 only after rounding to f32.
SQRT2_LITERAL = 1.4142135623730951

# --------------------------------------------------------------------------------- terms


# Strategies the term generators draw from, made once (see pypm_testing.draws).
_ATOMS = st.sampled_from(ATOMS)
_ATOM_LISTS = st.lists(_ATOMS, min_size=1, max_size=3)
_OPERATORS = st.sampled_from(OPERATORS)
_UNARY = st.sampled_from((F1, F2))


@functools.cache
def _chain_ops(max_len: int) -> st.SearchStrategy[list[Operator]]:
    return st.lists(st.sampled_from((F1, F1, F2, S)), min_size=1, max_size=max_len)


def _apply(draw: Callable[..., Any], op: Operator, inputs: list[Term]) -> Term:
    out = op(*inputs)
    if op.n_out > 1:
        out = out[draw(ints(0, op.n_out - 1))]
    return out


@st.composite
def dag_terms(draw: Callable[..., Any], max_ops: int = 4) -> Term:
    """A random term DAG: each new node applies an operator to earlier nodes, with
    repetition, so subterms are shared (and identical by hash-consing)."""
    pool: list[Term] = draw(_ATOM_LISTS)
    for _ in range(draw(ints(0, max_ops))):
        op = draw(_OPERATORS)
        n = draw(ints(0, 3)) if op.n_in is None else op.n_in
        pool.append(_apply(draw, op, [draw(sampled(pool)) for _ in range(n)]))
    return pool[-1]


@st.composite
def chain_terms(draw: Callable[..., Any], max_len: int = 5) -> Term:
    """``u1(u2(...(base)))`` with unary operators, often one operator repeated."""
    t = draw(_ATOMS)
    ops = draw(_chain_ops(max_len))
    for op in ops:
        t = _apply(draw, op, [t])
    return t


@st.composite
def tree_terms(draw: Callable[..., Any], max_ops: int = 4) -> Term:
    """Trees of one unary and one binary operator (what the paper's P(x, f, g) matches)."""
    unary = draw(_UNARY)
    pool = [draw(_ATOMS)]
    for _ in range(draw(ints(1, max_ops))):
        if draw(BOOLS):
            pool.append(unary(draw(sampled(pool))))
        else:
            pool.append(G(draw(sampled(pool)), draw(sampled(pool))))
    return pool[-1]


@functools.cache  # (one strategy object per arguments)
def terms(max_ops: int = 4) -> st.SearchStrategy[Term]:
    """Small terms: random DAGs with sharing, unary chains, or unary/binary trees."""
    return st.one_of(dag_terms(max_ops), chain_terms(max_ops + 1), tree_terms(max_ops))


def subterms(t: Term) -> list[Term]:
    """Every subterm of ``t`` once (shared nodes once), root first."""
    seen: dict[int, Term] = {}
    todo = [t]
    while todo:
        u = todo.pop()
        if id(u) not in seen:
            seen[id(u)] = u
            todo.extend(reversed(u.inputs))
    return list(seen.values())


# ------------------------------------------------------------------ recursive templates


def unary_chain(name: str, x: Arg, f: Arg, *, recursive_first: bool = True) -> PMu:
    """The paper's ``μU(x, f). f(U(x, f)) ‖ f(x)`` instantiated at (x, f)."""
    rec = PFunVar("f", (PCall(name, ("x", "f")),))
    base = PFunVar("f", (PVar("x"),))
    body = PAlt(rec, base) if recursive_first else PAlt(base, rec)
    return PMu(name, (Param("x"), Param("f", "op")), (x, f), body)


def op_chain(name: str, op: Operator, x: Arg) -> PMu:
    """``μC(x). op(C(x)) ‖ op(x)``: a chain of one fixed operator."""
    body = PAlt(PApp(op, (PCall(name, ("x",)),)), PApp(op, (PVar("x"),)))
    return PMu(name, (Param("x"),), (x,), body)


def constr_chain(name: str, op: Operator, x: Arg) -> PMu:
    """``μK(x). (∃y. op(y) ; (y ≈ K(x))) ‖ op(x)``: ``op_chain`` with its recursive reference in
    a match constraint on y, which the application binds to a proper subterm."""
    rec = PExists("y", PConstr(PApp(op, (PVar("y"),)), "y", PCall(name, ("x",))))
    body = PAlt(rec, PApp(op, (PVar("x"),)))
    return PMu(name, (Param("x"),), (x,), body)


def ptree(name: str, x: Arg, f: Arg, g: Arg) -> PMu:
    """The paper's P(x, f, g): x is bound to the root of a tree of f and g nodes.

    ``∃y. x ; (x ≈ f(P(y, f, g)))  ‖  ∃y. ∃z. x ; (x ≈ g(P(y, f, g), P(z, f, g)))  ‖  x``
    """
    call_y = PCall(name, ("y", "f", "g"))
    call_z = PCall(name, ("z", "f", "g"))
    alt1 = PExists("y", PConstr(PVar("x"), "x", PFunVar("f", (call_y,))))
    alt2 = PExists("y", PExists("z", PConstr(PVar("x"), "x", PFunVar("g", (call_y, call_z)))))
    params = (Param("x"), Param("f", "op"), Param("g", "op"))
    return PMu(name, params, (x, f, g), PAlt(alt1, PAlt(alt2, PVar("x"))))


def spine(name: str, op: Operator, x: Arg) -> PMu:
    """``μS(x). (∃z. op(S(x), z)) ‖ x``: the left spine of a binary operator."""
    rec = PExists("z", PApp(op, (PCall(name, ("x",)), PVar("z"))))
    return PMu(name, (Param("x"),), (x,), PAlt(rec, PVar("x")))


# ------------------------------------------------------------------ variables, renaming


def _expr_vars(e: Expr, out: dict[str, str]) -> None:
    """Variables a guard reads, with their kinds (term for ``x.α``, op for ``F.α``)."""
    match e:
        case EAttr(var, _):
            out.setdefault(var, "term")
        case EOpAttr(var, _):
            out.setdefault(var, "op")
        case EConst():
            pass
        case EIndex(base, index):
            _expr_vars(base, out)
            _expr_vars(index, out)
        case EBin(_, left, right) | ECmp(_, left, right):
            _expr_vars(left, out)
            _expr_vars(right, out)
        case EUnary(_, operand) | ENot(operand):
            _expr_vars(operand, out)
        case EAnd(items) | EOr(items) | ETuple(items) | ECall(_, items):
            for item in items:
                _expr_vars(item, out)
        case _:
            raise TypeError(f"not an expression: {e!r}")


def free_vars(p: Pattern) -> dict[str, str]:
    """Free variables of ``p`` in first-occurrence order, each with its kind."""
    out: dict[str, str] = {}

    def go(p: Pattern, bound: frozenset[str]) -> None:
        def add(name: str, kind: str) -> None:
            if name not in bound:
                out.setdefault(name, kind)

        match p:
            case PVar(x):
                add(x, "term")
            case PConst():
                pass
            case PApp(_, args, _):
                for a in args:
                    go(a, bound)
            case PFunVar(var, args, _, _):
                add(var, "op")
                for a in args:
                    go(a, bound)
            case PAlt(left, right):
                go(left, bound)
                go(right, bound)
            case PGuard(pat, g):
                go(pat, bound)
                found: dict[str, str] = {}
                _expr_vars(g, found)
                for name, kind in found.items():
                    add(name, kind)
            case PExists(x, body, _):
                go(body, bound | {x})
            case PConstr(pat, x, constraint):
                go(pat, bound)
                add(x, "term")
                go(constraint, bound)
            case PMu(_, params, args, _):
                for prm, a in zip(params, args, strict=True):
                    if isinstance(a, str):
                        add(a, prm.kind)
            case PCall(_, args):
                for a in args:
                    if isinstance(a, str):
                        add(a, "term")

    go(p, frozenset())
    return out


def _rename(p: Pattern, env: Mapping[str, Arg]) -> Pattern:
    """Rename free variables (names are unique, so binders never capture)."""
    match p:
        case PVar(x):
            return PVar(env.get(x, x))  # type: ignore[arg-type]
        case PConst():
            return p
        case PApp(op, args, index):
            return PApp(op, tuple(_rename(a, env) for a in args), index)
        case PFunVar(var, args, index, n_out):
            new_args = tuple(_rename(a, env) for a in args)
            new = env.get(var, var)
            if isinstance(new, Operator):
                return PApp(new, new_args, index)
            return PFunVar(new, new_args, index, n_out)
        case PAlt(left, right):
            return PAlt(_rename(left, env), _rename(right, env))
        case PGuard(pat, g, loc):
            return PGuard(_rename(pat, env), rename_expr(g, env), loc)
        case PExists(x, body, kind):
            return PExists(x, _rename(body, {k: v for k, v in env.items() if k != x}), kind)
        case PConstr(pat, x, constraint, loc):
            return PConstr(_rename(pat, env), env.get(x, x), _rename(constraint, env), loc)  # type: ignore[arg-type]
        case PMu(name, params, args, body):
            new_args = tuple(env.get(a, a) if isinstance(a, str) else a for a in args)
            return PMu(name, params, new_args, body)
    raise TypeError(f"cannot rename {p!r}")


# ---------------------------------------------------------------------------- abstraction

Bound = dict[str, Any]  # variable -> the value the abstraction means it to be bound to


class _Abstractor:
    """Builds a pattern for a term; see the module docstring for the recipe."""

    def __init__(
        self, draw: Callable[..., Any], root: Term, max_params: int, well_moded: bool
    ) -> None:
        self.draw = draw
        self.root = root
        self.max_params = max_params
        self.well_moded = well_moded
        self.params: dict[str, str] = {}  # parameters, in creation order, with kinds
        self.kinds: dict[str, str] = {}  # every variable made so far (parameters and locals)
        self.names = itertools.count()
        self.foils = [*subterms(root), *ATOMS]

    # -- helpers

    def _int(self, lo: int, hi: int) -> int:
        return self.draw(ints(lo, hi))

    def _pick(self, items: list[Any]) -> Any:
        return self.draw(sampled(items))

    def _fresh(self, stem: str) -> str:
        return f"{stem}{next(self.names)}"

    def _local(self, kind: str) -> str:
        name = self._fresh("y" if kind == "term" else "F")
        self.kinds[name] = kind
        return name

    def _is_term(self, x: str) -> bool:
        return self.kinds[x] == "term"

    def _new_param(self, kind: str) -> str | None:
        if len(self.params) >= self.max_params:
            return None
        name = self._fresh("x" if kind == "term" else "f")
        self.params[name] = self.kinds[name] = kind
        return name

    def _term_var(self, t: Term, bound: Bound) -> str | None:
        """A variable for t: a bound one meant for t (nonlinear), or a new parameter."""
        same = [x for x, v in bound.items() if v is t and self._is_term(x)]
        if same and self.draw(BOOLS):
            return self._pick(same)
        return self._new_param("term")

    def _op_var(self, op: Operator, bound: Bound) -> str | None:
        same = [x for x, v in bound.items() if v is op]
        if same and self.draw(BOOLS):
            return self._pick(same)
        return self._new_param("op")

    # -- the recipe

    def pat(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        r = 0 if depth <= 0 else self._int(0, 99)
        if r < 15:
            return self.var(t, bound, depth)
        if r < 50:
            return self.struct(t, bound, depth)
        if r < 58:
            return self.alt(t, bound, depth)
        if r < 66:
            return self.guarded(t, bound, depth)
        if r < 74:
            return self.exists(t, bound, depth)
        if r < 80:
            return self.constr(t, bound, depth)
        if r < 86:
            return self.call(t, bound, depth)
        if r < 92:
            return self.recursive(t, bound, depth)
        return self.pat(self._pick(self.foils), bound, depth - 1)  # a likely mismatch

    def var(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        if bound and self._int(0, 9) == 0:  # a nonlinear use that is probably wrong
            x = self._pick([x for x in bound if self._is_term(x)] or [None])
            if x is not None:
                return PVar(x), bound
        x = self._term_var(t, bound)
        if x is not None:
            return PVar(x), {**bound, x: t}
        if t.inputs or t.op is CONST:
            return self.struct(t, bound, 0)
        y = self._local("term")  # no parameter left: a local that binds the leaf
        return PExists(y, PVar(y)), bound

    def struct(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        if t.op is CONST:
            value = t.attrs["value"]
            if t is SQRT2 and self.draw(BOOLS):
                value = SQRT2_LITERAL
            elif self._int(0, 5) == 0:
                value = self._pick([0.0, 1.0, 0.5, 2, 3.5])
            return PConst(value), bound
        mode = self._int(0, 9)
        local_op = None
        if mode >= 6:  # an operator variable
            var = self._op_var(t.op, bound) if mode < 9 else None
            if var is None:
                var = local_op = self._local("op")
            bound = {**bound, var: t.op}
        args = []
        for ti in t.inputs:
            pi, bound = self.pat(ti, bound, depth - 1)
            args.append(pi)
        if mode < 6:
            return PApp(t.op, tuple(args), t.index), bound
        n_out = self._pick([None, t.op.n_out, t.op.n_out + 1]) if mode % 2 else None
        p: Pattern = PFunVar(var, tuple(args), t.index, n_out)
        if local_op is not None:
            p = PExists(local_op, p, "op")
            bound = {k: v for k, v in bound.items() if k != local_op}
        return p, bound

    def alt(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        p1, b1 = self.pat(t, bound, depth - 1)
        # the sibling abstracts another term (it mostly fails), or t again (two solutions)
        other = self._pick(self.foils) if self.draw(BOOLS) else t
        p2, b2 = self.pat(other, bound, depth - 1)
        p = PAlt(p1, p2) if self.draw(BOOLS) else PAlt(p2, p1)
        return p, {k: v for k, v in b1.items() if k in b2}

    def guard(self, bound: Bound) -> Expr:
        pool = dict(bound)
        if not self.well_moded:
            pool.update({x: None for x in self.params if x not in pool})
        return self._guard(pool, 2)

    def _guard(self, pool: Bound, depth: int) -> Expr:
        r = self._int(0, 5) if depth > 0 else 0
        if r == 3:
            return EAnd((self._guard(pool, depth - 1), self._guard(pool, depth - 1)))
        if r == 4:
            return EOr((self._guard(pool, depth - 1), self._guard(pool, depth - 1)))
        if r == 5:
            return ENot(self._guard(pool, depth - 1))
        if not pool:
            return ECmp(self._pick(["<", "=="]), EConst(self._int(0, 2)), EConst(1))
        x = self._pick(sorted(pool))
        value = pool[x]
        if not self._is_term(x):
            want = value.name if isinstance(value, Operator) else "F1"
            if self.draw(BOOLS):
                cls = value.op_class if isinstance(value, Operator) else None
                return ECmp("==", EOpAttr(x, "op_class"), EConst(cls or OpClass("other")))
            return ECmp(self._pick(["==", "!="]), EOpAttr(x, "name"), EConst(want))
        shape = value.shape if isinstance(value, Term) else None
        rank = len(shape) if shape is not None else self._int(0, 2)
        kind = self._int(0, 6)
        if kind == 0:
            op = self._pick(["==", "!=", "<=", ">"])
            return ECmp(op, EAttr(x, "rank"), EConst(rank + self._pick([0, 0, 1, -1])))
        if kind == 1:
            i = self._int(0, 1)
            dim = shape[i] if shape is not None and i < len(shape) else self._int(0, 3)
            return ECmp("==", EIndex(EAttr(x, "shape"), EConst(i)), EConst(dim))
        if kind == 2:
            dt = value.dtype if isinstance(value, Term) and value.dtype else F32
            return ECmp("==", EAttr(x, "dtype"), EConst(self._pick([dt, dt, I32, F16])))
        if kind == 3:
            return ECmp("in", EAttr(x, "dtype"), EConst((F32, I32)))
        if kind == 4:
            cls = value.op.op_class if isinstance(value, Term) else None
            return ECmp("==", EAttr(x, "op_class"), EConst(cls or OpClass("unary_pointwise")))
        if kind == 5:
            left = EBin(self._pick(["+", "*"]), EAttr(x, "rank"), EConst(2))
            right = EConst(rank + 2 if self.draw(BOOLS) else rank * 2)
            return ECmp("==", left, right)
        others = [y for y in sorted(pool) if self._is_term(y)]
        y = self._pick(others or [x])
        return ECmp("==", EAttr(x, "rank"), EAttr(y, "rank"))

    def guarded(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        p, b = self.pat(t, bound, depth - 1)
        return PGuard(p, self.guard(b)), b

    def exists(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        y = self._local("term")
        form = self._int(0, 2) if t.inputs else self._int(0, 1)
        if form == 0:  # ∃y. y ; (y ≈ p)   (the shape of P(x, f, g))
            p, b = self.pat(t, {**bound, y: t}, depth - 1)
            body: Pattern = PConstr(PVar(y), y, p)
        elif form == 1:  # ∃y. y ; guard(..y..)
            b = {**bound, y: t}
            body = PGuard(PVar(y), self.guard(b))
        else:  # ∃y. f(.., y, ..), y bound at one input, then perhaps a guard reading it
            i = self._int(0, len(t.inputs) - 1)
            b = bound
            args = []
            for j, tj in enumerate(t.inputs):
                if j == i:
                    args.append(PVar(y))
                    b = {**b, y: tj}
                else:
                    pj, b = self.pat(tj, b, depth - 1)
                    args.append(pj)
            body = PApp(t.op, tuple(args), t.index)
            if self.draw(BOOLS):
                body = PGuard(body, self.guard(b))
        return PExists(y, body), {k: v for k, v in b.items() if k != y}

    def constr(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        p, b = self.pat(t, bound, depth - 1)
        pool = [x for x in b if self._is_term(x)]
        if not self.well_moded:
            pool += [x for x, k in self.params.items() if k == "term" and x not in b]
        if not pool:
            return p, b
        x = self._pick(pool)
        target = b.get(x)
        q, b2 = self.pat(target if isinstance(target, Term) else t, b, depth - 1)
        return PConstr(p, x, q), b2

    def call(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        q, b = self.pat(t, bound, depth - 1)
        name = self._fresh("H")
        env: dict[str, Arg] = {}
        params, args = [], []
        for i, (v, kind) in enumerate(free_vars(q).items()):
            h = f"{name}_{i}"
            params.append(Param(h, kind))  # type: ignore[arg-type]
            env[v] = h
            concrete = kind == "op" and isinstance(b.get(v), Operator) and self.draw(BOOLS)
            if concrete:  # instantiate the operator parameter with the operator itself
                args.append(b[v])
                if v not in bound:
                    b = {k: w for k, w in b.items() if k != v}
            else:
                args.append(v)
        return PMu(name, tuple(params), tuple(args), _rename(q, env)), b

    def recursive(self, t: Term, bound: Bound, depth: int) -> tuple[Pattern, Bound]:
        name = self._fresh("R")
        unary = len(t.inputs) == 1 and t.index == 0
        choice = self._int(0, 3)
        if choice <= 1 and unary:  # chains bind x to the bottom of the chain
            x = self._term_var(_chain_bottom(t), bound)
            if x is None:
                return self.struct(t, bound, depth)
            b = {**bound, x: _chain_bottom(t)}
            if choice == 1:
                chain = constr_chain if self.draw(BOOLS) else op_chain
                return chain(name, t.op, x), b
            f = self._op_var(t.op, bound) or t.op
            p = unary_chain(name, x, f, recursive_first=self.draw(BOOLS))
            return p, ({**b, f: t.op} if isinstance(f, str) else b)
        if choice == 2 and t.op is G:  # the spine binds x to its leftmost bottom
            bottom = t
            while bottom.op is G:
                bottom = bottom.inputs[0]
            x = self._term_var(bottom, bound)
            if x is None:
                return self.struct(t, bound, depth)
            return spine(name, G, x), {**bound, x: bottom}
        x = self._term_var(t, bound)  # P(x, f, g) binds x to the root
        if x is None or choice == 3:
            return self.struct(t, bound, depth)
        f = self._op_var(self._pick([F1, F2]), bound) or self._pick([F1, F2])
        g = self._op_var(G, bound) or G
        return ptree(name, x, f, g), {**bound, x: t}


def _chain_bottom(t: Term) -> Term:
    op = t.op
    while len(t.inputs) == 1 and t.op is op and t.index == 0:
        t = t.inputs[0]
    return t


@st.composite
def pattern_and_term(
    draw: Callable[..., Any],
    max_ops: int = 4,
    max_params: int = 3,
    depth: int = 4,
    well_moded: bool = True,
) -> tuple[PatternDef, Term]:
    """A closed pattern definition and a term: usually the term the pattern abstracts,
    sometimes another one (so failures are common too)."""
    t = draw(terms(max_ops))
    ab = _Abstractor(draw, t, max_params, well_moded)
    body, _ = ab.pat(t, {}, depth)
    params = tuple(Param(x, k) for x, k in ab.params.items())  # type: ignore[arg-type]
    name = f"P{draw(ints(0, 9))}"
    if draw(ints(0, 3)) == 0:  # as the frontend writes a pattern that calls others
        body = PMu(name, params, tuple(x.name for x in params), body)
    pdef = PatternDef(name, params, body)
    target = t if draw(ints(0, 5)) else draw(terms(max_ops))
    return pdef, target


def patterns(**kwargs: Any) -> st.SearchStrategy[PatternDef]:
    """Closed pattern definitions (see :func:`pattern_and_term` for the knobs)."""
    return pattern_and_term(**kwargs).map(lambda pair: pair[0])
