"""Forward-mode derivatives for kernels whose reverse mode is a ``custom_vjp``.

A Pallas kernel's gradient is a ``custom_vjp`` (its backward kernels), and JAX cannot apply
forward-mode autodiff (``jvp``, ``jacfwd``, ``hessian``, ``linearize``) to a ``custom_vjp``.
A ``custom_jvp`` around the kernel is not enough: reverse mode transposes a ``custom_jvp``'s
tangent computation, so gradients would then come from the reference, not from the backward
kernels. :func:`with_forward_mode` keeps both:

* the value is always the kernel's;
* its tangent is one equation of :data:`kernel_tangent_p`, linear in the tangents. Evaluated
  (``jvp``, ``jacfwd``, ``linearize``), it is the reference's tangent; transposed (``grad``,
  ``vjp``), it is the kernel's own backward, run on the residuals the kernel's forward saved:
  reverse mode runs the Pallas forward and backward kernels once each, as the ``custom_vjp``
  alone does;
* the backward kernel has a tangent too, the reference's second derivative, so ``hessian``
  (``jacfwd`` of ``grad``) runs the Pallas forward and backward kernels with derivatives of
  higher order from the reference.

JAX has no public way to give a linear function a custom transpose (``custom_transpose`` is
gone from 0.10), so :data:`kernel_tangent_p` is a primitive with its own evaluation,
derivative, transpose and batching rules: the registries it uses (``jax.extend.core``,
``jax.interpreters.ad``/``batching``/``mlir``) appear in :func:`_register` only, and
``tests/pallas_kernels/test_kernels_autodiff.py`` fails loudly if they move.
"""

from __future__ import annotations

__all__ = ["with_forward_mode", "kernel_tangent_p"]

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._dispatch import vary_together


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def _zero_tangent(x: Any) -> Any:
    """A zero tangent of ``x``'s type (``float0`` for integers and booleans)."""
    if _is_float(x):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)


def with_forward_mode(kernel: Callable[..., Any], reference: Callable[..., Any]) -> Callable:
    """``kernel`` (differentiable by its ``custom_vjp``), with forward-mode derivatives from
    ``reference``, a plain-JAX function computing the same: see the module docstring.

    Both take the same positional arguments (pytrees of arrays; ``None`` for an absent
    operand) and return the same pytree. Arguments that are not floating point (masks) get
    no derivative, as under the kernel's ``custom_vjp``.
    """

    def wrapped(*args: Any) -> Any:
        leaves, tree = jax.tree.flatten(args)
        # inside shard_map(check_vma=True): one varying type for every operand and result
        leaves = vary_together(leaves)
        return _Call(kernel, reference, tree).call(*leaves)

    return wrapped


class _Call:
    """One call of :func:`with_forward_mode`'s function: the kernel and the reference as
    functions of the flattened arguments, and the differentiation rules built on them."""

    def __init__(self, kernel: Callable, reference: Callable, tree: Any):
        self.kernel = lambda *leaves: kernel(*jax.tree.unflatten(tree, leaves))
        self.reference = lambda *leaves: reference(*jax.tree.unflatten(tree, leaves))
        self.n_in = tree.num_leaves
        # set by ``forward``: the output's and the pullback's structures (a plain call,
        # never differentiated, does not trace the kernel twice to find them)
        self.out_tree: Any = None
        self.residual_tree: Any = None
        self.backward_kernel = _with_tangent(self.backward, self.reference_backward)
        self.call = jax.custom_jvp(self.kernel)
        self.call.defjvp(self.call_jvp)
        self.forward_with_residuals = jax.custom_jvp(self.forward)
        self.forward_with_residuals.defjvp(self.forward_jvp)

    def forward(self, *leaves: Any) -> tuple[Any, list[Any]]:
        """The kernel's value and the residuals its backward reads."""
        out, pullback = jax.vjp(self.kernel, *leaves)
        res, self.residual_tree = jax.tree.flatten(pullback)
        self.out_tree = jax.tree.structure(out)
        return out, res

    def backward(self, *operands: Any) -> list[Any]:
        """The kernel's backward (its ``custom_vjp``) on the residuals ``forward`` saved:
        operands are the primals, the residuals and the output cotangents; the result the
        cotangents of the floating-point primals."""
        n_in, n_out = self.n_in, self.out_tree.num_leaves
        res, cts = operands[n_in : len(operands) - n_out], operands[len(operands) - n_out :]
        pullback = jax.tree.unflatten(self.residual_tree, res)
        grads = pullback(jax.tree.unflatten(self.out_tree, cts))
        return [g for g, x in zip(grads, operands[:n_in], strict=True) if _is_float(x)]

    def reference_backward(self, *operands: Any) -> list[Any]:
        """``backward`` computed by the reference (the residuals unread): its derivative."""
        n_in, n_out = self.n_in, self.out_tree.num_leaves
        primals, cts = operands[:n_in], operands[len(operands) - n_out :]
        _, pullback = jax.vjp(self.reference, *primals)
        grads = pullback(jax.tree.unflatten(self.out_tree, cts))
        return [g for g, x in zip(grads, primals, strict=True) if _is_float(x)]

    def reference_tangent(self, *operands: Any) -> list[Any]:
        """The reference's tangent; operands are the primals, then the tangents of the
        floating-point primals."""
        primals, tangents = operands[: self.n_in], iter(operands[self.n_in :])
        full = [next(tangents) if _is_float(x) else _zero_tangent(x) for x in primals]
        _, t_out = jax.jvp(self.reference, tuple(primals), tuple(full))
        return jax.tree.leaves(t_out)

    def tangent(self, primals: Sequence[Any], res: Sequence[Any], tangents: Sequence[Any],
                out: Any) -> Any:  # fmt: skip
        """The tangent of the output ``out``: one :data:`kernel_tangent_p` equation."""
        float_tangents = [t for t, x in zip(tangents, primals, strict=True) if _is_float(x)]
        t_out = kernel_tangent_p.bind(
            *primals,
            *res,
            *float_tangents,
            n_in=self.n_in,
            n_res=len(res),
            evaluate=self.reference_tangent,
            transpose=self.backward_kernel,
            out_types=tuple(_aval(o) for o in jax.tree.leaves(out)),
        )
        return jax.tree.unflatten(self.out_tree, t_out)

    def call_jvp(self, primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
        out, res = self.forward_with_residuals(*primals)
        return out, self.tangent(primals, res, tangents, out)

    def forward_jvp(self, primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
        # The residuals' tangents are never read: only the backward kernel and the tangent
        # equation take residuals, and both differentiate through the reference.
        out, res = self.forward_with_residuals(*primals)
        t_res = [_zero_tangent(r) for r in res]
        return (out, res), (self.tangent(primals, res, tangents, out), t_res)


def _with_tangent(fn: Callable[..., list[Any]], reference: Callable[..., list[Any]]) -> Callable:
    """``fn`` (Pallas code, no derivative of its own) with the derivative of ``reference``
    (plain JAX computing the same from the same arguments)."""

    @jax.custom_jvp
    def call(*operands: Any) -> list[Any]:
        return fn(*operands)

    @call.defjvp
    def _jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> Any:
        t_in = [
            t if _is_float(x) else _zero_tangent(x) for t, x in zip(tangents, primals, strict=True)
        ]
        _, t_out = jax.jvp(reference, tuple(primals), tuple(t_in))
        return call(*primals), t_out

    return call


# ------------------------------------------------------------------------------ the primitive


def _evaluate(*operands: Any, n_in: int, n_res: int, evaluate: Callable, **_: Any) -> list[Any]:
    """Forward evaluation: the reference's tangent (the residuals are not read)."""
    return list(evaluate(*operands[:n_in], *operands[n_in + n_res :]))


def _aval(x: Any) -> Any:
    """``x``'s type: shape, dtype and, inside ``shard_map``, how it varies across the mesh
    (``_dispatch.out_struct``)."""
    return jax.typeof(x).update(weak_type=False)


def _abstract(*_: Any, out_types: tuple[Any, ...], **__: Any) -> list[Any]:
    return list(out_types)


def _derivative(primals: Sequence[Any], tangents: Sequence[Any], **params: Any) -> Any:
    """Its own tangent (nested differentiation): the reference's, a plain JAX function."""
    from jax.interpreters import ad

    t_in = [ad.instantiate_zeros(t) for t in tangents]
    return jax.jvp(lambda *xs: _evaluate(*xs, **params), tuple(primals), tuple(t_in))


def _transpose(cts: Sequence[Any], *operands: Any, n_in: int, n_res: int, transpose: Callable,
               out_types: tuple[Any, ...], **_: Any) -> list[Any]:  # fmt: skip
    """Reverse mode: the kernel's backward on its residuals."""
    from jax.interpreters import ad

    cts = [ad.instantiate_zeros(c) if type(c) is ad.Zero else c for c in cts]
    grads = transpose(*operands[: n_in + n_res], *cts)
    tangents = operands[n_in + n_res :]
    return [None] * (n_in + n_res) + [
        g if ad.is_undefined_primal(t) else None for g, t in zip(grads, tangents, strict=True)
    ]


def _batch(args: Sequence[Any], dims: Sequence[Any], *, n_in: int, n_res: int, evaluate: Callable,
           transpose: Callable, out_types: tuple[Any, ...]) -> Any:  # fmt: skip
    """vmap (``jacfwd`` is a vmap of jvp): the same primitive over batched functions."""
    size = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    primal_dims = dims[: n_in + n_res]
    eval_dims = (*dims[:n_in], *dims[n_in + n_res :])
    out_types = tuple(a.update(shape=(size, *a.shape), sharding=None) for a in out_types)
    outs = kernel_tangent_p.bind(
        *args,
        n_in=n_in,
        n_res=n_res,
        evaluate=jax.vmap(evaluate, in_axes=eval_dims),
        transpose=jax.vmap(transpose, in_axes=(*primal_dims, *(0,) * len(out_types))),
        out_types=out_types,
    )
    return outs, [0] * len(outs)


def _register() -> Any:
    from jax.extend.core import Primitive
    from jax.interpreters import ad, batching, mlir

    p = Primitive("kernel_tangent")
    p.multiple_results = True
    p.def_impl(_evaluate)
    p.def_abstract_eval(_abstract)
    mlir.register_lowering(p, mlir.lower_fun(_evaluate, multiple_results=True))
    ad.primitive_jvps[p] = _derivative
    ad.primitive_transposes[p] = _transpose
    batching.primitive_batchers[p] = _batch
    return p


kernel_tangent_p = _register()
