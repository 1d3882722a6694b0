"""Guards as generated Python, with the evaluation rules of :mod:`pypm_jax.semantics.guards`.

``compile_guard(g)`` is ``guard_holds(g, θ, φ)`` as a small generated function (cached
per expression object); ``_env_guard(g)`` runs it on a μ-body's variables read through
the machine's environment. ``_GuardCodegen`` emits guard code; the pattern code
generator (:mod:`pypm_jax.engine.codegen`) extends it.
"""

from __future__ import annotations

__all__ = ["compile_guard"]

import itertools
from collections.abc import Callable, Mapping
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
)
from ..core.dtypes import DType
from ..core.terms import CONST, UNDEFINED, const_equal, term_attr
from ..semantics.guards import Refusal, guard_holds, op_attr
from ..semantics.guards import binary as guard_binary
from .analysis import _ByIdentity, _expr_names, _Unsupported

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
    if t is None:  # (an unbound variable: ``x.term`` would otherwise read as None)
        raise _Undef
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


_RUNTIME = {
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


class _Known:
    """What is statically known where a guard is evaluated: which variables are bound, and
    the Python locals that hold them."""

    __slots__ = ("tvars", "ovars")

    def __init__(self) -> None:
        self.tvars: dict[str, str] = {}  # θ name -> Python local holding the term
        self.ovars: dict[str, str] = {}  # φ name -> Python local holding the operator


class _GuardCodegen:
    """Emits Python for guards; generated helpers go to ``helpers``, constants to ``ns``."""

    def __init__(self, ns: dict[str, Any], counter: itertools.count, dynamic: bool = False):
        self.dynamic = dynamic  # variables may hold None (unbound) at run time
        self.ns = ns
        self.counter = counter
        # shared by the code generators of one namespace (a pattern's functions): each
        # constant has one name there, and each guard helper is written once (by its text,
        # its variables named in the order it reads them), whichever function calls it;
        # ``helpers`` holds their definitions, which go in front of every function's code
        self._consts: dict[int, str]
        self._guards: dict[str, tuple[str, tuple[str, ...]]]
        self.helpers: list[str]
        self._consts, self._guards, self.helpers = ns.setdefault(_SHARED_KEY, ({}, {}, []))

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

    # -- guards

    def positive(self, g: Expr, st: _Known) -> str:
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

    def _inline_cmp(self, g: ECmp, st: _Known) -> str | None:
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

    def guard(self, g: Expr, st: _Known) -> str:
        """A call to a generated function deciding ⟦g[θ, φ]⟧ = True on this path."""
        canon = _Known()  # (the helper's parameters, named in the order the guard reads them)
        actual: dict[str, str] = {}
        canon.tvars = _Canonical(st.tvars, actual)  # type: ignore[assignment]
        canon.ovars = _Canonical(st.ovars, actual)  # type: ignore[assignment]
        refs: dict[str, None] = {}
        src = self.expr(g, canon, refs)
        hit = self._guards.get(src)
        if hit is None:
            name = self.local("_g")
            hit = self._guards[src] = (name, tuple(refs))
            self.helpers.append(
                f"def {name}({', '.join(refs)}):\n    try:\n        return _T({src})\n"
                "    except Exception:\n        return False\n"
            )
        name, params = hit
        return f"{name}({', '.join(actual[p] for p in params)})"

    def expr(self, e: Expr, st: _Known, refs: dict[str, None]) -> str:
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


_SHARED_KEY = "__pypm_codegen__"  # (a namespace's entry for what its generators share)


class _Canonical:
    """A variable's Python local, as ``_Known`` maps it, renamed ``a0``, ``a1``, ... in the
    order asked for (``actual``: each new name's local), so that one guard read at several
    places of a pattern, under other locals or other fresh names, is one helper's text."""

    __slots__ = ("known", "actual", "names")

    def __init__(self, known: dict[str, str], actual: dict[str, str]):
        self.known, self.actual = known, actual
        self.names: dict[str, str] = {}

    def get(self, var: str, default: Any = None) -> Any:
        local = self.known.get(var)
        if local is None:
            return default
        name = self.names.get(var)
        if name is None:
            name = self.names[var] = f"a{len(self.actual)}"
            self.actual[name] = local
        return name


def _simple_const(value: Any) -> bool:
    """Constants whose comparisons with ranks and dtypes cannot raise."""
    if isinstance(value, tuple):
        return all(_simple_const(v) for v in value)
    return value is None or isinstance(value, bool | int | float | str | DType)


# ---------------------------------------------------------------------- compiled guards


def compile_guard(g: Expr) -> Callable[[Mapping[str, Any], Mapping[str, Any]], bool]:
    """``guard_holds(g, θ, φ)`` as generated Python (cached per expression object).

    Generated when first evaluated: a rewrite run asks for the guard of every rule it is
    given, and most are never evaluated (their patterns match nowhere in the program), while
    generating and compiling one costs about a third of a millisecond."""
    hit = _compiled_guards.entries.get(id(g))
    if hit is not None and hit[0] is g:
        return hit[1]

    def first_use(theta: Mapping[str, Any], phi: Mapping[str, Any]) -> bool:
        return _compiled_guards(g)(theta, phi)

    return first_use


def _compile_guard(g: Expr) -> Callable[[Mapping[str, Any], Mapping[str, Any]], bool]:
    names: set[str] = set()
    _expr_names(g, names)
    ns: dict[str, Any] = dict(_RUNTIME)
    gen = _GuardCodegen(ns, itertools.count(1), dynamic=True)
    st = _Known()
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
    compiled = _compiled_guards(g)  # (this runs at the guard's first evaluation)

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
