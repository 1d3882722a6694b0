"""The JAX bridge: lift jaxprs into pm graphs, rewrite them, lower them back, re-jit.

``from pypm_jax.jax import prims`` gives the JAX primitive operators (``prims.dot_general``,
``prims.exp``, ...; see :mod:`pypm_jax.jax.primitives` for how params become attrs);
``register_impl(op, fn)`` gives a replacement operator its implementation and
``register_describe(op, fn)`` what reports say about it (a :class:`KernelInfo`),
``register_partitioning(op, fn)`` how it splits across devices (:class:`Partitioning`);
``optimize(fn)`` is ``pm.optimize``; ``optimize_module`` / ``nnx_optimize`` are the Flax
helpers (:mod:`pypm_jax.jax.flax`). The core language never imports this package.
"""

from __future__ import annotations

from typing import Any

from ..engine.report import KernelInfo, register_describe
from . import primitives
from . import primitives as prims
from .impls import KERNEL_IMPLS, register_impl
from .lift import LiftedProgram, lift
from .lower import LoweringError, lower
from .optimize import Optimized, default_rules, optimize, rewrite_nested
from .partition import Partitioning, register_partitioning
from .primitives import OPS
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
    "default_rules",
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
