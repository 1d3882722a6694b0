"""How a replacement operator splits across devices: the declaration, without JAX.

A rule library declares, beside an operator's implementation
(:func:`~pypm_jax.vocab.impls.register_impl`), how its operands' dimensions map onto shared
factors (:class:`Partitioning`, registered with :func:`register_partitioning`); the bridge's
lowering reads the declaration and wraps the kernel call so XLA partitions it like the
program it replaced (:mod:`pypm_jax.jax.partition` says what each entry means there).
"""

from __future__ import annotations

__all__ = ["Dim", "Partitioning", "PARTITIONINGS", "register_partitioning", "partitioning_for"]

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.terms import Operator

Dim = str | tuple[str, ...] | None


@dataclass(frozen=True)
class Partitioning:
    """How an operator's operand and result dimensions map onto shared factors.

    ``inputs`` has one tuple per operand (one entry per dimension), ``output`` one entry per
    result dimension: a factor name, a pair of names (a compound dimension, major first), or
    None (a dimension the kernel needs whole; :mod:`pypm_jax.jax.partition` has the details).
    ``partial(*args)`` and ``finish(acc, *args)`` split the operator at its contraction
    (``partial`` on the local operands gives the local accumulator, of the result's shape;
    ``finish`` the result from the summed accumulator); both None when a contraction is never
    split. ``offset``: a factor of the result that the implementation takes the first index
    of, as its keyword ``offset``, where that factor is split (not with ``partial``/``finish``).
    """

    inputs: tuple[tuple[Dim, ...], ...]
    output: tuple[Dim, ...]
    partial: Callable[..., Any] | None = None
    finish: Callable[..., Any] | None = None
    offset: str | None = None

    def __post_init__(self) -> None:
        if self.offset is not None and (
            self.offset not in self.output or self.partial is not None or self.finish is not None
        ):
            raise ValueError(
                f"offset {self.offset!r} must be a factor of the result {self.output} "
                "of a declaration without partial/finish"
            )


PARTITIONINGS: dict[Operator, Callable[..., Partitioning | None]] = {}


def register_partitioning(op: Operator, fn: Callable[..., Any] | None = None) -> Any:
    """Register ``fn(*input_shapes, **attrs) -> Partitioning | None`` for ``op``.

    Called with the operands' shapes and the node's attrs when the rewritten program is
    lowered; None keeps that call whole (XLA then replicates its operands). Usable as a
    decorator, like :func:`~pypm_jax.vocab.impls.register_impl`.
    """
    if not isinstance(op, Operator):
        raise TypeError(f"register_partitioning needs a pm operator, got {op!r}")

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(f):
            raise TypeError(f"the partitioning of {op.name} must be callable, got {f!r}")
        PARTITIONINGS[op] = f
        return f

    return deco(fn) if fn is not None else deco


def partitioning_for(op: Operator) -> Callable[..., Partitioning | None] | None:
    """The registered partitioning declaration of ``op``, or None."""
    return PARTITIONINGS.get(op)
