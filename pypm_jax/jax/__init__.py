"""The JAX bridge: lift jaxprs into pm graphs, rewrite them, lower them back, re-jit.

``from pypm_jax.jax import prims`` gives the JAX primitive operators (``prims.dot_general``,
``prims.exp``, ...; see :mod:`pypm_jax.vocab.primitives` for how params become attrs);
``register_impl(op, fn)`` gives a replacement operator its implementation and
``register_describe(op, fn)`` what reports say about it (a :class:`KernelInfo`),
``register_partitioning(op, fn)`` how it splits across devices (:class:`Partitioning`).
These are the JAX-free vocabulary's (:mod:`pypm_jax.vocab`), re-exported here; importing
the bridge installs JAX's type inference for the primitive operators (:mod:`.types`).

``optimize(fn, rules=...)`` is ``pm.optimize`` without its default: the bridge never names
a rule library, so the facade (``pm.optimize``, ``pm.optimize_module``,
``pm.nnx_optimize``) hands the standard rules in when none are given. ``optimize_module`` /
``nnx_optimize`` are the Flax helpers (:mod:`pypm_jax.jax.flax`). The core language never
imports this package.
"""

from __future__ import annotations

from typing import Any

from ..engine.report import KernelInfo, register_describe
from ..vocab import (
    KERNEL_IMPLS,
    OPS,
    Partitioning,
    primitives,
    prims,
    register_impl,
    register_partitioning,
)
from . import types as _types  # noqa: F401 - installs JAX's type inference for prims
from .lift import LiftedProgram, lift
from .lower import LoweringError, lower
from .optimize import Optimized, optimize, rewrite_nested
from .report import (
    OptimizationFallbackWarning,
    OptimizeReport,
    RuleDisabledWarning,
    VerificationError,
)

__all__ = [
    "prims",
    "primitives",
    "OPS",
    "KERNEL_IMPLS",
    "register_impl",
    "register_describe",
    "KernelInfo",
    "register_partitioning",
    "Partitioning",
    "lift",
    "LiftedProgram",
    "lower",
    "LoweringError",
    "rewrite_nested",
    "optimize",
    "Optimized",
    "OptimizeReport",
    "VerificationError",
    "OptimizationFallbackWarning",
    "RuleDisabledWarning",
    "optimize_module",
    "nnx_optimize",
]


def __getattr__(name: str) -> Any:
    if name in ("optimize_module", "nnx_optimize", "NNXOptimized"):  # Flax imported on use
        from . import flax as _flax

        return getattr(_flax, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
