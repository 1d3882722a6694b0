"""Equivalence checks for programs optimized by ``pm.optimize``, for your own tests.

:func:`assert_equivalent` runs a function as written (under ``jax.jit``) and optimized, and
fails, naming the output and the rewrites, if their values or gradients differ beyond the
dtype's tolerance, or if no rule rewrote anything (a check that compares a program with
itself proves nothing). The pytest plugin (:mod:`pypm_jax.pytest_plugin`, installed with the
package) adds ``--pypm-verify``, which turns ``verify=True`` on for every ``pm.optimize`` in
the test run, and the fixture ``pypm_verify``, which does so for one test.
"""

from __future__ import annotations

__all__ = ["assert_equivalent"]

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from . import optimize
from .jax.optimize import Optimized
from .jax.report import OptimizeReport, tolerance


def assert_equivalent(
    fn: Callable[..., Any],
    *args: Any,
    rules: Sequence[Any] | None = None,
    grads: bool = True,
    rtol: float | None = None,
    atol: float | None = None,
    require_rewrite: bool = True,
    seed: int = 0,
) -> OptimizeReport:
    """Assert that ``pm.optimize(fn, rules=rules)(*args)`` equals ``fn(*args)``.

    ``fn`` may also be a function ``pm.optimize`` already made (then ``rules`` are its own).
    Compares every output leaf (shape, dtype, values) and, with ``grads``, the vector-Jacobian
    product with a random cotangent (``seed``) with respect to every floating argument. Each
    element must be within ``rtol`` of the original or within ``atol`` times the leaf's
    largest magnitude (values near zero carry the rounding of the large ones);
    ``rtol``/``atol`` default to the dtype's tolerance (f32 1e-5; bf16/f16 2e-2; f64 1e-9);
    integers and booleans must be equal. With ``require_rewrite`` (the default) it also fails
    when no rule fired. Returns the rewrite report, for further assertions.
    """
    if isinstance(fn, Optimized):
        if rules is not None:
            raise ValueError(
                "assert_equivalent: rules= is for a plain function; this one is optimized"
            )
        fast, fn = fn, fn.fn
    else:
        fast = optimize(fn, rules=rules)
    report = fast.report(*args)
    if report.fallback:
        raise AssertionError(f"pm.optimize fell back to the original program: {report.fallback}")
    if require_rewrite and not report:
        raise AssertionError(
            f"no rule rewrote {getattr(fn, '__qualname__', fn)!r}; why not:\n{fast.missed(*args)}"
        )
    _compare("output", jax.jit(fn)(*args), fast(*args), rtol, atol, report)
    if grads:
        want, got = _vjp(jax.jit(fn), args, seed), _vjp(fast, args, seed)
        _compare("gradient", want, got, rtol, atol, report)
    return report


def _floating(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, np.inexact)


def _vjp(f: Callable[..., Any], args: tuple[Any, ...], seed: int) -> Any:
    """The gradients, with respect to the floating leaves of ``args``, of the outputs'
    inner product with a random cotangent of each floating output."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    where = [i for i, x in enumerate(leaves) if _floating(x)]

    def of_floats(*xs: Any) -> Any:
        full = list(leaves)
        for i, x in zip(where, xs, strict=True):
            full[i] = x
        return f(*jax.tree_util.tree_unflatten(tree, full))

    out, pullback = jax.vjp(of_floats, *(leaves[i] for i in where))
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    keys = jax.random.split(jax.random.key(seed), max(len(out_leaves), 1))
    cot = [
        jax.random.normal(k, y.shape, y.dtype)
        if _floating(y)
        else np.zeros(np.shape(y), jax.dtypes.float0)
        for k, y in zip(keys, out_leaves, strict=False)
    ]
    return pullback(jax.tree_util.tree_unflatten(out_tree, cot))


def _compare(
    what: str, want: Any, got: Any, rtol: float | None, atol: float | None, report: Any
) -> None:
    want_leaves, want_tree = jax.tree_util.tree_flatten_with_path(want)
    got_leaves, got_tree = jax.tree_util.tree_flatten_with_path(got)
    if jax.tree_util.tree_structure(want) != jax.tree_util.tree_structure(got):
        raise AssertionError(f"{what} structure differs: {got_tree} instead of {want_tree}")
    for (path, a), (_, b) in zip(want_leaves, got_leaves, strict=True):
        problem = _difference(np.asarray(a), np.asarray(b), rtol, atol)
        if problem is not None:
            name = jax.tree_util.keystr(path) or "(the only leaf)"
            raise AssertionError(
                f"{what} {name} of the optimized program differs: {problem}\nrewrites:\n{report}"
            )


def _difference(a: np.ndarray, b: np.ndarray, rtol: float | None, atol: float | None) -> str | None:
    """Why ``b`` (optimized) differs from ``a`` (original), or None."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{b.dtype}{list(b.shape)} instead of {a.dtype}{list(a.shape)}"
    if a.dtype == jax.dtypes.float0:
        return None
    tol = tolerance(a.dtype)
    if tol is None:
        bad = int(np.sum(a != b))
        return None if bad == 0 else f"{bad} of {a.size} elements differ"
    r, t = rtol if rtol is not None else tol[0], atol if atol is not None else tol[1]
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    x, y = a.astype(wide), b.astype(wide)
    scale = float(np.max(np.abs(x))) if x.size else 0.0
    t *= max(scale, 1e-30)
    ok = np.isclose(y, x, rtol=r, atol=t, equal_nan=True)
    if bool(np.all(ok)):
        return None
    worst = float(np.nanmax(np.where(ok, 0.0, np.abs(x - y))))
    return (
        f"{int(np.sum(~ok))} of {x.size} elements beyond rtol={r}, atol={t:.3g} (worst "
        f"absolute error {worst:.3g})"
    )
