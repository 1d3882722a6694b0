"""``pm.optimize``: trace, lift, rewrite (bodies of scan/while/cond too), lower, ``jax.jit``.

``optimize(fn)`` behaves like ``jax.jit(fn)``: pytrees in and out, static arguments, one
trace per signature (treedef, avals, static values) kept in a cache. Rewriting never makes a
program fail or compute something else silently: any failure while rewriting or lowering, or
while tracing or running the rewritten program, falls back to the original program with an
:class:`~pypm_jax.jax.report.OptimizationFallbackWarning` naming the cause; ``verify=True``
additionally compares both programs on the first concrete inputs of each signature and raises
a :class:`~pypm_jax.jax.report.VerificationError` naming the rewrite that changed the result.
"""

from __future__ import annotations

__all__ = ["optimize", "Optimized", "rewrite_nested", "default_rules"]

import functools
import importlib
import importlib.util
import warnings
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from .._frontend import as_rule_def
from .._rewrite import RewriteRecord, RewriteResult, rewrite
from . import _compat
from .lift import LiftedProgram, lift
from .lower import lower
from .report import (
    OptimizationFallbackWarning,
    OptimizeReport,
    VerificationError,
    compare,
)

# ------------------------------------------------------------------------------ rewriting


def default_rules() -> list[Any]:
    """The standard rule library (``pypm_jax.rules.default_rules()``), or [] without one."""
    if importlib.util.find_spec("pypm_jax.rules") is None:
        return []
    mod = importlib.import_module("pypm_jax.rules")
    fn = getattr(mod, "default_rules", None)
    if fn is None:
        warnings.warn(
            "pypm_jax.rules has no default_rules(); optimizing with no rules",
            OptimizationFallbackWarning,
            stacklevel=3,
        )
        return []
    return list(fn())


def rewrite_nested(target: Any, rules: Sequence[Any], **options: Any) -> RewriteResult:
    """Rewrite a lifted program (or graph) and every scan/while/cond body inside it.

    The report lists the outer program's rewrites first, then each body's (depth first, in
    node order). ``options`` go to :func:`pypm_jax._rewrite.rewrite` (``max_iterations``,
    ``engine``).
    """
    defs = [as_rule_def(r) for r in rules]
    graph = target.graph if isinstance(target, LiftedProgram) else target
    report = OptimizeReport()
    stack = [graph]
    while stack:
        g = stack.pop()
        result = rewrite(g, defs, **options)
        report.extend(result.report)
        bodies = []
        for node in result.graph.nodes():
            for value in node.attrs.values():
                items = value if isinstance(value, tuple) else (value,)
                bodies.extend(b.graph for b in items if isinstance(b, LiftedProgram))
        stack.extend(reversed(bodies))
    return RewriteResult(graph, report)


# ------------------------------------------------------------------------------ signatures


def _aval_key(x: Any) -> Hashable:
    try:
        t = jax.typeof(x)
    except TypeError as exc:
        raise TypeError(f"pm.optimize: argument {x!r} is not a JAX type ({exc})") from None
    return (tuple(t.shape), str(t.dtype), bool(getattr(t, "weak_type", False)))


def _norm_static(static_argnums: int | Sequence[int], nargs: int) -> tuple[int, ...]:
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    out = []
    for i in nums:
        j = i + nargs if i < 0 else i
        if not 0 <= j < nargs:
            raise ValueError(f"static_argnums {i} out of range for {nargs} positional arguments")
        out.append(j)
    return tuple(sorted(set(out)))


@dataclass(eq=False)
class _Entry:
    """One signature: the original program, the rewritten one, and what happened."""

    closed: Any  # ClosedJaxpr of the flattened function
    out_tree: Any
    original: Callable[..., Any]
    rewritten: Callable[..., Any] | None = None
    records: list[RewriteRecord] = field(default_factory=list)
    fallback: str | None = None
    verified: bool = False

    def report(self) -> OptimizeReport:
        return OptimizeReport.of(self.records, self.fallback)


def _has_tracers(values: Sequence[Any]) -> bool:
    return any(isinstance(v, jax.core.Tracer) for v in values)


def _describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Optimized:
    """A function optimized by :func:`optimize`; call it like the original."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        rules: Sequence[Any] | None = None,
        static_argnums: int | Sequence[int] = (),
        verify: bool = False,
        **rewrite_options: Any,
    ):
        if not callable(fn):
            raise TypeError(f"pm.optimize needs a callable, got {fn!r}")
        self.fn = fn
        self._rules = None if rules is None else list(rules)
        self.static_argnums = static_argnums
        self.verify = verify
        self.rewrite_options = rewrite_options
        self._cache: dict[Hashable, _Entry] = {}
        self.traces = 0  # how many times ``fn`` was traced (one per signature)
        functools.update_wrapper(self, fn)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self, obj)

    @property
    def rules(self) -> list[Any]:
        if self._rules is None:
            self._rules = default_rules()
        return self._rules

    # -- signatures

    def _split(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        static = _norm_static(self.static_argnums, len(args))
        static_vals = tuple((i, args[i]) for i in static)
        try:
            hash(static_vals)
        except TypeError as exc:
            raise TypeError(f"pm.optimize: static arguments must be hashable ({exc})") from None
        dyn = tuple(a for i, a in enumerate(args) if i not in static)
        flat, in_tree = jax.tree_util.tree_flatten((dyn, kwargs))
        return static_vals, flat, in_tree

    def _entry(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Entry, list[Any]]:
        static_vals, flat, in_tree = self._split(args, kwargs)
        key = (in_tree, tuple(_aval_key(x) for x in flat), static_vals)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._build(static_vals, flat, in_tree, len(args))
            if not _has_tracers(entry.closed.consts):  # a closure over tracers: not reusable
                self._cache[key] = entry
        return entry, flat

    def _build(
        self, static_vals: tuple[Any, ...], flat: list[Any], in_tree: Any, nargs: int
    ) -> _Entry:
        out_store: list[Any] = []
        fn = self.fn

        def flat_fn(*leaves: Any) -> list[Any]:
            dyn, kwargs = jax.tree_util.tree_unflatten(in_tree, leaves)
            it = iter(dyn)
            statics = dict(static_vals)
            full = [statics[i] if i in statics else next(it) for i in range(nargs)]
            out = fn(*full, **kwargs)
            out_flat, out_tree = jax.tree_util.tree_flatten(out)
            out_store.append(out_tree)
            return out_flat

        self.traces += 1
        closed = jax.make_jaxpr(flat_fn)(*flat)  # the user's errors propagate, as with jit
        original = jax.jit(_compat.jaxpr_as_fun(closed))
        entry = _Entry(closed=closed, out_tree=out_store[-1], original=original)
        try:
            names = _input_names(in_tree, flat)
            prog = lift(closed, in_names=names)
            result = rewrite_nested(prog, self.rules, **self.rewrite_options)
            entry.records = list(result.report)
            run = lower(prog)
            rewritten = jax.jit(lambda *xs: run(*xs))
            traced = rewritten.trace(*flat)
            _check_out_avals(traced.out_avals, closed.out_avals)
            entry.rewritten = rewritten
        except Exception as exc:  # any failure: the original program, and say why
            self._fall_back(entry, f"rewriting failed: {_describe(exc)}", stacklevel=5)
        return entry

    def _fall_back(self, entry: _Entry, why: str, stacklevel: int = 4) -> None:
        """Run the original program for this signature from now on, and warn once.

        ``stacklevel`` points the warning at the user's call (``fast(...)`` or
        ``fast.report(...)``).
        """
        entry.fallback = why
        entry.rewritten = None
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        warnings.warn(
            f"pm.optimize({name}): {why}; running the original program",
            OptimizationFallbackWarning,
            stacklevel=stacklevel,
        )

    # -- calling

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        entry, flat = self._entry(args, kwargs)
        out = self._run(entry, flat)
        return jax.tree_util.tree_unflatten(entry.out_tree, out)

    def _run(self, entry: _Entry, flat: list[Any]) -> list[Any]:
        if entry.rewritten is not None:
            try:
                out = entry.rewritten(*flat)
            except Exception as exc:
                self._fall_back(entry, f"the rewritten program failed: {_describe(exc)}")
            else:
                if self.verify and not entry.verified and not _has_tracers(flat):
                    self._verify(entry, flat, out)
                return out
        return entry.original(*flat)

    def report(self, *args: Any, **kwargs: Any) -> OptimizeReport:
        """The rewrites for this call signature (traces and rewrites it if needed)."""
        entry, _ = self._entry(args, kwargs)
        return entry.report()

    def lifted(self, *args: Any, **kwargs: Any) -> LiftedProgram:
        """The lifted program for this signature, rewritten with this function's rules."""
        entry, flat = self._entry(args, kwargs)
        static_vals, _, in_tree = self._split(args, kwargs)
        prog = lift(entry.closed, in_names=_input_names(in_tree, flat))
        rewrite_nested(prog, self.rules, **self.rewrite_options)
        return prog

    # -- verification

    def _verify(self, entry: _Entry, flat: list[Any], out: list[Any]) -> None:
        entry.verified = True
        expected = entry.original(*flat)
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
        defs = {as_rule_def(r).name: r for r in self.rules}
        for name, records in by_rule.items():
            rule = defs.get(name)
            if rule is None:
                continue
            prog = lift(entry.closed)
            rewrite_nested(prog, [rule], **self.rewrite_options)
            got = jax.jit(lower(prog))(*flat)
            if _first_difference(expected, got) is not None:
                return records
        return list(entry.records)


def _first_difference(expected: Sequence[Any], got: Sequence[Any]) -> str | None:
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        why = compare(a, b)
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
    static_argnums: int | Sequence[int] = (),
    verify: bool = False,
    **rewrite_options: Any,
) -> Any:
    """Optimize ``fn`` with pattern rewrites, jit-like: ``@pm.optimize`` or ``pm.optimize(fn)``.

    ``rules`` default to ``pypm_jax.rules.default_rules()`` (attention and GEMM-epilogue
    kernels) when that library exists. ``fast.report(*args)`` lists the rewrites for a call
    signature. ``verify=True`` checks the rewritten program against the original on the
    first concrete inputs of each signature. ``rewrite_options`` (``engine``,
    ``max_iterations``) go to the rewrite driver.
    """

    def make(f: Callable[..., Any]) -> Optimized:
        return Optimized(
            f, rules=rules, static_argnums=static_argnums, verify=verify, **rewrite_options
        )

    return make(fn) if fn is not None else make
