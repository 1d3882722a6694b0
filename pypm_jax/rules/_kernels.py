"""The replacement operators of the standard rules and their JAX implementations.

A rule replaces a matched subgraph by ONE node of these operators. Its attribute ``plan``
(:mod:`pypm_jax.rules._plans`) says how the node's inputs map onto the kernel; the
implementation registered here (``pypm_jax.vocab.register_impl``) transposes the inputs into
the kernel's layout, calls ``pallas_kernels``, and transposes/casts the result so the
replaced value keeps exactly its shape and dtype. Absent optional inputs (no bias, no mask)
are a literal ``0`` the plan tells the implementation to ignore.

Kernel selection is ``pallas_kernels``'s: Pallas on GPU, the plain-JAX reference on CPU,
``PYPM_KERNEL_IMPL=interpret`` for the Pallas interpreter.

GEMM epilogues follow a *fuse policy* (``$PYPM_GEMM_FUSE``: ``auto``, ``always``,
``never``; see :func:`gemm_impl`): where XLA already fuses the same epilogue into its own
GEMM, the automatic choice leaves the site to XLA.
"""

from __future__ import annotations

__all__ = [
    "FlashAttention",
    "FlashAttentionSinks",
    "GemmEpilogue",
    "AttentionRegion",
    "GemmRegion",
    "GemmPairRegion",
    "RegionOperands",
    "FUSE_ENV",
    "FUSE_POLICIES",
    "fuse_policy",
    "gemm_impl",
]

import functools
import os
from collections.abc import Mapping
from math import prod
from typing import Any

from ..core.dtypes import as_dtype
from ..core.errors import PyPMError
from ..engine.report import KernelInfo, register_describe
from ..lang import frontend as pm
from ..vocab import Partitioning, register_impl, register_partitioning
from ._gemm_regions import GemmRegionPlan
from ._plans import AttentionPlan, GemmPlan
from ._region import describe, region_fn

FUSE_ENV = "PYPM_GEMM_FUSE"
FUSE_POLICIES = ("auto", "always", "never")


def _infer(*_inputs: Any, plan: Any, **_attrs: Any) -> tuple[Any, Any]:
    """The replaced value's type, which the plan carries."""
    return plan.out_shape, plan.out_dtype


@pm.op(attrs=("plan",), op_class="attention", infer=_infer)
def FlashAttention(a, b, v, bias, mask, scale):  # noqa: N802 (operators are named like the paper's)
    return 1


@pm.op(attrs=("plan",), op_class="attention", infer=_infer)
def FlashAttentionSinks(a, b, v, bias, mask, scale, sinks):  # noqa: N802
    """``FlashAttention`` whose softmax also counts one logit ``sinks[h]`` per head."""
    return 1


@pm.op(attrs=("plan",), op_class="gemm", infer=_infer)
def GemmEpilogue(x, w, bias):  # noqa: N802
    return 1


def _describe_region(*, region: Any, plan: Any) -> str:
    """The report's text for a ``GemmRegion``: its region (``acc`` is ``x @ w``)."""
    return describe(region)


@pm.op(attrs=("region", "plan"), op_class="gemm", infer=_infer, describe=_describe_region)
def GemmRegion(x, w, operands):  # noqa: N802
    """``region(x @ w, *operands)`` (:mod:`pypm_jax.rules._region`); ``operands`` is ``0``
    (none) or a :func:`RegionOperands` pack."""
    return 1


@pm.op(attrs=("region", "plan"), op_class="gemm", infer=_infer, describe=_describe_region)
def GemmPairRegion(x, w, w2, operands):  # noqa: N802
    """``region(x @ w, *operands)`` where the operand ``plan.pair_at`` is ``x @ w2``,
    computed by the same kernel (a gated pair: ``pallas_kernels.gemm_fused_pair``)."""
    return 1


def _infer_pack(*_inputs: Any) -> tuple[Any, Any]:
    return None, None


@pm.op(op_class="pack", infer=_infer_pack)
def RegionOperands(rest, operand):  # noqa: N802
    """The operands of a region: those of ``rest`` (``0``: none, or another pack), then
    ``operand``. A list grows by one per rewrite, with rules of a fixed shape."""
    return 1


def _static_scalar(x: Any) -> float | None:
    """x as a Python float if it is known while tracing (a literal), else None."""
    import jax

    try:
        return float(x)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


@register_impl(FlashAttention)
@register_impl(FlashAttentionSinks)
def flash_attention_impl(
    a: Any,
    b: Any,
    v: Any,
    bias: Any,
    mask: Any,
    scale: Any,
    sinks: Any = None,
    *,
    plan: AttentionPlan,
    offset: Any = 0,
) -> Any:
    """The kernel call; ``offset``: the position of the first query (a device's block of a
    sequence split across devices, :func:`flash_attention_partitioning`)."""
    import jax.numpy as jnp

    from pallas_kernels import flash_attention

    q, k = (a, b) if plan.q_operand == 0 else (b, a)
    kernel_scale = 1.0
    if plan.scale_input:
        # A literal scale goes to the kernel, which scales the f32 scores as the program did;
        # a computed one (``scores / jnp.sqrt(d)`` is a sqrt at run time) scales q instead.
        c = _static_scalar(scale)
        if c is not None and c != 0.0:
            kernel_scale = c if plan.scale_input > 0 else 1.0 / c
        else:
            c = jnp.reshape(scale, ()).astype(q.dtype)
            q = q * c if plan.scale_input > 0 else q / c
    # operands of mixed float dtypes run in the plan's (wider) dtype; a no-op otherwise
    q = jnp.transpose(q, plan.perm_q).astype(plan.dtype)
    k = jnp.transpose(k, plan.perm_k).astype(plan.dtype)
    v = jnp.transpose(v, plan.perm_v).astype(plan.dtype)
    kernel_bias = kernel_mask = None
    if plan.bias:
        kernel_bias = jnp.transpose(bias, plan.perm_scores) if jnp.ndim(bias) else bias
        if plan.bias < 0:
            kernel_bias = -kernel_bias
    if plan.mask:
        kernel_mask = jnp.transpose(mask, plan.perm_scores)
    out = flash_attention(
        q,
        k,
        v,
        kernel_bias,
        kernel_mask,
        scale=kernel_scale,
        causal=plan.causal,
        band=(None, 0) if plan.mask_is_causal else None,  # keys above the diagonal: skipped
        layout=plan.layout,
        masked_rows=plan.masked_rows,
        sinks=None if sinks is None else jnp.asarray(sinks),
        q_offset=offset,
    )
    return jnp.transpose(out, plan.perm_out).astype(plan.out_dtype)


def fuse_policy() -> str:
    """``$PYPM_GEMM_FUSE`` (default ``auto``), checked: a misspelt policy raises."""
    policy = os.environ.get(FUSE_ENV, "").strip().lower() or "auto"
    if policy not in FUSE_POLICIES:
        raise ValueError(f"${FUSE_ENV}={policy!r}: expected one of {FUSE_POLICIES}")
    return policy


def gemm_impl(xla_fuses: bool) -> str | None:
    """The ``impl`` a GEMM-epilogue site asks ``pallas_kernels`` for.

    * ``never``: ``"xla"`` -- XLA's own GEMM and the epilogue as the program wrote it;
    * ``always``: None -- the kernels' own choice (Pallas on a GPU, ``$PYPM_KERNEL_IMPL``);
    * ``auto``: like ``always``, except that a site whose epilogue XLA:GPU already fuses into
      its GEMM (``xla_fuses``: a bias or residual add, then at most a ReLU or tanh-GELU:
      cuBLASLt's epilogues) runs as ``"xla"`` on a GPU when no kernel implementation was
      asked for explicitly: the kernel cannot beat the fusion it would replace. (On a CPU
      the automatic choice is the reference, the original computation, anyway.)
    """
    from pallas_kernels import ENV_VAR
    from pallas_kernels._dispatch import on_gpu

    policy = fuse_policy()
    if policy == "never":
        return "xla"
    explicit = os.environ.get(ENV_VAR, "").strip().lower() not in ("", "auto")
    if policy == "auto" and xla_fuses and not explicit and on_gpu():
        return "xla"
    return None


@register_impl(GemmEpilogue)
def gemm_epilogue_impl(x: Any, w: Any, bias: Any, *, plan: GemmPlan) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import gemm_epilogue

    if plan.transpose_w:
        w = jnp.transpose(w)
    b = jnp.reshape(bias, (-1,)) if plan.bias else None  # (N elements; a shard's N/d)
    fused_by_xla = plan.activation in ("none", "relu", "gelu_tanh")
    out = gemm_epilogue(x, w, b, activation=plan.activation, impl=gemm_impl(fused_by_xla))
    return out.astype(plan.out_dtype)


# ------------------------------------------------------------------- report describers


def _short_dtype(name: str) -> str:
    dt = as_dtype(name)
    return dt.name if dt is not None else name


@register_describe(FlashAttention)
@register_describe(FlashAttentionSinks)
def describe_attention(attrs: Mapping[str, Any], _type: str) -> KernelInfo:
    """``attention  f32 B2 H8/2 S128x256 D64  causal,bias``: batch, query/kv heads (one
    number without GQA), query x key lengths (one when equal), head dim; the flags say which
    kernel features the site uses."""
    plan: AttentionPlan = attrs["plan"]
    q, k = plan.kernel_shapes[0], plan.kernel_shapes[1]
    axes = {"BHSD": (0, 1, 2), "BSHD": (0, 2, 1)}[plan.layout]  # B, H, S
    b, hq, sq = (q[a] for a in axes)
    hk, sk = k[axes[1]], k[axes[2]]
    heads = f"H{hq}" if hq == hk else f"H{hq}/{hk}"
    seq = f"S{sq}" if sq == sk else f"S{sq}x{sk}"
    flags = [
        name
        for name, on in (
            ("causal", plan.causal or plan.mask_is_causal),
            ("mask", plan.mask),
            ("bias", plan.bias),
            ("zero-rows", plan.masked_rows == "zero"),
            ("sinks", plan.sinks),
        )
        if on
    ]
    return KernelInfo(
        "attention", f"{_short_dtype(plan.dtype)} B{b} {heads} {seq} D{q[-1]}", tuple(flags)
    )


@register_describe(GemmEpilogue)
def describe_gemm(attrs: Mapping[str, Any], _type: str) -> KernelInfo:
    """``gemm  f32 256x512x1024  gelu,bias``: M x K x N (M all rows of x)."""
    plan: GemmPlan = attrs["plan"]
    m = prod(plan.out_shape[:-1])
    flags = tuple(
        f for f, on in ((plan.activation, plan.activation != "none"), ("bias", plan.bias)) if on
    )
    return KernelInfo("gemm", f"{_short_dtype(plan.dtype)} {m}x{plan.k}x{plan.n}", flags)


# ------------------------------------------------------------------------------ partitioning
# How each kernel's operands split across devices (``pypm_jax.vocab.partitioning``):
# attention over batch, (kv) heads and the query sequence, GEMM epilogues over rows and
# columns and, summed, over K.

_KERNEL_AXES = {"B": "b", "S": "s", "H": ("g", "r"), "D": None}


def _dims(perm: tuple[int, ...], labels: Any) -> tuple[Any, ...]:
    """Dims in the caller's layout of an operand that ``perm`` transposes to ``labels``."""
    dims: list[Any] = [None] * len(perm)
    for label, axis in zip(labels, perm, strict=True):
        dims[axis] = label
    return tuple(dims)


@register_partitioning(FlashAttention)
def flash_attention_partitioning(*shapes: Any, plan: AttentionPlan) -> Partitioning | None:
    """Batch ``b``, heads and the query sequence ``s`` split; query heads are kv heads ``g``
    times the group ``r``; the key sequence (which every query's softmax reduces over), head
    dims, the scale and any further operand stay whole. A device holding a block of the
    query sequence gets its first position as ``offset`` (causal masks and bands read it)."""
    if any(len(p) != 4 for p in (plan.perm_q, plan.perm_k, plan.perm_v, plan.perm_out)):
        return None
    q = tuple(_KERNEL_AXES[c] for c in plan.layout)
    kv = tuple({"H": "g", "S": None}.get(c, _KERNEL_AXES[c]) for c in plan.layout)
    scores = ("b", ("g", "r"), "s", None)
    q_dims, k_dims = _dims(plan.perm_q, q), _dims(plan.perm_k, kv)
    ab = (q_dims, k_dims) if plan.q_operand == 0 else (k_dims, q_dims)
    return Partitioning(
        inputs=(
            *ab,
            _dims(plan.perm_v, kv),
            _dims(plan.perm_scores, scores) if len(shapes[3]) == 4 else (None,) * len(shapes[3]),
            _dims(plan.perm_scores, scores) if len(shapes[4]) == 4 else (None,) * len(shapes[4]),
            *((None,) * len(s) for s in shapes[5:]),
        ),
        output=tuple(q[axis] for axis in plan.perm_out),  # the result is out.transpose(perm_out)
        offset="s",
    )


@register_partitioning(GemmEpilogue)
def gemm_epilogue_partitioning(x: Any, w: Any, bias: Any, *, plan: GemmPlan) -> Partitioning | None:
    """Rows ``m*`` and columns ``n`` split; a split ``k`` sums the f32 accumulators of the
    devices (``partial``) before the reference epilogue (``finish``)."""
    import jax.numpy as jnp

    from pallas_kernels import epilogue_reference

    rows = tuple(f"m{i}" for i in range(len(x) - 1))

    def partial(x: Any, w: Any, bias: Any) -> Any:
        return jnp.dot(
            x, jnp.transpose(w) if plan.transpose_w else w, preferred_element_type=jnp.float32
        )

    def finish(acc: Any, x: Any, w: Any, bias: Any) -> Any:
        b = jnp.reshape(bias, (-1,)) if plan.bias else None
        return epilogue_reference(acc, b, activation=plan.activation).astype(plan.out_dtype)

    return Partitioning(
        inputs=(
            (*rows, "k"),
            ("n", "k") if plan.transpose_w else ("k", "n"),
            tuple("n" if d == plan.n else None for d in bias),
        ),
        output=(*rows, "n"),
        partial=partial,
        finish=finish,
    )


# ------------------------------------------------------------ attention score regions


def _region_infer(*_inputs: Any, plan: Any) -> tuple[Any, Any]:
    return plan.attention.out_shape, plan.attention.out_dtype


@pm.op(
    attrs=("plan",),
    op_class="attention",
    infer=_region_infer,
    describe=lambda plan: plan.describe(),
)
def AttentionRegion(a, b, v, x, c0, c1, c2, c3, c4, c5):  # noqa: N802
    """Flash attention whose logits are a region of pointwise steps over the scores
    (:mod:`pypm_jax.rules.attention_region`): ``x`` is the part of the logits not yet taken
    into the region (the literal 0 once it is), ``c0``..``c5`` the captured operands."""
    return 1


@functools.cache
def _score_mod(fn: Any) -> Any:
    """The kernel's ``score_mod`` for a compiled region (one function object per region,
    as ``region_fn`` is memoized: jit caches keyed by it hit)."""

    def score_mod(s: Any, b: Any, h: Any, qi: Any, ki: Any, *caps: Any) -> Any:
        return fn(s, *caps, b=b, h=h, q=qi, k=ki)

    return score_mod


@functools.cache
def _mask_mod(fn: Any) -> Any:
    def mask_mod(b: Any, h: Any, qi: Any, ki: Any, *caps: Any) -> Any:
        return fn(None, *caps, b=b, h=h, q=qi, k=ki)

    return mask_mod


def _to_score_tile(c: Any, frame: tuple[int, ...], perm_scores: tuple[int, ...]) -> Any:
    """A captured operand, whose axes lie along the program's score axes ``frame``, as a
    rank-4 array broadcastable to the kernel's ``[B, H, Sq, Skv]``."""
    import jax.numpy as jnp

    axes = [perm_scores.index(f) for f in frame]  # kernel axis of each of c's axes
    order = sorted(range(len(axes)), key=axes.__getitem__)
    c = jnp.transpose(c, order)
    shape = [1, 1, 1, 1]
    for i, j in enumerate(order):
        shape[axes[j]] = c.shape[i]
    return jnp.reshape(c, shape)


@register_impl(AttentionRegion)
def attention_region_impl(
    a: Any, b: Any, v: Any, x: Any, *caps: Any, plan: Any, offset: Any = 0
) -> Any:
    """The kernel call; ``offset``: the position of the first query, as for
    :func:`flash_attention_impl`."""
    import jax.numpy as jnp

    from pallas_kernels import flash_attention

    if plan.spine:  # the first rule's guard proves the rules finish it (rules/_region_walk.py)
        raise PyPMError("AttentionRegion: the region does not reach the scores yet")
    att = plan.attention
    q, k = (a, b) if att.q_operand == 0 else (b, a)
    q = jnp.transpose(q, att.perm_q).astype(att.dtype)
    k = jnp.transpose(k, att.perm_k).astype(att.dtype)
    v = jnp.transpose(v, att.perm_v).astype(att.dtype)
    captures = tuple(
        _to_score_tile(c, frame, att.perm_scores)
        for c, (_, frame) in zip(caps, plan.captures, strict=False)
    )
    out = flash_attention(
        q,
        k,
        v,
        scale=1.0,
        layout=att.layout,
        score_mod=_score_mod(region_fn(plan.region, "kernel")) if plan.region else None,
        mask_mod=_mask_mod(region_fn(plan.mask, "kernel")) if plan.mask else None,
        captures=captures,
        band=plan.band,
        masked_rows=att.masked_rows,
        q_offset=offset,
    )
    return jnp.transpose(out, att.perm_out).astype(att.out_dtype)


@register_partitioning(AttentionRegion)
def attention_region_partitioning(*shapes: Any, plan: Any) -> Partitioning | None:
    """As :func:`flash_attention_partitioning`; a captured operand's axes, which lie along
    the program's score axes (its frame), take those axes' factors."""
    att = plan.attention
    if plan.spine:
        return None
    base = flash_attention_partitioning(*shapes[:3], (), (), (), plan=att)
    if base is None:
        return None
    kernel_scores = ("b", ("g", "r"), "s", None)

    def capture(i: int, shape: Any) -> tuple[Any, ...]:
        if i >= len(plan.captures) or len(plan.captures[i][1]) != len(shape):
            return (None,) * len(shape)
        return tuple(kernel_scores[att.perm_scores.index(f)] for f in plan.captures[i][1])

    return Partitioning(
        inputs=(
            *base.inputs[:3],
            (None,) * len(shapes[3]),
            *(capture(i, s) for i, s in enumerate(shapes[4:])),
        ),
        output=base.output,
        offset="s",
    )


@register_describe(AttentionRegion)
def describe_attention_region(attrs: Mapping[str, Any], type_: str) -> KernelInfo:
    """As :func:`describe_attention`, flagged ``region`` (the region itself is the report's
    detail line: its logits, mask and band)."""
    info = describe_attention({"plan": attrs["plan"].attention}, type_)
    return KernelInfo(info.kernel, info.shape, (*info.flags, "region"))


@register_impl(RegionOperands)
def region_operands_impl(rest: Any, operand: Any) -> tuple[Any, ...]:
    return (*(rest if isinstance(rest, tuple) else ()), operand)


def _operand_tile(value: Any, kind: str, rank: int) -> Any:
    """The part of an operand (the value the program read, of the result's shape where it
    was broadcast) the kernel tiles: XLA folds these slices of a broadcast away."""
    import jax.numpy as jnp

    value = jnp.asarray(value)
    value = jnp.reshape(value, (1,) * (rank - value.ndim) + value.shape)
    if kind == "col":
        return value[(0,) * (rank - 1)]
    if kind == "row":
        return value[..., :1]
    if kind == "scalar":
        return value[(0,) * rank]
    if kind == "ecol":  # [E, 1, .., 1, N]: the experts' axis and the columns
        return value[(slice(None), *(slice(0, 1),) * (rank - 2), slice(None))]
    return value


@register_impl(GemmRegion)
def gemm_region_impl(x: Any, w: Any, operands: Any, *, region: Any, plan: GemmRegionPlan) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import gemm_fused, gemm_fused_experts

    ops = operands if isinstance(operands, tuple) else ()
    rank = len(plan.out_shape)
    tiles = tuple(_operand_tile(v, k, rank) for v, k in zip(ops, plan.operands, strict=True))
    if plan.experts:  # w [E, K, N] (or [E, N, K]), x shared: the result [E, *lead, N]
        return gemm_fused_experts(
            x,
            jnp.swapaxes(w, 1, 2) if plan.transpose_w else w,
            region_fn(region),
            *tiles,
            impl=gemm_impl(plan.xla_fuses),
            kernel_epilogue=region_fn(region, "kernel"),
            out_dtype=plan.out_dtype,
        )
    if plan.transpose_w:
        w = jnp.transpose(w)
    return gemm_fused(
        x,
        w,
        region_fn(region),
        *tiles,
        impl=gemm_impl(plan.xla_fuses),
        kernel_epilogue=region_fn(region, "kernel"),
        out_dtype=plan.out_dtype,
    )


@register_impl(GemmPairRegion)
def gemm_pair_region_impl(
    x: Any, w: Any, w2: Any, operands: Any, *, region: Any, plan: GemmRegionPlan
) -> Any:
    import jax.numpy as jnp

    from pallas_kernels import gemm_fused_pair

    ops = operands if isinstance(operands, tuple) else ()
    kinds = tuple(k for k in plan.operands if k != "pair")
    rank = len(plan.out_shape)
    tiles = tuple(_operand_tile(v, k, rank) for v, k in zip(ops, kinds, strict=True))
    return gemm_fused_pair(
        x,
        jnp.transpose(w) if plan.transpose_w else w,
        jnp.transpose(w2) if plan.transpose_w2 else w2,
        region_fn(region),
        *tiles,
        pair_at=plan.pair_at,
        impl=gemm_impl(plan.xla_fuses),
        kernel_epilogue=region_fn(region, "kernel"),
        out_dtype=plan.out_dtype,
    )


@register_describe(GemmPairRegion)
@register_describe(GemmRegion)
def describe_gemm_region(attrs: Mapping[str, Any], _type: str) -> KernelInfo:
    """``gemm  f32 256x512x1024  region,col,full``: M x K x N, flagged ``region`` and the
    kinds of the operands the epilogue reads (the region itself is the report's detail
    line)."""
    plan: GemmRegionPlan = attrs["plan"]
    m = prod(plan.out_shape[:-1])
    flags = ("region", *sorted(set(plan.operands)), *(("experts",) if plan.experts else ()))
    return KernelInfo("gemm", f"{_short_dtype(plan.dtype)} {m}x{plan.k}x{plan.n}", flags)
