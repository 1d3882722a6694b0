"""GEMM with a fused epilogue on Hopper (sm90) through Pallas' Mosaic GPU backend.

The Triton kernel in ``_gemm.py`` ran bf16 ``relu(x @ w + b)`` at 0.84-1.04x of cuBLAS's
fused epilogue on an H100 (benchmarks/RESULTS.md): Triton's main loop is the gap.  This
kernel is JAX's own Hopper matmul (``jax/experimental/pallas/ops/gpu/hopper_matmul_mgpu.py``,
Apache-2.0, by the JAX authors) -- a persistent, warp-specialized kernel: one warpgroup
issues TMA loads into a ring of shared-memory stages, two compute warpgroups run WGMMA on
them -- with our epilogue applied to the f32 accumulator before the store.  Only the
epilogue differs from the original: each ``epi_tile_m x epi_tile_n`` piece of the
accumulator goes through ``epilogue(acc, *columns)`` and is cast to the output dtype on its
way to shared memory and out through TMA.  The column operands are read from global memory
before the main loop, as ``[epi_tile_n]`` vectors in the accumulator's column layout, and
reach the epilogue broadcast to the piece's shape.  (Also dropped from the original: the
2-CTA cluster variants and the ``C +=`` input.)

Scope: bf16/f16 inputs (WGMMA with f32 accumulation), M, N, K padded to tile multiples,
epilogues built from :data:`EPILOGUE_PRIMITIVES` (elementwise primitives with a Mosaic GPU
warpgroup lowering, each checked by ``tests/pallas_kernels/test_kernels_gemm_mgpu.py``).
Anything else stays on the Triton kernel; :func:`mosaic_error` says why.

On CPU the same kernel runs in Mosaic GPU's interpret mode (``InterpretGPUParams``), which
simulates the warpgroups, shared memory, TMA and barriers; the tests use it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from . import _dispatch as dsp

pl = dsp.LazyModule("jax.experimental.pallas")
plgpu = dsp.LazyModule("jax.experimental.pallas.mosaic_gpu")

# Elementwise primitives an epilogue may use on the Mosaic path: each has a warpgroup
# lowering rule in Mosaic GPU (checked per primitive by exporting a kernel for CUDA in the
# tests).  An epilogue with any other primitive (or with a call/custom-derivative wrapper,
# e.g. ``jax.nn.relu``) runs on the Triton kernel instead.
EPILOGUE_PRIMITIVES: frozenset[str] = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "max",
        "min",
        "neg",
        "abs",
        "exp",
        "log",
        "tanh",
        "logistic",
        "rsqrt",
        "integer_pow",
        "select_n",
        "lt",
        "le",
        "gt",
        "ge",
        "convert_element_type",
        "broadcast_in_dim",
    }
)

MOSAIC_DTYPES: tuple[str, ...] = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MosaicGemmConfig:
    """Tiles of the Hopper kernel (the fields of JAX's ``hopper_matmul_mgpu.TuningConfig``).

    Each of the two compute warpgroups owns a ``tile_m x tile_n`` accumulator; with
    ``wg_dimension="n"`` they sit side by side, so a CTA computes ``tile_m x 2*tile_n``.
    """

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    grid_minor_dim: str = "n"  # the output-tile order: planar snake along this dim
    grid_tile_width: int = 8
    wg_dimension: str = "n"
    # Load the column operands (bias) before the main loop instead of in the epilogue:
    # costs tile_n / 4 registers per operand and thread during the loop.
    preload_columns: bool = True

    @property
    def cta_tile_m(self) -> int:
        return self.tile_m * (2 if self.wg_dimension == "m" else 1)

    @property
    def cta_tile_n(self) -> int:
        return self.tile_n * (2 if self.wg_dimension == "n" else 1)


def default_mosaic_config(m: int, n: int, interpret: bool) -> MosaicGemmConfig:
    """H100 defaults (JAX's tuned Hopper matmul tiles); 64-wide tiles when interpreted, so
    small test shapes still cover several CTA tiles and K steps."""
    if interpret:
        return MosaicGemmConfig(64, 64, 64, 2, 64, 64, "n", 2, "n", True)
    # Narrow problems get narrower tiles, so padding does not multiply the work.
    return MosaicGemmConfig(tile_m=64 if m <= 64 else 128, tile_n=64 if n <= 128 else 128)


def mosaic_error(
    dtype: Any, col_dtypes: tuple[Any, ...], epilogue: Callable[..., Any]
) -> str | None:
    """None when the Mosaic kernel handles the call, otherwise why not."""
    name = dsp.dtype_name(dtype)
    if name not in MOSAIC_DTYPES:
        return f"dtype {name} (the Mosaic kernel takes {MOSAIC_DTYPES})"
    for i, cd in enumerate(col_dtypes):
        if not jnp.issubdtype(cd, jnp.floating):
            return f"column operand {i} has dtype {jnp.dtype(cd).name} (floats only)"
    return _epilogue_problem(epilogue, len(col_dtypes))


@functools.lru_cache(maxsize=256)
def _epilogue_problem(epilogue: Callable[..., Any], n_cols: int) -> str | None:
    """Why the kernel cannot trace ``epilogue`` on its tiles, or None.  Traced as the kernel
    calls it: the accumulator piece and each column operand broadcast to its shape."""
    tile = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    try:
        closed, shape = jax.make_jaxpr(epilogue, return_shape=True)(tile, *([tile] * n_cols))
    except Exception as exc:
        return f"the epilogue does not trace on broadcast column tiles ({type(exc).__name__})"
    if getattr(shape, "shape", None) != (8, 8):
        return f"the epilogue is not elementwise on [8, 8] tiles (it returns {shape})"
    bad = _primitive_names(closed.jaxpr) - EPILOGUE_PRIMITIVES
    if bad:
        return f"the epilogue uses {sorted(bad)}, outside EPILOGUE_PRIMITIVES"
    return None


def _primitive_names(jaxpr: Any) -> set[str]:
    """Primitives of ``jaxpr``, looking through ``jit`` calls (``jnp.where`` is one; Mosaic
    lowers a ``jit`` by lowering its body)."""
    names: set[str] = set()
    for eqn in jaxpr.eqns:
        inner = eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit") else None
        if inner is not None:
            names |= _primitive_names(getattr(inner, "jaxpr", inner))
        else:
            names.add(eqn.primitive.name)
    return names


def _interpret_params() -> Any:
    return dsp.mosaic_gpu_interpret_params()


def _num_sms() -> int:
    return int(getattr(jax.local_devices()[0], "core_count", 0) or 132)


def _kernel(
    x_gmem: Any,
    w_gmem: Any,
    *refs: Any,
    n_cols: int,
    epilogue: Callable[..., Any],
    config: MosaicGemmConfig,
    interpret: bool,
) -> None:
    col_gmems, out_gmem = refs[:n_cols], refs[n_cols]
    dtype, out_dtype = x_gmem.dtype, out_gmem.dtype
    m, k = x_gmem.shape
    n = w_gmem.shape[1]
    tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
    cta_tile_m, cta_tile_n = config.cta_tile_m, config.cta_tile_n
    epi_tile_m, epi_tile_n = config.epi_tile_m, config.epi_tile_n
    m_iters, n_iters, k_iters = m // cta_tile_m, n // cta_tile_n, k // tile_k
    wg_on_n = config.wg_dimension == "n"

    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    num_out_slots = min(2, (tile_m * tile_n) // (epi_tile_m * epi_tile_n))
    out_swizzle = plgpu.find_swizzle(epi_tile_n * jnp.dtype(out_dtype).itemsize * 8)
    out_swizzle_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle_elems)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    col_layout = plgpu.Layout.WGMMA.reduce(0)

    # The epilogue gets each column operand broadcast to the [epi_tile_m, epi_tile_n]
    # tile.  Compiled, the column is loaded in the layout of one row of the WGMMA
    # accumulator and broadcast in registers (Mosaic's layout inference needs the explicit
    # broadcast + cast; it rejects an implicit one inside ``acc + b``).  The interpreter
    # has no rule for that layout-annotated load (gpu ``load_p``), only for a plain ref
    # read; both read the same values.
    def load_col(ref: Any, start: Any) -> Any:
        idx = (pl.ds(start, epi_tile_n),)
        if interpret:
            return ref[idx]
        return dsp.mosaic_gpu_load(ref.at[idx], layout=col_layout)

    def tile_of(v: Any) -> Any:
        if interpret:
            return jnp.broadcast_to(v[None, :], (epi_tile_m, epi_tile_n))
        v = lax.broadcast_in_dim(v, (epi_tile_m, epi_tile_n), (1,))
        return plgpu.layout_cast(v, plgpu.Layout.WGMMA)

    def get_pipeline(body: Any, compute_context: Any) -> Any:
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_tile_m, tile_k),
                    lambda kk: (0, kk),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                ),
                plgpu.BlockSpec(
                    (tile_k, cta_tile_n),
                    lambda kk: (kk, 0),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=config.max_concurrent_steps,
            compute_context=compute_context,
        )

    def ignore(*_: Any, **__: Any) -> None:
        return None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        out_smem=plgpu.SMEM(
            (2, num_out_slots, epi_tile_m, epi_tile_n), out_dtype, transforms=out_transforms
        ),
        collective_axes="wg",
    )
    def _pipeline_scope(pipeline_allocs: Any, out_smem: Any) -> None:
        wg_idx = lax.axis_index("wg")
        minor = 1 if config.grid_minor_dim == "n" else 0

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="cluster_grid")
        def _mn_loop(loop_info: Any) -> None:
            (lin_idx,) = loop_info.index
            m_idx, n_idx = plgpu.planar_snake(
                lin_idx, (m_iters, n_iters), minor, config.grid_tile_width
            )
            cta_m_slice = pl.ds(m_idx * cta_tile_m, cta_tile_m)
            cta_n_slice = pl.ds(n_idx * cta_tile_n, cta_tile_n)
            if wg_on_n:
                wg_m_slice, wg_n_slice = slice(None), pl.ds(wg_idx * tile_n, tile_n)
                wg_n0 = n_idx * cta_tile_n + wg_idx * tile_n
            else:
                wg_m_slice, wg_n_slice = pl.ds(wg_idx * tile_m, tile_m), slice(None)
                wg_n0 = n_idx * cta_tile_n

            def compute_context(eval_pipeline: Any) -> None:
                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
                def _acc_scope(acc_ref: Any) -> None:
                    n_epi = tile_n // epi_tile_n
                    pre = None
                    if config.preload_columns:
                        # Issued before the main loop, which hides their latency; each
                        # [epi_tile_n] slice is loaded once, not once per row of sub-tiles.
                        pre = [
                            [load_col(c, wg_n0 + ni * epi_tile_n) for ni in range(n_epi)]
                            for c in col_gmems
                        ]
                    eval_pipeline(acc_ref)
                    acc = acc_ref[...]
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for epi_mi in range(tile_m // epi_tile_m):
                        for epi_ni in range(tile_n // epi_tile_n):
                            epi_m_slice = slice(epi_mi * epi_tile_m, (epi_mi + 1) * epi_tile_m)
                            epi_n_slice = slice(epi_ni * epi_tile_n, (epi_ni + 1) * epi_tile_n)
                            slot = (epi_mi * (tile_n // epi_tile_n) + epi_ni) % 2
                            if pre is not None:
                                cols = [tile_of(v[epi_ni]) for v in pre]
                            else:
                                start = wg_n0 + epi_ni * epi_tile_n
                                cols = [tile_of(load_col(c, start)) for c in col_gmems]
                            out = epilogue(acc[epi_m_slice, epi_n_slice], *cols)
                            if jnp.shape(out) != (epi_tile_m, epi_tile_n):
                                raise ValueError(
                                    "gemm_fused: epilogue must be elementwise (tile "
                                    f"{(epi_tile_m, epi_tile_n)} -> same), it returned shape "
                                    f"{jnp.shape(out)}"
                                )
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg_idx, slot] = out.astype(out_dtype)
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg_idx, slot],
                                out_gmem.at[cta_m_slice, cta_n_slice]
                                .at[wg_m_slice, wg_n_slice]
                                .at[epi_m_slice, epi_n_slice],
                            )

            def mma_body(_: Any, x_smem: Any, w_smem: Any, acc_ref: Any) -> Any:
                plgpu.wgmma(acc_ref, x_smem.at[wg_m_slice], w_smem.at[:, wg_n_slice])
                plgpu.wgmma_wait(0)
                return acc_ref

            get_pipeline(mma_body, compute_context)(
                x_gmem.at[cta_m_slice, :],
                w_gmem.at[:, cta_n_slice],
                allocations=pipeline_allocs,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def gemm_mosaic(
    x: jax.Array,
    w: jax.Array,
    cols: tuple[jax.Array, ...],
    epilogue: Callable[..., Any],
    out_dtype: Any,
    interpret: bool,
    config: MosaicGemmConfig | None = None,
) -> jax.Array:
    """``epilogue(x @ w, *cols)`` for 2-D ``x [M, K]``, ``w [K, N]``, ``cols [N]`` (padded
    to the tiles here and sliced back).  Traced inside the caller's jit."""
    m, k = x.shape
    n = w.shape[1]
    if config is None:
        config = default_mosaic_config(m, n, interpret)
    mp = dsp.round_up(m, config.cta_tile_m)
    np_ = dsp.round_up(n, config.cta_tile_n)
    kp = dsp.round_up(k, config.tile_k)
    if (mp, kp) != (m, k):
        x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    if (kp, np_) != (k, n):
        w = jnp.pad(w, ((0, kp - k), (0, np_ - n)))
    cols = tuple(
        jnp.pad(c.astype(jnp.float32), (0, np_ - n)) if np_ != n else c.astype(jnp.float32)
        for c in cols
    )
    tiles = (mp // config.cta_tile_m) * (np_ // config.cta_tile_n)
    grid = max(1, min(tiles, 2 if interpret else _num_sms()))
    extra: dict[str, Any] = {"interpret": _interpret_params()} if interpret else {}
    f = plgpu.kernel(
        functools.partial(
            _kernel, n_cols=len(cols), epilogue=epilogue, config=config, interpret=interpret
        ),
        out_type=dsp.out_struct((mp, np_), out_dtype, x),
        grid=(grid,),
        grid_names=("cluster_grid",),
        cluster=(1,),
        cluster_names=("cluster",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **extra,
    )
    out = f(x, w, *cols)
    if (mp, np_) != (m, n):
        out = out[:m, :n]
    return out
