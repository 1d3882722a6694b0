"""The PyPM frontend: ``@op``, ``@pattern``, ``@rule``, ``var()``, ``Op(n, m)``, ``opclass``.

Pattern and rule bodies are ordinary Python functions. Their AST is rewritten
(``_rewrite_ast``) and the result is run with symbolic parameters (``_symbolic``) once per
path through its ``if``/``elif``/``else`` branches. Each run yields one alternate (for a
pattern) or one branch (for a rule) of the core calculus:

* ``assert g``                → ``p ; guard(g)``          (carries the assert's file:line)
* ``x <= p`` (statement)      → ``p ; (x ≈ p')``
* ``y = var()`` / ``Op(n, m)`` → ``∃y. p``                  (term / operator variable)
* a parameter called ``f(x)``  → ``F(p)``                   (operator variable)
* a call of another pattern   → ``μQ(xs)[ys]. q``          (instantiated definition)
* a pattern calling itself    → ``P(ys)`` under ``μP``     (recursion; must consume a node)
* several definitions, or several paths, under one name → alternates in definition order.
"""

from __future__ import annotations

__all__ = [
    "op",
    "pattern",
    "rule",
    "var",
    "Op",
    "opclass",
    "PatternFunction",
    "Rule",
    "as_pattern_def",
    "as_rule_def",
]

import dataclasses
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from types import CodeType, FunctionType
from typing import Any

from ..core import terms as _terms
from ..core.calculus import (
    Arg,
    EAnd,
    EAttr,
    ECall,
    ECmp,
    EConst,
    ENot,
    EOpAttr,
    EOr,
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
    RApp,
    RConst,
    Rhs,
    RTuple,
    RuleBranch,
    RuleDef,
    RVar,
    binds_below,
    children,
    show,
)
from ..core.errors import PatternDefinitionError, SourceLoc
from ..core.terms import CONST, OpClass, Operator, Term
from . import symbolic as _symbolic
from .registry import GUARD_FNS, register_op
from .rewrite_ast import transform_function
from .symbolic import Sym, SymExpr, SymOp, SymPattern, definition_error, to_expr

# ------------------------------------------------------------------------------ operators


def op(
    fn: Callable[..., int] | None = None,
    *,
    attrs: Sequence[str] = (),
    op_class: str | OpClass | None = None,
    name: str | None = None,
    pure: bool = True,
    infer: Callable[..., Any] | None = None,
    describe: Callable[..., str] | None = None,
) -> Any:
    """Declare an operator: arity = number of parameters, outputs = the int it returns.

    ``@pm.op`` or ``@pm.op(attrs=("stride",), op_class="conv")``. ``infer(*inputs,
    **attrs)`` may return ``(shape, dtype)`` (a list of them for several outputs) so terms
    built with the operator carry types. ``describe(**attrs)`` may return a short text that
    rewrite reports show for a node a rule built (a region rule's region).
    """

    def make(f: Callable[..., int]) -> Operator:
        try:
            params = inspect.signature(f).parameters.values()
        except (TypeError, ValueError) as exc:
            raise PatternDefinitionError(f"@op needs a plain function: {exc}") from None
        if any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
            raise PatternDefinitionError(
                f"@op {f.__name__}: operands must be plain positional parameters",
                _def_loc(f),
            )
        n_in = len(list(params))
        try:
            n_out = f(*([None] * n_in))
        except Exception as exc:
            raise PatternDefinitionError(
                f"@op {f.__name__}: the body must just return the number of outputs ({exc})",
                _def_loc(f),
            ) from None
        if not isinstance(n_out, int) or isinstance(n_out, bool) or n_out < 1:
            raise PatternDefinitionError(
                f"@op {f.__name__}: must return a positive int (the number of outputs), "
                f"got {n_out!r}",
                _def_loc(f),
            )
        operator = Operator(
            name or f.__name__,
            n_in,
            n_out,
            attrs=tuple(attrs),
            op_class=op_class,
            namespace=f.__module__,
            pure=pure,
            infer=infer,
            describe=describe,
        )
        return register_op(operator)

    return make(fn) if fn is not None else make


def _def_loc(f: Callable[..., Any]) -> SourceLoc | None:
    code = getattr(f, "__code__", None)
    if code is None:
        return None
    return SourceLoc(code.co_filename, code.co_firstlineno, "")


def opclass(name: str) -> OpClass:
    """The operator class called ``name`` (compare with ``F.op_class`` in guards)."""
    return OpClass(name)


# -------------------------------------------------------------------- locals in bodies
_active = threading.local()


def _tracer() -> _Tracer:
    tracer = getattr(_active, "tracer", None)
    if tracer is None:
        raise PatternDefinitionError(
            "var() and Op() can only be used inside @pattern and @rule bodies"
        )
    return tracer


def var() -> SymPattern:
    """A fresh local pattern variable (``y = pm.var()``): an existential ``∃y``."""
    return _tracer().new_local()


def Op(n_in: int | None = None, n_out: int | None = 1) -> SymOp:  # noqa: N802 (paper's name)
    """A fresh local operator variable with ``n_in`` inputs and ``n_out`` outputs."""
    return _tracer().new_local_op(n_in, n_out)


# ------------------------------------------------------------------------ the tracer

_BUILTINS = {len, min, max, abs, range, tuple, int, float, sum, all, any, zip, enumerate}


class _Path:
    """What one run of a body collected along one path."""

    def __init__(self) -> None:
        self.conditions: list[tuple[Expr, SourceLoc | None]] = []  # guards, in order
        self.constraints: list[tuple[str, Any, SourceLoc | None]] = []
        self.locals: list[tuple[str, str]] = []  # (name, kind) in creation order
        self.aliases: dict[int, tuple[str, SymPattern]] = {}
        self.used_names: set[str] = set()
        self.auto_named: set[str] = set()  # locals still carrying a generated name
        self.local_locs: dict[str, SourceLoc] = {}  # where each var()/Op() was made


class _Tracer:
    """Runs a rewritten body along every path and turns each run into calculus."""

    def __init__(
        self,
        owner: str,
        params: list[str],
        code_objects: set[CodeType],
        lines: list[str],
        file: str,
        self_fn: PatternFunction | None,
    ):
        self.owner = owner
        self.params = params
        self.param_kinds: dict[str, set[str]] = {p: set() for p in params}
        self.code_objects = code_objects
        self.lines = lines
        self.file = file
        self.self_fn = self_fn
        self.path = _Path()
        self.schedule: list[bool] = []
        self.decisions: list[bool] = []

    # --- source locations ---
    def loc(self, line: int | None = None) -> SourceLoc:
        if line is None:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code not in self.code_objects:
                frame = frame.f_back
            line = frame.f_lineno if frame is not None else 0
        text = self.lines[line - 1].rstrip("\n") if 0 < line <= len(self.lines) else ""
        return SourceLoc(self.file, line, text.strip())

    # --- variables ---
    def fresh_name(self, hint: str) -> str:
        name = hint
        n = 1
        while name in self.path.used_names or name in self.params:
            name = f"{hint}_{n}"
            n += 1
        self.path.used_names.add(name)
        return name

    def new_local(self) -> SymPattern:
        name = self.fresh_name("v")
        self.path.locals.append((name, "term"))
        self.path.auto_named.add(name)
        self.path.local_locs[name] = self.loc()
        return SymPattern(self, "var", name)

    def new_local_op(self, n_in: int | None, n_out: int | None) -> SymOp:
        if n_in is not None and (not isinstance(n_in, int) or n_in < 0):
            definition_error("Op(n_in, n_out): n_in must be a non-negative int")
        if n_out is not None and (not isinstance(n_out, int) or n_out < 1):
            definition_error("Op(n_in, n_out): n_out must be a positive int")
        name = self.fresh_name("F")
        self.path.locals.append((name, "op"))
        self.path.auto_named.add(name)
        self.path.local_locs[name] = self.loc()
        return SymOp(self, name, n_in, n_out)

    def rename_local(self, old: str, new_hint: str) -> str:
        """``y = var()``: give the local the Python name the user chose."""
        for i, (name, kind) in enumerate(self.path.locals):
            if name == old:
                self.path.used_names.discard(old)
                new = self.fresh_name(new_hint)
                self.path.locals[i] = (new, kind)
                if old in self.path.local_locs:
                    self.path.local_locs[new] = self.path.local_locs.pop(old)
                return new
        return old

    def is_param(self, name: str) -> bool:
        return name in self.param_kinds

    def use_param(self, name: str, kind: str) -> None:
        if name in self.param_kinds:
            self.param_kinds[name].add(kind)

    def name_of(self, sym: SymPattern) -> str:
        """The variable standing for ``sym`` in guards (an alias gets a fresh variable)."""
        if sym.kind == "var":
            return sym.data
        if self.mode == "rule":
            definition_error("guards in rules can only read attributes of pattern variables")
        entry = self.path.aliases.get(id(sym))
        if entry is None:
            name = self.fresh_name(sym.hint or "t")
            self.path.locals.append((name, "term"))
            entry = (name, sym)
            self.path.aliases[id(sym)] = entry
        return entry[0]

    # --- applications ---
    def apply_op(self, operator: Operator, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if operator.n_in is not None and len(args) != operator.n_in:
            definition_error(f"{operator.name} takes {operator.n_in} inputs, got {len(args)}")
        unknown = set(kwargs) - set(operator.attrs)
        if unknown:
            definition_error(f"{operator.name} has no attribute(s) {sorted(unknown)}")
        outs = [
            SymPattern(self, "app", (operator, args, i, dict(kwargs)))
            for i in range(operator.n_out)
        ]
        return outs[0] if operator.n_out == 1 else tuple(outs)

    def apply_opvar(
        self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], sym_op: SymOp | None = None
    ) -> Any:
        if kwargs:
            definition_error("operator variables take no attributes")
        if sym_op is None:
            self.use_param(name, "op")
            n_out = 1
        else:
            if sym_op.var_n_in is not None and len(args) != sym_op.var_n_in:
                definition_error(
                    f"{name} was declared with {sym_op.var_n_in} inputs, got {len(args)}"
                )
            n_out = sym_op.var_n_out or 1
        outs = [
            SymPattern(
                self, "funvar", (name, args, i, sym_op.var_n_out if sym_op is not None else None)
            )
            for i in range(n_out)
        ]
        return outs[0] if n_out == 1 else tuple(outs)

    def call_pattern(self, fn: PatternFunction, args: tuple[Any, ...]) -> SymPattern:
        return SymPattern(self, "call", (fn, args))

    # --- the runtime called by rewritten code (``__pm__.*``) ---
    def assert_(self, test: Any, line: int) -> None:
        if isinstance(test, Sym):
            self.path.conditions.append((to_expr(test), self.loc(line)))
        elif not test:
            raise _InfeasiblePath()

    def branch(self, test: Any, line: int) -> bool:
        if not isinstance(test, Sym):
            return bool(test)
        expr = to_expr(test)
        i = len(self.decisions)
        choice = self.schedule[i] if i < len(self.schedule) else True
        self.decisions.append(choice)
        self.path.conditions.append((expr if choice else ENot(expr), self.loc(line)))
        return choice

    def constrain(self, x: Any, p: Any, line: int) -> None:
        loc = self.loc(line)
        if not (isinstance(x, SymPattern) and x.kind == "var"):
            raise PatternDefinitionError(
                "the left side of a match constraint `x <= p` must be a pattern variable", loc
            )
        self.use_param(x.data, "term")
        self.path.constraints.append((x.data, p, loc))

    def and_(self, line: int, *thunks: Callable[[], Any]) -> Any:
        symbolic: list[Expr] = []
        for thunk in thunks:
            value = thunk()
            if isinstance(value, Sym):
                symbolic.append(to_expr(value))
            elif not value:
                return value
        if not symbolic:
            return value
        return SymExpr(symbolic[0] if len(symbolic) == 1 else EAnd(tuple(symbolic)))

    def or_(self, line: int, *thunks: Callable[[], Any]) -> Any:
        symbolic: list[Expr] = []
        for thunk in thunks:
            value = thunk()
            if isinstance(value, Sym):
                symbolic.append(to_expr(value))
            elif value:
                return value
        if not symbolic:
            return value
        return SymExpr(symbolic[0] if len(symbolic) == 1 else EOr(tuple(symbolic)))

    def not_(self, value: Any, line: int) -> Any:
        return SymExpr(ENot(to_expr(value))) if isinstance(value, Sym) else not value

    def in_(self, a: Any, b: Any) -> Any:
        if isinstance(a, Sym) or isinstance(b, Sym) or _has_sym(b):
            return SymExpr(ECmp("in", to_expr(a), to_expr(b)))
        return a in b

    def not_in(self, a: Any, b: Any) -> Any:
        if isinstance(a, Sym) or isinstance(b, Sym) or _has_sym(b):
            return SymExpr(ECmp("not in", to_expr(a), to_expr(b)))
        return a not in b

    def is_(self, a: Any, b: Any) -> Any:
        if isinstance(a, SymExpr) or isinstance(b, SymExpr):
            return SymExpr(ECmp("==", to_expr(a), to_expr(b)))
        return a is b

    def is_not(self, a: Any, b: Any) -> Any:
        if isinstance(a, SymExpr) or isinstance(b, SymExpr):
            return SymExpr(ECmp("!=", to_expr(a), to_expr(b)))
        return a is not b

    def named(self, value: Any, name: str) -> Any:
        auto = self.path.auto_named
        if isinstance(value, SymPattern):
            if value.kind == "var" and value.data in auto:
                auto.discard(value.data)
                value.data = self.rename_local(value.data, name)
            elif value.kind != "var" and value.hint is None:
                value.hint = name
        elif isinstance(value, SymOp) and value.var_name in auto:
            auto.discard(value.var_name)
            value.var_name = self.rename_local(value.var_name, name)
        return value

    def call(self, fn: Any, line: int) -> Callable[..., Any]:
        if isinstance(fn, Operator):
            return lambda *a, **k: self.apply_op(fn, a, k)
        if isinstance(fn, PatternFunction):
            if self.mode == "rule":
                raise PatternDefinitionError(
                    f"rule results cannot use pattern {fn.name}; build the replacement from "
                    "operators",
                    self.loc(line),
                )
            return lambda *a, **k: (
                self.call_pattern(fn, a)
                if not k
                else definition_error(f"pattern {fn.name} takes positional arguments only")
            )
        if isinstance(fn, SymPattern | SymOp):
            return fn
        if fn in (var, Op, opclass) or fn is _terms.const:
            return fn
        if fn in _BUILTINS:
            builtin_name = getattr(fn, "__name__", "")

            def builtin(*a: Any, **k: Any) -> Any:
                if any(isinstance(x, Sym) for x in a) and builtin_name in GUARD_FNS and not k:
                    return SymExpr(ECall(GUARD_FNS[builtin_name], tuple(to_expr(x) for x in a)))
                return fn(*a, **k)

            return builtin
        for g in GUARD_FNS.values():
            if g.fn is fn or getattr(g.fn, "__wrapped__", None) is fn:
                gfn = g
                return lambda *a: (
                    SymExpr(ECall(gfn, tuple(to_expr(x) for x in a)))
                    if any(isinstance(x, Sym) or _has_sym(x) for x in a)
                    else fn(*a)
                )
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise PatternDefinitionError(
            f"call to unknown function {name!r}: pattern and rule bodies may call operators, "
            "patterns, operator variables, var(), Op(), opclass(), len/min/max/abs and "
            "functions registered with @pm.guard_fn",
            self.loc(line),
        )

    mode = "pattern"


class _InfeasiblePath(Exception):
    """``assert False`` on a path: the path contributes no alternate."""


def _has_sym(value: Any) -> bool:
    return isinstance(value, tuple | list) and any(isinstance(v, Sym) for v in value)


def _explore(tracer: _Tracer, fn: FunctionType, args: list[Any]) -> list[tuple[_Path, Any]]:
    """Run ``fn`` once per path (depth-first, the true branch first)."""
    results: list[tuple[_Path, Any]] = []
    schedule: list[bool] = []
    previous = getattr(_active, "tracer", None)
    _active.tracer = tracer
    saved_loc = _symbolic.current_loc
    _symbolic.current_loc = tracer.loc
    try:
        while True:
            tracer.path = _Path()
            tracer.path.used_names = set(tracer.params)
            tracer.schedule = schedule
            tracer.decisions = []
            try:
                result = fn(*args)
                results.append((tracer.path, result))
            except _InfeasiblePath:
                pass
            except PatternDefinitionError:
                raise
            except RecursionError:
                raise
            except Exception as exc:
                loc = _exception_loc(exc, tracer)
                raise PatternDefinitionError(
                    f"error while tracing {tracer.owner}: {type(exc).__name__}: {exc}", loc
                ) from exc
            decisions = tracer.decisions
            while decisions and decisions[-1] is False:
                decisions.pop()
            if not decisions:
                return results
            schedule = decisions[:-1] + [False]
    finally:
        _active.tracer = previous
        _symbolic.current_loc = saved_loc


def _exception_loc(exc: BaseException, tracer: _Tracer) -> SourceLoc | None:
    tb = exc.__traceback__
    line = None
    while tb is not None:
        if tb.tb_frame.f_code in tracer.code_objects:
            line = tb.tb_lineno
        tb = tb.tb_next
    return tracer.loc(line) if line is not None else None


# ------------------------------------------------------------- from symbols to calculus


class _PatternBuilder:
    """Turns one traced path of a pattern body into a core-calculus alternate."""

    def __init__(self, tracer: _Tracer, path: _Path, self_fn: PatternFunction):
        self.tracer = tracer
        self.path = path
        self.self_fn = self_fn
        self.extra_locals: list[tuple[str, str]] = []
        self.pending: list[tuple[str, Pattern, SourceLoc | None]] = []
        self.scheduled: set[int] = set()

    def fresh(self, hint: str) -> str:
        name = self.tracer.fresh_name(hint)
        self.extra_locals.append((name, "term"))
        return name

    def convert(self, value: Any, *, top: bool = False) -> Pattern:
        if isinstance(value, SymPattern):
            alias = self.path.aliases.get(id(value))
            if alias is not None and not top:
                if id(value) not in self.scheduled:
                    self.scheduled.add(id(value))
                    self.pending.append((alias[0], self.convert(value, top=True), None))
                return PVar(alias[0])
            kind, data = value.kind, value.data
            if kind == "var":
                self.tracer.use_param(data, "term")
                return PVar(data)
            if kind == "app":
                operator, args, index, attrs = data
                pat: Pattern = PApp(operator, tuple(self.convert(a) for a in args), index)
                if attrs:
                    # Conv(x, w, stride=2): name the application and guard its attributes.
                    v = self.fresh(value.hint or operator.name.lower())
                    guard = EAnd(
                        tuple(ECmp("==", EAttr(v, k), to_expr(a)) for k, a in attrs.items())
                    )
                    self.pending.append((v, PGuard(pat, guard, self.tracer.loc(None)), None))
                    return PVar(v)
                return pat
            if kind == "funvar":
                name, args, index, n_out = data
                return PFunVar(name, tuple(self.convert(a) for a in args), index, n_out)
            if kind == "call":
                return self.convert_call(*data)
            if kind == "const":
                return PConst(data)
        if isinstance(value, SymOp):
            definition_error(f"operator variable {value.var_name} used where a pattern is expected")
        if isinstance(value, Term) and value.op is CONST:
            return PConst(value.attrs["value"])
        if isinstance(value, bool | int | float):
            return PConst(value)
        if isinstance(value, Operator):
            definition_error(f"operator {value.name} used without arguments; call it")
        if isinstance(value, PatternFunction):
            definition_error(f"pattern {value.name} used without arguments; call it")
        definition_error(f"cannot use {value!r} of type {type(value).__name__} in a pattern")

    def convert_call(self, fn: PatternFunction, args: tuple[Any, ...]) -> Pattern:
        recursive = fn is self.self_fn
        if recursive:
            params = None
            arity = len(self.tracer.params)
        else:
            definition = fn.definition
            params = definition.params
            arity = len(params)
        if len(args) != arity:
            definition_error(f"pattern {fn.name} takes {arity} arguments, got {len(args)}")
        actuals: list[Arg] = []
        constraints: list[tuple[str, Pattern]] = []
        for i, a in enumerate(args):
            kind = params[i].kind if params is not None else None
            if isinstance(a, SymPattern) and a.kind == "var" and id(a) not in self.path.aliases:
                if kind is not None:
                    self.tracer.use_param(a.data, kind)
                actuals.append(a.data)
            elif isinstance(a, SymOp):
                actuals.append(a.var_name)
            elif isinstance(a, Operator) and kind in ("op", None):
                actuals.append(a)
            else:
                if kind == "op":
                    definition_error(
                        f"argument {i + 1} of {fn.name} is an operator parameter; pass an "
                        "operator or an operator variable"
                    )
                v = self.fresh("arg")
                actuals.append(v)
                constraints.append((v, self.convert(a)))
        if recursive:
            pat: Pattern = PCall(fn.name, tuple(actuals))
        else:
            body = definition.body
            alts = body.body if isinstance(body, PMu) and body.name == fn.name else body
            pat = PMu(fn.name, params, tuple(actuals), alts)
        for v, p in constraints:
            pat = PConstr(pat, v, p)
        return pat

    def build(self, result: Any) -> Pattern:
        if result is None:
            definition_error(f"pattern {self.self_fn.name} must return a pattern on every path")
        body = self.convert(result)
        todo = [(x, self.convert(p), loc) for x, p, loc in self.path.constraints]
        while self.pending:  # constraints naming sub-patterns that guards read
            todo.append(self.pending.pop(0))
        # Check each constraint once its variable is bound (the written order otherwise), so
        # a constraint on a variable that only another constraint binds still works.
        bound = _bound_names(body)
        while todo:
            i = next((j for j, (x, _, _) in enumerate(todo) if x in bound), 0)
            x, p, loc = todo.pop(i)
            body = PConstr(body, x, p, loc)
            bound |= _bound_names(p) | {x}
        for alias, sym in self.path.aliases.values():
            if id(sym) not in self.scheduled:
                definition_error(
                    f"a guard reads {alias} (= {sym.hint or 'a sub-pattern'}), which is not part "
                    "of the returned pattern or of a match constraint"
                )
        for guard, loc in self.path.conditions:
            body = PGuard(body, guard, loc)
        bound = _bound_names(body)
        for name, _ in self.path.locals:
            if name not in bound:
                raise PatternDefinitionError(
                    f"local variable {name} is never bound: use it in the returned pattern or "
                    "inside a match constraint's pattern (an unbound local makes the pattern "
                    "fail on every term)",
                    self.path.local_locs.get(name),
                )
        for name, kind in reversed(self.path.locals + self.extra_locals):
            body = PExists(name, body, kind)  # type: ignore[arg-type]
        return body


def _bound_names(p: Pattern) -> set[str]:
    """Variables a pattern binds by matching (occurrences as PVar or as an F in F(...))."""
    match p:
        case PVar(n):
            return {n}
        case PApp(_, args):
            return set().union(*(_bound_names(a) for a in args))
        case PFunVar(v, args):
            return {v}.union(*(_bound_names(a) for a in args))
        case PAlt(left, right):
            return _bound_names(left) & _bound_names(right)
        case PGuard(pat) | PExists(_, pat):
            return _bound_names(pat)
        case PConstr(pat, _, c):
            return _bound_names(pat) | _bound_names(c)
        case PMu(_, _, args, _) | PCall(_, args):
            return {a for a in args if isinstance(a, str)}
    return set()


def _check_recursion(name: str, p: Pattern, loc: SourceLoc | None) -> None:
    """Every recursive reference must sit under an operator application, or in a match
    constraint on a variable bound under one (:func:`~pypm_jax.core.calculus.binds_below`)."""

    def walk(q: Pattern, guarded: bool) -> None:
        match q:
            case PCall(n) if n == name and not guarded:
                raise PatternDefinitionError(
                    f"pattern {name} reaches itself without consuming an operator application "
                    "(the recursion would not terminate); put the recursive call under an "
                    "operator",
                    loc,
                )
            case PConstr(pat, x, c):
                walk(pat, guarded)
                # ``y <= f(x); x <= P()``: x is a proper subterm, so P(...) consumes f
                walk(c, guarded or binds_below(pat, x))
                return
            case PMu(n) if n == name:
                return  # an inner definition of the same name: its references are its own
        below = guarded or isinstance(q, PApp | PFunVar)
        for c in children(q):
            walk(c, below)

    walk(p, False)


def _op_kind_exprs(e: Expr, op_vars: set[str]) -> Expr:
    """``f.op_class`` on an operator parameter is an operator attribute, not a term's."""
    if isinstance(e, EAttr):
        return EOpAttr(e.var, e.attr) if e.var in op_vars else e
    if isinstance(e, EConst | EOpAttr):
        return e
    changes = {}
    for f in dataclasses.fields(e):
        value = getattr(e, f.name)
        if isinstance(value, tuple) and f.name in ("items", "args"):
            changes[f.name] = tuple(_op_kind_exprs(v, op_vars) for v in value)
        elif f.name in ("left", "right", "operand", "base", "index"):
            changes[f.name] = _op_kind_exprs(value, op_vars)
    return dataclasses.replace(e, **changes)


def _fix_op_attrs(p: Pattern, op_vars: set[str]) -> Pattern:
    match p:
        case PGuard(pat, g, loc):
            return PGuard(_fix_op_attrs(pat, op_vars), _op_kind_exprs(g, op_vars), loc)
        case PExists(v, body, kind):
            return PExists(v, _fix_op_attrs(body, op_vars), kind)
        case PConstr(pat, v, c, loc):
            return PConstr(_fix_op_attrs(pat, op_vars), v, _fix_op_attrs(c, op_vars), loc)
        case PAlt(left, right):
            return PAlt(_fix_op_attrs(left, op_vars), _fix_op_attrs(right, op_vars))
    return p


# ------------------------------------------------------------------------ patterns

# The patterns being compiled, innermost last (to name a mutual recursion). Compiling holds
# ``_compile_lock``, so threads that first use a pattern at once compile it once, in turn,
# and one thread's compilation is never mistaken for another's recursion.
_compiling: list[PatternFunction] = []
_compile_lock = threading.RLock()


class PatternFunction:
    """What ``@pm.pattern`` returns: the alternates defined under one name.

    Call it inside another pattern to use it as a sub-pattern; ``.definition`` is the core
    calculus (:class:`PatternDef`), compiled on first use.
    """

    def __init__(self, fn: FunctionType):
        self.name = fn.__name__
        self.qualname = fn.__qualname__
        self.module = fn.__module__
        self.functions: list[FunctionType] = [fn]
        self._definition: PatternDef | None = None

    def add_alternate(self, fn: FunctionType) -> None:
        self.functions.append(fn)
        self._definition = None

    @property
    def params(self) -> tuple[Param, ...]:
        return self.definition.params

    @property
    def definition(self) -> PatternDef:
        if self._definition is not None:
            return self._definition
        with _compile_lock:
            if self._definition is None:
                if self in _compiling:
                    names = " -> ".join(p.name for p in [*_compiling, self])
                    raise PatternDefinitionError(
                        f"mutual recursion between patterns ({names}) is not supported; write "
                        "the recursion inside one pattern with alternates"
                    )
                _compiling.append(self)
                try:
                    self._definition = self._compile()
                finally:
                    _compiling.pop()
            return self._definition

    def _compile(self) -> PatternDef:
        param_names: list[str] | None = None
        alternates: list[Pattern] = []
        alt_locs: list[SourceLoc | None] = []
        kinds: dict[str, set[str]] = {}
        first_loc: SourceLoc | None = None
        for fn in self.functions:
            names = list(inspect.signature(fn).parameters)
            runtime = _Runtime()
            new_fn, codes, loc, lines = transform_function(fn, runtime)
            first_loc = first_loc or loc
            if param_names is None:
                param_names = names
                kinds = {n: set() for n in names}
            elif names != param_names:
                raise PatternDefinitionError(
                    f"alternate of pattern {self.name} has parameters {names}, but the first "
                    f"definition has {param_names}",
                    loc,
                )
            tracer = _Tracer(self.name, names, codes, lines, loc.file, self)
            runtime.tracer = tracer
            args = [SymPattern(tracer, "var", n) for n in names]
            for path, result in _explore(tracer, new_fn, args):
                tracer.path = path
                saved = _symbolic.current_loc
                _symbolic.current_loc = lambda t=tracer, line=loc.line: t.loc(line)
                try:
                    alternates.append(_PatternBuilder(tracer, path, self).build(result))
                finally:
                    _symbolic.current_loc = saved
                alt_locs.append(loc)
            for n, ks in tracer.param_kinds.items():
                kinds[n] |= ks
        assert param_names is not None  # at least one function
        if not alternates:
            raise PatternDefinitionError(
                f"pattern {self.name} has no feasible path (every path asserts False)", first_loc
            )
        for n, ks in kinds.items():
            if ks == {"term", "op"}:
                raise PatternDefinitionError(
                    f"parameter {n} of pattern {self.name} is used both as a term and as an "
                    "operator (called like a function)",
                    first_loc,
                )
        params = tuple(Param(n, "op" if "op" in kinds[n] else "term") for n in param_names)
        op_vars = {p.name for p in params if p.kind == "op"}
        if op_vars:
            alternates = [_fix_op_attrs(a, op_vars) for a in alternates]
        body: Pattern = alternates[-1]
        for alt in reversed(alternates[:-1]):
            body = PAlt(alt, body)
        if _mentions_call(body, self.name):
            _check_recursion(self.name, body, first_loc)
            body = PMu(self.name, params, tuple(p.name for p in params), body)
        return PatternDef(self.name, params, body, first_loc, tuple(alt_locs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tracer = getattr(_active, "tracer", None)
        if tracer is None or kwargs:
            raise PatternDefinitionError(
                f"pattern {self.name} can only be called inside another pattern's body; "
                f"use pm.match({self.name}, term) to match it"
            )
        return tracer.call_pattern(self, args)

    def __repr__(self) -> str:
        return f"<pattern {self.name} ({len(self.functions)} definition(s))>"


def _mentions_call(p: Pattern, name: str) -> bool:
    """Does ``p`` refer to the pattern ``name`` being defined (outside a definition of the
    same name)? A called pattern's definition ``μQ`` is not looked into: its body, made by
    this frontend, refers only to ``Q`` itself and, inside their own ``μ``, to the patterns
    it calls, so it never refers to another name unbound."""
    if isinstance(p, PCall):
        return p.name == name
    return any(_mentions_call(c, name) for c in children(p, into_mu=False))


class _Runtime:
    """The object rewritten bodies call as ``__pm__``; forwards to the active tracer."""

    tracer: _Tracer

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tracer, name)


def pattern(fn: FunctionType) -> PatternFunction:
    """Define a pattern; a second definition under the same name adds an alternate."""
    if not isinstance(fn, FunctionType):
        raise PatternDefinitionError("@pattern decorates a function")
    existing = sys._getframe(1).f_locals.get(fn.__name__)
    if isinstance(existing, PatternFunction) and existing.qualname == fn.__qualname__:
        existing.add_alternate(fn)
        return existing
    return PatternFunction(fn)


# ---------------------------------------------------------------------------- rules


class Rule:
    """What ``@pm.rule(P)`` returns; ``.definition`` is the core :class:`RuleDef`."""

    def __init__(self, pattern: Any, fn: FunctionType, name: str | None, single_use: bool):
        self.pattern = pattern
        self.fn = fn
        self.name = name or fn.__name__
        self.single_use = single_use
        self._definition: RuleDef | None = None

    @property
    def definition(self) -> RuleDef:
        if self._definition is not None:
            return self._definition
        with _compile_lock:  # one RuleDef per rule, however many threads first use it
            if self._definition is None:
                self._definition = self._compile()
            return self._definition

    def _compile(self) -> RuleDef:
        pdef = as_pattern_def(self.pattern)
        kinds = {p.name: p.kind for p in pdef.params}
        names = list(inspect.signature(self.fn).parameters)
        runtime = _Runtime()
        new_fn, codes, loc, lines = transform_function(self.fn, runtime)
        unknown = [n for n in names if n not in kinds]
        if unknown:
            raise PatternDefinitionError(
                f"rule {self.name}: parameter(s) {unknown} are not parameters of pattern "
                f"{pdef.name} ({[p.name for p in pdef.params]})",
                loc,
            )
        tracer = _Tracer(self.name, names, codes, lines, loc.file, None)
        tracer.mode = "rule"
        runtime.tracer = tracer
        args = [
            SymOp(tracer, n, None, None) if kinds[n] == "op" else SymPattern(tracer, "var", n)
            for n in names
        ]
        branches: list[RuleBranch] = []
        for path, result in _explore(tracer, new_fn, args):
            if result is None:
                continue  # a path that returns nothing: the rule does not fire there
            saved = _symbolic.current_loc
            _symbolic.current_loc = lambda t=tracer, line=loc.line: t.loc(line)
            try:
                rhs = _to_rhs(result, set(names))
            finally:
                _symbolic.current_loc = saved
            guards = tuple(g for g, _ in path.conditions)
            guard: Expr = (
                EConst(True) if not guards else guards[0] if len(guards) == 1 else EAnd(guards)
            )
            op_vars = {n for n in names if kinds[n] == "op"}
            guard_locs = tuple(where for _, where in path.conditions)
            branches.append(RuleBranch(_op_kind_exprs(guard, op_vars), rhs, loc, guard_locs))
        if not branches:
            raise PatternDefinitionError(f"rule {self.name} returns nothing on every path", loc)
        return RuleDef(self.name, pdef, tuple(branches), self.single_use, loc)

    def __repr__(self) -> str:
        return f"<rule {self.name} for pattern {getattr(self.pattern, 'name', '?')}>"


def _to_rhs(value: Any, params: set[str]) -> Rhs:
    if isinstance(value, SymPattern):
        if value.kind == "var":
            if value.data not in params:
                definition_error(f"variable {value.data} is not bound in the rule")
            return RVar(value.data)
        if value.kind == "app":
            operator, args, index, attrs = value.data
            return RApp(
                operator,
                tuple(_to_rhs(a, params) for a in args),
                tuple((k, to_expr(v)) for k, v in attrs.items()),
                index,
            )
        definition_error("a rule's result must be built from operators and pattern variables")
    if isinstance(value, tuple):
        return RTuple(tuple(_to_rhs(v, params) for v in value))
    if isinstance(value, Term) and value.op is CONST:
        return RConst(value.attrs["value"])
    if isinstance(value, bool | int | float):
        return RConst(value)
    if isinstance(value, SymOp):
        definition_error("operator variables cannot be returned from a rule; apply an operator")
    definition_error(f"cannot use {value!r} in a rule's result")


def rule(
    pattern: Any, *, name: str | None = None, single_use: bool = False
) -> Callable[[FunctionType], Rule]:
    """``@pm.rule(P)``: a rewrite for matches of P. Asserts and if/elif branches choose the
    replacement; the first rule whose guards pass fires."""
    if not isinstance(pattern, PatternFunction | PatternDef):
        raise PatternDefinitionError(f"@rule needs a pattern, got {pattern!r}")

    def deco(fn: FunctionType) -> Rule:
        return Rule(pattern, fn, name, single_use)

    return deco


def as_pattern_def(p: Any) -> PatternDef:
    if isinstance(p, PatternDef):
        return p
    if isinstance(p, PatternFunction):
        return p.definition
    raise TypeError(f"expected a pattern (from @pm.pattern or pm.deserialize), got {p!r}")


def as_rule_def(r: Any) -> RuleDef:
    if isinstance(r, RuleDef):
        return r
    if isinstance(r, Rule):
        return r.definition
    raise TypeError(f"expected a rule (from @pm.rule or pm.deserialize), got {r!r}")


def _install() -> None:
    """Applying an operator to symbolic values inside a traced body builds a pattern."""

    def symbolic_apply(operator: Operator, args: tuple[Any, ...], attrs: dict[str, Any]) -> Any:
        return _tracer().apply_op(operator, args, attrs)

    _terms._symbolic_apply = symbolic_apply


_install()
_ = show  # printing is re-exported by the facade
