"""Pointwise regions as data: what a region rule matched, carried by the replacement node.

A *region* is the pointwise computation a rule found after a GEMM (its epilogue) or between
an attention's scores and its softmax (a score modifier). The replacement node keeps it as
plain data, so ``pm.serialize`` of a rewritten graph keeps it and a report can print it, and
the kernel's implementation turns it back into a function when the program is lowered:

* a region is a tuple of *steps*, each ``(prim_name, params, args)``: ``prim_name`` a JAX
  primitive name (:data:`PRIMS`), ``params`` a sorted tuple of ``(name, value)`` pairs of
  plain hashable values (dtypes by their numpy names), ``args`` a tuple of references;
* a reference is ``("acc",)`` (the GEMM accumulator, or the attention score), ``("in", i)``
  (the i-th captured operand), ``("step", j)`` (the value of an earlier step), ``("lit", v)``
  (a Python number) or, in attention regions only, ``("idx", a)`` with ``a`` one of ``"b"``,
  ``"h"``, ``"q"``, ``"k"`` (batch, head, query or key position);
* the last step's value is the region's value.

:func:`region_error` says why data is not a region this module can compile (an unknown
primitive, a reference to a later step...), :func:`region_fn` builds the elementwise function
(memoized: equal regions give the same function object, so jit caches keyed on it hit) and
:func:`describe` prints a region in one line (``tanh(acc / 30.0) * 30.0``).

Only :func:`region_fn` imports JAX, when called: rules and guards use the rest without it.
"""

from __future__ import annotations

__all__ = [
    "PRIMS",
    "Region",
    "Step",
    "Ref",
    "region_error",
    "region_inputs",
    "region_fn",
    "describe",
    "step",
]

import functools
import math
from collections.abc import Callable
from typing import Any

Ref = tuple[Any, ...]
Step = tuple[str, tuple[tuple[str, Any], ...], tuple[Ref, ...]]
Region = tuple[Step, ...]

# primitive name -> number of arguments (None: two or more, ``select_n``)
_UNARY = (
    "neg", "abs", "sign", "floor", "ceil", "exp", "exp2", "expm1", "log", "log1p", "tanh",
    "logistic", "sqrt", "rsqrt", "cbrt", "sin", "cos", "erf", "erfc", "square", "not",
    "is_finite", "integer_pow", "convert_element_type", "copy",
)  # fmt: skip
_BINARY = (
    "add", "sub", "mul", "div", "max", "min", "pow", "rem", "atan2", "and", "or",
    "eq", "ne", "lt", "le", "gt", "ge",
)  # fmt: skip
PRIMS: dict[str, int | None] = {
    **dict.fromkeys(_UNARY, 1),
    **dict.fromkeys(_BINARY, 2),
    "clamp": 3,
    "select_n": None,
}

# The params a step may carry; any other param makes the region one we cannot compile.
_PARAMS: dict[str, frozenset[str]] = {
    "integer_pow": frozenset({"y"}),
    "convert_element_type": frozenset({"new_dtype"}),
}
_DTYPES = frozenset({"float32", "bfloat16", "float16", "float64", "int32", "int8", "bool"})
_INDEX_AXES = ("b", "h", "q", "k")

_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "eq": "==", "ne": "!=",
          "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "and": "&", "or": "|"}  # fmt: skip


def step(prim: str, args: tuple[Ref, ...], **params: Any) -> Step:
    """A step with its params in the canonical (sorted) order."""
    return (prim, tuple(sorted(params.items())), tuple(args))


def _is_number(v: Any) -> bool:
    return isinstance(v, bool | int | float) and not (isinstance(v, float) and math.isnan(v))


def _ref_error(ref: Any, j: int, n_inputs: int | None, index_refs: bool) -> str | None:
    if not isinstance(ref, tuple) or not ref:
        return f"step {j}: argument {ref!r} is not a reference"
    kind = ref[0]
    if kind == "acc" and len(ref) == 1:
        return None
    if kind == "in" and len(ref) == 2 and type(ref[1]) is int and ref[1] >= 0:
        if n_inputs is not None and ref[1] >= n_inputs:
            return f"step {j} reads operand {ref[1]}, the region has {n_inputs}"
        return None
    if kind == "step" and len(ref) == 2 and type(ref[1]) is int and 0 <= ref[1] < j:
        return None
    if kind == "lit" and len(ref) == 2 and _is_number(ref[1]):
        return None
    if kind == "idx" and len(ref) == 2 and ref[1] in _INDEX_AXES:
        return None if index_refs else f"step {j}: index {ref[1]!r} is not available here"
    return f"step {j}: argument {ref!r} is not a reference to acc, an operand, an earlier step or a number"  # noqa: E501


def _step_error(s: Any, j: int, n_inputs: int | None, index_refs: bool) -> str | None:
    if not (isinstance(s, tuple) and len(s) == 3):
        return f"step {j} is not (prim, params, args)"
    prim, params, args = s
    if prim not in PRIMS:
        return f"step {j}: primitive {prim!r} has no kernel lowering"
    arity = PRIMS[prim]
    if not isinstance(args, tuple) or (arity is not None and len(args) != arity):
        return f"step {j}: {prim} takes {arity} arguments"
    if arity is None and len(args) != 3:
        return f"step {j}: only two-way select_n (a boolean predicate) is supported"
    if not isinstance(params, tuple) or list(params) != sorted(params):
        return f"step {j}: params must be a sorted tuple of (name, value) pairs"
    allowed = _PARAMS.get(prim, frozenset())
    for item in params:
        if not (isinstance(item, tuple) and len(item) == 2) or item[0] not in allowed:
            return f"step {j}: {prim} takes no param {item!r}"
    p = dict(params)
    if prim == "integer_pow" and type(p.get("y")) is not int:
        return f"step {j}: integer_pow needs an int y"
    if prim == "convert_element_type" and p.get("new_dtype") not in _DTYPES:
        return f"step {j}: cannot cast to {p.get('new_dtype')!r} in a kernel"
    for ref in args:
        err = _ref_error(ref, j, n_inputs, index_refs)
        if err is not None:
            return err
    return None


def region_error(
    region: Any, n_inputs: int | None = None, *, index_refs: bool = False
) -> str | None:
    """Why ``region`` is not a region :func:`region_fn` compiles, or None.

    ``n_inputs`` bounds the operand references; ``index_refs`` allows ``("idx", a)``
    (attention regions). Total: never raises, whatever ``region`` is.
    """
    if not isinstance(region, tuple) or not region:
        return "a region is a non-empty tuple of steps"
    for j, s in enumerate(region):
        err = _step_error(s, j, n_inputs, index_refs)
        if err is not None:
            return err
    return None


def region_inputs(region: Region) -> int:
    """How many operands the region reads (one more than the highest ``("in", i)``)."""
    return 1 + max((r[1] for _, _, args in region for r in args if r[0] == "in"), default=-1)


# --------------------------------------------------------------------------- compiling


def _kernel_erf(x: Any) -> Any:
    from pallas_kernels._gemm import erf

    return erf(x)


def _lax_binary(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A ``lax`` binary op on operands promoted and broadcast as ``jnp`` does (``lax.div`` and
    ``lax.rem`` round integers toward zero, as the program's ``div``/``rem`` did: attention
    index expressions such as ``i // chunk`` are integer)."""

    def call(a: Any, b: Any) -> Any:
        import jax.numpy as jnp

        dt = jnp.result_type(a, b)
        return fn(*jnp.broadcast_arrays(jnp.asarray(a, dt), jnp.asarray(b, dt)))

    return call


def _ops(target: str) -> dict[str, Callable[..., Any]]:
    """The elementwise implementation of each primitive. ``"kernel"`` avoids the few
    primitives Pallas-Triton cannot lower (``erf``, ``erfc``, ``logistic``) by exact or
    documented-accuracy substitutes (``pallas_kernels._gemm.erf``: |error| <= 1.5e-7)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    ops: dict[str, Callable[..., Any]] = {
        "neg": jnp.negative, "abs": jnp.abs, "sign": jnp.sign, "floor": jnp.floor,
        "ceil": jnp.ceil, "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1,
        "log": jnp.log, "log1p": jnp.log1p, "tanh": jnp.tanh, "logistic": jax.nn.sigmoid,
        "sqrt": jnp.sqrt, "rsqrt": lax.rsqrt, "cbrt": jnp.cbrt, "sin": jnp.sin,
        "cos": jnp.cos, "erf": lax.erf, "erfc": lax.erfc, "square": jnp.square,
        "not": jnp.logical_not, "is_finite": jnp.isfinite, "copy": lambda a: a,
        "integer_pow": lambda a, *, y: lax.integer_pow(a, y),
        "convert_element_type": lambda a, *, new_dtype: jnp.asarray(a).astype(new_dtype),
        "add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": _lax_binary(lax.div),
        "max": jnp.maximum, "min": jnp.minimum, "pow": jnp.power, "rem": _lax_binary(lax.rem),
        "atan2": jnp.arctan2, "and": jnp.logical_and, "or": jnp.logical_or,
        "eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal,
        "gt": jnp.greater, "ge": jnp.greater_equal,
        "clamp": lambda lo, a, hi: jnp.minimum(jnp.maximum(a, lo), hi),
        "select_n": lambda p, a, b: jnp.where(p, b, a),
    }  # fmt: skip
    if target == "kernel":
        ops["erf"] = _kernel_erf
        ops["erfc"] = lambda a: 1.0 - _kernel_erf(a)
        ops["logistic"] = lambda a: 1.0 / (1.0 + jnp.exp(-a))
    return ops


def _key(region: Region) -> tuple[Any, ...]:
    """``region`` with each literal tagged by its type and sign: ``1``, ``1.0``, ``True``,
    ``0.0`` and ``-0.0`` compare equal in Python but compute different things."""

    def ref_key(r: Ref) -> Any:
        if r[0] == "lit":
            return ("lit", type(r[1]).__name__, repr(r[1]))
        return r

    return tuple((p, params, tuple(ref_key(r) for r in args)) for p, params, args in region)


def region_fn(region: Region, target: str = "reference") -> Callable[..., Any]:
    """The elementwise function ``fn(acc, *operands)`` computing ``region``.

    ``target`` is ``"reference"`` (the primitives the program used) or ``"kernel"`` (inside a
    Pallas kernel: see :func:`_ops`). Operands broadcast against ``acc`` (a ``[bn]`` column
    tile, a ``[bm, 1]`` row tile, a full tile, a scalar). Attention regions (``("idx", a)``
    references) take the positions as keywords ``fn(acc, *operands, b=, h=, q=, k=)``.
    Memoized: the same region (and target) gives the same function object.
    """
    err = region_error(region, index_refs=True)
    if err is not None:
        raise ValueError(f"not a region: {err}")
    if target not in ("reference", "kernel"):
        raise ValueError(f"target must be 'reference' or 'kernel', got {target!r}")
    return _compiled(_key(region), region, target)


@functools.cache
def _compiled(_key: Any, region: Region, target: str) -> Callable[..., Any]:
    ops = _ops(target)

    def fn(acc: Any, *operands: Any, **index: Any) -> Any:
        values: list[Any] = []

        def read(ref: Ref) -> Any:
            kind = ref[0]
            if kind == "acc":
                return acc
            if kind == "in":
                return operands[ref[1]]
            if kind == "step":
                return values[ref[1]]
            if kind == "lit":
                return ref[1]
            return index[ref[1]]

        for prim, params, args in region:
            values.append(ops[prim](*(read(a) for a in args), **dict(params)))
        return values[-1]

    fn.__name__ = fn.__qualname__ = "region"
    fn.__doc__ = describe(region)
    return fn


# --------------------------------------------------------------------------- printing


def _uses(region: Region) -> list[int]:
    counts = [0] * len(region)
    for _, _, args in region:
        for r in args:
            if r[0] == "step":
                counts[r[1]] += 1
    return counts


def _show_ref(ref: Ref, shown: list[str], named: list[bool]) -> tuple[str, bool]:
    """The text of a reference and whether it is an infix expression (to parenthesize)."""
    kind = ref[0]
    if kind == "acc":
        return "acc", False
    if kind == "in":
        return f"in{ref[1]}", False
    if kind == "lit":
        return repr(ref[1]), False
    if kind == "idx":
        return ref[1], False
    j = ref[1]
    if named[j]:
        return f"t{j}", False
    return shown[j], _is_infix(shown[j])


def _is_infix(text: str) -> bool:
    return text.startswith("!")


def _show_step(s: Step, shown: list[str], named: list[bool]) -> str:
    """A step's text; an infix one is marked with a leading ``!`` until it is inlined."""
    prim, params, args = s
    refs = [_show_ref(a, shown, named) for a in args]
    bare = [t[1:] if t.startswith("!") else t for t, _ in refs]
    p = dict(params)
    if prim in _INFIX or prim == "integer_pow":
        wrapped = [f"({b})" if infix else b for b, (_, infix) in zip(bare, refs, strict=True)]
        if prim == "integer_pow":
            return f"!{wrapped[0]} ** {p['y']}"
        return "!" + f" {_INFIX[prim]} ".join(wrapped)
    if prim == "convert_element_type":
        return f"{p['new_dtype']}({bare[0]})"
    if prim == "select_n":
        return f"where({bare[0]}, {bare[2]}, {bare[1]})"
    return f"{prim}({', '.join(bare)})"


def describe(region: Region) -> str:
    """One line for reports: ``tanh(acc / 30.0) * 30.0``; a step read more than once is
    named (``t0 = acc + in0; t0 * logistic(t0)``) so the text stays as long as the region."""
    err = region_error(region, index_refs=True)
    if err is not None:
        return f"<not a region: {err}>"
    uses = _uses(region)
    last = len(region) - 1
    named = [uses[j] > 1 and j != last for j in range(len(region))]
    shown: list[str] = []
    lets: list[str] = []
    for j, s in enumerate(region):
        shown.append(_show_step(s, shown, named))
        if named[j]:
            lets.append(f"t{j} = {shown[j].removeprefix('!')}")
    return "; ".join([*lets, shown[last].removeprefix("!")])
