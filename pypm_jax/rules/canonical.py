"""Canonical forms, in the pattern language: rules that run before the kernel rules.

Living model code spells the same computation in ways that differ only by operations that
compute nothing. The kernel rules (``attention.py``, ``causal.py``, ``gemm.py``) would need an
alternate for every such spelling inside every piece; instead these rules rewrite each one
to a single form first, so every kernel rule sees that form:

* ``copy(x)`` is ``x`` (penzai emits a ``copy`` after every named-axis operation);
* two transposes that cancel (``swapaxes`` there and back) and two row-major reshapes back
  to the operand's shape (split and merged back) are ``x`` (JAX itself elides a single
  identity ``transpose``/``reshape``/``broadcast_in_dim`` when it traces one);
* a softmax in ``vmap``'s form, taken on ``transpose(u)`` (the max taken on ``u`` before the
  transpose) and moved back by the inverse transpose, is the plain softmax of ``u``: that
  is what ``jax.vmap(jax.nn.softmax)`` over any axis but the softmax's (penzai's ``nmap``)
  makes, and the attention rules read the plain form. (``jax.nn.dot_product_attention``
  uses the softmax in the moved frame without moving it back; its own rules read that.)

Each rule replaces a value by one that is equal element for element, so it never changes
what the program computes, only how the kernel rules see it; where no kernel rule fires,
the program is the same computation with fewer operations. The rules are named
``canonical_*`` so reports can tell them from the kernel rewrites.
"""

from __future__ import annotations

import pypm_jax as pm

from ..jax import prims as P
from ._plans import (
    inverse_permutation,
    kept_dims,
    kept_shape,
    noop_reshape,
    row_major,
    vmapped_softmax_axes,
)
from ._weight_slices import (
    squeezed_permutation,
    swapped_dot,
    weight_side,
    weight_slice,
    weight_split,
    weight_squeeze,
)
from .attention import NEG_INF, Expand, Splat, StopGrad

__all__ = [
    "CANONICAL_RULES",
    "VmapSoftmaxBack",
    "canonical_copy",
    "canonical_reshapes",
    "canonical_transposes",
    "canonical_softmax",
    "canonical_sliced_dot",
    "canonical_split_dot",
    "canonical_squeezed_dot",
    "canonical_swapped_dot",
]

# ---------------------------------------------------------------- no-op layout


@pm.pattern
def Copied(x):
    return P.copy(x)


@pm.pattern
def TransposedBack(x):
    """``transpose(transpose(x, a), b)`` where ``b`` undoes ``a`` (``swapaxes`` there and
    back). Two transposes that do not cancel stay: ``jax.nn.dot_product_attention``'s rules
    read its output's two."""
    y, t = pm.var(), pm.var()
    y <= P.transpose(t)
    t <= P.transpose(x)
    assert inverse_permutation(t.permutation, y.permutation)
    return y


@pm.pattern
def ReshapedBack(x):
    """``reshape(reshape(x))`` back to ``x``'s shape, both row-major (split and merged
    back): the elements never moved."""
    y, r = pm.var(), pm.var()
    y <= P.reshape(r)
    r <= P.reshape(x)
    assert row_major(y.dimensions) and row_major(r.dimensions)
    assert noop_reshape(None, x.shape, y.shape)
    return y


@pm.rule(Copied)
def canonical_copy(x):
    """``copy(x)`` → ``x``: JAX's ``copy`` is the identity on values."""
    return x


@pm.rule(TransposedBack)
def canonical_transposes(x):
    """Two transposes that cancel → the operand."""
    return x


@pm.rule(ReshapedBack)
def canonical_reshapes(x):
    """Two row-major reshapes back to the operand's shape → the operand."""
    return x


# ------------------------------------------------------------------- vmap softmax


@pm.pattern
def MaxClamp(mm, m):
    """``mm`` is the row max ``m``, maybe clamped ``max(-inf, m)`` as ``jax.nn.softmax`` does."""
    c = pm.var()
    assert c.value == NEG_INF
    mm <= P.max(Splat(c), m)
    return mm


@pm.pattern
def MaxClamp(mm, m):  # noqa: F811 (alternates share a name)
    c = pm.var()
    assert c.value == NEG_INF
    mm <= P.max(m, Splat(c))
    return mm


@pm.pattern
def MaxClamp(mm, m):  # noqa: F811
    mm <= m
    return mm


@pm.pattern
def VmapSoftmaxBack(y, u, m, mm, z, x):
    """``transpose(softmax(transpose(u)))`` as ``vmap`` makes it, the max taken on ``u``: the
    root ``y`` moves the probabilities back into ``u``'s frame. Binds the row max ``m`` of
    ``u`` and its clamped form ``mm`` (reused by the plain form), the sum ``z`` and ``x``."""
    e, kept_sum, kept_max, moved_max, p = pm.var(), pm.var(), pm.var(), pm.var(), pm.var()
    y <= P.transpose(p)
    p <= P.div(e, kept_sum)
    kept_sum <= Expand(z)
    z <= P.reduce_sum(e)
    e <= P.exp(P.sub(x, StopGrad(kept_max)))
    kept_max <= Expand(moved_max)
    moved_max <= P.transpose(MaxClamp(mm, m))
    m <= P.reduce_max(u)
    x <= P.transpose(u)
    assert vmapped_softmax_axes(
        x.shape, x.permutation, z.axes, m.axes, moved_max.permutation, kept_sum.shape,
        kept_max.shape,
    )  # fmt: skip
    assert inverse_permutation(x.permutation, y.permutation)
    return y


@pm.rule(VmapSoftmaxBack)
def canonical_softmax(y, u, m, mm, z, x):
    """The plain softmax of ``u`` over the axis ``m`` reduces, reusing its row max:
    ``exp(u - stop_gradient(mm[..., None])) / sum(..)[..., None]``."""
    shape, dims = kept_shape(u.shape, m.axes), kept_dims(u.shape, m.axes)
    assert shape is not None and dims is not None
    e = P.exp(
        P.sub(u, P.stop_gradient(P.broadcast_in_dim(mm, shape=shape, broadcast_dimensions=dims)))
    )
    total = P.broadcast_in_dim(P.reduce_sum(e, axes=m.axes), shape=shape, broadcast_dimensions=dims)
    return P.div(e, total)


# ------------------------------------------------------------- sliced projections


@pm.pattern
def SlicedDot(y, d, x, w):
    """``slice(dot_general(x, w))`` narrowing only axes the weight ``w`` contributes (a
    fused gate/up projection cut into its halves), the full result read only by such
    slices."""
    y <= P.slice(d)
    d <= P.dot_general(x, w)
    assert weight_slice(d.term, y.term, None) != None  # noqa: E711
    return y


@pm.pattern
def SlicedDotT(y, t, d, x, w):
    """The same through the einsum's output transpose: ``slice(transpose(dot_general))``."""
    y <= P.slice(t)
    t <= P.transpose(d)
    d <= P.dot_general(x, w)
    assert weight_slice(d.term, y.term, t.permutation) != None  # noqa: E711
    return y


@pm.pattern
def SplitDot(y, d, x, w):
    """One output of ``split(dot_general(x, w))`` along a weight axis in two
    (``jnp.split(x @ w, 2, axis=-1)``): the first half..."""
    S = pm.Op(1, 2)
    assert S.name == "split"
    y <= S(d)[0]
    d <= P.dot_general(x, w)
    assert weight_split(d.term, y.term) != None  # noqa: E711
    return y


@pm.pattern
def SplitDot(y, d, x, w):  # noqa: F811
    """... and the second."""
    S = pm.Op(1, 2)
    assert S.name == "split"
    y <= S(d)[1]
    d <= P.dot_general(x, w)
    assert weight_split(d.term, y.term) != None  # noqa: E711
    return y


@pm.pattern
def SqueezedDot(y, d, x, w):
    """``squeeze(dot_general(x, w))`` of size-1 axes the weight contributes."""
    y <= P.squeeze(d)
    d <= P.dot_general(x, w)
    assert weight_squeeze(d.term, y.dimensions, None) != None  # noqa: E711
    return y


@pm.pattern
def SqueezedDotT(y, t, d, x, w):
    y <= P.squeeze(t)
    t <= P.transpose(d)
    d <= P.dot_general(x, w)
    assert weight_squeeze(d.term, y.dimensions, t.permutation) != None  # noqa: E711
    return y


@pm.pattern
def SwappedDot(y, d, a, b):
    """``transpose(dot_general(a, b))`` that is ``dot_general(b, a)``, ``b`` contracting its
    last axis (the weight-first form ``jnp.einsum`` writes for some output orders)."""
    y <= P.transpose(d)
    d <= P.dot_general(a, b)
    assert swapped_dot(d.term, y.permutation) != None  # noqa: E711
    return y


@pm.rule(SlicedDot)
def canonical_sliced_dot(y, d, x, w):
    """``slice(x · w)`` → ``x · slice(w)``: the weight sliced as the result was (the
    weight is either operand: ``weight_side``)."""
    s = weight_slice(d.term, y.term, None)
    if weight_side(d.term) == 1:
        ws = P.slice(w, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            x,
            ws,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        xs = P.slice(x, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            xs,
            w,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )


@pm.rule(SlicedDotT)
def canonical_sliced_dot_t(y, t, d, x, w):
    """``slice(transpose(x · w))`` → ``transpose(x · slice(w))``."""
    s = weight_slice(d.term, y.term, t.permutation)
    if weight_side(d.term) == 1:
        ws = P.slice(w, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.transpose(
            P.dot_general(
                x,
                ws,
                dimension_numbers=d.dimension_numbers,
                precision=d.precision,
                preferred_element_type=d.preferred_element_type,
            ),
            permutation=t.permutation,
        )
    else:
        xs = P.slice(x, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.transpose(
            P.dot_general(
                xs,
                w,
                dimension_numbers=d.dimension_numbers,
                precision=d.precision,
                preferred_element_type=d.preferred_element_type,
            ),
            permutation=t.permutation,
        )


@pm.rule(SplitDot)
def canonical_split_dot(y, d, x, w):
    """``split(x · w)[i]`` → ``x · slice(w)``: the weight cut as the result was."""
    s = weight_split(d.term, y.term)
    if weight_side(d.term) == 1:
        ws = P.slice(w, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            x,
            ws,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        xs = P.slice(x, start_indices=s[0], limit_indices=s[1], strides=s[2])
        return P.dot_general(
            xs,
            w,
            dimension_numbers=d.dimension_numbers,
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )


@pm.rule(SqueezedDot, single_use=True)
def canonical_squeezed_dot(y, d, x, w):
    """``squeeze(x · w)`` → ``x · squeeze(w)``: the size-1 weight axis dropped first."""
    s = weight_squeeze(d.term, y.dimensions, None)
    if weight_side(d.term) == 1:
        return P.dot_general(
            x,
            P.squeeze(w, dimensions=s[0]),
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        return P.dot_general(
            P.squeeze(x, dimensions=s[0]),
            w,
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )


@pm.rule(SqueezedDotT, single_use=True)
def canonical_squeezed_dot_t(y, t, d, x, w):
    """``squeeze(transpose(x · w))`` → ``transpose(x · squeeze(w))``."""
    s = weight_squeeze(d.term, y.dimensions, t.permutation)
    perm = squeezed_permutation(t.permutation, y.dimensions)
    if weight_side(d.term) == 1:
        dot = P.dot_general(
            x,
            P.squeeze(w, dimensions=s[0]),
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    else:
        dot = P.dot_general(
            P.squeeze(x, dimensions=s[0]),
            w,
            dimension_numbers=s[1],
            precision=d.precision,
            preferred_element_type=d.preferred_element_type,
        )
    return P.transpose(dot, permutation=perm)


@pm.rule(SwappedDot, single_use=True)
def canonical_swapped_dot(y, d, a, b):
    """``transpose(a · b)`` → ``b · a`` where the transpose only swaps the operands'
    axes."""
    return P.dot_general(
        b,
        a,
        dimension_numbers=swapped_dot(d.term, y.permutation),
        precision=d.precision,
        preferred_element_type=d.preferred_element_type,
    )


CANONICAL_RULES = [
    canonical_copy,
    canonical_transposes,
    canonical_reshapes,
    canonical_softmax,
    canonical_sliced_dot,
    canonical_sliced_dot_t,
    canonical_split_dot,
    canonical_squeezed_dot,
    canonical_squeezed_dot_t,
    canonical_swapped_dot,
]
