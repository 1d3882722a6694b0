"""The per-primitive table: every JAX primitive we lift, as a pm :class:`Operator`.

One entry per primitive (a per-primitive table): adding a primitive is one line here. Each
entry says which pm operator stands for the primitive, its op class, whether it is pure, and
how lifting treats it (``kind``):

* ``"plain"``   one graph node per equation; node attrs are the primitive's params.
* ``"inline"``  the callee's body is lifted in place (``jit``, ``closed_call``).
* ``"region"``  the body is lifted in place for matching, and remembered as a region so
  lowering can re-emit the original call when no rewrite touched it (``custom_jvp_call``,
  ``custom_vjp_call``, ``remat2``): gradients keep their custom rules.
* ``"nested"``  one node whose attrs hold lifted sub-graphs; rewriting reaches inside
  (``scan``, ``while``, ``cond``, ``shard_map``).
* ``"opaque"``  kept as one impure node, never merged, never rewritten through; lowered by
  binding the original primitive with its original params.
* ``"retype"``  no node: the outputs are the operands (``pvary``, which only changes a
  shard_map value's type; JAX inserts it again when the lowered body is traced).

How guards see attributes: a lifted node's ``attrs`` are the equation's params under the same
names (``dimension_numbers``, ``axes``, ``permutation``, ``new_sizes``, ``shape``,
``broadcast_dimensions``, ``new_dtype``, ``y`` for ``integer_pow``, ...). Params that hold an
element type (``new_dtype``, ``preferred_element_type``, ``dtype``, ``index_dtype``,
``out_dtype``) are converted to pm dtypes, so ``x.new_dtype == pm.bf16`` works in a guard.
Literals and constants become ``pypm.const`` nodes whose ``value`` attr is a Python scalar
when the array is a scalar or a splat (all elements equal), so ``Div(x, 8.0)`` matches.

This module does not import JAX (it is part of the JAX-free vocabulary, :mod:`pypm_jax.vocab`):
rules can use the operators without it. The type of an op a rule builds is JAX's abstract
evaluation, which the bridge installs (:func:`set_type_inference`) when it is imported.
"""

from __future__ import annotations

__all__ = [
    "PrimSpec",
    "SPECS",
    "OPS",
    "DTYPE_PARAMS",
    "spec_for",
    "op_for",
    "opaque_op",
    "is_table_op",
    "py_name",
    "lift_attrs",
    "set_type_inference",
]

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ..core.dtypes import as_dtype
from ..core.errors import PyPMError
from ..core.terms import Operator
from ..lang.registry import register_op

NAMESPACE = "jax"

# Params whose value is an element type; lifted to pm dtypes, lowered back to numpy dtypes.
DTYPE_PARAMS: frozenset[str] = frozenset(
    {"new_dtype", "preferred_element_type", "dtype", "index_dtype", "out_dtype"}
)

KINDS = ("plain", "inline", "region", "nested", "opaque", "retype")


@dataclass(frozen=True)
class PrimSpec:
    """How one JAX primitive is lifted and lowered."""

    name: str
    op: Operator
    kind: str = "plain"
    # Params a rule may leave out when it builds this op; lowering fills them in.
    defaults: Mapping[str, Any] = field(default_factory=dict)


SPECS: dict[str, PrimSpec] = {}
OPS: dict[str, Operator] = {}


def py_name(prim_name: str) -> str:
    """The attribute name of a primitive's op in this module (``scatter-add`` → ``scatter_add``,
    ``and`` → ``and_``)."""
    name = prim_name.replace("-", "_")
    return name + "_" if name in {"and", "or", "not", "while"} else name


def _def(
    name: str,
    n_in: int | None,
    op_class: str,
    attrs: tuple[str, ...] = (),
    *,
    n_out: int = 1,
    pure: bool = True,
    kind: str = "plain",
    defaults: Mapping[str, Any] | None = None,
) -> Operator:
    if kind not in KINDS:
        raise ValueError(f"unknown lifting kind {kind!r} for primitive {name}")
    op = Operator(
        name,
        n_in,
        n_out,
        attrs=attrs,
        op_class=op_class,
        namespace=NAMESPACE,
        pure=pure,
        infer=_make_infer(name) if kind == "plain" else None,
    )
    register_op(op)
    SPECS[name] = PrimSpec(name, op, kind, MappingProxyType(dict(defaults or {})))
    OPS[name] = op
    globals()[py_name(name)] = op
    return op


# How an op a rule builds is typed: JAX's abstract evaluation, ``fn(prim_name, inputs,
# attrs) -> (shape, dtype)`` (or a list of them), which the JAX bridge installs when it is
# imported (:mod:`pypm_jax.jax.types`); this module never imports JAX itself.
_type_inference: Callable[[str, tuple[Any, ...], Mapping[str, Any]], Any] | None = None


def set_type_inference(fn: Callable[[str, tuple[Any, ...], Mapping[str, Any]], Any]) -> None:
    """Make ``fn(prim_name, inputs, attrs)`` the type inference of the table's operators
    (called once, by the JAX bridge on import; a second call replaces the first)."""
    global _type_inference
    if not callable(fn):
        raise TypeError(f"type inference must be callable, got {fn!r}")
    _type_inference = fn


def _make_infer(prim_name: str) -> Any:
    def infer(*inputs: Any, **attrs: Any) -> Any:
        """Shape/dtype of an op a rule builds: unknown when an input's is, else JAX's."""
        if any(getattr(x, "shape", None) is None for x in inputs):
            return (None, None)
        if any(getattr(x, "dtype", None) is None for x in inputs):
            return (None, None)
        if _type_inference is None:
            raise PyPMError(
                f"the type of jax.{prim_name} on typed inputs is JAX's to infer, and the "
                "JAX bridge is not imported (import pypm_jax.jax)"
            )
        return _type_inference(prim_name, inputs, attrs)

    return infer


_ACC = ("accuracy",)
_ACC_DEFAULT = {"accuracy": None}

# ---------------------------------------------------------------- unary pointwise
for _n in ("exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "rsqrt", "sqrt", "cbrt"):
    _def(_n, 1, "unary_pointwise", _ACC, defaults=_ACC_DEFAULT)
for _n in ("sin", "cos", "tan"):
    _def(_n, 1, "unary_pointwise", _ACC, defaults=_ACC_DEFAULT)
for _n in (
    "neg", "abs", "sign", "square", "erf", "erfc", "erf_inv", "floor", "ceil", "is_finite",
    "not", "sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh", "atanh", "lgamma",
    "digamma", "real", "imag", "population_count", "clz", "copy", "stop_gradient",
):  # fmt: skip
    _def(_n, 1, "unary_pointwise")
_def("round", 1, "unary_pointwise", ("rounding_method",))
_def("conj", 1, "unary_pointwise", ("input_dtype",))
_def("integer_pow", 1, "unary_pointwise", ("y",))
_def("reduce_precision", 1, "unary_pointwise", ("exponent_bits", "mantissa_bits"))
_def(
    "convert_element_type",
    1,
    "conversion",
    ("new_dtype", "weak_type", "sharding"),
    defaults={"weak_type": False, "sharding": None},
)
_def("bitcast_convert_type", 1, "conversion", ("new_dtype",))

# ---------------------------------------------------------------- binary pointwise
for _n in (
    "add", "sub", "div", "rem", "pow", "max", "min", "atan2", "nextafter", "complex",
    "and", "or", "xor", "eq", "ne", "lt", "le", "gt", "ge",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "add_any",
):  # fmt: skip
    _def(_n, 2, "binary_pointwise")
_def("mul", 2, "binary_pointwise", ("out_dtype",), defaults={"out_dtype": None})

# ---------------------------------------------------------------- ternary / selection
_def("select_n", None, "select")  # predicate, then one case per value of the predicate
_def("clamp", 3, "ternary_pointwise")  # clamp(lo, x, hi)

# ---------------------------------------------------------------- reductions
# Params only some supported JAX versions have (out_sharding of reduce_max/min and is_stable
# of top_k: jax >= 0.11) are listed; lowering drops them on a JAX without them (_compat).
for _n in ("reduce_max", "reduce_min"):
    _def(_n, 1, "reduction", ("axes", "out_sharding"), defaults={"out_sharding": None})
for _n in ("reduce_prod", "reduce_and", "reduce_or", "reduce_xor"):
    _def(_n, 1, "reduction", ("axes",))
_def("reduce_sum", 1, "reduction", ("axes", "out_sharding"), defaults={"out_sharding": None})
for _n in ("argmax", "argmin"):
    _def(_n, 1, "reduction", ("axes", "index_dtype"))
for _n in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
    _def(_n, 1, "cumulative", ("axis", "reverse"), defaults={"reverse": False})
_WINDOW = ("window_dimensions", "window_strides", "padding", "base_dilation", "window_dilation")
for _n in ("reduce_window_sum", "reduce_window_max", "reduce_window_min"):
    _def(_n, 1, "window_reduction", _WINDOW)

# ---------------------------------------------------------------- contractions
_def(
    "dot_general",
    2,
    "contraction",
    ("dimension_numbers", "precision", "preferred_element_type", "out_sharding"),
    defaults={"precision": None, "preferred_element_type": None, "out_sharding": None},
)
_def(
    "conv_general_dilated",
    2,
    "contraction",
    (
        "window_strides", "padding", "lhs_dilation", "rhs_dilation", "dimension_numbers",
        "feature_group_count", "batch_group_count", "precision", "preferred_element_type",
        "out_sharding",
    ),
)  # fmt: skip

# ---------------------------------------------------------------- layout
_def(
    "broadcast_in_dim",
    1,
    "layout",
    ("shape", "broadcast_dimensions", "sharding"),
    defaults={"sharding": None},
)
_def(
    "reshape",
    1,
    "layout",
    ("new_sizes", "dimensions", "sharding"),
    defaults={"dimensions": None, "sharding": None},
)
_def("transpose", 1, "layout", ("permutation",))
_def("squeeze", 1, "layout", ("dimensions",))
_def("rev", 1, "layout", ("dimensions",))
_def("pad", 2, "layout", ("padding_config",))  # operand, padding value
_def("concatenate", None, "layout", ("dimension",))  # variadic
_def("split", 1, "layout", ("sizes", "axis"))  # one output per size: see op_for
_def(
    "slice", 1, "layout", ("start_indices", "limit_indices", "strides"), defaults={"strides": None}
)
_def("dynamic_slice", None, "layout", ("slice_sizes",))  # operand, *start indices
_def("dynamic_update_slice", None, "layout")  # operand, update, *start indices
_def(
    "gather",
    2,
    "indexing",
    (
        "dimension_numbers",
        "slice_sizes",
        "unique_indices",
        "indices_are_sorted",
        "mode",
        "fill_value",
    ),
)
_SCATTER = ("update_jaxpr", "update_consts", "dimension_numbers", "indices_are_sorted",
            "unique_indices", "mode")  # fmt: skip
for _n in ("scatter", "scatter-add", "scatter-mul", "scatter-min", "scatter-max"):
    _def(_n, 3, "indexing", _SCATTER)
_def(
    "iota", 0, "creation", ("dtype", "shape", "dimension", "sharding"), defaults={"sharding": None}
)
_def("sort", None, "sort", ("dimension", "is_stable", "num_keys"))  # one output per operand
_def("top_k", 1, "sort", ("k", "axis", "is_stable"), n_out=2, defaults={"is_stable": True})

# ---------------------------------------------------------------- calls: bodies lifted in place
_JIT = ("jaxpr", "in_shardings", "out_shardings", "in_layouts", "out_layouts", "donated_invars",
        "ctx_mesh", "name", "keep_unused", "inline", "compiler_options_kvs")  # fmt: skip
_def("jit", None, "call", _JIT, kind="inline")
_def("closed_call", None, "call", ("call_jaxpr",), kind="inline")
_def(
    "custom_jvp_call",
    None,
    "call",
    ("call_jaxpr", "jvp_jaxpr_fun", "num_consts", "symbolic_zeros"),
    kind="region",
)
_def(
    "custom_vjp_call",
    None,
    "call",
    ("call_jaxpr", "fwd_jaxpr_thunk", "num_consts", "bwd", "out_trees", "symbolic_zeros"),
    kind="region",
)
_def("remat2", None, "call", ("jaxpr", "prevent_cse", "differentiated", "policy"), kind="region")

# ---------------------------------------------------------------- control flow: nested graphs
# attrs: the version-independent params (_compat.CONTROL_PARAMS), whatever JAX gives
_def(
    "scan",
    None,
    "control",
    ("reverse", "length", "jaxpr", "num_consts", "num_carry", "unroll"),
    kind="nested",
)
_def(
    "while",
    None,
    "control",
    ("cond_jaxpr", "body_jaxpr", "cond_nconsts", "body_nconsts"),
    kind="nested",
)
_def("cond", None, "control", ("branches",), kind="nested")
_def(
    "shard_map",
    None,
    "control",
    ("jaxpr", "mesh", "in_specs", "out_specs", "check_vma", "newly_manual_axes"),
    kind="nested",
)

# ---------------------------------------------------------------- retyping only: no node
# ``pvary`` marks values as varying across a shard_map's manual axes (``check_vma``); its
# outputs are its operands. JAX inserts it again where needed when the lowered body is traced.
_def("pvary", None, "retype", ("axes",), kind="retype")

# ---------------------------------------------------------------- random: never merged
for _n, _a in (
    ("random_seed", ("impl",)),
    ("random_wrap", ("impl",)),
    ("random_unwrap", ()),
    ("random_bits", ("bit_width", "shape")),
    ("random_split", ("shape",)),
    ("random_fold_in", ()),
    ("random_gamma", ("log_space",)),
    ("threefry2x32", ()),
    ("rng_uniform", ("shape",)),
    ("rng_bit_generator", ("shape", "dtype", "algorithm", "out_sharding")),
):
    _def(_n, None, "random", _a, pure=False, kind="opaque")

# ---------------------------------------------------------------- kept whole, never matched
for _n in ("optimization_barrier", "sharding_constraint", "device_put"):
    _def(_n, None, "opaque", pure=False, kind="opaque")


# ------------------------------------------------------------------------------ look-ups

_VARIANTS: dict[tuple[str, int, bool], Operator] = {}


def opaque_op(prim_name: str, n_out: int = 1) -> Operator:
    """The opaque, impure operator standing for an unknown or effectful primitive.

    Created on first use per (primitive name, output count); never merged, and lowered by
    binding the original primitive with its original params.
    """
    key = (prim_name, n_out, True)
    op = _VARIANTS.get(key)
    if op is None:
        op = Operator(
            prim_name, None, n_out, op_class="opaque", namespace=NAMESPACE + ".opaque", pure=False
        )
        _VARIANTS[key] = op
    return op


def is_table_op(op: Operator) -> bool:
    """Is ``op`` one of this module's operators -- a table entry, a variant of one or an
    opaque operator -- by identity? Only these stand for the JAX primitive of their name; an
    operator that merely carries such a name (a loaded ``jaxEVIL.log``) does not."""
    name = op.name
    spec = SPECS.get(name)
    if spec is not None and spec.op is op:
        return True
    get, n_out = _VARIANTS.get, op.n_out
    return get((name, n_out, False)) is op or get((name, n_out, True)) is op


def spec_for(prim_name: str) -> PrimSpec | None:
    """The table entry for a primitive name, or None (then the primitive is opaque)."""
    return SPECS.get(prim_name)


def op_for(prim_name: str, n_out: int) -> Operator:
    """The operator for an equation of ``prim_name`` with ``n_out`` outputs.

    Table operators have a fixed output count; primitives whose output count depends on the
    equation (``sort`` of several operands, ``split``, ``scan``, ...) get a variant with the
    same name, class and purity, created once per output count.
    """
    spec = SPECS.get(prim_name)
    if spec is None:
        return opaque_op(prim_name, n_out)
    if spec.op.n_out == n_out:
        return spec.op
    key = (prim_name, n_out, False)
    op = _VARIANTS.get(key)
    if op is None:
        base = spec.op
        op = Operator(
            base.name,
            base.n_in,
            n_out,
            attrs=base.attrs,
            op_class=base.op_class,
            namespace=base.namespace,
            pure=base.pure,
            infer=base.infer,
        )
        _VARIANTS[key] = op
    return op


def lift_attrs(params: Mapping[str, Any]) -> dict[str, Any]:
    """Node attrs for an equation's params: the same names, element types as pm dtypes."""
    attrs: dict[str, Any] = {}
    for k, v in params.items():
        if k in DTYPE_PARAMS and v is not None:
            try:
                v = as_dtype(v)
            except TypeError:
                pass  # an extended dtype (PRNG keys): keep JAX's object, guards see it as is
        attrs[k] = v
    return attrs
