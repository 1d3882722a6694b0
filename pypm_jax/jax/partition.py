"""Kernels that partition under SPMD like the program they replaced.

XLA cannot look inside a kernel call (a Pallas call on GPU, its interpreter's loops on CPU),
so on a mesh it would gather every operand onto every device. A replacement operator
therefore declares, beside its implementation (:func:`~pypm_jax.vocab.impls.register_impl`),
how its operands' dimensions map onto shared *factors* -- batch, heads, a query sequence,
rows, columns -- with
:func:`~pypm_jax.vocab.partitioning.register_partitioning` (the declaration belongs to the
JAX-free vocabulary, :mod:`pypm_jax.vocab`; this module is what lowering does with it).
Lowering then wraps the kernel call in JAX's ``jax.experimental.custom_partitioning``: the
factors become its Shardy sharding rule (and drive the GSPMD callbacks), and at partitioning
time the kernel runs once per device on the shards of whatever the operands are sharded by,
with no collective of its own.

Declared in terms of a :class:`~pypm_jax.vocab.partitioning.Partitioning`:

* each dimension of an operand or of the result is a factor name, a pair of names (a
  *compound* dimension, major first: GQA's query heads are ``("g", "r")``, the kv heads
  ``"g"``), or None: a dimension the kernel needs whole (a sequence the softmax reduces
  over, a head dimension). A compound splits by the axes of its major factor, or past it:
  8 query heads over 2 kv heads on a model axis of 4 split the query heads 4 ways and the
  kv heads by the axis's major half (a sub-axis, as Shardy cuts it after a reshape), so
  each device holds the one kv head its query heads read -- the split ``jax.jit`` gives
  the program the kernel replaced;
* a factor of the operands absent from the result is a contraction. Split (the operands come
  sharded along it, as in a row-parallel matmul), the site runs as ``finish(psum(partial(
  local operands)), local operands)`` -- the accumulation, XLA's own all-reduce of it, then
  the epilogue -- when the declaration gives ``partial``/``finish``; without them the factor
  is never split;
* a dimension of size 1 in an operand (a broadcast mask or bias) is never split;
* ``offset`` names a factor whose positions the kernel reads (attention's query sequence,
  under a causal mask, a band or a position-reading modifier): split, each device's call
  gets its block's first index as the keyword ``offset`` (an int32 scalar, the linear index
  of the device along the factor's axes, ``lax.axis_index``, times the block's length).

Operand shardings are read as mesh axes, or, where Shardy split an axis into sub-axes, as
axes of the mesh's finest refinement (every axis cut into prime-sized sub-axes; the call
then runs on that mesh, the same devices in the same order). A sharding neither expresses
counts as unsplit: XLA gathers that operand for the kernel.

Gradients: the kernel's own ``custom_vjp`` runs per shard inside a second partitioned call
(``custom_partitioning`` has no derivative rules of its own), which recomputes the kernel's
forward from the operands; gradients of operands that lack a split factor (a bias broadcast
over the batch), or that devices share (the kv heads above), are summed over those axes
with ``psum``, as XLA does for the original program. Under GSPMD, which would gather an
operand once per call, the forward call also returns its operands as it took them, and
those are the backward call's.

Under ``jax.vmap`` (``custom_partitioning`` has no batching rule) the call becomes the
partitioned call of the vmapped function, the mapped axis one more factor. With one device
nothing is wrapped: the kernel is called as registered.
"""

from __future__ import annotations

__all__ = ["partitioned"]

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..vocab.partitioning import Dim, Partitioning
from . import _compat

# ------------------------------------------------------------------------------ factors


def _factors(dim: Dim) -> tuple[str, ...]:
    if dim is None:
        return ()
    return (dim,) if isinstance(dim, str) else tuple(dim)


def _major(dim: Dim) -> str | None:
    """The factor a dimension is split by: the only one, or a compound's major one."""
    fs = _factors(dim)
    return fs[0] if fs else None


@dataclass(frozen=True)
class _Site:
    """One call's declaration checked against its operands' shapes.

    ``dims`` / ``out`` are the declaration with unsplittable dimensions (None, size 1, a
    contraction without ``partial``) as None; ``sizes`` every factor's size.
    """

    dims: tuple[tuple[Dim, ...], ...]
    out: tuple[Dim, ...]
    sizes: dict[str, int]
    summed: frozenset[str]
    spec: Partitioning


def _site(
    spec: Partitioning, shapes: Sequence[tuple[int, ...]], out_shape: tuple[int, ...]
) -> _Site:
    if (
        len(spec.inputs) != len(shapes)
        or any(len(d) != len(s) for d, s in zip(spec.inputs, shapes, strict=True))
        or len(spec.output) != len(out_shape)
    ):
        raise ValueError(
            f"partitioning {spec.inputs} -> {spec.output} does not fit shapes {list(shapes)} "
            f"-> {out_shape}"
        )
    sizes: dict[str, int] = {}
    for dims, shape in zip((*spec.inputs, spec.output), (*shapes, out_shape), strict=True):
        for dim, n in zip(dims, shape, strict=True):
            if isinstance(dim, str) and n != 1:
                if sizes.setdefault(dim, n) != n:
                    raise ValueError(f"factor {dim!r} has sizes {sizes[dim]} and {n}")
    for dims, shape in zip((*spec.inputs, spec.output), (*shapes, out_shape), strict=True):
        for dim, n in zip(dims, shape, strict=True):  # a compound's minor factor: the rest
            if isinstance(dim, tuple) and len(dim) == 2 and dim[0] in sizes and n != 1:
                if n % sizes[dim[0]] == 0:
                    sizes.setdefault(dim[1], n // sizes[dim[0]])
    out_factors = {f for d in spec.output for f in _factors(d)}
    splittable_sum = spec.partial is not None and spec.finish is not None
    summed = frozenset(
        f for dims in spec.inputs for d in dims for f in _factors(d) if f not in out_factors
    )

    def keep(dim: Dim, n: int) -> Dim:
        major = _major(dim)
        if major is None or n == 1 or major not in sizes or sizes[major] == 1:
            return None
        if major in summed and not splittable_sum:
            return None
        if isinstance(dim, tuple) and (len(dim) != 2 or n % sizes[major]):
            return None
        return dim

    dims = tuple(
        tuple(keep(d, n) for d, n in zip(ds, s, strict=True))
        for ds, s in zip(spec.inputs, shapes, strict=True)
    )
    out = tuple(keep(d, n) for d, n in zip(spec.output, out_shape, strict=True))
    return _Site(dims, out, sizes, summed if splittable_sum else frozenset(), spec)


def _sharding_rule(site: _Site, with_operands: bool = False) -> SdyShardingRule:
    """The Shardy rule: kept dims by factor; every other dim its own need-replication factor.
    ``with_operands``: the operands are results too (after the result)."""
    names: dict[str, str] = {}
    whole: list[str] = []
    sizes: dict[str, int] = {}

    def name(f: str) -> str:
        return names.setdefault(f, f"f{len(names)}")

    def mapping(dims: tuple[Dim, ...]) -> ArrayMapping:
        out = []
        for dim in dims:
            if dim is None:
                w = f"w{len(whole)}"
                whole.append(w)
                out.append(w)
            elif isinstance(dim, str):
                out.append(name(dim))
            elif site.sizes[dim[1]] == 1:  # (g, 1): just g (Shardy takes no unit factor)
                out.append(name(dim[0]))
            else:
                for f in dim:
                    sizes[name(f)] = site.sizes[f]
                out.append(CompoundFactor(*(name(f) for f in dim)))
        return ArrayMapping(*out)

    ins = tuple(mapping(d) for d in site.dims)
    res = (mapping(site.out), *(mapping(d) for d in site.dims if with_operands))
    plain = {d for m in (*ins, *res) for d in m if isinstance(d, str)}
    sizes = {k: v for k, v in sizes.items() if k not in plain}  # only compound-only factors
    return SdyShardingRule(ins, res, need_replication_factors=tuple(whole), **sizes)


# ------------------------------------------------------------------------------ partitioning


Spec = tuple[tuple[str, ...], ...]  # mesh axes per dimension


def _decode(sharding: Any, mesh: Any, ndim: int) -> Spec | None:
    """Mesh axes per dimension; unsplit for no sharding at all (GSPMD infers a result
    before every operand has its sharding); None when no axes of ``mesh`` express it."""
    if sharding is None:
        return ((),) * ndim
    return _compat.mesh_axes(sharding, mesh, ndim)


def _finest(mesh: Any) -> Any:
    """``mesh`` with every axis cut into prime-sized sub-axes, major first (``model`` of 4:
    ``model.0`` x ``model.1``), the same devices in the same order: the mesh whose axes
    express the sub-axis shardings Shardy chooses after a reshape (``model:(1)2``)."""
    names: list[str] = []
    shape: list[int] = []
    for a, n in mesh.shape.items():
        primes = []
        p = 2
        while n > 1:
            while n % p == 0:
                primes.append(p)
                n //= p
            p += 1
        names += [a] if len(primes) <= 1 else [f"{a}.{i}" for i in range(len(primes))]
        shape += primes or [1]
    return Mesh(mesh.devices.reshape(shape), tuple(names))


def _assign(
    site: _Site, mesh: Any, arg_specs: Sequence[tuple[tuple[str, ...], ...]]
) -> dict[str, tuple[str, ...]]:
    """Mesh axes per factor: from the first operand that has it split (so nothing split is
    ever gathered unless two operands disagree), when the factor's size divides evenly.

    A compound dimension ``(g, r)`` may come split by more devices than ``g`` has indices
    (8 query heads over 2 kv heads, on 4 devices): when each device's block of it lies
    within one index of ``g`` and the axes' major part splits ``g`` exactly, ``g`` takes
    those axes too, *shared* (see :class:`_Layout`).
    """
    used: set[str] = set()
    axes: dict[str, tuple[str, ...]] = {}
    for dims, spec in zip(site.dims, arg_specs, strict=True):
        for dim, entry in zip(dims, spec, strict=True):
            major = _major(dim)
            if major is None or major in axes or not entry or used & set(entry):
                continue
            sizes = [mesh.shape[a] for a in entry]
            n, size = math.prod(sizes), site.sizes[major]
            shared = (
                isinstance(dim, tuple)
                and n % size == 0
                and site.sizes[dim[1]] % (n // size) == 0
                and _major_part(sizes, size) is not None
            )
            if size % n == 0 or shared:
                axes[major] = entry
                used |= set(entry)
    return axes


def _major_part(sizes: Sequence[int], n: int) -> tuple[int, int] | None:
    """Where axes of ``sizes`` (major first, product a multiple of ``n``) split into a major
    part of ``n`` devices and the rest: ``(i, k)``, axis ``i`` splitting into ``k`` major
    by ``sizes[i] // k`` minor; None when no axis boundary or even split gives ``n``."""
    acc = 1
    for i, s in enumerate(sizes):
        if n % (acc * s) == 0:
            acc *= s
            if acc == n:
                return i + 1, 0  # a boundary: axes [:i + 1] are the major part
            continue
        k = n // acc
        return (i, k) if n % acc == 0 and s % k == 0 else None
    return None


@dataclass(frozen=True)
class _Layout:
    """How one call splits across the mesh, read from its operands' shardings.

    ``axes`` gives each split factor its mesh axes. A *shared* factor ``g`` (a compound
    ``(g, r)`` split by more devices than ``g`` has indices) has its axes cut into major
    sub-axes, ``alone[g]``, splitting ``g`` exactly, and minor ones, splitting ``r``:
    ``mesh`` is the call's mesh with those sub-axes as axes of their own (same devices, in
    the same order). A dimension of ``g`` alone (GQA's kv heads) splits by ``alone[g]``,
    so each device holds the one index of ``g`` its block of the compound belongs to, and
    the devices sharing it sum its gradient.
    """

    mesh: Any
    axes: dict[str, tuple[str, ...]]
    alone: dict[str, tuple[str, ...]]


def _layout(site: _Site, mesh: Any, shardings: Sequence[Any], shapes: Sequence[Any]) -> _Layout:
    """The call's layout from its operands' shardings, on ``mesh``, or on its finest
    refinement (:func:`_finest`) when an operand comes split by sub-axes or a shared factor
    cuts an axis; a sharding neither expresses counts as unsplit (XLA then gathers it)."""

    def read(mesh: Any) -> tuple[list[Spec | None], dict[str, tuple[str, ...]]]:
        specs = [_decode(sh, mesh, len(s)) for sh, s in zip(shardings, shapes, strict=True)]
        unsplit = [((),) * len(s) if p is None else p for p, s in zip(specs, shapes, strict=True)]
        return specs, _assign(site, mesh, unsplit)

    specs, axes = read(mesh)
    cuts = [_major_part([mesh.shape[a] for a in e], site.sizes[f]) for f, e in axes.items()]
    if any(p is None for p in specs) or any(c is not None and c[1] for c in cuts):
        mesh = _finest(mesh)
        specs, axes = read(mesh)
    alone: dict[str, tuple[str, ...]] = {}
    for f, entry in axes.items():
        sizes = [mesh.shape[a] for a in entry]
        if math.prod(sizes) > site.sizes[f]:  # shared: _assign checked the cut
            cut = _major_part(sizes, site.sizes[f])
            assert cut is not None and not cut[1]
            alone[f] = entry[: cut[0]]
    return _Layout(mesh, axes, alone)


def _named(layout: _Layout, dims: tuple[Dim, ...]) -> NamedSharding:
    entries = []
    for dim in dims:
        f = _major(dim)
        a = () if f is None else layout.axes.get(f, ())
        if isinstance(dim, str) and f in layout.alone:
            a = layout.alone[f]
        entries.append(None if not a else a[0] if len(a) == 1 else a)
    return NamedSharding(layout.mesh, P(*entries))


def _psum(x: Any, axes: Sequence[str]) -> Any:
    return jax.lax.psum(x, tuple(axes)) if axes else x


def _summed_axes(site: _Site, layout: _Layout) -> tuple[str, ...]:
    return tuple(a for f in sorted(site.summed) for a in layout.axes.get(f, ()))


def _missing_axes(site: _Site, dims: tuple[Dim, ...], layout: _Layout) -> tuple[str, ...]:
    """Axes an operand's gradient sums over: those of split result factors it lacks, and
    the minor ones of a shared factor it has alone (its devices each hold a part)."""
    have = {_major(d) for d in dims}
    lacking = [
        a
        for d in site.out
        if (f := _major(d)) is not None and f not in have
        for a in layout.axes.get(f, ())
    ]
    sharing = [
        a
        for d in dims
        if isinstance(d, str) and d in layout.alone
        for a in layout.axes[d][len(layout.alone[d]) :]
    ]
    return (*lacking, *(a for a in sharing if a not in lacking))


def _offset_kw(site: _Site, layout: _Layout) -> dict[str, Any]:
    """``{"offset": first index}`` of this device's block of the offset factor, when split."""
    f = site.spec.offset
    axes = layout.axes.get(f, ()) if f is not None else ()
    if not axes:
        return {}
    block = site.sizes[f] // math.prod(layout.mesh.shape[a] for a in axes)
    return {"offset": jax.lax.axis_index(tuple(axes)) * block}


def _is_float(x: Any) -> bool:
    return jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.inexact)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def partitioned(fn: Callable[..., Any], spec: Partitioning, args: Sequence[Any]) -> Any:
    """``fn(*args)`` (one array out) as a call XLA partitions by ``spec``'s factors.

    Operands known while tracing and of rank 0 (a literal scale, an absent bias's ``0``) stay
    Python-visible constants of the kernel call rather than becoming its operands.
    """
    fixed = {i: a for i, a in enumerate(args) if not _compat.is_tracer(a) and np.ndim(a) == 0}
    if fixed:
        n, free = len(args), [i for i in range(len(args)) if i not in fixed]
        fn = _bound(fn, fixed, free, n)
        spec = Partitioning(
            tuple(spec.inputs[i] for i in free),
            spec.output,
            None if spec.partial is None else _bound(spec.partial, fixed, free, n),
            None if spec.finish is None else _bound(spec.finish, fixed, free, n, 1),
            spec.offset,
        )
        args = [args[i] for i in free]
    args = [jax.numpy.asarray(a) for a in args]
    shapes = [_shape(a) for a in args]
    out = jax.eval_shape(fn, *args)
    site = _site(spec, shapes, tuple(out.shape))
    if all(d is None for dims in site.dims for d in dims):
        return fn(*args)  # nothing can be split: the plain call, replicated by XLA
    floats = tuple(i for i, a in enumerate(args) if _is_float(a))
    fwd = _batchable(_forward(fn, site, shapes), _vmapped_forward(fn, spec))
    fwd_res = _batchable(
        _forward(fn, site, shapes, with_operands=True), _vmapped_forward(fn, spec, True)
    )
    bwd = _batchable(
        _backward(fn, site, shapes, tuple(out.shape), floats), _vmapped_backward(fn, spec, floats)
    )

    @jax.custom_vjp
    def call(*xs: Any) -> Any:
        return fwd(*xs)

    def call_fwd(*xs: Any) -> tuple[Any, Any]:
        if jax.config.jax_use_shardy_partitioner:
            return fwd(*xs), xs  # Shardy's program gathers an operand once for both calls
        # GSPMD's gathers it for each call, unless the forward hands on the operands as it
        # took them: the backward call finds them split as it needs them
        out, *res = fwd_res(*xs)
        return out, tuple(res)

    def call_bwd(xs: Any, ct: Any) -> tuple[Any, ...]:
        grads = iter(bwd(*xs, ct))
        return tuple(next(grads) if i in floats else None for i in range(len(xs)))

    call.defvjp(call_fwd, call_bwd)
    return call(*args)


# ------------------------------------------------------------------------------ vmap
# ``custom_partitioning`` has no batching rule: under ``jax.vmap`` the call is rebuilt as the
# partitioned call of the vmapped function, the mapped axis one more (splittable) factor.


def _batchable(f: Callable[..., Any], rule: Callable[..., Any]) -> Callable[..., Any]:
    g = custom_vmap(_positional(f))
    g.def_vmap(rule)
    return g


def _vmapped(spec: Partitioning) -> Partitioning:
    v = f"vmap{len(spec.output)}"  # nested vmaps: one factor per level
    return Partitioning(
        tuple((v, *d) for d in spec.inputs),
        (v, *spec.output),
        None if spec.partial is None else jax.vmap(spec.partial),
        None if spec.finish is None else jax.vmap(spec.finish),
        spec.offset,
    )


def _vmap(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``jax.vmap(fn)`` over the positional operands; keywords (``offset``) unmapped."""

    def g(*xs: Any, **kw: Any) -> Any:
        return jax.vmap(functools.partial(fn, **kw))(*xs)

    return g


def _all_mapped(axis_size: int, in_batched: Sequence[bool], xs: Sequence[Any]) -> list[Any]:
    """Every operand with the mapped axis first (per-example gradients need it everywhere)."""
    return [
        x if b else jax.numpy.broadcast_to(x, (axis_size, *np.shape(x)))
        for x, b in zip(xs, in_batched, strict=True)
    ]


def _vmapped_forward(
    fn: Callable[..., Any], spec: Partitioning, with_operands: bool = False
) -> Callable[..., Any]:
    def rule(axis_size: int, in_batched: Sequence[bool], *xs: Any) -> tuple[Any, Any]:
        xs = _all_mapped(axis_size, in_batched, xs)
        out = partitioned(_vmap(fn), _vmapped(spec), xs)
        if with_operands:
            return (out, *xs), (True,) * (1 + len(xs))
        return out, True

    return rule


def _vmapped_backward(
    fn: Callable[..., Any], spec: Partitioning, floats: tuple[int, ...]
) -> Callable[..., Any]:
    def rule(axis_size: int, in_batched: Sequence[bool], *xs_ct: Any) -> tuple[Any, Any]:
        *xs, ct = _all_mapped(axis_size, in_batched, xs_ct)

        def on_floats(*fl: Any) -> Any:
            full = list(xs)
            for i, x in zip(floats, fl, strict=True):
                full[i] = x
            return partitioned(_vmap(fn), _vmapped(spec), full)

        _, vjp = jax.vjp(on_floats, *(xs[i] for i in floats))
        grads = tuple(vjp(ct))
        return grads, (True,) * len(grads)

    return rule


def _positional(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with a plain ``*args`` signature (``custom_partitioning`` binds its arguments
    to ``f``'s signature, and keyword-only parameters defeat that)."""

    def g(*xs: Any) -> Any:
        return f(*xs)

    return g


def _bound(
    f: Callable[..., Any], fixed: dict[int, Any], free: list[int], n: int, lead: int = 0
) -> Callable[..., Any]:
    """``f`` taking only the free operands (after ``lead`` leading arguments)."""

    def g(*xs: Any, **kw: Any) -> Any:
        full = dict(fixed)
        full.update(zip(free, xs[lead:], strict=True))
        return f(*xs[:lead], *(full[i] for i in range(n)), **kw)

    return g


def _forward(fn: Callable[..., Any], site: _Site, shapes: Any, with_operands: bool = False) -> Any:
    """``fn`` per shard; ``with_operands``: also its operands, as split for it."""

    def lower(mesh: Any, arg_infos: Any, _result: Any) -> Any:
        layout = _layout(site, mesh, [a.sharding for a in arg_infos], shapes)
        summed = _summed_axes(site, layout)

        def local(*xs: Any) -> Any:
            if not summed:
                out = fn(*xs, **_offset_kw(site, layout))
            else:
                out = site.spec.finish(_psum(site.spec.partial(*xs), summed), *xs)
            return (out, *xs) if with_operands else out

        arg_sh = tuple(_named(layout, d) for d in site.dims)
        out_sh = _named(layout, site.out)
        return layout.mesh, local, (out_sh, *arg_sh) if with_operands else out_sh, arg_sh

    def infer(mesh: Any, arg_infos: Any, _result: Any) -> Any:
        layout = _layout(site, mesh, [a.sharding for a in arg_infos], shapes)
        out_sh = _named(layout, site.out)
        if not with_operands:
            return out_sh
        return (out_sh, *(_named(layout, d) for d in site.dims))

    rule = _sharding_rule(site, with_operands)
    cp = custom_partitioning(_positional(_with_operands(fn) if with_operands else fn))
    cp.def_partition(
        decode_shardings=False,  # read by _layout, which survives sub-axes
        partition=lower,
        infer_sharding_from_operands=infer,
        sharding_rule=rule,
    )
    return cp


def _with_operands(fn: Callable[..., Any]) -> Callable[..., Any]:
    def g(*xs: Any) -> Any:
        return (fn(*xs), *xs)

    return g


def _backward(
    fn: Callable[..., Any], site: _Site, shapes: Any, out_shape: Any, floats: tuple[int, ...]
) -> Any:
    """The gradients of the float operands, per shard, from the operands and the cotangent."""
    n = len(shapes)
    bsite = _with_cotangent(site)

    def grads(*xs_ct: Any, summed: tuple[str, ...] = (), layout: Any = None) -> tuple[Any, ...]:
        xs, ct = list(xs_ct[:n]), xs_ct[n]

        def on_floats(f: Callable[..., Any]) -> Callable[..., Any]:
            def g(*fl: Any) -> Any:
                full = list(xs)
                for i, x in zip(floats, fl, strict=True):
                    full[i] = x
                return f(*full)

            return g

        fl = [xs[i] for i in floats]
        if not summed:
            kw = {} if layout is None else _offset_kw(site, layout)
            _, vjp = jax.vjp(on_floats(functools.partial(fn, **kw)), *fl)
            gs = list(vjp(ct))
        else:
            acc, pvjp = jax.vjp(on_floats(site.spec.partial), *fl)
            acc = _psum(acc, summed)

            def finish(a: Any, *f: Any) -> Any:
                return on_floats(lambda *x: site.spec.finish(a, *x))(*f)

            _, fvjp = jax.vjp(finish, acc, *fl)
            d_acc, *g_fin = fvjp(ct)
            gs = [a + b for a, b in zip(g_fin, pvjp(d_acc), strict=True)]
        if layout is not None:
            gs = [
                _psum(g, _missing_axes(site, site.dims[i], layout))
                for g, i in zip(gs, floats, strict=True)
            ]
        return tuple(gs)

    def lower(mesh: Any, arg_infos: Any, _result: Any) -> Any:
        layout = _layout(bsite, mesh, [a.sharding for a in arg_infos], (*shapes, out_shape))

        def local(*xs_ct: Any) -> Any:
            return grads(*xs_ct, summed=_summed_axes(site, layout), layout=layout)

        arg_sh = tuple(_named(layout, d) for d in bsite.dims)
        out_sh = tuple(_named(layout, site.dims[i]) for i in floats)
        return layout.mesh, local, out_sh, arg_sh

    def infer(mesh: Any, arg_infos: Any, _result: Any) -> Any:
        layout = _layout(bsite, mesh, [a.sharding for a in arg_infos], (*shapes, out_shape))
        return tuple(_named(layout, site.dims[i]) for i in floats)

    cp = custom_partitioning(_positional(grads))
    cp.def_partition(
        decode_shardings=False,  # read by _layout, which survives sub-axes
        partition=lower,
        infer_sharding_from_operands=infer,
        sharding_rule=_bwd_rule(site, floats),
    )
    return cp


def _with_cotangent(site: _Site) -> _Site:
    """The backward call's operands: the forward's and the result's cotangent."""
    return _Site((*site.dims, site.out), (), site.sizes, site.summed, site.spec)


def _bwd_rule(site: _Site, floats: tuple[int, ...]) -> SdyShardingRule:
    """The forward rule over the operands and the cotangent; results: the float operands'
    gradients, each mapped like its operand."""
    fwd = _sharding_rule(_with_cotangent(site))
    return SdyShardingRule(
        fwd.operand_mappings,
        tuple(fwd.operand_mappings[i] for i in floats),
        need_replication_factors=fwd.need_replication_factors,
        **fwd.factor_sizes,
    )
