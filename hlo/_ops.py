"""The per-op table: how each StableHLO / CHLO op becomes a JAX primitive's pm operator.

One entry per op (a per-op table). Each maps an MLIR op name onto the operator the jaxpr
lifter uses for the corresponding JAX primitive (:mod:`pypm_jax.vocab.primitives`), with the
attributes under JAX's param names and in JAX's form, so the standard rules' patterns and
guards read the same values on both: ``dot_general``'s ``dimension_numbers`` is
``((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))``, a ``reduce`` whose body is one
``add``/``maximum``/... is ``reduce_sum``/``reduce_max``/... with ``axes``, ``convert`` is
``convert_element_type`` with a pm ``new_dtype``, and so on.

An entry is an :class:`OpSpec`: the primitive's name, a function from the op (a snapshot
:class:`~hlo._snapshot.Op`) to the node's attrs (or None: this instance has no JAX
equivalent, lift it as opaque), a function picking and ordering the operands (``select``'s
``(pred, on_true, on_false)`` is ``select_n(pred, on_false, on_true)``), and whether the op
is one of JAX's broadcasting binary primitives (see :mod:`hlo._lift` for what that changes).

Ops not in the table, and ops with effects (``custom_call``, collectives, infeed, ...), are
lifted as opaque, impure nodes named by the op (:func:`opaque_op`): never merged, never
matched through.
"""

from __future__ import annotations

__all__ = ["OpSpec", "TABLE", "spec_for", "opaque_op", "REDUCERS", "NAMESPACE"]

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pypm_jax import Operator, as_dtype

from ._snapshot import Op

NAMESPACE = "hlo.opaque"

Attrs = Callable[[Op], dict[str, Any] | None]
Operands = Callable[[Op], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class OpSpec:
    """How one MLIR op is lifted: ``prim`` names the JAX primitive's operator."""

    prim: str
    attrs: Attrs
    operands: Operands | None = None  # default: all operands, in order
    broadcasting: bool = False  # a JAX binary primitive whose lowering broadcasts operands


TABLE: dict[str, OpSpec] = {}


def _none(_op: Op) -> dict[str, Any]:
    return {}


def _fixed(**attrs: Any) -> Attrs:
    return lambda _op: dict(attrs)


def _def(names: str | tuple[str, ...], prim: str, attrs: Attrs = _none, **kw: Any) -> None:
    for name in (names,) if isinstance(names, str) else names:
        TABLE[name] = OpSpec(prim, attrs, **kw)


def _result_dtype(op: Op) -> Any:
    return as_dtype(op.types[0][1]) if op.types and op.types[0][1] else None


def _result_shape(op: Op) -> tuple[int, ...] | None:
    shape = op.types[0][0] if op.types else None
    if shape is None or any(d is None for d in shape):
        return None  # dynamic shapes have no JAX param form here
    return tuple(shape)


# ---------------------------------------------------------------------- unary pointwise
# JAX's transcendental primitives carry ``accuracy`` (None: the default).
_ACCURATE = {
    "stablehlo.exponential": "exp",
    "stablehlo.exponential_minus_one": "expm1",
    "stablehlo.log": "log",
    "stablehlo.log_plus_one": "log1p",
    "stablehlo.tanh": "tanh",
    "stablehlo.logistic": "logistic",
    "stablehlo.rsqrt": "rsqrt",
    "stablehlo.sqrt": "sqrt",
    "stablehlo.cbrt": "cbrt",
    "stablehlo.sine": "sin",
    "stablehlo.cosine": "cos",
    "stablehlo.tan": "tan",
    "chlo.tan": "tan",
}
for _name, _prim in _ACCURATE.items():
    _def(_name, _prim, _fixed(accuracy=None))

_UNARY = {
    "stablehlo.negate": "neg",
    "stablehlo.abs": "abs",
    "stablehlo.sign": "sign",
    "stablehlo.floor": "floor",
    "stablehlo.ceil": "ceil",
    "stablehlo.is_finite": "is_finite",
    "stablehlo.not": "not",
    "stablehlo.real": "real",
    "stablehlo.imag": "imag",
    "stablehlo.popcnt": "population_count",
    "stablehlo.count_leading_zeros": "clz",
    "chlo.square": "square",
    "chlo.erf": "erf",
    "chlo.erfc": "erfc",
    "chlo.erf_inv": "erf_inv",
    "chlo.sinh": "sinh",
    "chlo.cosh": "cosh",
    "chlo.asin": "asin",
    "chlo.acos": "acos",
    "chlo.atan": "atan",
    "chlo.asinh": "asinh",
    "chlo.acosh": "acosh",
    "chlo.atanh": "atanh",
    "chlo.lgamma": "lgamma",
    "chlo.digamma": "digamma",
}
for _name, _prim in _UNARY.items():
    _def(_name, _prim)

# jax.lax.RoundingMethod: AWAY_FROM_ZERO = 0, TO_NEAREST_EVEN = 1
_def("stablehlo.round_nearest_afz", "round", _fixed(rounding_method=0))
_def("stablehlo.round_nearest_even", "round", _fixed(rounding_method=1))
_def(
    "stablehlo.convert",
    "convert_element_type",
    lambda op: {"new_dtype": _result_dtype(op), "weak_type": False, "sharding": None},
)
_def(
    "stablehlo.bitcast_convert", "bitcast_convert_type", lambda op: {"new_dtype": _result_dtype(op)}
)
_def(
    "stablehlo.reduce_precision",
    "reduce_precision",
    lambda op: {
        "exponent_bits": op.attrs.get("exponent_bits"),
        "mantissa_bits": op.attrs.get("mantissa_bits"),
    },
)

# ---------------------------------------------------------------------- binary pointwise
_BINARY = {
    "add": "add",
    "subtract": "sub",
    "divide": "div",
    "remainder": "rem",
    "power": "pow",
    "maximum": "max",
    "minimum": "min",
    "atan2": "atan2",
    "and": "and",
    "or": "or",
    "xor": "xor",
    "shift_left": "shift_left",
    "shift_right_logical": "shift_right_logical",
    "shift_right_arithmetic": "shift_right_arithmetic",
    "complex": "complex",
}
for _name, _prim in _BINARY.items():
    # chlo.broadcast_* (TensorFlow's lowering) broadcast numpy-style: the same operator
    _def((f"stablehlo.{_name}", f"chlo.broadcast_{_name}"), _prim, broadcasting=True)
_def(
    ("stablehlo.multiply", "chlo.broadcast_multiply"),
    "mul",
    _fixed(out_dtype=None),
    broadcasting=True,
)
_def("chlo.next_after", "nextafter", broadcasting=True)

_COMPARE = {"EQ": "eq", "NE": "ne", "LT": "lt", "LE": "le", "GT": "gt", "GE": "ge"}


def _compare_spec(op: Op) -> OpSpec | None:
    prim = _COMPARE.get(str(op.attrs.get("comparison_direction", "")))
    return None if prim is None else OpSpec(prim, _none, broadcasting=True)


# ---------------------------------------------------------------------- selection


def _select_operands(op: Op) -> tuple[int, ...]:
    pred, on_true, on_false = op.operands
    return (pred, on_false, on_true)  # select_n: case 0 is "false"


_def("stablehlo.select", "select_n", operands=_select_operands)
_def("stablehlo.clamp", "clamp")  # clamp(min, x, max), as lax.clamp(lo, x, hi)

# ---------------------------------------------------------------------- contractions


def _precision(op: Op) -> Any:
    p = op.attrs.get("precision_config")
    if not p or all(str(x) == "DEFAULT" for x in p):
        return None
    return tuple(str(x) for x in p)


def _dot_general(op: Op) -> dict[str, Any] | None:
    d = op.attrs.get("dot_dimension_numbers")
    if not isinstance(d, dict):
        return None
    dn = (
        (d["lhs_contracting_dimensions"], d["rhs_contracting_dimensions"]),
        (d["lhs_batching_dimensions"], d["rhs_batching_dimensions"]),
    )
    return {
        "dimension_numbers": dn,
        "precision": _precision(op),
        "preferred_element_type": _result_dtype(op),
        "out_sharding": None,
    }


def _dot(op: Op) -> dict[str, Any] | None:
    """``stablehlo.dot`` (vector/matrix products): the lhs's last axis with the rhs's first."""
    lhs = op.operand_types[0][0]
    if lhs is None or len(lhs) not in (1, 2):
        return None
    return {
        "dimension_numbers": (((len(lhs) - 1,), (0,)), ((), ())),
        "precision": _precision(op),
        "preferred_element_type": _result_dtype(op),
        "out_sharding": None,
    }


_def("stablehlo.dot_general", "dot_general", _dot_general)
_def("stablehlo.dot", "dot_general", _dot)

# ---------------------------------------------------------------------- layout


def _with_shape(make: Callable[[Op, tuple[int, ...]], dict[str, Any]]) -> Attrs:
    def attrs(op: Op) -> dict[str, Any] | None:
        shape = _result_shape(op)
        return None if shape is None else make(op, shape)

    return attrs


_def(
    "stablehlo.broadcast_in_dim",
    "broadcast_in_dim",
    _with_shape(
        lambda op, shape: {
            "shape": shape,
            "broadcast_dimensions": tuple(op.attrs.get("broadcast_dimensions", ())),
            "sharding": None,
        }
    ),
)


def _broadcast(op: Op, shape: tuple[int, ...]) -> dict[str, Any]:
    """Legacy ``broadcast``: new leading axes, the operand's axes last."""
    n = len(tuple(op.attrs.get("broadcast_sizes", ())))
    return {
        "shape": shape,
        "broadcast_dimensions": tuple(range(n, len(shape))),
        "sharding": None,
    }


_def("stablehlo.broadcast", "broadcast_in_dim", _with_shape(_broadcast))
_def(
    "stablehlo.reshape",
    "reshape",
    _with_shape(lambda op, shape: {"new_sizes": shape, "dimensions": None, "sharding": None}),
)
_def("stablehlo.transpose", "transpose", lambda op: {"permutation": tuple(op.attrs["permutation"])})
_def("stablehlo.reverse", "rev", lambda op: {"dimensions": tuple(op.attrs["dimensions"])})
_def("stablehlo.concatenate", "concatenate", lambda op: {"dimension": op.attrs["dimension"]})


def _slice(op: Op) -> dict[str, Any]:
    strides = tuple(op.attrs.get("strides", ()))
    return {
        "start_indices": tuple(op.attrs["start_indices"]),
        "limit_indices": tuple(op.attrs["limit_indices"]),
        "strides": None if all(s == 1 for s in strides) else strides,
    }


_def("stablehlo.slice", "slice", _slice)
_def(
    "stablehlo.dynamic_slice",
    "dynamic_slice",
    lambda op: {"slice_sizes": tuple(op.attrs["slice_sizes"])},
)
_def("stablehlo.dynamic_update_slice", "dynamic_update_slice")
_def(
    "stablehlo.pad",
    "pad",
    lambda op: {
        "padding_config": tuple(
            zip(
                op.attrs["edge_padding_low"],
                op.attrs["edge_padding_high"],
                op.attrs["interior_padding"],
                strict=True,
            )
        )
    },
)
_def(
    "stablehlo.iota",
    "iota",
    _with_shape(
        lambda op, shape: {
            "dtype": _result_dtype(op),
            "shape": shape,
            "dimension": op.attrs["iota_dimension"],
            "sharding": None,
        }
    ),
)


def _top_k(op: Op) -> dict[str, Any] | None:
    shape = op.operand_types[0][0]
    if shape is None:
        return None
    return {"k": op.attrs["k"], "axis": len(shape) - 1}


_def("chlo.top_k", "top_k", _top_k)
_def("stablehlo.optimization_barrier", "optimization_barrier")  # impure in the prims table

# ---------------------------------------------------------------------- reductions
# A ``reduce`` of one operand whose body applies one of these to its two arguments.
REDUCERS = {
    "stablehlo.add": ("reduce_sum", "add"),
    "stablehlo.maximum": ("reduce_max", "max"),
    "stablehlo.minimum": ("reduce_min", "min"),
    "stablehlo.multiply": ("reduce_prod", "mul"),
    "stablehlo.and": ("reduce_and", "and"),
    "stablehlo.or": ("reduce_or", "or"),
    "stablehlo.xor": ("reduce_xor", "xor"),
}


def spec_for(op: Op) -> OpSpec | None:
    """The table entry for ``op``, or None (lift it as opaque). ``reduce`` is the lifter's."""
    if op.name in ("stablehlo.compare", "chlo.broadcast_compare"):
        return _compare_spec(op)
    return TABLE.get(op.name)


# ---------------------------------------------------------------------- opaque

_OPAQUE: dict[tuple[str, int], Operator] = {}


def opaque_op(name: str, n_out: int = 1) -> Operator:
    """The impure operator standing for an op with no JAX equivalent (``custom_call``,
    ``while``, ``gather``, ...): one per (op name, output count), never merged."""
    key = (name, n_out)
    op = _OPAQUE.get(key)
    if op is None:
        op = Operator(name, None, n_out, op_class="opaque", namespace=NAMESPACE, pure=False)
        _OPAQUE[key] = op
    return op
