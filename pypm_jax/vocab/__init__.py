"""The vocabulary rules are written in, without JAX: the JAX primitives as pm operators
(:mod:`~pypm_jax.vocab.primitives`, imported as ``prims``) and the tables a rule library
fills for its replacement operators -- their implementations (:func:`register_impl`) and how
they split across devices (:func:`register_partitioning`, :class:`Partitioning`).

Importing it never imports JAX: the standard rules (:mod:`pypm_jax.rules`) depend on this
package and the layers below it, never on the bridge (:mod:`pypm_jax.jax`), which reads
these tables when it lifts and lowers programs and re-exports them for users.

Internal layers: the public API is ``pypm_jax`` (``import pypm_jax as pm``).
"""

from __future__ import annotations

from . import primitives
from . import primitives as prims
from .impls import KERNEL_IMPLS, impl_for, register_impl
from .partitioning import Partitioning, partitioning_for, register_partitioning
from .primitives import OPS, is_table_op

__all__ = [
    "prims",
    "primitives",
    "OPS",
    "is_table_op",
    "KERNEL_IMPLS",
    "impl_for",
    "register_impl",
    "Partitioning",
    "partitioning_for",
    "register_partitioning",
]
