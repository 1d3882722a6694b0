"""Patterns as generated Python: the machine run ahead of time on a fixed pattern.

The compiler executes the machine *symbolically*: the continuation is known statically, so
every match action becomes a line of straight Python (``if t3.op is not MatMul: break``) and
every alternate becomes a ``while True:`` block that a failure leaves with ``break`` -- which
is exactly "pop the backtrack stack". Along each generated path it is statically known which
variables are bound, so a binding is a Python local, a nonlinear check is ``is``, and
backtracking undoes nothing. A recursive sub-pattern becomes a ``for`` loop over the
solutions of the iterative machine (:mod:`pypm_jax.engine.machine`) run from it (``_sub``).

A straight function repeats the continuation after each alternate, so its size multiplies
with the alternates in a row. A pattern too branchy for that (the attention patterns: a
softmax of casts, expansions and maxima inside the output contraction) is generated with a
*generator function per definition that has alternates of its own* (``_Subs``): the caller
writes its continuation once, in a ``for`` loop over the definition's solutions, and a
failure after it resumes the generator -- backtracking into its latest alternate, in the
machine's order, with its fresh names drawn from the counter the machine would use. There,
a *linear* recursive definition (one recursive reference, nothing before it that can choose
two ways at a term) is a generator function calling itself, handing the rest of a chain to
the machine past ``_MAX_GEN_DEPTH`` nested calls; others run on the machine as above. Such
code starts with the machine's structural pre-check and refuses early where the machine
does (:func:`pypm_jax.engine.machine._early_shapes`), both as inline tests. Definitions
called alike by several patterns share their generator functions.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from ..core.calculus import (
    EAnd,
    ECmp,
    EConst,
    EOpAttr,
    PAlt,
    PApp,
    Pattern,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    children,
)
from ..core.terms import CONST, OpClass
from ..semantics.subst import FreshNames, unfold
from .analysis import (
    _calls_self,
    _closed,
    _definitely_bound,
    _draws_names,
    _has_call,
    _paths,
    _plain_names,
    _Unsupported,
)
from .guard_code import _RUNTIME as _GUARD_RUNTIME
from .guard_code import _SHARED_KEY, _GuardCodegen, _Known
from .machine import MatchRun, _early_shapes, _trail_machine
from .precheck import _check_of, _deep_prefilter, _prefilter, _test_of

# Python refuses more than 20 statically nested blocks in one function; each alternate on a
# generated path opens one. Patterns deeper than this run on the iterative machine.
_MAX_BLOCKS = 18
# Generated paths duplicate the continuation after an alternate; cap the code size.
_MAX_LINES = 1000
# A pattern too branchy for that (its alternates multiply the paths) is generated with a
# generator function per definition that has alternates of its own (see ``_Subs``): code
# linear in the definitions' sizes, at most this many lines in all.
_MAX_SUB_LINES = 6000
# Patterns whose paths x nodes (``_paths``) stay within this are generated straight.
_INLINE_PATHS = 8 * _MAX_LINES
# A linear recursive definition (see ``_linear``) is a generator function that calls
# itself; past this many nested generator calls it hands the rest to the machine, which
# needs no Python stack.
_MAX_GEN_DEPTH = 48


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


def _made_when_called(shape: list) -> Callable[[Any], bool]:
    """The function of ``shape``'s test (``_check_of``), made at its first call: generated
    code names it, and most of a pattern's code never runs in a given program."""
    check: Callable[[Any], bool] | None = None

    def call(t: Any) -> bool:
        nonlocal check
        if check is None:
            check = _check_of(_test_of(shape))
        return check(t)

    return call


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
        self,
        mode: str,
        ns: dict[str, Any],
        counter: itertools.count,
        dynamic: bool = False,
        subs: _Subs | None = None,
    ):
        super().__init__(ns, counter, dynamic)
        self.mode = mode  # "first", "all", or "sub" (a definition's generator, see _Subs)
        self.lines: list[str] = []
        self.blocks = 0  # alternates emitted: none means at most one solution
        self.ctr = "ctr"  # the fresh-name counter: a local, or a cell shared with machines
        self.subs = subs  # definitions with alternates become generator functions
        # variable -> the constant holding the shape its term must fit when bound (the
        # machine's early refusals, :func:`pypm_jax.engine.machine._early_shapes`)
        self.checks: dict[str, str] = {}
        # the early refusals skip code that draws fresh names: only in distinct runs (exact
        # ones keep the reference's names, :func:`pypm_jax.engine.analysis._draws_names`)
        self.checks_distinct = False
        self.outs: list[tuple[str, bool]] = []  # "sub": the arguments it yields

    # -- small utilities

    def line(self, indent: int, text: str) -> None:
        self.lines.append("    " * indent + text)
        if len(self.lines) > _MAX_LINES:
            raise _Unsupported("generated code too large")

    def unfold_fresh(self, mu: PMu, ind: int) -> Pattern:
        """``mu`` unfolded now (ST-Match-Mu), its fresh names numbered at run time from the
        counter, whose advance this emits."""
        counter = self.local("b")
        supply = _FreshSupply(counter)
        try:
            q = unfold(mu, supply)
        except TypeError as exc:  # the machine raises this at run time
            raise _Unsupported(str(exc)) from None
        if supply.count:
            self.line(ind, f"{counter} = {self.ctr}")
            self.line(ind, f"{self.ctr} += {supply.count}")
        return q

    # -- the machine, symbolically

    def function(self, body: Pattern) -> str:
        name = "_first" if self.mode == "first" else "_all"
        fail = "return None" if self.mode == "first" else "return"
        self.lines.append(f"def {name}(t0, R=None):")
        if self.subs is not None:
            # the machine's structural pre-check, as code this branchy runs much like it
            pre = _prefilter(body)
            if pre is not None:
                self.line(1, f"if not ({self.shape_test(pre, 't0')}): {fail}")
            deep = _deep_prefilter(body)
            if deep is not None:  # (and the deep one: a call, its paths are many and long)
                check = self.const(_made_when_called(deep))
                self.line(1, f"if not {check}(t0): {fail}")
            shapes = _early_shapes(body)
            if shapes:
                self.checks = {var: self.const(shape) for var, shape in shapes.items()}
                self.checks_distinct = _draws_names(body)
        if self.subs is not None or _has_call(body):
            # recursive sub-patterns and definitions' generators share the counter
            self.ctr = "C[0]"
            self.line(1, "C = [1]")
        else:
            self.line(1, "ctr = 1")
        self.emit([("m", body, "t0")], _State(), 1, fail, 0)
        if self.mode == "all":
            self.line(1, "yield  # unreachable; makes this a generator even with no solution")
        return "\n".join(self.lines) + "\n"  # (its guard helpers: ``_generate``)

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
                        shape = self.checks.get(name)
                        if shape is not None:  # an early refusal
                            test = self.shape_test(self.ns[shape], t)
                            if self.checks_distinct:  # (R: the run, None for exact)
                                test = f"({test}) or R is None or not R.distinct"
                            line(ind, f"if not ({test}): {fail}")
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
                    if not (
                        self.subs is not None
                        and _linear(p)
                        and self.call_sub(p, t, k, st, ind, fail, depth)
                    ):
                        self.submachine(p, t, k, st, ind, fail, depth)
                    return
                elif (
                    cls is PMu
                    and self.subs is not None
                    and _own_alternates(p)
                    and self.call_sub(p, t, k, st, ind, fail, depth)
                ):
                    return
                elif cls is PMu:  # ST-Match-Mu, unfolded now; fresh numbers at run time
                    k.append(("m", self.unfold_fresh(p, ind), t))
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
        for param, arg in zip(p.params, p.args, strict=True):
            if isinstance(arg, str) and arg[:1] == "\x01":  # a generator's argument: its
                # caller names it (the machine's θ and φ are its own, fresh per solution)
                self.line(ind + 1, f"{ph if param.kind == 'op' else th}.pop({arg!r}, None)")
        inner.extra_theta.append(th)
        inner.extra_phi.append(ph)
        inner.struct.append(f"*{sx}")
        self.emit(k, inner, ind + 1, "continue", depth + 1)
        self.line(ind, fail)

    def shape_test(self, shape: list, t: str, budget: list[int] | None = None) -> str:
        """Python deciding ``_fits(shape, t)`` inline (past a size, a call of its test's
        function, ``_check_of``)."""
        if budget is None:
            budget = [64]
        budget[0] -= len(shape)
        if budget[0] < 0:
            return f"{self.const(_made_when_called(shape))}({t})"
        alts = []
        for op, n, kids in shape:
            conds = []
            if op is not None:
                conds.append(f"{t}.op is {self.const(op)}")
            if kids is not None:
                ins = self.local("i")
                conds.append(f"len({ins} := {t}.inputs) == {n}")
                for j, k in enumerate(kids):
                    if k is not None:
                        conds.append(f"({self.shape_test(k, f'{ins}[{j}]', budget)})")
            elif n is not None:
                conds.append(f"len({t}.inputs) == {n}")
            alts.append(" and ".join(conds) or "True")
        return " or ".join(f"({a})" for a in alts)

    def call_sub(
        self, p: PMu, t: str, k: list[tuple], st: _State, ind: int, fail: str, depth: int
    ) -> bool:
        """A definition with alternates: ``for`` each solution of its generator function
        (:class:`_Subs`) at ``t``, given the arguments bound so far, the rest of the
        continuation; False (unfold it here instead) when it reads variables it is not
        passed.

        The generator enters the definition where the machine would (drawing its fresh
        names from the shared counter) and yields the arguments it binds, the θ and φ of its
        own variables and the terms it matched, in the machine's order: a failure after it
        resumes it (``continue``), which is backtracking into its latest alternate.
        """
        if not _closed(p):
            return False
        if depth >= _MAX_BLOCKS:
            raise _Unsupported("too many nested alternates")
        subs = self.subs
        if subs is None:
            return False
        canon: dict[tuple[str, bool], str] = {}
        args: list[Any] = []
        ins: list[tuple[str, bool, str]] = []  # (canonical name, is_op, caller's local)
        outs: list[tuple[str, bool, str]] = []  # (canonical name, is_op, caller's name)
        checks: list[tuple[str, str]] = []
        for param, arg in zip(p.params, p.args, strict=True):
            if not isinstance(arg, str):
                args.append(arg)  # an operator: the unfolding substitutes it
                continue
            is_op = param.kind == "op"
            c = canon.get((arg, is_op))
            if c is None:
                c = canon[(arg, is_op)] = f"\x01{len(canon)}"
                bound = (st.ovars if is_op else st.tvars).get(arg)
                if bound is not None:
                    ins.append((c, is_op, bound))
                else:
                    outs.append((c, is_op, arg))
                    shape = None if is_op else self.checks.get(arg)
                    if shape is not None:
                        checks.append((c, shape))
            args.append(c)
        name = subs.get(
            PMu(p.name, p.params, tuple(args), p.body),
            tuple((c, o) for c, o, _ in ins),
            tuple((c, o) for c, o, _ in outs),
            tuple(checks),
            self.checks_distinct and bool(checks),
        )
        if name is None:
            return False
        locs = [self.local("o" if o else "t") for _, o, _ in outs]
        th, ph, sx = (self.local(x) for x in ("th", "ph", "sx"))
        self.blocks += 1
        inputs = "".join(f"{loc}, " for _, _, loc in ins)
        down = ", D + 1" if self.mode == "sub" else ""  # (how deep generators are nested)
        self.line(
            ind,
            f"for {''.join(f'{x}, ' for x in locs)}{th}, {ph}, {sx} in "
            f"{name}({t}, {inputs}C, R{down}):",
        )
        inner = st.copy()
        for (_, is_op, arg), loc in zip(outs, locs, strict=True):
            (inner.ovars if is_op else inner.tvars)[arg] = loc
        inner.extra_theta.append(th)
        inner.extra_phi.append(ph)
        inner.struct.append(f"*{sx}")
        self.emit(k, inner, ind + 1, "continue", depth + 1)
        self.line(ind, fail)
        return True

    def sub_function(
        self,
        name: str,
        mu: PMu,
        ins: tuple[tuple[str, bool], ...],
        outs: tuple[tuple[str, bool], ...],
    ) -> str:
        """The generator function of one definition ``mu`` (its arguments canonical names):
        ``name(t, <the bound arguments>, C, R)`` yields ``(<the unbound arguments>, θ, φ,
        matched terms)`` per solution, θ and φ holding the definition's own variables."""
        st = _State()
        params = []
        for c, is_op in ins:
            loc = self.local("o" if is_op else "t")
            (st.ovars if is_op else st.tvars)[c] = loc
            params.append(f"{loc}, ")
        self.lines.append(f"def {name}(t0, {''.join(params)}C, R, D=0):")
        self.ctr = "C[0]"
        self.outs = list(outs)
        if _calls_self(mu):  # past _MAX_GEN_DEPTH, the machine runs the rest
            self.line(1, f"if D > {_MAX_GEN_DEPTH}:")
            args = "".join(
                f"{a!r}, " if isinstance(a, str) else f"{self.const(a)}, " for a in mu.args
            )
            th_in = ", ".join(f"{c!r}: {st.tvars[c]}" for c, o in ins if not o)
            ph_in = ", ".join(f"{c!r}: {st.ovars[c]}" for c, o in ins if o)
            sol, th, ph, sx = (self.local(x) for x in ("s", "th", "ph", "sx"))
            self.line(
                2,
                f"for {sol} in _sub({self.const(mu)}, ({args}), t0, {{{th_in}}}, "
                f"{{{ph_in}}}, C, R):",
            )
            self.line(3, f"{th}, {ph}, {sx} = {sol}")
            vals = []
            for c, o in outs:  # (the machine binds them: as the generated paths do)
                v = self.local("o" if o else "t")
                self.line(3, f"{v} = {ph if o else th}[{c!r}]")
                vals.append(f"{v}, ")
            for c, o in (*ins, *outs):  # (the caller names its arguments)
                self.line(3, f"{ph if o else th}.pop({c!r}, None)")
            self.line(3, f"yield {''.join(vals)}{th}, {ph}, {sx}")
            self.line(2, "return")
        q = self.unfold_fresh(mu, 1)
        self.emit([("m", q, "t0")], st, 1, "return", 0)
        self.line(1, "yield  # unreachable; makes this a generator even with no solution")
        return "\n".join(self.lines) + "\n"  # (its guard helpers: ``_generate``)

    def _unpack(self, args: tuple[Pattern, ...], k: list[tuple], ind: int) -> None:
        locs = [self.local("t") for _ in args]
        self.line(ind, f"{', '.join(locs)}, = a")
        for arg, loc in zip(reversed(args), reversed(locs), strict=True):
            k.append(("m", arg, loc))

    def success(self, st: _State, ind: int, fail: str) -> None:
        # (a definition's generator leaves its arguments, canonical names, to its caller)
        theta = ", ".join(
            [f"**{x}" for x in st.extra_theta]
            + [f"{_name_expr(n)}: {v}" for n, v in st.tvars.items() if n[:1] != "\x01"]
        )
        phi = ", ".join(
            [f"**{x}" for x in st.extra_phi]
            + [f"{_name_expr(n)}: {v}" for n, v in st.ovars.items() if n[:1] != "\x01"]
        )
        struct = "".join(f"{s}, " for s in st.struct)
        if self.mode == "sub":
            vals = []
            for c, is_op in self.outs:
                loc = (st.ovars if is_op else st.tvars).get(c)
                if loc is None:
                    raise _Unbound("a definition may leave an argument unbound")
                vals.append(f"{loc}, ")
            self.line(ind, f"yield {''.join(vals)}{{{theta}}}, {{{phi}}}, ({struct})")
            self.line(ind, fail)
        elif self.mode == "first":
            self.line(ind, f"return {{{theta}}}, {{{phi}}}, ({struct})")
        else:
            self.line(ind, f"yield {{{theta}}}, {{{phi}}}, ({struct})")
            self.line(ind, fail)  # resume = backtrack into the innermost alternate


class _Unbound(_Unsupported):
    """A definition's solution may leave one of its arguments unbound."""


class _Subs:
    """The generator functions of one pattern's definitions with alternates, one per
    (definition, which arguments are bound, which alias, the early refusals passed down),
    shared by its ``first`` and ``all`` functions: the continuation after a definition is
    written once, in a ``for`` loop over its solutions, not once per alternate."""

    def __init__(self, ns: dict[str, Any], counter: itertools.count):
        self.ns = ns
        self.counter = counter
        self.made: dict[tuple, tuple[PMu, str | None]] = {}
        self.sources: list[str] = []
        self.lines = 0
        self.fresh: list[tuple[tuple, tuple, str | None]] = []  # made here, to publish

    def publish(self) -> None:
        """Offer the functions made here (now compiled) to the patterns compiled later."""
        for gkey, holders, name in self.fresh:
            if len(_SHARED) >= _SHARED_LIMIT:
                _SHARED.clear()
            _SHARED[gkey] = (holders, None if name is None else self.ns[name])

    def get(
        self,
        mu: PMu,
        ins: tuple[tuple[str, bool], ...],
        outs: tuple[tuple[str, bool], ...],
        checks: tuple[tuple[str, str], ...],
        checks_distinct: bool,
    ) -> str | None:
        """The generator function's name, or None where a solution of the definition may
        leave an argument unbound (the caller unfolds it in place). ``checks``: the early
        refusals passed down, made in distinct runs only where ``checks_distinct``."""
        args = tuple(a if isinstance(a, str) else id(a) for a in mu.args)
        key = (id(mu.body), mu.name, mu.params, args, ins, outs, checks_distinct, checks)
        hit = self.made.get(key)
        if hit is not None:
            return hit[1]  # (None: left to the caller to unfold)
        # a function another pattern made for the same key (shapes by identity) is this one
        shapes = tuple(self.ns[k] for _, k in checks)
        refusals = tuple((c, id(sh)) for (c, _), sh in zip(checks, shapes, strict=True))
        gkey = (key[:-1], refusals, _MAX_GEN_DEPTH)
        holders = (mu, shapes)  # (keeps the ids in the key theirs)
        shared = _SHARED.get(gkey)
        if shared is not None and shared[0][0].body is mu.body:
            fn = shared[1]
            name = None if fn is None else f"_d{next(self.counter)}"
            if name is not None:
                self.ns[name] = fn
                self.sources.append(f"# {name} = {fn.__name__}, made for an earlier pattern\n")
            self.made[key] = (mu, name)
            return name
        name = f"_d{next(self.counter)}"
        self.made[key] = (mu, name)  # (holds the body and operators: their ids stay theirs)
        gen = _Codegen("sub", self.ns, self.counter, subs=self)
        gen.checks = dict(checks)
        gen.checks_distinct = checks_distinct
        try:
            src = gen.sub_function(name, mu, ins, outs)
        except _Unbound:
            self.made[key] = (mu, None)
            self.fresh.append((gkey, holders, None))
            return None
        self.lines += len(gen.lines)
        if self.lines > _MAX_SUB_LINES:
            raise _Unsupported("generated code too large")
        self.sources.append(src)
        self.fresh.append((gkey, holders, name))
        return name


# Generator functions made for patterns compiled so far, by (definition body, name,
# parameters, arguments, bound and unbound ones, early refusals' shapes): patterns that
# call the same definitions (the attention rules' Weighted, Softmax, Probs, ...) compile
# them once.
_SHARED: dict[tuple, tuple[tuple, Callable | None]] = {}
_SHARED_LIMIT = 4096


def _own_alternates(mu: PMu) -> bool:
    """Has ``mu``'s body an alternate outside the definitions nested in it?"""
    hit = _OWN_ALTS.get(id(mu.body))
    if hit is not None and hit[0] is mu.body:
        return hit[1]
    found = False
    stack: list[Pattern] = [mu.body]
    while stack and not found:
        q = stack.pop()
        found = type(q) is PAlt
        stack.extend(children(q, into_mu=False))
    if len(_OWN_ALTS) >= 4096:
        _OWN_ALTS.clear()
    _OWN_ALTS[id(mu.body)] = (mu.body, found)
    return found


_OWN_ALTS: dict[int, tuple[Pattern, bool]] = {}


# -------------------------------------------------- recursion that generated code may run
#
# A recursive definition runs as a generator function calling itself when it is *linear*:
# one recursive reference, and no alternate matched before it (in the alternate of the
# definition that holds it) can choose among more than one way at a term -- their
# alternatives have disjoint roots. Then each call makes at most one recursive call per
# term it is matched at, and a match costs what the chain it walks down costs; a
# definition that could fan out (and needs the machine's tables to stay polynomial) is
# left to the machine.


def _roots(p: Pattern, budget: list[int]) -> list[tuple[str, Any]] | None:
    """What the root of a term ``p`` matches can be: ``("op", operator)`` or ``("class",
    op class)`` entries; None: anything."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    cls = type(p)
    if cls is PApp:
        return [("op", p.op)]
    if cls is PConst:
        return [("op", CONST)]
    if cls is PAlt:
        a = _roots(p.left, budget)
        b = _roots(p.right, budget) if a is not None else None
        return None if a is None or b is None else a + b
    if cls is PGuard:
        if type(p.pat) is PFunVar:
            items = p.guard.items if isinstance(p.guard, EAnd) else (p.guard,)
            for g in items:  # `f.op_class == C` at the top of the guard
                if isinstance(g, ECmp) and g.op == "==":
                    for a, b in ((g.left, g.right), (g.right, g.left)):
                        if (
                            isinstance(a, EOpAttr)
                            and a.var == p.pat.var
                            and a.attr == "op_class"
                            and isinstance(b, EConst)
                            and isinstance(b.value, OpClass)
                        ):
                            return [("class", b.value)]
        return _roots(p.pat, budget)
    if cls is PExists or cls is PConstr:
        return _roots(p.pat if cls is PConstr else p.body, budget)
    if cls is PMu:
        try:
            return _roots(unfold(p, FreshNames()), budget)
        except TypeError:
            return None
    return None  # PVar, PFunVar, PCall


def _disjoint(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    if a[0] == "op" and b[0] == "op":
        return a[1] is not b[1]
    if a[0] == "class" and b[0] == "class":
        return a[1] is not b[1]
    op, klass = (a[1], b[1]) if a[0] == "op" else (b[1], a[1])
    return op.op_class is not klass


def _choice_free(alt: PAlt) -> bool:
    """Can at most one alternative of ``alt`` match a given term (disjoint roots)?"""
    options: list[Pattern] = []
    stack: list[Pattern] = [alt]
    while stack:
        q = stack.pop()
        if type(q) is PAlt:
            stack.extend((q.right, q.left))
        else:
            options.append(q)
    roots = []
    for q in options:
        r = _roots(q, [200])
        if r is None:
            return False
        roots.append(r)
    return all(
        _disjoint(x, y) for i, a in enumerate(roots) for b in roots[i + 1 :] for x in a for y in b
    )


def _find_linear(mu: PMu) -> bool:
    name = mu.name
    refs = 0
    # pre-order in matching order; per node, is it on the path to the reference yet?
    before: list[PAlt] = []  # alternates matched before the reference
    seen_ref = False
    stack: list[tuple[Pattern, bool]] = [(mu.body, False)]
    while stack:
        q, _ = stack.pop()
        cls = type(q)
        if cls is PCall and q.name == name:
            refs += 1
            seen_ref = True
            continue
        if cls is PMu and q.name == name:
            continue  # shadowed
        if cls is PAlt and not seen_ref:
            before.append(q)
        stack.extend((c, False) for c in reversed(children(q)))
    if refs != 1:
        return False
    # an alternate before the reference that contains it is one of its ancestors: fine
    # (only one of its alternatives reaches it); the others must be choice-free
    return all(_contains_ref(a, name) or _choice_free(a) for a in before)


def _contains_ref(p: Pattern, name: str) -> bool:
    stack = [p]
    while stack:
        q = stack.pop()
        if type(q) is PCall and q.name == name:
            return True
        if type(q) is PMu and q.name == name:
            continue
        stack.extend(children(q))
    return False


_LINEAR: dict[int, tuple[Pattern, bool]] = {}


def _linear(mu: PMu) -> bool:
    """Is ``mu`` a recursive definition generated code may run (see above)?"""
    hit = _LINEAR.get(id(mu.body))
    if hit is not None and hit[0] is mu.body:
        return hit[1]
    try:
        found = _find_linear(mu)
    except RecursionError:
        found = False
    if len(_LINEAR) >= 4096:
        _LINEAR.clear()
    _LINEAR[id(mu.body)] = (mu.body, found)
    return found


def _generate(body: Pattern) -> tuple[Callable, Callable, str, bool]:
    """Generated ``first`` and ``all`` functions for a pattern, and whether it has at most
    one solution (no alternate anywhere). Small patterns are one straight function each;
    branchier ones get a generator function per definition with alternates (``_Subs``)."""
    try:
        paths, nodes = _paths(body, [_MAX_LINES])  # (code has at least a line per node)
        inline = paths * nodes <= _INLINE_PATHS
    except _Unsupported:
        inline = False
    names: set[str] = set()
    _plain_names(body, names)
    if any("#" in n or "\x01" in n for n in names):
        raise _Unsupported("user variable names contain '#'")
    ns: dict[str, Any] = dict(_RUNTIME)
    counter = itertools.count(1)
    subs = None if inline else _Subs(ns, counter)
    src_first = _Codegen("first", ns, counter, subs=subs).function(body)
    gen_all = _Codegen("all", ns, counter, subs=subs)
    src_all = gen_all.function(body)
    source = src_first + "\n" + src_all
    if subs is not None:
        source = "\n".join(subs.sources) + "\n" + source
    source = "\n".join(ns[_SHARED_KEY][2]) + "\n" + source  # (the guard helpers, once)
    try:
        code = compile(source, "<pypm-fast>", "exec")
    except (SyntaxError, RecursionError, MemoryError) as exc:
        raise _Unsupported(f"generated code does not compile: {exc}") from None
    exec(code, ns)
    if subs is not None:
        subs.publish()
    return ns["_first"], ns["_all"], source, gen_all.blocks == 0
