"""Patterns as generated Python: the machine run ahead of time on a fixed pattern.

The compiler executes the machine *symbolically*: the continuation is known statically, so
every match action becomes a line of straight Python (``if t3.op is not MatMul: break``) and
every alternate becomes a ``while True:`` block that a failure leaves with ``break`` -- which
is exactly "pop the backtrack stack". Along each generated path it is statically known which
variables are bound, so a binding is a Python local, a nonlinear check is ``is``, and
backtracking undoes nothing. A recursive sub-pattern becomes a ``for`` loop over the
solutions of the iterative machine (:mod:`pypm_jax.engine.machine`) run from it (``_sub``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ..core.calculus import (
    PAlt,
    PApp,
    Pattern,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
)
from ..semantics.subst import unfold
from .analysis import (
    _calls_self,
    _closed,
    _definitely_bound,
    _has_call,
    _paths,
    _plain_names,
    _Unsupported,
)
from .guard_code import _RUNTIME as _GUARD_RUNTIME
from .guard_code import _GuardCodegen, _Known
from .machine import MatchRun, _trail_machine

# Python refuses more than 20 statically nested blocks in one function; each alternate on a
# generated path opens one. Patterns deeper than this run on the iterative machine.
_MAX_BLOCKS = 18
# Generated paths duplicate the continuation after an alternate; cap the code size.
_MAX_LINES = 1000


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


_RUNTIME = {**_GUARD_RUNTIME, "_sub": _sub}


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


class _State(_Known):
    """What is statically known on one generated path: bound variables and matched terms."""

    __slots__ = ("struct", "extra_theta", "extra_phi")

    def __init__(self) -> None:
        super().__init__()
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


class _Codegen(_GuardCodegen):
    """Emits one Python function that runs the machine on a fixed pattern.

    ``mode`` is ``"first"`` (return the first solution or None) or ``"all"`` (a generator of
    ``(θ, φ, matched terms)`` in exploration order).
    """

    def __init__(
        self, mode: str, ns: dict[str, Any], counter: itertools.count, dynamic: bool = False
    ):
        super().__init__(ns, counter, dynamic)
        self.mode = mode
        self.lines: list[str] = []
        self.blocks = 0  # alternates emitted: none means at most one solution
        self.ctr = "ctr"  # the fresh-name counter: a local, or a cell shared with machines

    # -- small utilities

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
