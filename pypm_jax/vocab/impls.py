"""Implementations of replacement operators (kernels), looked up when lowering a graph.

A rule's replacement is a pm operator; when the rewritten graph is lowered back to JAX, a
node whose operator is not a JAX primitive from the table is computed by the callable
registered here: ``fn(*inputs, **attrs)`` returning one array (``op.n_out == 1``) or a
tuple of ``op.n_out`` arrays. Its gradient is the callable's own (a Pallas kernel brings its
``custom_vjp``). Registration happens at import time of the module defining the rule; the
table is JAX-free (an implementation imports JAX when it runs), and lowering takes it as an
argument (:func:`pypm_jax.jax.lower.lower`'s ``impls``, this table by default).

    @pm.op(attrs=("scale", "causal"), op_class="attention")
    def flash_attention(q, k, v): return 1

    register_impl(flash_attention, lambda q, k, v, **a: pallas_kernels.flash_attention(q, k, v, **a))
"""

from __future__ import annotations

__all__ = ["KERNEL_IMPLS", "register_impl", "impl_for"]

from collections.abc import Callable
from typing import Any

from ..core.terms import Operator

KERNEL_IMPLS: dict[Operator, Callable[..., Any]] = {}


def register_impl(op: Operator, fn: Callable[..., Any] | None = None) -> Any:
    """Register ``fn(*inputs, **attrs)`` as the implementation of ``op``.

    ``register_impl(op, fn)``, or as a decorator ``@register_impl(op)``. The latest
    registration wins.
    """
    if not isinstance(op, Operator):
        raise TypeError(f"register_impl needs a pm operator, got {op!r}")

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"the implementation of {op.name} must be callable, got {f!r}")
        KERNEL_IMPLS[op] = f
        return f

    return deco(fn) if fn is not None else deco


def impl_for(op: Operator) -> Callable[..., Any] | None:
    """The registered implementation of ``op``, or None."""
    return KERNEL_IMPLS.get(op)
