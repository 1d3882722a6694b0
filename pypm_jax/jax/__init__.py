"""The JAX bridge: lift jaxprs into pm graphs, rewrite them, lower them back, re-jit.

``from pypm_jax.jax import prims`` gives the JAX primitive operators (``prims.dot_general``,
``prims.exp``, ...; see :mod:`pypm_jax.jax.primitives` for how params become attrs).
Everything that needs JAX itself is imported lazily, so the op table is cheap to import.
"""

from __future__ import annotations

from typing import Any

from . import primitives
from . import primitives as prims
from .impls import KERNEL_IMPLS, register_impl
from .primitives import OPS

__all__ = [
    "prims",
    "primitives",
    "OPS",
    "KERNEL_IMPLS",
    "register_impl",
    "lift",
    "lower",
    "rewrite_nested",
    "optimize",
    "Optimized",
    "optimize_module",
    "nnx_optimize",
]

_LAZY = {
    "lift": ("lift", "lift"),
    "LiftedProgram": ("lift", "LiftedProgram"),
    "lower": ("lower", "lower"),
    "rewrite_nested": ("optimize", "rewrite_nested"),
    "optimize": ("optimize", "optimize"),
    "Optimized": ("optimize", "Optimized"),
    "optimize_module": ("flax", "optimize_module"),
    "nnx_optimize": ("flax", "nnx_optimize"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{mod}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
