"""What :meth:`Optimized.report` returns: the rewrites of one call signature, as a table."""

from __future__ import annotations

__all__ = [
    "OptimizeReport",
    "VerificationError",
    "OptimizationFallbackWarning",
    "RuleDisabledWarning",
    "fused_calls",
    "tolerance",
]

import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..core.errors import PyPMError
from ..engine.rewrite import RewriteRecord, RewriteReport, printable


class OptimizationFallbackWarning(UserWarning):
    """Rewriting failed somewhere; the original program runs instead (the message says why)."""


class RuleDisabledWarning(UserWarning):
    """A rule failed (its body cannot be compiled, its result cannot be built or has another
    type than what it replaces): it is left out, named with its source line, and the other
    rules still apply."""


class VerificationError(PyPMError):
    """``verify=True`` found the rewritten program's outputs differ from the original's.

    ``records`` are the rewrites that, applied alone, reproduce the difference (all of them
    when none does alone).
    """

    def __init__(self, message: str, records: Iterable[RewriteRecord] = ()):
        self.records = tuple(records)
        super().__init__(message)


# Rules named ``canonical_*`` rewrite spellings to one form for the kernel rules (the
# standard library's ``pypm_jax/rules/canonical.py``); reports list them apart from the
# kernel rewrites (the sites).
CANONICAL_PREFIX = "canonical_"


# Primitives that are already a fused kernel: a program calling one has no softmax or
# epilogue for the rules to see there, and is left as written (the report says so).
FUSED_PRIMITIVES = {
    "pallas_call": "Pallas kernel",
    "dot_product_attention_fwd_wrapper": "cuDNN attention",
    "dot_product_attention_fwd": "cuDNN attention",
    "dot_product_attention_fp8_fwd_wrapper": "cuDNN attention (fp8)",
    "dot_product_attention_fp8_fwd": "cuDNN attention (fp8)",
    "triton_kernel_call": "Triton kernel",
}


def fused_calls(prog: Any) -> list[str]:
    """The fused kernels a lifted program (and every nested body) already calls, one line
    each: what it is, its name, the user's source line."""
    out, stack = [], [prog]
    while stack:
        p = stack.pop()
        for node in p.graph.nodes():
            kind = FUSED_PRIMITIVES.get(node.op.name)
            if kind is None:
                continue
            eqn = node.meta.get("jax_eqn")
            name = getattr(eqn, "params", {}).get("name") if eqn is not None else None
            what = f"{kind} {name}" if isinstance(name, str) and name else kind
            where = f" at {node.loc}" if node.loc is not None else ""
            out.append(f"{what}{where}")
        stack.extend(body for _node, _name, body in reversed(p.nested()))
    return out


class OptimizeReport(RewriteReport):
    """The rewrites in firing order (outer program first, then scan/while/cond bodies).

    The list holds the kernel rewrites; ``canonical`` the canonicalizing ones (rules named
    ``canonical_*``), which only bring spellings to one form. ``fallback`` is the reason the
    original program runs instead, or None; ``disabled`` why each rule left out for this
    signature was; ``fused`` the fused kernels the program already calls (a Pallas kernel,
    cuDNN attention), which the rules leave as written. ``str()`` is a table at most 100 columns wide, one row per kernel that
    runs: rule, kernel, its shapes/dtype and flags, the number of nodes replaced, the Flax
    module path, the user's source line (names escaped: one line per row whatever they
    hold), then counts by kernel and by module. ``to_dict()`` / ``to_json()`` give every
    rewrite as data.
    """

    fallback: str | None = None
    disabled: tuple[str, ...] = ()
    fused: tuple[str, ...] = ()

    def __init__(
        self, records: Iterable[RewriteRecord] = (), canonical: Iterable[RewriteRecord] = ()
    ):
        super().__init__(records)
        self.canonical = RewriteReport(canonical)

    @classmethod
    def of(
        cls,
        records: Iterable[RewriteRecord],
        fallback: str | None = None,
        disabled: Iterable[str] = (),
        fused: Iterable[str] = (),
    ) -> OptimizeReport:
        """The report of ``records`` (kernel and canonical rewrites, in firing order)."""
        records = list(records)
        canonical = [r for r in records if r.rule.startswith(CANONICAL_PREFIX)]
        out = cls([r for r in records if not r.rule.startswith(CANONICAL_PREFIX)], canonical)
        out.fallback = fallback
        out.disabled = tuple(disabled)
        out.fused = tuple(fused)
        return out

    def to_dict(self) -> dict[str, Any]:
        """The rewrites, counts by kernel and module, ``fallback``, ``disabled``, ``fused``."""
        return {
            **super().to_dict(),
            "fallback": self.fallback,
            "disabled": list(self.disabled),
            "fused": list(self.fused),
        }

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as JSON (``kwargs`` go to ``json.dumps``, e.g. ``indent=2``)."""
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [f"rule left out: {printable(why)}" for why in self.disabled]
        if self.fallback:
            lines.append(f"fell back to the original program: {printable(self.fallback)}")
        if self.canonical:
            done = ", ".join(f"{name} x{n}" for name, n in self.canonical.counts().items())
            lines.append(f"canonical forms: {printable(done)}")
        lines += [f"already fused, left as written: {printable(f)}" for f in self.fused]
        return "\n".join([*lines, super().__str__()])


def tolerance(dtype: Any) -> tuple[float, float] | None:
    """(rtol, atol) for comparing outputs of this dtype; None means exact."""
    dt = np.dtype(dtype) if not hasattr(dtype, "itemsize") else dtype
    name = str(dt)
    if name in ("bfloat16", "float16") or name.startswith("float8"):
        return (2e-2, 2e-2) if not name.startswith("float8") else (1.3e-1, 1.3e-1)
    kind = getattr(dt, "kind", "")
    if name == "float64" or name == "complex128":
        return (1e-9, 1e-9)
    if kind in "fc" or name in ("float32", "complex64"):
        return (1e-5, 1e-5)
    return None


def compare(a: Any, b: Any) -> str | None:
    """Why ``a`` (original) and ``b`` (rewritten) differ beyond tolerance, or None."""
    import jax

    if jax.dtypes.issubdtype(getattr(a, "dtype", np.float32), jax.dtypes.extended):
        a, b = jax.random.key_data(a), jax.random.key_data(b)  # PRNG keys: their bits
    a_arr, b_arr = np.asarray(a), np.asarray(b)
    if a_arr.shape != b_arr.shape:
        return f"shape {b_arr.shape} instead of {a_arr.shape}"
    if a_arr.dtype != b_arr.dtype:
        return f"dtype {b_arr.dtype} instead of {a_arr.dtype}"
    tol = tolerance(a_arr.dtype)
    if tol is None:
        if a_arr.dtype.kind in "biu" or a_arr.dtype == bool:
            bad = int(np.sum(a_arr != b_arr))
            return None if bad == 0 else f"{bad} of {a_arr.size} elements differ"
        return None  # extended dtypes (keys): nothing to compare numerically
    x = a_arr.astype(np.complex128 if a_arr.dtype.kind == "c" else np.float64)
    y = b_arr.astype(x.dtype)
    rtol, atol = tol
    ok = np.isclose(y, x, rtol=rtol, atol=atol, equal_nan=True)
    if bool(np.all(ok)):
        return None
    err = np.abs(x - y)
    worst = float(np.nanmax(np.where(ok, 0.0, err)))
    return (
        f"{int(np.sum(~ok))} of {x.size} elements differ beyond rtol={rtol}, atol={atol} "
        f"(worst absolute error {worst:.3g})"
    )
