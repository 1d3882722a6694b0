"""Shared helpers of the StableHLO tests: lift a function both ways and compare the graphs."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

import hlo
from pypm_jax.jax import lift as lift_jaxpr

# The attributes the standard rules' guards read (and a few more a pattern may), compared
# between the two lifts wherever a node has them.
COMPARED_ATTRS = (
    "dimension_numbers", "axes", "permutation", "broadcast_dimensions", "shape", "new_sizes",
    "new_dtype", "start_indices", "limit_indices", "strides", "dimension", "padding_config",
    "slice_sizes", "value", "dtype", "rounding_method", "k", "axis",
)  # fmt: skip

# Primitives that are the identity on values and lower to nothing: read through on the
# jaxpr side (the rules' patterns allow them to be absent).
IDENTITIES = frozenset({"stop_gradient", "copy"})


def both(fn: Any, *args: Any) -> tuple[Any, Any]:
    """(graph lifted from fn's jaxpr, graph lifted from fn's StableHLO)."""
    g_jaxpr = lift_jaxpr(jax.make_jaxpr(fn)(*args)).graph
    g_hlo = hlo.lift(jax.jit(fn, keep_unused=True).lower(*args))
    return g_jaxpr, g_hlo


def _attr_key(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return ("array", value.dtype.str, value.shape, tuple(value.reshape(-1).tolist()))
    if isinstance(value, tuple | list):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, float) and value != value:
        return "nan"
    return value


class Structure:
    """Canonical ids of values, shared between graphs: equal ids, equal computations
    (operator, output index, type, compared attributes, inputs; graph inputs by position)."""

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}

    def outputs(self, graph: Any) -> tuple[Any, ...]:
        memo: dict[Any, Any] = {v: ("in", i) for i, v in enumerate(graph.inputs)}
        for node in graph.nodes():
            if node.op.namespace == "jax" and node.op.name in IDENTITIES:
                memo[node.outputs[0]] = memo[node.inputs[0]]
                continue
            attrs = tuple((k, _attr_key(node.attrs[k])) for k in COMPARED_ATTRS if k in node.attrs)
            ins = tuple(memo[x] for x in node.inputs)
            for v in node.outputs:
                key = (node.op.namespace, node.op.name, v.index, v.shape, v.dtype, attrs, ins)
                memo[v] = self.ids.setdefault(key, len(self.ids))
        return tuple(memo[v] for v in graph.outputs)


def same_graph(g_jaxpr: Any, g_hlo: Any) -> bool:
    """Do both lifts compute the same values with the same operators and attributes?"""
    s = Structure()
    return s.outputs(g_jaxpr) == s.outputs(g_hlo)


def op_names(graph: Any) -> list[str]:
    return sorted(n.op.name for n in graph.nodes() if n.op.name != "const")
