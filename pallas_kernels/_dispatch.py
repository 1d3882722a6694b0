"""Implementation selection and small version-compat shims shared by the kernels.

Every public kernel takes ``impl``:

* ``None`` (auto): ``"pallas"`` on a GPU backend when the kernel supports the
  shapes, otherwise ``"xla"``.  The process-wide override ``PYPM_KERNEL_IMPL``
  (``xla`` / ``interpret`` / ``pallas`` / ``auto``) replaces the auto choice, so
  a whole-product test run can force every substituted kernel through
  ``interpret``.  An override is an *explicit* request: if it cannot run, the
  call raises exactly like an explicit ``impl`` argument would.
* ``"xla"``: the plain-JAX reference computation, compiled by XLA.  This is the
  documented CPU fallback; it is the same computation the rewrite replaced, so it
  is never slower than the original program.
* ``"interpret"``: the Pallas kernel run by the Pallas interpreter (any backend;
  slow, for tests).
* ``"pallas"``: the Pallas kernel lowered through Triton; needs a GPU backend.

An explicit ``impl`` that cannot run raises ``ValueError``; nothing silently
falls back to another implementation.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ENV_VAR = "PYPM_KERNEL_IMPL"
IMPLS: tuple[str, ...] = ("xla", "interpret", "pallas")
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


class LazyModule:
    """A module imported on first attribute access.

    ``jax.experimental.pallas`` is a heavy import that only building a Pallas kernel
    (``"pallas"`` or ``"interpret"``) needs; the kernels refer to it through one of these,
    so importing ``pallas_kernels`` and running the ``"xla"`` fallback never import it.
    """

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU (the only place Triton Pallas runs)."""
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:  # no backend could be initialised at all
        return False


def gpu_compute_capability() -> str | None:
    """The default GPU's compute capability (``"9.0"`` on an H100), None without a GPU."""
    if not on_gpu():
        return None
    cc = getattr(jax.local_devices()[0], "compute_capability", None)
    return None if cc is None else str(cc)


def resolve_impl(impl: str | None, unsupported_reason: str | None, kernel: str) -> str:
    """Turn the user's ``impl`` (or the env override) into a concrete implementation.

    ``unsupported_reason`` is None when the Pallas kernel handles the call; otherwise
    it explains why not, and is quoted in the error for explicit kernel requests.
    """
    explicit = impl
    source = "impl"
    if explicit is None:
        env = os.environ.get(ENV_VAR, "").strip().lower()
        if env and env != "auto":
            explicit, source = env, f"${ENV_VAR}"
    if explicit is None:
        return "pallas" if (on_gpu() and unsupported_reason is None) else "xla"
    if explicit not in IMPLS:
        raise ValueError(
            f"{kernel}: invalid {source}={explicit!r}; expected one of {IMPLS} "
            f"(or None / 'auto' for automatic selection)."
        )
    if explicit == "pallas" and not on_gpu():
        raise ValueError(
            f"{kernel}: {source}='pallas' needs a GPU backend (Triton lowering), but "
            f"jax.default_backend() is {jax.default_backend()!r}. Use impl='interpret' to "
            "run the same kernel in the Pallas interpreter, or impl='xla'."
        )
    if explicit in ("pallas", "interpret") and unsupported_reason is not None:
        raise ValueError(
            f"{kernel}: {source}={explicit!r} cannot handle this call: {unsupported_reason}"
        )
    return explicit


def dtype_name(dtype: Any) -> str | None:
    """Canonical dtype name for strings / numpy / jax dtypes; None if not a dtype."""
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        return None


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def broadcastable(shape: Sequence[int], target: Sequence[int]) -> bool:
    """numpy broadcasting of ``shape`` *to* ``target`` (no growth of ``target``)."""
    if len(shape) > len(target):
        return False
    for s, t in zip(reversed(tuple(shape)), reversed(tuple(target)), strict=False):
        if s != 1 and s != t:
            return False
    return True


def matmul_precision(dtype: Any) -> lax.Precision | None:
    """In-kernel dot precision for ``dtype``, honouring ``jax.default_matmul_precision``.

    f32 follows the same rule XLA applies to the original program (TF32 unless the
    user asked for "highest"/"float32"), so kernel and original agree in accuracy.
    Half-precision inputs always run natively with f32 accumulation.
    """
    if jnp.dtype(dtype) != jnp.float32:
        return None
    setting = jax.config.jax_default_matmul_precision
    if setting is None:
        return None
    setting = str(setting).lower()
    if setting in ("highest", "float32", "precision.highest"):
        return lax.Precision.HIGHEST
    return None


def dot(
    a: jax.Array,
    b: jax.Array,
    *,
    trans_a: bool = False,
    trans_b: bool = False,
    precision: lax.Precision | None = None,
) -> jax.Array:
    """2-D dot with f32 accumulation, written with ``lax.dot_general`` (stable across
    JAX versions; ``pl.dot`` is deprecated) and lowerable by Pallas-Triton."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def triton_compiler_params(num_warps: int, num_stages: int) -> Any:
    """``CompilerParams`` for the Triton backend under its current name.

    JAX renamed ``TritonCompilerParams`` to ``CompilerParams`` (0.7); keep the
    version difference in this one place.
    """
    from jax.experimental.pallas import triton as plgpu

    cls = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    return cls(num_warps=num_warps, num_stages=num_stages)


def mosaic_gpu_interpret_params() -> Any:
    """``InterpretGPUParams()``: runs a Mosaic GPU kernel in its CPU interpreter.

    jax 0.11 exports the class as ``jax.experimental.pallas.mosaic_gpu.InterpretGPUParams``;
    0.10 has it only under ``jax._src``.  The one private import of the kernels lives here;
    ``tests/pallas_kernels/test_kernels_gemm_mgpu.py`` fails loudly if it moves.
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cls = getattr(plgpu, "InterpretGPUParams", None)
    if cls is None:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as cls
    return cls()


def mosaic_gpu_load(ref: Any, *, layout: Any) -> Any:
    """``plgpu.load`` of a whole (already indexed, ``ref.at[...]``) ref in ``layout``.

    jax 0.10 requires the index argument; 0.11 deprecates it (index through ``ref.at``) and
    0.12 removes it.
    """
    import inspect

    from jax.experimental.pallas import mosaic_gpu as plgpu

    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout, optimized=False)
    return plgpu.load(ref, layout=layout, optimized=False)


def pallas_call_kwargs(interpret: bool, num_warps: int, num_stages: int) -> dict[str, Any]:
    """Backend-dependent ``pallas_call`` keyword arguments."""
    if interpret:
        return {"interpret": True}
    return {"compiler_params": triton_compiler_params(num_warps, num_stages)}


def static_float(x: Any, name: str) -> float:
    """Kernels specialise on scalar hyper-parameters: they must be Python numbers."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a Python/numpy real number, got {type(x).__name__}")
    value = float(x)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def as_callable(fn: Any, name: str) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"{name} must be callable, got {type(fn).__name__}")
    return fn


# ------------------------------------------------------------- shard_map(check_vma=True)
#
# Inside ``jax.shard_map`` with ``check_vma=True`` (its default) every value's type records
# the mesh axes along which it varies from device to device, and a ``pallas_call`` must
# declare its results' (``ShapeDtypeStruct(..., manual_axis_type=)``); outside a
# ``shard_map`` the record is empty and ignored. A kernel's result depends on every operand,
# so the kernels make their operands vary together first (:func:`vary_together`) and give
# every result that common type (:func:`out_struct`). Both use public JAX APIs of 0.10 to
# 0.12 (``jax.typeof(x).manual_axis_type``, ``jax.lax.pcast``,
# ``jax.ShapeDtypeStruct(manual_axis_type=)``); ``tests/pallas_kernels`` checks them.


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` (an array or an abstract value) varies along (empty
    outside ``shard_map``)."""
    mat = getattr(x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x),
                  "manual_axis_type", None)  # fmt: skip
    return frozenset(getattr(mat, "varying", None) or ())


def vary_together(xs: Sequence[Any]) -> list[Any]:
    """``xs`` (arrays or None), each cast to vary along every axis some operand varies along.

    ``pcast(..., to="varying")`` is the identity on values; its transpose sums a cotangent
    over the axes it added, so the gradient of an operand that did not vary (a replicated
    weight) is the sum of the per-device gradients, as ``jax.jit`` computes it."""
    if not all(x is None or isinstance(x, jax.Array) for x in xs):
        return list(xs)  # abstract values (shapes being worked out): nothing to cast
    axes = frozenset().union(*(varying_axes(x) for x in xs if x is not None))
    if not axes:
        return list(xs)
    out = []
    for x in xs:
        missing = None if x is None else axes - varying_axes(x)
        out.append(lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x)
    return out


def out_struct(shape: Sequence[int], dtype: Any, like: Any) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` result of ``shape`` and ``dtype`` varying as ``like`` (an operand
    after :func:`vary_together`) does."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, manual_axis_type=mat)
