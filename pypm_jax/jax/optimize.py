"""``pm.optimize``: trace, lift, rewrite (bodies of scan/while/cond too), lower, ``jax.jit``.

``optimize(fn)`` behaves like ``jax.jit(fn)``: pytrees in and out, every ``jax.jit`` option
(static and donated arguments, shardings, ...), one trace per signature (treedef, avals,
static values). Rewriting never makes a program fail or compute something else silently:
any failure before the rewritten program runs (rewriting, lowering, tracing or compiling it)
falls back to the original program with an
:class:`~pypm_jax.jax.report.OptimizationFallbackWarning` naming the cause; a failure to
transform the rewritten program (``jax.jvp`` of a kernel without forward mode) falls back
for that call only. An error raised while the program runs (a callback, a runtime check)
propagates unchanged, as under ``jax.jit``: the program is never run a second time, so its
effects happen once. ``verify=True`` additionally compares both programs on the first
concrete inputs of each signature and raises a
:class:`~pypm_jax.jax.report.VerificationError` naming the rewrite that changed the result."""

from __future__ import annotations

__all__ = ["optimize", "Optimized", "rewrite_nested"]

import contextlib
import functools
import gc
import inspect
import logging
import os
import time
import warnings
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from ..core.calculus import PatternDef, RuleDef
from ..core.errors import RuleError
from ..core.graph import Value
from ..core.source import user_stacklevel
from ..core.terms import LEAF
from ..engine.rewrite import RewriteRecord, RewriteResult, printable, rewrite
from ..lang.frontend import PatternFunction, Rule, as_rule_def
from ..vocab.impls import KERNEL_IMPLS
from . import _compat
from .lift import LiftedProgram, eqn_info, lift
from .lower import lower
from .report import (
    OptimizationFallbackWarning,
    OptimizeReport,
    RuleDisabledWarning,
    VerificationError,
    compare,
    fused_calls,
)

log = logging.getLogger("pypm_jax.optimize")

# Every optimized function verifies (as with ``verify=True``) when this is true: set by
# ``PYPM_VERIFY=1`` at import, or by the pytest plugin's ``--pypm-verify``.
VERIFY_ALL = os.environ.get("PYPM_VERIFY", "") not in ("", "0")

# ------------------------------------------------------------------------------ rewriting


# Cheap to keep for other readers: moving, casting, comparing and combining values (the
# masks several attention layers share), never arithmetic, reductions or contractions.
_PLUMBING_CLASSES = frozenset({"layout", "conversion", "select"})
_PLUMBING_OPS = frozenset({"and", "or", "not", "xor", "eq", "ne", "lt", "le", "gt", "ge"})


def mask_plumbing(node: Any) -> bool:
    """Is ``node`` a JAX primitive that only moves, casts, compares or combines values?

    ``rewrite``'s ``shareable``: a single-use rule may then leave such interior nodes to the
    other readers -- e.g. ``jax.nn.dot_product_attention``'s regrouped mask, one value for
    every layer that passes the same mask -- as long as the match's part they depend on is
    such nodes too (so never scores or probabilities).
    """
    op = node.op
    if op.namespace != "jax":
        return False
    cls = op.op_class
    return op.name in _PLUMBING_OPS or (cls is not None and cls.name in _PLUMBING_CLASSES)


def rewrite_nested(target: Any, rules: Sequence[Any], **options: Any) -> RewriteResult:
    """Rewrite a lifted program (or graph) and every scan/while/cond body inside it.

    The report lists the outer program's rewrites first, then each body's (depth first, in
    node order); the canonicalizing ones are in its ``canonical``. ``options`` go to :func:`pypm_jax.engine.rewrite.rewrite` (``max_iterations``,
    ``engine``, ``shareable``: by default :func:`mask_plumbing`; ``check_types``: by default
    on, a rule replacing a value by one of another type raises
    :class:`~pypm_jax.core.errors.RuleError`; ``weak_type``: by default the lifted avals').
    """
    defs = [as_rule_def(r) for r in rules]
    options.setdefault("shareable", mask_plumbing)
    options.setdefault("check_types", True)
    graph = target.graph if isinstance(target, LiftedProgram) else target
    records: list[RewriteRecord] = []
    stack = [target]
    while stack:
        t = stack.pop()
        g, opts = t, options
        if isinstance(t, LiftedProgram):
            g = t.graph
            if "weak_type" not in options:
                opts = {**options, "weak_type": weak_types(t)}
        result = rewrite(g, defs, **opts)
        records.extend(result.report)
        bodies = []
        for node in result.graph.nodes():
            for value in node.attrs.values():
                if isinstance(value, LiftedProgram):
                    bodies.append(value)
                elif isinstance(value, tuple):
                    for b in value:
                        if isinstance(b, LiftedProgram):
                            bodies.append(b)
        stack.extend(reversed(bodies))
    return RewriteResult(graph, OptimizeReport.of(records))


def weak_types(prog: LiftedProgram) -> Callable[[Value], bool | None]:
    """The JAX weak type of a value of ``prog``'s graph: known for its inputs and the values
    lifted from equations, unknown (None) for what a rule built."""
    inputs = {
        id(v): getattr(a, "weak_type", None)
        for v, a in zip(prog.inputs, prog.in_avals, strict=False)
    }

    def weak_type(v: Value) -> bool | None:
        node = v.node
        if node.op is LEAF and not node.inputs:
            return inputs.get(id(v))
        info = eqn_info(node)
        if info is None or v.index >= len(info.avals):
            return None
        return getattr(info.avals[v.index], "weak_type", None)

    return weak_type


def _rule_name(r: Any) -> str:
    """``name (file:line)`` of a rule as ``@pm.rule`` made it (the line of its ``def``,
    where the rule's own location points)."""
    fn = getattr(r, "fn", None)
    code = getattr(fn, "__code__", None)
    where = ""
    if code is not None:
        line = code.co_firstlineno
        try:
            lines, start = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            pass
        else:
            line = next(
                (start + i for i, t in enumerate(lines) if t.lstrip().startswith("def ")), line
            )
        where = f" ({code.co_filename}:{line})"
    return f"{getattr(r, 'name', None) or r!r}{where}"


def _check_rules(rules: Any) -> list[Any]:
    """The rules as a list; anything in it that is not a rule (a pattern) is a TypeError
    naming it."""
    if isinstance(rules, str) or not isinstance(rules, Iterable):
        raise TypeError(f"pm.optimize: rules must be a list of rules, got {rules!r}")
    rules = list(rules)
    for i, r in enumerate(rules):
        if isinstance(r, Rule | RuleDef):
            continue
        what = repr(r)
        if isinstance(r, PatternFunction | PatternDef):
            try:
                loc = r.loc if isinstance(r, PatternDef) else r.definition.loc
            except Exception:  # noqa: BLE001 - a pattern that does not compile: no line
                loc = None
            what = f"the pattern {r.name}" + (f" ({loc})" if loc is not None else "")
        raise TypeError(
            f"pm.optimize: rules[{i}] is {what}, not a rule; a rule is made with "
            "@pm.rule(Pattern) (or loaded with pm.deserialize)"
        )
    return rules


# ------------------------------------------------------------------------------ signatures


def _aval_key(x: Any) -> Hashable:
    try:
        t = jax.typeof(x)
    except TypeError as exc:
        raise TypeError(f"pm.optimize: argument {x!r} is not a JAX type ({exc})") from None
    return (tuple(t.shape), str(t.dtype), bool(getattr(t, "weak_type", False)))


def _norm_static(static_argnums: Sequence[int], nargs: int) -> tuple[int, ...]:
    """The static positions among ``nargs`` positional arguments (negative ones count from
    the end); a position past them is an argument given by name, or not at all, as in jit."""
    return tuple(sorted({i + nargs if i < 0 else i for i in static_argnums} & set(range(nargs))))


# ``jax.jit``'s options, passed on to the one ``jax.jit`` an optimized function runs under.
JIT_OPTIONS = (
    "in_shardings",
    "out_shardings",
    "static_argnums",
    "static_argnames",
    "donate_argnums",
    "donate_argnames",
    "keep_unused",
    "device",
    "backend",
    "inline",
    "compiler_options",
)
# ``pypm_jax.engine.rewrite.rewrite``'s options.
REWRITE_OPTIONS = tuple(
    name
    for name, p in inspect.signature(rewrite).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
)


def _check_options(options: dict[str, Any]) -> None:
    """An option that is neither ``jax.jit``'s nor the rewrite driver's is a TypeError now,
    as ``jax.jit`` raises one, not a failure at the first call."""
    for name in options:
        if name not in JIT_OPTIONS and name not in REWRITE_OPTIONS:
            raise TypeError(
                f"pm.optimize() got an unexpected keyword argument {name!r} (it takes "
                f"jax.jit's options {', '.join(JIT_OPTIONS)}, the rewrite options "
                f"{', '.join(REWRITE_OPTIONS)}, rules and verify)"
            )


def _as_tuple(x: Any) -> tuple[Any, ...]:
    if x is None:
        return ()
    return (x,) if isinstance(x, int | str) else tuple(x)


def _static_args(fn: Any, nums: Any, names: Any) -> tuple[tuple[int, ...], frozenset[str]]:
    """Static positions and names as ``jax.jit`` infers them from ``fn``'s signature: a
    static name is also static by its position and a static position by its name."""
    nums, names = _as_tuple(nums), _as_tuple(names)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature (a builtin): only what was given
        return nums, frozenset(names)
    named = [
        (i, p.name)
        for i, p in enumerate(params)
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    nums = nums + tuple(i for i, name in named if name in names and i not in nums)
    names = names + tuple(name for i, name in named if i in nums and name not in names)
    return nums, frozenset(names)


@dataclass(eq=False)
class _Entry:
    """One signature: the original program, the rewritten one, and what happened."""

    closed: Any  # ClosedJaxpr of the flattened function
    out_tree: Any
    run: Callable[..., list[Any]] | None = None  # the rewritten program (its checked jaxpr)
    records: list[RewriteRecord] = field(default_factory=list)
    fallback: str | None = None
    disabled: list[str] = field(default_factory=list)  # why each rule was left out
    fused: list[str] = field(default_factory=list)  # fused kernels the program already calls
    verified: bool = False
    compiles: bool = False  # the rewritten program is known to compile (see _recover)

    def report(self) -> OptimizeReport:
        return OptimizeReport.of(self.records, self.fallback, self.disabled, self.fused)

    def original(self, *flat: Any) -> list[Any]:
        return _compat.jaxpr_as_fun(self.closed)(*flat)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _signature(flat: Sequence[Any]) -> str:
    """``(f32[2,8,64], i32[2,8])``: the first few flattened arguments' types."""
    shown = []
    for x in flat[:4]:
        try:
            shown.append(jax.typeof(x).str_short(short_dtypes=True))
        except Exception:  # noqa: BLE001 - only a log line: never fail on it
            shown.append(type(x).__name__)
    more = f", ... ({len(flat)} arrays)" if len(flat) > 4 else ""
    return f"({', '.join(shown)}{more})"


def _rewrites(report: OptimizeReport) -> str:
    """``24 rewrites (attention_bias x12, gemm_epilogue x12)``."""
    what = printable(", ".join(f"{rule} x{n}" for rule, n in report.counts().items()))
    n = len(report)
    return f"{n} rewrite{'' if n == 1 else 's'} ({what})" if n else "no rewrites"


def _has_tracers(values: Sequence[Any]) -> bool:
    return _compat.has_tracers(values)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Optimized:
    """A function optimized by :func:`optimize`; call it like the original.

    Calls go through one ``jax.jit`` (its C++ dispatch and cache: no per-call Python work
    beyond jit's own); tracing that ``jit`` is where the work happens, once per signature:
    trace ``fn`` to a jaxpr, lift, rewrite, lower, trace the lowered program under a ``jax.jit``
    of its own and check its types, then call that ``jit`` on the tracers (one call equation,
    reusing the checked trace), or evaluate the original jaxpr when anything failed.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        rules: Sequence[Any] | None = None,
        default_rules: Callable[[], Sequence[Any]] | None = None,
        verify: bool = False,
        **options: Any,
    ):
        if not callable(fn):
            raise TypeError(f"pm.optimize needs a callable, got {fn!r}")
        _check_options(options)
        if rules is None and default_rules is None:
            raise TypeError(
                "pypm_jax.jax.optimize needs rules= or default_rules= (the bridge names no "
                "rule library; pm.optimize gives the standard rules when none are given)"
            )
        if default_rules is not None and not callable(default_rules):
            raise TypeError(f"default_rules must be a function giving rules, got {default_rules!r}")
        self.fn = fn
        self._rules = None if rules is None else _check_rules(rules)
        self._default_rules = default_rules
        self._defs: list[RuleDef] | None = None  # the rules that compile, as RuleDefs
        self.verify = verify
        self.jit_options = {k: v for k, v in options.items() if k in JIT_OPTIONS}
        self.rewrite_options = {k: v for k, v in options.items() if k in REWRITE_OPTIONS}
        self.static_argnums, self.static_argnames = _static_args(
            fn, options.get("static_argnums"), options.get("static_argnames")
        )
        self._cache: dict[Hashable, _Entry] = {}
        self._failed: set[Hashable] = set()  # signatures whose rewritten program failed
        self.traces = 0  # how many times ``fn`` was traced (one per signature)
        functools.update_wrapper(self, fn)
        # jit's own checks of its options (a static name fn does not take) happen here
        self._jitted = self._jit(self._traced)
        self._jitted_original = self._jit(self._traced_original)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    @property
    def rules(self) -> list[Any]:
        """The rules given, or else those ``default_rules()`` gives (asked once, on first
        use: the standard library is imported when the first signature is traced)."""
        if self._rules is None:
            assert self._default_rules is not None  # __init__ requires one of the two
            self._rules = _check_rules(self._default_rules())
        return self._rules

    def _rule_defs(self) -> list[RuleDef]:
        """The rules as RuleDefs, once; a rule whose body cannot be compiled is left out with
        a warning naming it and its line, and the others still apply."""
        if self._defs is None:
            defs = []
            for r in self.rules:
                try:
                    defs.append(as_rule_def(r))
                except Exception as exc:  # a broken rule: it alone is left out
                    self._disable(f"rule {_rule_name(r)} cannot be compiled: {_describe(exc)}")
            self._defs = defs
        return self._defs

    def _disable(self, why: str) -> None:
        warnings.warn(
            printable(f"pm.optimize({_name(self.fn)}): {why}; rewriting without it"),
            RuleDisabledWarning,
            stacklevel=user_stacklevel(),
        )

    # -- signatures

    def _static(self, nargs: int) -> tuple[int, ...]:
        return _norm_static(self.static_argnums, nargs) if self.static_argnums else ()

    def _key(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Hashable, Any, Any]:
        """(signature, dynamic leaves, their treedef) of a call."""
        static = self._static(len(args))
        static_vals = tuple((i, args[i]) for i in static)
        static_kw = tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames))
        dyn = tuple(a for i, a in enumerate(args) if i not in static)
        dyn_kw = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        flat, in_tree = jax.tree_util.tree_flatten((dyn, dyn_kw))
        avals = tuple(_aval_key(x) for x in flat)
        return (in_tree, avals, static_vals, static_kw), flat, in_tree

    def _jit(self, body: Callable[..., Any]) -> Any:
        """``jax.jit(body, **jit_options)``, ``body`` seen with ``fn``'s signature (jit infers
        static and donated names from positions and back, as it does for ``fn``)."""

        def traced(*args: Any, **kwargs: Any) -> Any:
            return body(*args, **kwargs)

        functools.update_wrapper(traced, self.fn)
        options = dict(self.jit_options)
        options["static_argnums"] = self.static_argnums
        options["static_argnames"] = tuple(sorted(self.static_argnames))
        return jax.jit(traced, **options)

    def _entry(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Entry, Any, Any]:
        key, flat, in_tree = self._key(args, kwargs)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(key, flat, in_tree, len(args))
            if not _has_tracers(entry.closed.consts):  # a closure over tracers: not reusable
                self._cache[key] = entry
        return entry, key, flat

    def _build(self, key: Hashable, flat: list[Any], in_tree: Any, nargs: int) -> _Entry:
        out_store: list[Any] = []
        fn = self.fn
        static_vals, static_kw = dict(key[2]), dict(key[3])

        def flat_fn(*leaves: Any) -> list[Any]:
            dyn, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            it = iter(dyn)
            full = [static_vals[i] if i in static_vals else next(it) for i in range(nargs)]
            out = fn(*full, **kwargs, **static_kw)
            out_flat, out_tree = jax.tree_util.tree_flatten(out)
            out_store.append(out_tree)
            return out_flat

        self.traces += 1
        t0 = time.perf_counter()
        closed = jax.make_jaxpr(flat_fn)(*flat)  # the user's errors propagate, as with jit
        entry = _Entry(closed=closed, out_tree=out_store[-1])
        try:
            with _gc_paused():
                t1 = time.perf_counter()
                prog, result, t2 = self._rewrite(closed, _input_names(in_tree, flat), entry)
                entry.records = [*result.report.canonical, *result.report]
                t3 = time.perf_counter()
                run = lower(prog, KERNEL_IMPLS)

                # trace the rewritten program on its own first: a failure (a kernel raising,
                # a wrong type) must not leave half a program in the caller's trace
                def rewritten(*xs: Any) -> list[Any]:
                    return run(*xs)

                program = jax.jit(rewritten)
                checked = program.trace(*flat)
                _check_out_avals(checked.jaxpr.out_avals, closed.out_avals)
                # the caller's trace calls it: jit reuses this trace (one call equation of
                # the checked program), so the rewritten program is traced once, not twice
                entry.run = program
            if log.isEnabledFor(logging.INFO):
                t4 = time.perf_counter()
                log.info(
                    "pm.optimize(%s) for %s: traced in %.0f ms, lifted %d nodes in %.0f ms, "
                    "%s in %.0f ms, lowered and traced again in %.0f ms",
                    _name(self.fn), _signature(flat), (t1 - t0) * 1e3, len(prog.graph),
                    (t2 - t1) * 1e3, _rewrites(entry.report()), (t3 - t2) * 1e3, (t4 - t3) * 1e3,
                )  # fmt: skip
        except Exception as exc:  # any failure: the original program, and say why
            self._fall_back(entry, f"rewriting failed: {_describe(exc)}")
        return entry

    def _rewrite(
        self, closed: Any, in_names: list[str], entry: _Entry
    ) -> tuple[LiftedProgram, RewriteResult, float]:
        """Lift and rewrite; a rule that fails (its result cannot be built, or has another
        type than what it replaces) is left out for this signature, with a warning naming
        it, and the program is rewritten again from the start without it. Returns the
        rewritten program, the result and when the last lifting ended."""
        defs = self._rule_defs()
        while True:
            prog = lift(closed, in_names=in_names)
            lifted = time.perf_counter()
            entry.fused = fused_calls(prog)
            try:
                return prog, rewrite_nested(prog, defs, **self.rewrite_options), lifted
            except RuleError as exc:
                if not any(d is exc.rule for d in defs):
                    raise
                defs = [d for d in defs if d is not exc.rule]
                entry.disabled.append(str(exc))
                self._disable(str(exc))

    def _fall_back(self, entry: _Entry, why: str) -> None:
        """Run the original program for this signature from now on, and warn once."""
        entry.fallback = why
        entry.run = None
        warnings.warn(
            printable(f"pm.optimize({_name(self.fn)}): {why}; running the original program"),
            OptimizationFallbackWarning,
            stacklevel=user_stacklevel(),
        )

    # -- calling

    def _traced(self, *args: Any, **kwargs: Any) -> Any:
        """The body of the ``jax.jit``: runs once per signature, on tracers."""
        entry, key, flat = self._entry(args, kwargs)
        if entry.run is not None and key not in self._failed:
            out = entry.run(*flat)
        else:
            out = entry.original(*flat)
        return jax.tree_util.tree_unflatten(entry.out_tree, out)

    def _traced_original(self, *args: Any, **kwargs: Any) -> Any:
        """The body of the second ``jax.jit``: the original program (see :meth:`_retry`)."""
        entry, _, flat = self._entry(args, kwargs)
        return jax.tree_util.tree_unflatten(entry.out_tree, entry.original(*flat))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        expected = self._expected(args, kwargs) if self.verify or VERIFY_ALL else None
        try:
            out = self._jitted(*args, **kwargs)
        except Exception as exc:
            if self._recover(args, kwargs, exc):
                out = self._jitted(*args, **kwargs)
            elif self._transformed(args, kwargs):
                out = self._retry(args, kwargs, exc)
            else:
                raise
        if expected is not None:
            self._verify(*expected, jax.tree_util.tree_leaves(out))
        return out

    def _recover(self, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception) -> bool:
        """After a failed call: did the rewritten program fail to compile? Then fall back
        and retry. An error raised while it ran is the program's own (an ``io_callback``,
        a runtime check): it propagates as under ``jax.jit``, and running again would
        repeat the program's effects."""
        try:
            key, _, _ = self._key(args, kwargs)
        except Exception:
            return False
        entry = self._cache.get(key)
        if entry is None or entry.run is None or key in self._failed:
            return False  # the original program failed: the caller's error
        if entry.compiles or not _fails_to_compile(entry):
            return False  # it compiled, so it ran: the error is the program's own
        self._failed.add(key)
        self._fall_back(entry, f"the rewritten program failed to compile: {_describe(exc)}")
        self._jitted.clear_cache()  # the next call re-traces, now with the original program
        return True

    def _transformed(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Was the failed call one under a transformation (``jax.jvp``, ``jax.hessian``, a
        ``vmap``: its arguments are tracers) of a rewritten program that compiles and has no
        effects? Then the transformation of a kernel failed, and nothing ran."""
        if not _has_tracers(jax.tree_util.tree_leaves((args, kwargs))):
            return False
        try:
            key, _, _ = self._key(args, kwargs)
        except Exception:
            return False
        entry = self._cache.get(key)
        return (
            entry is not None
            and entry.run is not None
            and key not in self._failed
            and not entry.closed.effects
        )

    def _retry(self, args: tuple[Any, ...], kwargs: dict[str, Any], exc: Exception) -> Any:
        """This call again with the original program, under the same transformation. The
        signature keeps its rewritten program: a plain call, ``jax.grad``, ``jax.vmap`` still
        run the kernels. An error of the original program is the caller's and propagates."""
        out = self._jitted_original(*args, **kwargs)
        warnings.warn(
            printable(
                f"pm.optimize({_name(self.fn)}): transforming the rewritten program failed "
                f"({_describe(exc)}); running the original program for this call"
            ),
            OptimizationFallbackWarning,
            stacklevel=user_stacklevel(),
        )
        return out

    def report(self, *args: Any, **kwargs: Any) -> OptimizeReport:
        """The rewrites for this call signature (traces and rewrites it if needed)."""
        entry, _, _ = self._entry(args, kwargs)
        return entry.report()

    def missed(self, *args: Any, **kwargs: Any) -> Any:
        """The attention-like and GEMM+activation-like sites of this signature's program
        that no rule rewrote, each with the deepest check that stopped the rules, in words
        (a :class:`~pypm_jax.jax.missed.MissedReport`)."""
        from .missed import missed_sites

        return missed_sites(self.lifted(*args, **kwargs), self._rule_defs())

    def lifted(self, *args: Any, **kwargs: Any) -> LiftedProgram:
        """The lifted program for this signature, rewritten with this function's rules."""
        entry, key, flat = self._entry(args, kwargs)
        prog, _, _ = self._rewrite(entry.closed, _input_names(key[0], flat), _Entry(None, None))
        return prog

    # -- verification

    def _expected(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """(entry, original outputs) for a first concrete call of a rewritten signature, run
        before the call (which may donate its arguments); None if nothing is to verify."""
        if _has_tracers(jax.tree_util.tree_leaves((args, kwargs))):
            return None  # under a transformation: nothing concrete to compare
        entry, key, flat = self._entry(args, kwargs)
        if entry.verified or entry.run is None or key in self._failed:
            return None
        entry.verified = True
        if self.jit_options.get("donate_argnums") or self.jit_options.get("donate_argnames"):
            flat = [jax.numpy.copy(x) for x in flat]  # kept for the search of the culprit
        return entry, flat, jax.jit(entry.original)(*flat)

    def _verify(self, entry: _Entry, flat: list[Any], expected: list[Any], out: list[Any]) -> None:
        problem = _first_difference(expected, out)
        if problem is None:
            return
        if not entry.records:
            raise VerificationError(
                f"the lifted and lowered program differs from the original with no rewrite "
                f"applied ({problem}): a bug in pypm_jax.jax, please report it"
            )
        culprits = self._culprits(entry, flat, expected)
        lines = "\n".join(f"  {r}" for r in culprits)
        raise VerificationError(
            f"the rewritten program differs from the original ({problem}); rewrite(s) "
            f"responsible:\n{lines}",
            culprits,
        )

    def _culprits(self, entry: _Entry, flat: list[Any], expected: list[Any]) -> list[RewriteRecord]:
        """The rewrites of the first rule that, applied alone, changes the result."""
        by_rule: dict[str, list[RewriteRecord]] = {}
        for r in entry.records:
            by_rule.setdefault(r.rule, []).append(r)
        defs = {d.name: d for d in self._rule_defs()}
        for name, records in by_rule.items():
            rule = defs.get(name)
            if rule is None:
                continue
            prog = lift(entry.closed)
            rewrite_nested(prog, [rule], **self.rewrite_options)
            got = jax.jit(lower(prog, KERNEL_IMPLS))(*flat)
            if _first_difference(expected, got) is not None:
                return records
        return list(entry.records)


def _fails_to_compile(entry: _Entry) -> bool:
    """Does lowering or compiling the rewritten program alone fail (a kernel the backend
    cannot lower)? Asked only after a call failed, so a call that works pays nothing; it
    runs nothing."""
    specs = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", False)))
        for a in entry.closed.in_avals
    ]
    try:
        entry.run.lower(*specs).compile()
    except Exception:  # noqa: BLE001 - any failure here is one of compiling
        return True
    entry.compiles = True
    return False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a program is lifted, rewritten, lowered
    and checked, then resume it (unless it was off already).

    These phases allocate many objects, most of which stay alive (graph nodes, compiled
    patterns, jaxpr equations). The collector kept examining them, and their number set off
    a full collection of the whole heap: 0.1 s of a 12-layer BERT's first call, whose
    process holds Flax and Transformers. Reference counting still frees what the phases
    drop; cyclic garbage, if any, waits for the next collection after the pause.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _whole(x: Any) -> Any:
    """``x`` itself, or, for an array spread over several processes, all of it (a collective:
    every process verifies the same calls, so every process takes part and concludes alike)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(x, tiled=True)
    return x


def _first_difference(expected: Sequence[Any], got: Sequence[Any]) -> str | None:
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        why = compare(_whole(a), _whole(b))
        if why is not None:
            return f"output {i}: {why}"
    return None


def _check_out_avals(got: Sequence[Any], want: Sequence[Any]) -> None:
    got_t = [(tuple(a.shape), str(a.dtype)) for a in got]
    want_t = [(tuple(a.shape), str(a.dtype)) for a in want]
    if got_t != want_t:
        raise TypeError(f"the rewritten program returns {got_t}, the original {want_t}")


def _input_names(in_tree: Any, flat: Sequence[Any]) -> list[str]:
    """Graph input names from pytree paths (``args[0]['params']['Dense_0']['kernel']``)."""
    try:
        dummy = jax.tree_util.tree_unflatten(in_tree, list(range(len(flat))))
        paths = jax.tree_util.tree_flatten_with_path(dummy)[0]
    except Exception:
        return [f"in{i}" for i in range(len(flat))]
    names = []
    for path, _ in paths:
        dyn_or_kw, *rest = path
        head = "args" if getattr(dyn_or_kw, "idx", 0) == 0 else "kwargs"
        names.append(head + jax.tree_util.keystr(tuple(rest)))
    if len(set(names)) != len(names):
        return [f"in{i}" for i in range(len(flat))]
    return names


def optimize(
    fn: Callable[..., Any] | None = None,
    *,
    rules: Sequence[Any] | None = None,
    default_rules: Callable[[], Sequence[Any]] | None = None,
    verify: bool = False,
    **options: Any,
) -> Any:
    """Optimize ``fn`` with pattern rewrites, jit-like: ``@pm.optimize`` or ``pm.optimize(fn)``.

    ``rules``: the rules to rewrite with; where None, those ``default_rules()`` gives, asked
    when the first signature is traced (``pm.optimize`` hands in the standard library's);
    one of the two is required. ``fast.report(*args)`` lists the rewrites for a call
    signature. ``verify=True`` checks the rewritten program against the original on the
    first concrete inputs of each signature. ``options`` are ``jax.jit``'s
    (:data:`JIT_OPTIONS`: ``static_argnums``, ``donate_argnums``, ``in_shardings``, ...), with
    jit's meaning, and the rewrite driver's (``engine``, ``max_iterations``,
    ``match_budget``); any other is a TypeError here.
    """

    def make(f: Callable[..., Any]) -> Optimized:
        return Optimized(f, rules=rules, default_rules=default_rules, verify=verify, **options)

    return make(fn) if fn is not None else make
