"""GEMM with a fused elementwise epilogue: ``epilogue(x @ w, *operands)``.

The kernel accumulates ``x @ w`` in f32 over K tiles and applies the epilogue to
the f32 accumulator tile before the single store, so ``act(x @ w + b)`` costs one
pass over the output.  ``gemm_fused`` takes any elementwise epilogue (a traced
chain of pointwise JAX ops) and operands the kernel tiles with the output: column
vectors ``[N]`` (a bias), row vectors ``[..., 1]`` (a per-row scale), full tiles
``[..., N]`` (a residual) and scalars; ``gemm_epilogue`` instantiates it for the
standard activations.  M, N, K that are not tile multiples are zero-padded (padding never
reaches the result).  Gradients (``custom_vjp``) are computed by XLA: the epilogue
is differentiated with ``jax.vjp`` on the recomputed accumulator.

Epilogues must be lowerable by Pallas-Triton on GPU: ``jnp`` arithmetic,
comparisons/``where``, ``exp``/``log``/``tanh``/``sqrt``/... work; ``erf`` has no
Triton lowering, hence the ``erf`` below for the exact GELU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _dispatch as dsp
from . import _gemm_mgpu as mgpu
from ._autodiff import with_forward_mode

pl = dsp.LazyModule("jax.experimental.pallas")  # imported when a kernel is built

GEMM_BACKEND_ENV = "PYPM_GEMM_BACKEND"
GEMM_BACKENDS: tuple[str, ...] = ("triton", "mosaic")

ACTIVATIONS: tuple[str, ...] = (
    "none",
    "relu",
    "gelu_tanh",
    "gelu",
    "silu",
    "sigmoid",
    "tanh",
    "quick_gelu",
)

# quick GELU (CLIP's ``quick_gelu``, in transformers and OpenCLIP): ``x * sigmoid(1.702 x)``.
QUICK_GELU_SCALE = 1.702

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT2 = 1.0 / math.sqrt(2.0)


def erf(x: jax.Array) -> jax.Array:
    """erf from exp/arith only: Abramowitz & Stegun 7.1.26, |error| <= 1.5e-7.

    ``lax.erf`` has no Pallas-Triton lowering; this keeps exact GELU in-kernel. Near 0 the
    *relative* error of erf grows, but GELU reads ``1 + erf``, so only the absolute error
    counts (max |gelu error| 4.8e-7 on [-8, 8], as with a Maclaurin branch near 0, which an
    earlier version had: it cost 2.3x the whole GEMM on an H100, see benchmarks/RESULTS.md).
    """
    ax = jnp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * ax)
    poly = t * (
        0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429)))
    )
    y = 1.0 - poly * jnp.exp(-ax * ax)
    return jnp.where(x < 0, -y, y)


def _sigmoid(x: jax.Array) -> jax.Array:
    return 1.0 / (1.0 + jnp.exp(-x))


# Kernel-side activations: only ops with a Triton lowering.
_KERNEL_ACTS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "none": lambda a: a,
    "relu": lambda a: jnp.maximum(a, 0.0),
    "gelu_tanh": lambda a: 0.5 * a * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a * a * a))),
    "gelu": lambda a: 0.5 * a * (1.0 + erf(a * _INV_SQRT2)),
    "silu": lambda a: a * _sigmoid(a),
    "sigmoid": _sigmoid,
    "tanh": jnp.tanh,
    "quick_gelu": lambda a: a * _sigmoid(QUICK_GELU_SCALE * a),
}

# Reference activations: the library functions the original program uses.
_REF_ACTS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "none": lambda a: a,
    "relu": jax.nn.relu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "quick_gelu": lambda a: a * jax.nn.sigmoid(QUICK_GELU_SCALE * a),
}


def _make_epilogue(act: Callable[[jax.Array], jax.Array], with_bias: bool) -> Callable[..., Any]:
    if with_bias:
        return lambda acc, b: act(acc + b)
    return lambda acc: act(acc)


# Built once so the functions are stable jit cache keys.
_KERNEL_EPILOGUES = {
    (a, wb): _make_epilogue(_KERNEL_ACTS[a], wb) for a in ACTIVATIONS for wb in (False, True)
}
_REF_EPILOGUES = {
    (a, wb): _make_epilogue(_REF_ACTS[a], wb) for a in ACTIVATIONS for wb in (False, True)
}


# --------------------------------------------------------------------------- #
# Support predicate
# --------------------------------------------------------------------------- #


OPERAND_KINDS: tuple[str, ...] = ("col", "row", "full", "scalar")


def operand_kind(shape: Any, lead: tuple[int, ...], n: int) -> str | None:
    """How the kernel tiles an operand of ``shape`` read against a ``[*lead, N]`` result:
    ``"scalar"`` (one element), ``"col"`` (``[N]``, or ``[1, .., N]``), ``"row"``
    (``[*lead, 1]``), ``"full"`` (``[*lead, N]``), or None (a shape it cannot tile, such
    as a per-batch ``[B, 1, N]`` bias of a ``[B, S, N]`` result)."""
    try:
        s = tuple(int(d) for d in shape)
    except TypeError:
        return None
    out = (*lead, n)
    if len(s) > len(out):
        return None
    s = (1,) * (len(out) - len(s)) + s
    if math.prod(s) == 1:
        return "scalar"
    if s[-1] == n and all(d == 1 for d in s[:-1]):
        return "col"
    if lead and s == (*lead, 1):
        return "row"
    if s == out:
        return "full"
    return None


def _structure_error(x_shape: Any, w_shape: Any, operand_shapes: tuple[Any, ...]) -> str | None:
    try:
        xs = tuple(int(d) for d in x_shape)
        ws = tuple(int(d) for d in w_shape)
    except TypeError:
        return f"shapes must be sequences of ints, got {x_shape!r}, {w_shape!r}"
    if len(xs) < 1:
        return f"x must have rank >= 1, got shape {xs}"
    if len(ws) != 2:
        return f"w must be rank 2 [K, N], got shape {ws}"
    if xs[-1] != ws[0]:
        return f"contraction mismatch: x[..., {xs[-1]}] @ w[{ws[0]}, ...]"
    for i, cs in enumerate(operand_shapes):
        if operand_kind(cs, xs[:-1], ws[1]) is None:
            return (
                f"operand {i} of shape {tuple(cs) if isinstance(cs, tuple | list) else cs!r} "
                f"is not a scalar, a column of shape [N] = ({ws[1]},), a row {(*xs[:-1], 1)} or a full "
                f"tile {(*xs[:-1], ws[1])}"
            )
    return None


def _kernel_error(
    x_shape: Any, w_shape: Any, dtype: Any, operand_shapes: tuple[Any, ...]
) -> str | None:
    err = _structure_error(x_shape, w_shape, operand_shapes)
    if err is not None:
        return err
    name = dsp.dtype_name(dtype)
    if name not in dsp.SUPPORTED_DTYPES:
        return f"dtype {name or dtype!r} not supported (expected one of {dsp.SUPPORTED_DTYPES})"
    if 0 in tuple(x_shape) or 0 in tuple(w_shape):
        return "empty operands are not supported by the kernel"
    return None


def supports_gemm(
    x_shape: Any,
    w_shape: Any,
    dtype: Any,
    *,
    bias_shape: Any = None,
    operand_shapes: tuple[Any, ...] = (),
) -> bool:
    """True iff the Pallas GEMM handles ``x[..., K] @ w[K, N] (+ bias[N])`` in ``dtype``
    with epilogue operands of ``operand_shapes`` (see :func:`operand_kind`); a bias is
    exactly ``[N]``.

    Pure Python; ``dtype`` may be a name or a dtype.  Any M, N, K >= 1 work (padded
    to tiles); dtype must be float32, bfloat16 or float16.
    """
    if bias_shape is not None:
        try:
            if tuple(int(d) for d in bias_shape) != (int(tuple(w_shape)[-1]),):
                return False
        except (TypeError, ValueError, IndexError):
            return False
    ops = (() if bias_shape is None else (bias_shape,)) + tuple(operand_shapes)
    return _kernel_error(x_shape, w_shape, dtype, ops) is None


# --------------------------------------------------------------------------- #
# Kernel
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class GemmBlocks:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def default_gemm_blocks(m: int, n: int, k: int, dtype: Any, interpret: bool) -> GemmBlocks:
    """Tile defaults (tuned on an H100, see benchmarks/RESULTS.md); 16-wide tiles in
    interpret mode so tiny test shapes still cover multi-tile grids and K loops."""
    if interpret:
        cfg = GemmBlocks(16, 16, 16, 2, 4, 2)
    elif jnp.dtype(dtype) == jnp.float32:
        cfg = GemmBlocks(128, 128, 32, 8, 8, 3)
    else:
        cfg = GemmBlocks(128, 256, 64, 8, 8, 3)
    return clamp_gemm_blocks(cfg, m, n, k)


def clamp_gemm_blocks(cfg: GemmBlocks, m: int, n: int, k: int) -> GemmBlocks:
    return dataclasses.replace(
        cfg,
        block_m=min(cfg.block_m, max(16, dsp.next_pow2(m))),
        block_n=min(cfg.block_n, max(16, dsp.next_pow2(n))),
        block_k=min(cfg.block_k, max(16, dsp.next_pow2(k))),
    )


def _tile_ids(pid: Any, nm: int, nn: int, group_m: int) -> tuple[Any, Any]:
    """Grouped ("swizzled") tile order: consecutive programs share x row-panels and
    w column-panels in L2."""
    width = group_m * nn
    first_m = lax.div(pid, width) * group_m
    size_m = jnp.minimum(nm - first_m, group_m)
    within = lax.rem(pid, width)
    return first_m + lax.rem(within, size_m), lax.div(within, size_m)


def _gemm_kernel(
    x_ref: Any,
    w_ref: Any,
    *refs: Any,
    epilogue: Callable[..., Any],
    n_cols: int,
    block_k: int,
    precision: Any,
    pair_at: int | None = None,
) -> None:
    """One output tile: ``epilogue(x @ w, *operand tiles)``; with ``pair_at``, ``refs``
    starts with a second weight ``w2`` and the tile of ``x @ w2`` (rounded to x's dtype, as
    the program's own GEMM returns it) is the epilogue's operand ``pair_at``."""
    if pair_at is not None:
        w2_ref, refs = refs[0], refs[1:]
    col_refs, o_ref = refs[:n_cols], refs[n_cols]
    bm, bn = o_ref.shape
    k_steps = x_ref.shape[1] // block_k
    zero = jnp.zeros((bm, bn), jnp.float32)

    if pair_at is None:

        def body(kk: Any, acc: jax.Array) -> jax.Array:
            a = x_ref[:, pl.ds(kk * block_k, block_k)]
            b = w_ref[pl.ds(kk * block_k, block_k), :]
            return acc + dsp.dot(a, b, precision=precision)

        acc = lax.fori_loop(0, k_steps, body, zero)
    else:

        def body2(kk: Any, accs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            a = x_ref[:, pl.ds(kk * block_k, block_k)]
            b = w_ref[pl.ds(kk * block_k, block_k), :]
            b2 = w2_ref[pl.ds(kk * block_k, block_k), :]
            return (
                accs[0] + dsp.dot(a, b, precision=precision),
                accs[1] + dsp.dot(a, b2, precision=precision),
            )

        acc, acc2 = lax.fori_loop(0, k_steps, body2, (zero, zero))
    cols = []
    for c in col_refs:
        tile = c[...]
        cols.append(tile.astype(jnp.float32) if jnp.issubdtype(tile.dtype, jnp.floating) else tile)
    if pair_at is not None:
        cols.insert(pair_at, acc2.astype(x_ref.dtype).astype(jnp.float32))
    out = epilogue(acc, *cols)
    if jnp.shape(out) != (bm, bn):
        raise ValueError(
            f"gemm_fused: epilogue must be elementwise (tile {(bm, bn)} -> {(bm, bn)}), "
            f"it returned shape {jnp.shape(out)}"
        )
    o_ref[...] = out.astype(o_ref.dtype)


def _tiled_kind(c: jax.Array) -> str:
    """The kind of an operand already in kernel form (:func:`_as_kernel_operands`)."""
    if c.ndim == 1:
        return "col"
    if c.shape[1] != 1:
        return "full"
    return "scalar" if c.shape[0] == 1 else "row"


def _pad_operand(c: jax.Array, rows: int, cols: int) -> jax.Array:
    kind = _tiled_kind(c)
    if kind == "col":
        return c if c.shape[0] == cols else jnp.pad(c, (0, cols - c.shape[0]))
    if kind == "row":
        return _pad2(c, rows, 1)
    if kind == "full":
        return _pad2(c, rows, cols)
    return c


def _operand_spec(c: jax.Array, bm: int, bn: int, m_of: Any, n_of: Any) -> Any:
    """Column tiles are ``[bn]``, row tiles ``[bm, 1]``, full tiles ``[bm, bn]``, a scalar
    ``[1, 1]``: each broadcasts against the ``[bm, bn]`` accumulator in the epilogue."""
    kind = _tiled_kind(c)
    if kind == "col":
        return pl.BlockSpec((bn,), lambda p: (n_of(p),))
    if kind == "row":
        return pl.BlockSpec((bm, 1), lambda p: (m_of(p), 0))
    if kind == "full":
        return pl.BlockSpec((bm, bn), lambda p: (m_of(p), n_of(p)))
    return pl.BlockSpec((1, 1), lambda p: (0, 0))


def _as_kernel_operands(
    operands: tuple[jax.Array, ...], lead: tuple[int, ...], n: int
) -> tuple[jax.Array, ...]:
    """Each operand in the form both the kernel and the reference feed the epilogue: a
    column ``[N]``, a row ``[M, 1]``, a full ``[M, N]`` or a scalar ``[1, 1]``
    (M = prod(lead)). Shapes were checked by :func:`_structure_error`."""
    m = math.prod(lead)
    shapes = {"col": (n,), "row": (m, 1), "full": (m, n), "scalar": (1, 1)}
    return tuple(jnp.reshape(c, shapes[operand_kind(c.shape, lead, n) or "full"]) for c in operands)


def _pad2(x: jax.Array, rows: int, cols: int) -> jax.Array:
    if x.shape == (rows, cols):
        return x
    return jnp.pad(x, ((0, rows - x.shape[0]), (0, cols - x.shape[1])))


def _gemm_pallas(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    out_dtype: Any,
    interpret: bool,
    blocks: GemmBlocks | mgpu.MosaicGemmConfig | None,
    precision: Any,
    backend: str = "triton",
    w2: jax.Array | None = None,
    pair_at: int | None = None,
) -> jax.Array:
    """The Pallas GEMM; with ``w2`` (and ``pair_at``), also ``x @ w2`` in the same kernel,
    the epilogue's operand ``pair_at`` (:func:`gemm_fused_pair`)."""
    if backend == "mosaic":
        cfg = blocks if isinstance(blocks, mgpu.MosaicGemmConfig) else None
        return mgpu.gemm_mosaic(x, w, cols, epilogue, out_dtype, interpret, cfg)
    m, k = x.shape
    n = w.shape[1]
    if not isinstance(blocks, GemmBlocks):
        blocks = None
    if blocks is None:
        blocks = default_gemm_blocks(m, n, k, x.dtype, interpret)
        if w2 is not None and not interpret:  # two accumulators: half as wide (untimed)
            blocks = dataclasses.replace(blocks, block_n=max(16, blocks.block_n // 2))
    else:
        blocks = clamp_gemm_blocks(blocks, m, n, k)
    bm, bn, bk = blocks.block_m, blocks.block_n, blocks.block_k
    mp, np_, kp = dsp.round_up(m, bm), dsp.round_up(n, bn), dsp.round_up(k, bk)
    xp = _pad2(x, mp, kp)
    wp = _pad2(w, kp, np_)
    w2p = () if w2 is None else (_pad2(w2, kp, np_),)
    colsp = tuple(_pad_operand(c, mp, np_) for c in cols)
    nm, nn = mp // bm, np_ // bn
    gm = max(1, min(blocks.group_m, nm))

    def m_of(pid: Any) -> Any:
        return _tile_ids(pid, nm, nn, gm)[0]

    def n_of(pid: Any) -> Any:
        return _tile_ids(pid, nm, nn, gm)[1]

    out = pl.pallas_call(
        functools.partial(
            _gemm_kernel,
            epilogue=epilogue,
            n_cols=len(cols),
            block_k=bk,
            precision=precision,
            pair_at=None if w2 is None else pair_at,
        ),
        grid=(nm * nn,),
        in_specs=[
            pl.BlockSpec((bm, kp), lambda p: (m_of(p), 0)),
            pl.BlockSpec((kp, bn), lambda p: (0, n_of(p))),
        ]
        + [pl.BlockSpec((kp, bn), lambda p: (0, n_of(p))) for _ in w2p]
        + [_operand_spec(c, bm, bn, m_of, n_of) for c in cols],
        out_specs=pl.BlockSpec((bm, bn), lambda p: (m_of(p), n_of(p))),
        out_shape=dsp.out_struct((mp, np_), out_dtype, xp),
        name="gemm_fused" if w2 is None else "gemm_fused_pair",
        **dsp.pallas_call_kwargs(interpret, blocks.num_warps, blocks.num_stages),
    )(xp, wp, *w2p, *colsp)
    if (mp, np_) != (m, n):
        out = out[:m, :n]
    return out


def _apply_epilogue(
    epilogue: Callable[..., Any], acc: jax.Array, cols: tuple[jax.Array, ...], out_dtype: Any
) -> jax.Array:
    cols32 = [c.astype(jnp.float32) if jnp.issubdtype(c.dtype, jnp.floating) else c for c in cols]
    return jnp.asarray(epilogue(acc, *cols32)).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gemm_core(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    cfg: tuple[Any, ...],
) -> jax.Array:
    out_dtype, interpret, blocks, precision, backend = cfg
    return _gemm_pallas(x, w, cols, epilogue, out_dtype, interpret, blocks, precision, backend)


def _gemm_core_fwd(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    cfg: tuple[Any, ...],
) -> tuple[jax.Array, Any]:
    return _gemm_core(x, w, cols, epilogue, cfg), (x, w, cols)


def _gemm_core_bwd(
    epilogue: Callable[..., Any], cfg: tuple[Any, ...], res: Any, g: jax.Array
) -> tuple[Any, ...]:
    out_dtype, _, _, precision, _ = cfg
    x, w, cols = res
    acc = dsp.dot(x, w, precision=precision)
    _, vjp = jax.vjp(lambda a, *c: _apply_epilogue(epilogue, a, c, out_dtype), acc, *cols)
    dacc, *dcols = vjp(g)
    dacc = dacc.astype(x.dtype)
    dx = dsp.dot(dacc, w, trans_b=True, precision=precision).astype(x.dtype)
    dw = dsp.dot(x, dacc, trans_a=True, precision=precision).astype(w.dtype)
    return dx, dw, tuple(dcols)


_gemm_core.defvjp(_gemm_core_fwd, _gemm_core_bwd)


@functools.partial(
    jax.jit,
    static_argnames=("epilogue", "interpret", "blocks", "precision", "backend", "out_dtype"),
)
def _gemm_kernel_path(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    *,
    epilogue: Callable[..., Any],
    interpret: bool,
    blocks: GemmBlocks | mgpu.MosaicGemmConfig | None,
    precision: Any,
    backend: str,
    out_dtype: Any,
) -> jax.Array:
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    cfg = (out_dtype, interpret, blocks, precision, backend)
    ops = _as_kernel_operands(tuple(cols), lead, w.shape[1])
    out = _gemm_core(x2, w, ops, epilogue, cfg)
    return out.reshape(*lead, w.shape[1])


# --------------------------------------------------------------------------- #
# References and public entry points
# --------------------------------------------------------------------------- #


def gemm_fused_reference(
    x: jax.Array,
    w: jax.Array,
    epilogue: Callable[..., Any],
    *col_operands: jax.Array,
    out_dtype: Any = None,
) -> jax.Array:
    """Plain JAX: ``epilogue(dot(x, w) in f32, *[c in f32]).astype(result dtype)``, the
    operands in the form the kernel gives them to the epilogue (see :func:`gemm_fused`)."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    cols = tuple(jnp.asarray(c) for c in col_operands)
    _validate(x, w, cols, "gemm_fused_reference")
    lead, n = x.shape[:-1], w.shape[1]
    acc = jnp.dot(x.reshape(-1, x.shape[-1]), w, preferred_element_type=jnp.float32)
    ops = _as_kernel_operands(cols, lead, n)
    out_dtype = jnp.result_type(x.dtype, w.dtype) if out_dtype is None else out_dtype
    out = _apply_epilogue(epilogue, acc, ops, out_dtype)
    return out.reshape(*lead, n)


_gemm_reference_jit = jax.jit(
    gemm_fused_reference, static_argnums=(2,), static_argnames=("out_dtype",)
)


def gemm_epilogue_reference(
    x: jax.Array, w: jax.Array, bias: jax.Array | None = None, *, activation: str = "none"
) -> jax.Array:
    """Plain JAX ``act(x @ w + bias)`` with f32 accumulation and f32 epilogue."""
    _check_activation(activation)
    cols = () if bias is None else (bias,)
    return gemm_fused_reference(x, w, _REF_EPILOGUES[(activation, bias is not None)], *cols)


def _check_activation(activation: Any) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _validate(x: jax.Array, w: jax.Array, cols: tuple[jax.Array, ...], who: str) -> None:
    err = _structure_error(x.shape, w.shape, tuple(c.shape for c in cols))
    if err is not None:
        raise ValueError(f"{who}: {err}")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{who}: {name} must be floating point, got {a.dtype}")


# Whether auto picks the Mosaic kernel on a Hopper GPU for the calls it can serve.  Off
# until its H100 timings are recorded (docs/STATUS.md, benchmarks/RESULTS.md); turning it
# on is this one line, the policy below is already tested.
MOSAIC_AUTO_ON_HOPPER = False


def _mosaic_reason(
    impl: str,
    dtype: Any,
    col_dtypes: tuple[Any, ...],
    epilogue: Callable[..., Any],
    operand_kinds: tuple[Any, ...] = (),
) -> str | None:
    if any(k != "col" for k in operand_kinds):
        return f"the Mosaic kernel takes column operands only, got {operand_kinds}"
    reason = mgpu.mosaic_error(dtype, col_dtypes, epilogue)
    if reason is None and impl == "pallas":
        cc = dsp.gpu_compute_capability()
        if cc is None or not cc.startswith("9."):
            reason = f"it needs a Hopper (sm90) GPU, this one is compute capability {cc}"
    return reason


def resolve_gemm_backend(
    requested: str | None,
    impl: str,
    dtype: Any,
    col_dtypes: tuple[Any, ...],
    epilogue: Callable[..., Any],
    operand_kinds: tuple[Any, ...] = (),
) -> str:
    """Which Pallas kernel runs a ``"pallas"``/``"interpret"`` GEMM: ``"triton"`` or
    ``"mosaic"`` (the Hopper kernel of ``_gemm_mgpu``).

    ``requested`` (the private ``_backend`` argument) or ``$PYPM_GEMM_BACKEND`` asks for
    one explicitly; a request that cannot run raises, like an explicit ``impl``.  Auto is
    Triton unless :data:`MOSAIC_AUTO_ON_HOPPER`, which is off until the Mosaic kernel
    (it lowers, checked on CPU, and is exact in the interpreter) is timed on an H100;
    then auto takes it for the compiled calls it can serve and Triton for the rest.
    ``$PYPM_GEMM_BACKEND=prefer-mosaic`` applies that policy now (to compare whole
    models both ways on a GPU).
    """
    source = "_backend"
    prefer = MOSAIC_AUTO_ON_HOPPER
    if requested is None:
        env = os.environ.get(GEMM_BACKEND_ENV, "").strip().lower()
        if env == "prefer-mosaic":
            prefer = True
        elif env and env != "auto":
            requested, source = env, f"${GEMM_BACKEND_ENV}"
    if requested is None:
        if (
            prefer
            and impl == "pallas"
            and _mosaic_reason(impl, dtype, col_dtypes, epilogue, operand_kinds) is None
        ):
            return "mosaic"
        return "triton"
    if requested not in GEMM_BACKENDS:
        raise ValueError(
            f"gemm_fused: invalid {source}={requested!r}; expected one of {GEMM_BACKENDS} "
            "(or 'auto', or 'prefer-mosaic' in the environment)."
        )
    if requested == "mosaic":
        reason = _mosaic_reason(impl, dtype, col_dtypes, epilogue, operand_kinds)
        if reason is not None:
            raise ValueError(f"gemm_fused: {source}='mosaic' cannot handle this call: {reason}")
    return requested


def gemm_fused(
    x: jax.Array,
    w: jax.Array,
    epilogue: Callable[..., Any],
    *operands: jax.Array,
    impl: str | None = None,
    kernel_epilogue: Callable[..., Any] | None = None,
    out_dtype: Any = None,
    _blocks: GemmBlocks | mgpu.MosaicGemmConfig | None = None,
    _backend: str | None = None,
) -> jax.Array:
    """``epilogue(x @ w, *operands)`` with the epilogue fused into the GEMM.

    Args:
      x: ``[..., K]``; leading dims are flattened into M.
      w: ``[K, N]``.
      epilogue: elementwise ``fn(acc_f32_tile, *operand_tiles) -> tile``; ``acc`` is the
        f32 accumulator ``[bm, bn]`` and each operand tile broadcasts against it: a column
        operand's ``[bn]`` slice, a row operand's ``[bm, 1]``, a full operand's
        ``[bm, bn]``, a scalar's ``[1, 1]`` (floats upcast to f32); in the Hopper kernel a
        column slice comes broadcast to ``[bm, bn]``: write the epilogue with broadcasting
        arithmetic (``acc * s + t``).  It is traced into the kernel, so it must be a pure
        elementwise JAX function; it is a static (hashable) argument.
      *operands: arrays the epilogue reads, each (see :func:`operand_kind`) a column
        ``[N]`` (a bias), a row ``[*lead, 1]`` (a per-row scale), a full ``[*lead, N]``
        tile (a residual) or a scalar (any shape of one element).
      impl: None (auto), "xla", "interpret" or "pallas".
      kernel_epilogue: the same function for the Pallas kernel, where it differs (written
        with operations Pallas-Triton lowers); default ``epilogue``.
      out_dtype: the result's dtype; default ``result_type(x, w)``.

    Returns ``[..., N]``.  Differentiable in x, w and every float operand: reverse mode by
    the kernel's ``custom_vjp`` (XLA backward), forward mode from the reference.
    """
    epilogue = dsp.as_callable(epilogue, "epilogue")
    kernel_epilogue = (
        epilogue if kernel_epilogue is None else dsp.as_callable(kernel_epilogue, "epilogue")
    )
    x, w = jnp.asarray(x), jnp.asarray(w)
    cols = tuple(jnp.asarray(c) for c in operands)
    _validate(x, w, cols, "gemm_fused")
    out_dtype = jnp.dtype(jnp.result_type(x.dtype, w.dtype) if out_dtype is None else out_dtype)
    reason = _kernel_error(x.shape, w.shape, x.dtype, tuple(c.shape for c in cols))
    if reason is None and x.dtype != w.dtype:
        reason = f"x and w must share a dtype, got {x.dtype} and {w.dtype}"
    impl = dsp.resolve_impl(impl, reason, "gemm_fused")
    if impl == "xla":
        return _gemm_reference_jit(x, w, epilogue, *cols, out_dtype=out_dtype)
    if isinstance(_blocks, mgpu.MosaicGemmConfig) and _backend is None:
        _backend = "mosaic"
    kinds = tuple(operand_kind(c.shape, x.shape[:-1], w.shape[1]) for c in cols)
    backend = resolve_gemm_backend(
        _backend, impl, x.dtype, tuple(c.dtype for c in cols), kernel_epilogue, kinds
    )
    kernel = functools.partial(
        _gemm_kernel_path,
        epilogue=kernel_epilogue,
        interpret=impl == "interpret",
        blocks=_blocks,
        precision=dsp.matmul_precision(x.dtype),
        backend=backend,
        out_dtype=out_dtype,
    )

    def reference(x: jax.Array, w: jax.Array, cols: tuple[jax.Array, ...]) -> jax.Array:
        return _gemm_reference_jit(x, w, epilogue, *cols, out_dtype=out_dtype)

    return with_forward_mode(kernel, reference)(x, w, cols)


def gemm_epilogue(
    x: jax.Array,
    w: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str = "none",
    impl: str | None = None,
    _blocks: GemmBlocks | mgpu.MosaicGemmConfig | None = None,
    _backend: str | None = None,
) -> jax.Array:
    """``act(x @ w + bias)``: f32 accumulation, f32 epilogue, result in x's dtype.

    ``activation`` is one of :data:`ACTIVATIONS` ("gelu" is the exact erf form,
    "gelu_tanh" the tanh approximation, "quick_gelu" ``x * sigmoid(1.702 x)``).  Built on
    :func:`gemm_fused`; the "xla" implementation is :func:`gemm_epilogue_reference` (library
    activations).
    """
    _check_activation(activation)
    cols = () if bias is None else (bias,)
    x_arr = jnp.asarray(x)
    reason = _kernel_error(
        x_arr.shape, jnp.shape(w), x_arr.dtype, tuple(jnp.shape(c) for c in cols)
    )
    chosen = dsp.resolve_impl(impl, reason, "gemm_epilogue")
    table = _REF_EPILOGUES if chosen == "xla" else _KERNEL_EPILOGUES
    return gemm_fused(
        x,
        w,
        table[(activation, bias is not None)],
        *cols,
        impl=chosen,
        _blocks=_blocks,
        _backend=_backend,
    )


def epilogue_reference(
    acc: jax.Array, bias: jax.Array | None = None, *, activation: str = "none"
) -> jax.Array:
    """The epilogue of :func:`gemm_epilogue_reference` alone: ``act(acc + bias)`` in f32.

    For a caller that forms the f32 accumulator itself, e.g. one device's share of a matmul
    whose contraction is split across devices, summed before the epilogue.
    """
    _check_activation(activation)
    cols = () if bias is None else (bias,)
    return _apply_epilogue(_REF_EPILOGUES[(activation, bias is not None)], acc, cols, jnp.float32)


# --------------------------------------------------------------------------- #
# Batched GEMMs: a leading expert axis on the weight
# --------------------------------------------------------------------------- #


def _experts_frame(
    x_shape: Any, w_shape: Any, operand_shapes: tuple[Any, ...], x_batched: bool
) -> tuple[tuple[int, ...], tuple[str, ...], tuple[bool, ...]] | str:
    """``(lead, per-expert operand kinds, which operands vary along the experts)`` of
    ``x @ w[e]`` for every expert ``e``, or why the kernel cannot take it."""
    try:
        xs = tuple(int(d) for d in x_shape)
        ws = tuple(int(d) for d in w_shape)
    except TypeError:
        return f"shapes must be sequences of ints, got {x_shape!r}, {w_shape!r}"
    if len(ws) != 3:
        return f"w must be rank 3 [E, K, N], got shape {ws}"
    e, k, n = ws
    if x_batched and (len(xs) < 2 or xs[0] != e):
        return f"a batched x must be [E={e}, ..., K], got shape {xs}"
    lead = xs[1:-1] if x_batched else xs[:-1]
    if not xs or xs[-1] != k:
        return f"contraction mismatch: x[..., {xs[-1] if xs else None}] @ w[E, {k}, ...]"
    rank = len(lead) + 2
    kinds, batched = [], []
    for i, cs in enumerate(operand_shapes):
        s = tuple(int(d) for d in cs)
        if len(s) > rank:
            return f"operand {i} of shape {s} has more axes than the result [E, ..., N]"
        s = (1,) * (rank - len(s)) + s
        kind = operand_kind(s[1:], lead, n)
        if kind is None or s[0] not in (1, e):
            return (
                f"operand {i} of shape {s} is not, per expert, a scalar, a column [N], a row "
                f"[*lead, 1] or a full tile [*lead, N] (with or without the expert axis)"
            )
        kinds.append(kind)
        batched.append(s[0] == e and e != 1)
    return lead, tuple(kinds), tuple(batched)


def supports_gemm_experts(
    x_shape: Any,
    w_shape: Any,
    dtype: Any,
    *,
    x_batched: bool = False,
    operand_shapes: tuple[Any, ...] = (),
) -> bool:
    """True iff :func:`gemm_fused_experts` runs the Pallas kernel for these shapes."""
    frame = _experts_frame(x_shape, w_shape, tuple(operand_shapes), x_batched)
    if isinstance(frame, str):
        return False
    lead = frame[0]
    ws = tuple(int(d) for d in w_shape)
    return _kernel_error((*lead, ws[1]), ws[1:], dtype, ()) is None


def _experts_operands(
    cols: tuple[jax.Array, ...], lead: tuple[int, ...], n: int, batched: tuple[bool, ...]
) -> tuple[jax.Array, ...]:
    """Each operand in kernel form (:func:`_as_kernel_operands`), per expert; an operand
    that varies along the experts keeps that axis first."""
    rank = len(lead) + 2
    out = []
    for c, b in zip(cols, batched, strict=True):
        c = jnp.reshape(c, (1,) * (rank - c.ndim) + c.shape)
        if b:
            out.append(jax.vmap(lambda ce: _as_kernel_operands((ce,), lead, n)[0])(c))
        else:
            out.append(_as_kernel_operands((c[0],), lead, n)[0])
    return tuple(out)


def _experts_axes(x_batched: bool, batched: tuple[bool, ...]) -> tuple[Any, ...]:
    return (0 if x_batched else None, 0, *(0 if b else None for b in batched))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _experts_core(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    cfg: tuple[Any, ...],
) -> jax.Array:
    out_dtype, interpret, precision, x_batched, batched = cfg

    def one(xe: jax.Array, we: jax.Array, *ce: jax.Array) -> jax.Array:
        return _gemm_pallas(xe, we, ce, epilogue, out_dtype, interpret, None, precision)

    # vmap adds the expert axis to the kernel's grid (one pallas_call)
    return jax.vmap(one, in_axes=_experts_axes(x_batched, batched))(x, w, *cols)


def _experts_fwd(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    cfg: tuple[Any, ...],
) -> tuple[jax.Array, Any]:
    return _experts_core(x, w, cols, epilogue, cfg), (x, w, cols)


def _experts_frame_cols(cols: tuple[jax.Array, ...], batched: tuple[bool, ...]) -> tuple:
    """Kernel-form operands broadcastable against the ``[E, M, N]`` accumulator: a
    per-expert column ``[E, N]`` becomes ``[E, 1, N]``."""
    return tuple(
        c[:, None, :] if b and c.ndim == 2 else c for c, b in zip(cols, batched, strict=True)
    )


def _experts_bwd(
    epilogue: Callable[..., Any], cfg: tuple[Any, ...], res: Any, g: jax.Array
) -> tuple[Any, ...]:
    out_dtype, _, precision, x_batched, batched = cfg
    x, w, cols = res
    sx = "emk" if x_batched else "mk"
    acc = jnp.einsum(
        f"{sx},ekn->emn", x, w, precision=precision, preferred_element_type=jnp.float32
    )
    framed = _experts_frame_cols(cols, batched)
    _, vjp = jax.vjp(lambda a, *c: _apply_epilogue(epilogue, a, c, out_dtype), acc, *framed)
    dacc, *dcols = vjp(g)
    dcols = [jnp.reshape(d, c.shape) for d, c in zip(dcols, cols, strict=True)]
    dacc = dacc.astype(x.dtype)
    dx = jnp.einsum(f"emn,ekn->{sx}", dacc, w, precision=precision).astype(x.dtype)
    dw = jnp.einsum(f"{sx},emn->ekn", x, dacc, precision=precision).astype(w.dtype)
    return dx, dw, tuple(dcols)


_experts_core.defvjp(_experts_fwd, _experts_bwd)


@functools.partial(
    jax.jit, static_argnames=("epilogue", "interpret", "precision", "out_dtype", "x_batched")
)
def _experts_kernel_path(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    *,
    epilogue: Callable[..., Any],
    interpret: bool,
    precision: Any,
    out_dtype: Any,
    x_batched: bool,
) -> jax.Array:
    frame = _experts_frame(x.shape, w.shape, tuple(c.shape for c in cols), x_batched)
    assert not isinstance(frame, str), frame
    lead, _, batched = frame
    e, k, n = w.shape
    m = math.prod(lead)
    x2 = x.reshape((e, m, k) if x_batched else (m, k))
    ops = _experts_operands(cols, lead, n, batched)
    cfg = (out_dtype, interpret, precision, x_batched, batched)
    return _experts_core(x2, w, ops, epilogue, cfg).reshape(e, *lead, n)


def gemm_fused_experts_reference(
    x: jax.Array,
    w: jax.Array,
    epilogue: Callable[..., Any],
    *operands: jax.Array,
    x_batched: bool = False,
    out_dtype: Any = None,
) -> jax.Array:
    """Plain JAX: ``epilogue(einsum(x, w) in f32, *[c in f32]).astype(result dtype)``
    over the ``[E, *lead, N]`` result (see :func:`gemm_fused_experts`)."""
    x, w = jnp.asarray(x), jnp.asarray(w)
    acc = jnp.einsum(
        "e...k,ekn->e...n" if x_batched else "...k,ekn->e...n",
        x,
        w,
        preferred_element_type=jnp.float32,
    )
    out_dtype = jnp.result_type(x.dtype, w.dtype) if out_dtype is None else out_dtype
    cols = tuple(jnp.asarray(c) for c in operands)
    return _apply_epilogue(epilogue, acc, cols, out_dtype)


def gemm_fused_experts(
    x: jax.Array,
    w: jax.Array,
    epilogue: Callable[..., Any],
    *operands: jax.Array,
    x_batched: bool = False,
    impl: str | None = None,
    kernel_epilogue: Callable[..., Any] | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """``epilogue(x @ w[e], *operands)`` for every expert ``e``: a batched GEMM whose
    weight ``w`` is ``[E, K, N]``, the epilogue fused (MoE experts run densely).

    ``x`` is ``[..., K]``, shared by every expert, or (``x_batched``) ``[E, ..., K]``; the
    result is ``[E, *lead, N]``. Each operand broadcasts against the result and is, per
    expert, one :func:`gemm_fused` takes (a scalar, a column ``[N]``, a row ``[*lead, 1]``
    or a full tile ``[*lead, N]``), with the expert axis (``[E, 1, N]``: a per-expert bias)
    or without it. The kernel is :func:`gemm_fused`'s with the expert axis added to its
    grid; the backward pass is XLA's (einsums and the epilogue's own derivative), forward
    mode the reference's.
    """
    epilogue = dsp.as_callable(epilogue, "epilogue")
    kernel_epilogue = (
        epilogue if kernel_epilogue is None else dsp.as_callable(kernel_epilogue, "epilogue")
    )
    x, w = jnp.asarray(x), jnp.asarray(w)
    cols = tuple(jnp.asarray(c) for c in operands)
    frame = _experts_frame(x.shape, w.shape, tuple(c.shape for c in cols), x_batched)
    if isinstance(frame, str):
        raise ValueError(f"gemm_fused_experts: {frame}")
    for name, a in (("x", x), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"gemm_fused_experts: {name} must be floating point, got {a.dtype}")
    out_dtype = jnp.dtype(jnp.result_type(x.dtype, w.dtype) if out_dtype is None else out_dtype)
    reason = _kernel_error((*frame[0], w.shape[1]), w.shape[1:], x.dtype, ())
    if reason is None and x.dtype != w.dtype:
        reason = f"x and w must share a dtype, got {x.dtype} and {w.dtype}"
    impl = dsp.resolve_impl(impl, reason, "gemm_fused_experts")

    def reference(x: jax.Array, w: jax.Array, cols: tuple[jax.Array, ...]) -> jax.Array:
        return gemm_fused_experts_reference(
            x, w, epilogue, *cols, x_batched=x_batched, out_dtype=out_dtype
        )

    if impl == "xla":
        return jax.jit(reference)(x, w, cols)
    kernel = functools.partial(
        _experts_kernel_path,
        epilogue=kernel_epilogue,
        interpret=impl == "interpret",
        precision=dsp.matmul_precision(x.dtype),
        out_dtype=out_dtype,
        x_batched=x_batched,
    )
    return with_forward_mode(kernel, reference)(x, w, cols)


# --------------------------------------------------------------------------- #
# Gated pairs: two GEMMs of one activation in one kernel
# --------------------------------------------------------------------------- #


def _with_pair(cols: tuple[Any, ...], pair_at: int, acc2: Any) -> tuple[Any, ...]:
    return (*cols[:pair_at], acc2, *cols[pair_at:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pair_core(
    x: jax.Array,
    w: jax.Array,
    w2: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    cfg: tuple[Any, ...],
) -> jax.Array:
    out_dtype, interpret, blocks, precision, pair_at = cfg
    return _gemm_pallas(
        x, w, cols, epilogue, out_dtype, interpret, blocks, precision, w2=w2, pair_at=pair_at
    )


def _pair_fwd(
    x: jax.Array,
    w: jax.Array,
    w2: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    cfg: tuple[Any, ...],
) -> tuple[jax.Array, Any]:
    return _pair_core(x, w, w2, cols, epilogue, cfg), (x, w, w2, cols)


def _pair_bwd(
    epilogue: Callable[..., Any], cfg: tuple[Any, ...], res: Any, g: jax.Array
) -> tuple[Any, ...]:
    out_dtype, _, _, precision, pair_at = cfg
    x, w, w2, cols = res
    acc = dsp.dot(x, w, precision=precision)
    acc2 = dsp.dot(x, w2, precision=precision).astype(x.dtype)

    def epi(a: jax.Array, a2: jax.Array, *c: jax.Array) -> jax.Array:
        return _apply_epilogue(epilogue, a, _with_pair(c, pair_at, a2), out_dtype)

    _, vjp = jax.vjp(epi, acc, acc2, *cols)
    dacc, dacc2, *dcols = vjp(g)
    dacc, dacc2 = dacc.astype(x.dtype), dacc2.astype(x.dtype)
    dx = dsp.dot(dacc, w, trans_b=True, precision=precision) + dsp.dot(
        dacc2, w2, trans_b=True, precision=precision
    )
    dw = dsp.dot(x, dacc, trans_a=True, precision=precision).astype(w.dtype)
    dw2 = dsp.dot(x, dacc2, trans_a=True, precision=precision).astype(w2.dtype)
    return dx.astype(x.dtype), dw, dw2, tuple(dcols)


_pair_core.defvjp(_pair_fwd, _pair_bwd)


@functools.partial(
    jax.jit, static_argnames=("epilogue", "interpret", "precision", "out_dtype", "pair_at")
)
def _pair_kernel_path(
    x: jax.Array,
    w: jax.Array,
    w2: jax.Array,
    cols: tuple[jax.Array, ...],
    *,
    epilogue: Callable[..., Any],
    interpret: bool,
    precision: Any,
    out_dtype: Any,
    pair_at: int,
) -> jax.Array:
    lead = x.shape[:-1]
    x2 = x.reshape(math.prod(lead), x.shape[-1])
    ops = _as_kernel_operands(tuple(cols), lead, w.shape[1])
    cfg = (out_dtype, interpret, None, precision, pair_at)
    return _pair_core(x2, w, w2, ops, epilogue, cfg).reshape(*lead, w.shape[1])


def gemm_fused_pair_reference(
    x: jax.Array,
    w: jax.Array,
    w2: jax.Array,
    epilogue: Callable[..., Any],
    *operands: jax.Array,
    pair_at: int | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """Plain JAX: :func:`gemm_fused_reference` with ``x @ w2`` (in x's dtype) inserted as
    the epilogue's operand ``pair_at`` (default: after the others)."""
    x, w, w2 = jnp.asarray(x), jnp.asarray(w), jnp.asarray(w2)
    cols = tuple(jnp.asarray(c) for c in operands)
    at = len(cols) if pair_at is None else pair_at
    up = jnp.dot(x, w2, preferred_element_type=jnp.float32).astype(x.dtype)
    return gemm_fused_reference(x, w, epilogue, *_with_pair(cols, at, up), out_dtype=out_dtype)


def gemm_fused_pair(
    x: jax.Array,
    w: jax.Array,
    w2: jax.Array,
    epilogue: Callable[..., Any],
    *operands: jax.Array,
    pair_at: int | None = None,
    impl: str | None = None,
    kernel_epilogue: Callable[..., Any] | None = None,
    out_dtype: Any = None,
) -> jax.Array:
    """``epilogue(x @ w, *operands)`` where the operand ``pair_at`` (default: the last) is
    ``x @ w2``, computed by the same kernel: a gated pair (GLU, SwiGLU, GeGLU:
    ``act(x @ w1) * (x @ w2)``) reads each tile of x once for both GEMMs.

    ``w2`` has ``w``'s shape ``[K, N]``; ``x @ w2`` reaches the epilogue rounded to x's
    dtype, as the program's own GEMM returns it. The other operands are
    :func:`gemm_fused`'s. The backward pass is XLA's (GEMMs and the epilogue's own
    derivative), forward mode the reference's.
    """
    epilogue = dsp.as_callable(epilogue, "epilogue")
    kernel_epilogue = (
        epilogue if kernel_epilogue is None else dsp.as_callable(kernel_epilogue, "epilogue")
    )
    x, w, w2 = jnp.asarray(x), jnp.asarray(w), jnp.asarray(w2)
    cols = tuple(jnp.asarray(c) for c in operands)
    _validate(x, w, cols, "gemm_fused_pair")
    if w2.shape != w.shape or w2.dtype != w.dtype:
        raise ValueError(
            f"gemm_fused_pair: w2 must have w's shape and dtype {w.shape} {w.dtype}, "
            f"got {w2.shape} {w2.dtype}"
        )
    at = len(cols) if pair_at is None else int(pair_at)
    if not 0 <= at <= len(cols):
        raise ValueError(f"gemm_fused_pair: pair_at={at} outside 0..{len(cols)}")
    out_dtype = jnp.dtype(jnp.result_type(x.dtype, w.dtype) if out_dtype is None else out_dtype)
    reason = _kernel_error(x.shape, w.shape, x.dtype, tuple(c.shape for c in cols))
    if reason is None and x.dtype != w.dtype:
        reason = f"x and w must share a dtype, got {x.dtype} and {w.dtype}"
    impl = dsp.resolve_impl(impl, reason, "gemm_fused_pair")

    def reference(x: jax.Array, w: jax.Array, w2: jax.Array, cols: tuple) -> jax.Array:
        return gemm_fused_pair_reference(x, w, w2, epilogue, *cols, pair_at=at, out_dtype=out_dtype)

    if impl == "xla":
        return jax.jit(reference)(x, w, w2, cols)
    kernel = functools.partial(
        _pair_kernel_path,
        epilogue=kernel_epilogue,
        interpret=impl == "interpret",
        precision=dsp.matmul_precision(x.dtype),
        out_dtype=out_dtype,
        pair_at=at,
    )
    return with_forward_mode(kernel, reference)(x, w, w2, cols)
