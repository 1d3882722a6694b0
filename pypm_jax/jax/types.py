"""The types of ops a rule builds from the primitive table: JAX's abstract evaluation.

A node a rule builds (``prims.mul(x, 0.125)``) gets its shape and dtype from JAX itself:
the primitive bound on abstract values of the inputs' types, with the node's attrs as
params. Importing this module installs :func:`infer_types` as the type inference of the
table's operators (:func:`pypm_jax.vocab.primitives.set_type_inference`), so the vocabulary
stays JAX-free; lowering converts attrs back to params with the same :func:`lower_attrs`.
"""

from __future__ import annotations

__all__ = ["infer_types", "lower_attrs", "numpy_dtype"]

from collections.abc import Mapping
from typing import Any

import jax

from ..core.dtypes import DType, as_dtype
from ..vocab.primitives import DTYPE_PARAMS, SPECS, set_type_inference
from . import _compat


def numpy_dtype(dt: Any) -> Any:
    """A pm dtype as the numpy dtype JAX expects (bf16 through ml_dtypes)."""
    if isinstance(dt, DType):
        return jax.numpy.dtype(dt.numpy_name)
    return dt


def lower_attrs(prim_name: str, attrs: Mapping[str, Any]) -> dict[str, Any]:
    """A node's attrs as the primitive's params: pm dtypes back to numpy, defaults filled."""
    spec = SPECS.get(prim_name)
    params = dict(spec.defaults) if spec is not None else {}
    for k, v in attrs.items():
        params[k] = numpy_dtype(v) if k in DTYPE_PARAMS else v
    return _compat.adapt_params(prim_name, params)


def infer_types(prim_name: str, inputs: tuple[Any, ...], attrs: Mapping[str, Any]) -> Any:
    """``(shape, dtype)`` of ``prim_name`` applied to typed inputs, by abstract evaluation.

    Unknown (``(None, None)``) when an input's type is unknown; a primitive that rejects the
    inputs raises, naming the primitive, so a rule building an ill-typed op fails clearly.
    """
    prim = _compat.primitive_by_name(prim_name)
    if prim is None or any(getattr(x, "shape", None) is None for x in inputs):
        return (None, None)
    if any(getattr(x, "dtype", None) is None for x in inputs):
        return (None, None)
    params = lower_attrs(prim_name, attrs)
    avals = [jax.ShapeDtypeStruct(tuple(x.shape), numpy_dtype(x.dtype)) for x in inputs]
    try:
        out = jax.eval_shape(lambda *xs: _compat.bind(prim, xs, params), *avals)
    except Exception as exc:
        raise TypeError(
            f"jax.{prim_name} cannot be applied to {avals} with {params}: {exc}"
        ) from exc
    if prim.multiple_results:
        return [(tuple(o.shape), as_dtype(o.dtype)) for o in out]
    return (tuple(out.shape), as_dtype(out.dtype))


set_type_inference(infer_types)
