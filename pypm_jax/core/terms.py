"""Operators and terms: the things patterns are matched against.

Terms are hash-consed: applying the same pure operator to the same inputs with the same
attributes gives the identical object, so term equality is object identity (``is``), exactly
the paper's syntactic equality. Graph values (``pypm_jax.core.graph``) offer the same read-only
interface (``op``, ``inputs``, ``index``, ``attrs``, ``shape``, ``dtype``), so every matcher
works on both.
"""

from __future__ import annotations

__all__ = [
    "Operator",
    "OpClass",
    "Term",
    "Shape",
    "UNDEFINED",
    "LEAF",
    "CONST",
    "leaf",
    "const",
    "make_term",
    "term_attr",
    "freeze",
    "const_equal",
]

import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from .dtypes import DType, as_dtype
from .errors import PyPMError


class OpClass:
    """A named class of operators (``pm.opclass("unary_pointwise")``); interned by name.

    Interned weakly: a class nothing refers to any more (say, one named only by a refused
    blob) leaves the table, and a later ``OpClass(name)`` makes it anew -- nobody can tell.
    """

    __slots__ = ("name", "__weakref__")
    _interned: weakref.WeakValueDictionary[str, OpClass] = weakref.WeakValueDictionary()

    def __new__(cls, name: str) -> OpClass:
        if not isinstance(name, str) or not name:
            raise TypeError("an op class is named by a non-empty string")
        obj = cls._interned.get(name)
        if obj is None:
            obj = super().__new__(cls)
            obj.name = name
            cls._interned[name] = obj
        return obj

    def __repr__(self) -> str:
        return f"opclass({self.name!r})"

    def __reduce__(self):
        return (OpClass, (self.name,))


# Hook installed by the frontend: applying an operator to symbolic pattern values builds a
# pattern instead of a term. Kept as a hook so this module never imports the frontend.
_symbolic_apply: Callable[..., Any] | None = None


# Every attribute name some operator declares: a guard reading any other attribute of a term
# that is not one every term has can never hold (see ``_symbolic``).
DECLARED_ATTRS: set[str] = set()


class Operator:
    """A function symbol of the calculus: name, arity, output count, declared attributes.

    Operators are compared by identity. ``n_in=None`` means variadic (JAX's ``concatenate``).
    ``pure=False`` marks effectful or random operators, which are never hash-consed.
    """

    __slots__ = (
        "name",
        "n_in",
        "n_out",
        "attrs",
        "op_class",
        "namespace",
        "pure",
        "infer",
        "describe",
        "__weakref__",
    )

    def __init__(
        self,
        name: str,
        n_in: int | None,
        n_out: int = 1,
        *,
        attrs: tuple[str, ...] = (),
        op_class: str | OpClass | None = None,
        namespace: str = "",
        pure: bool = True,
        infer: Callable[..., Any] | None = None,
        describe: Callable[..., str] | None = None,
    ):
        if n_in is not None and (not isinstance(n_in, int) or n_in < 0):
            raise TypeError(f"operator {name}: arity must be a non-negative int or None")
        if not isinstance(n_out, int) or n_out < 1:
            raise TypeError(f"operator {name}: output count must be a positive int")
        self.name = name
        self.n_in = n_in
        self.n_out = n_out
        self.attrs = tuple(attrs)
        DECLARED_ATTRS.update(self.attrs)
        self.op_class = OpClass(op_class) if isinstance(op_class, str) else op_class
        self.namespace = namespace
        self.pure = pure
        self.infer = infer
        self.describe = describe

    @property
    def qualname(self) -> str:
        return f"{self.namespace}.{self.name}" if self.namespace else self.name

    def __repr__(self) -> str:
        return self.name

    def __call__(self, *args: Any, **attrs: Any) -> Any:
        if _symbolic_apply is not None and any(
            getattr(a, "__pypm_symbolic__", False) for a in (*args, *attrs.values())
        ):
            return _symbolic_apply(self, args, attrs)
        if self.n_in is not None and len(args) != self.n_in:
            raise TypeError(f"{self.name} takes {self.n_in} inputs, got {len(args)}")
        unknown = set(attrs) - set(self.attrs)
        if unknown:
            raise TypeError(f"{self.name} has no attribute(s) {sorted(unknown)}")
        inputs = tuple(_as_term(a) for a in args)
        shapes: list[tuple[Any, Any]] = [(None, None)] * self.n_out
        if self.infer is not None:
            inferred = self.infer(*inputs, **attrs)
            shapes = list(inferred) if self.n_out > 1 else [inferred]
        outs = tuple(
            make_term(self, inputs, index=i, attrs=attrs, shape=s, dtype=d)
            for i, (s, d) in enumerate(shapes)
        )
        return outs[0] if self.n_out == 1 else outs


LEAF = Operator("leaf", 0, attrs=("name",), namespace="pypm")
CONST = Operator("const", 0, attrs=("value",), namespace="pypm")


class Shape(tuple):
    """A shape: a tuple of ints with ``.rank`` (the paper's ``x.shape.rank``)."""

    __slots__ = ()

    @property
    def rank(self) -> int:
        return len(self)


class _Undefined:
    """The value of an attribute a term does not have (the paper's partial ⟦α⟧)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNDEFINED"

    def __bool__(self) -> bool:
        raise PyPMError("UNDEFINED has no truth value")


UNDEFINED = _Undefined()


# the element types of a list or tuple that ``freeze`` keeps as they are, with their types
# beside them: ("scalars", types, values), a form no other value freezes to (a scalar's is
# (its type's name, it) or a float's or complex's with signs, a list's otherwise begins
# with a frozen element, never a string)
_SCALARS = frozenset({int, str, bool, type(None)})


def frozen_scalars(values: tuple | list) -> tuple | None:
    """``freeze(values)`` where every element is an int, a string, a bool or None (the
    common attribute: a shape, axes, a permutation), else None."""
    types = tuple(map(type, values))
    if _SCALARS.issuperset(types):
        return ("scalars", types, tuple(values))
    return None


def freeze(value: Any) -> Any:
    """A hashable stand-in for an attribute value (lists → tuples, arrays → bytes). A float
    or complex zero keeps its sign: ``x * -0.0`` is not ``x * 0.0`` (``1 / -0.0`` is -inf),
    though -0.0 == 0.0."""
    t = type(value)
    if t is float:
        return ("float", value) if value else ("float", value, math.copysign(1.0, value))
    if t is complex:
        return ("complex", value, math.copysign(1.0, value.real), math.copysign(1.0, value.imag))
    if isinstance(value, np.ndarray | np.generic):
        arr = np.asarray(value)
        return ("ndarray", arr.dtype.str, arr.shape, arr.tobytes())
    if isinstance(value, list | tuple):
        found = frozen_scalars(value)
        if found is not None:
            return found
        return tuple((type(v).__name__, v) if type(v) in _SCALARS else freeze(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((k, freeze(v)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return frozenset(freeze(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    # 2, 2.0 and True hash alike; keep the type so const(2) and const(2.0) stay distinct.
    return (type(value).__name__, value)


class Term:
    """A hash-consed application of an operator to input terms (one output of it)."""

    __slots__ = ("op", "inputs", "index", "attrs", "shape", "dtype", "loc", "__weakref__")

    op: Operator
    inputs: tuple[Term, ...]
    index: int
    attrs: Mapping[str, Any]
    shape: Shape | None
    dtype: DType | None

    def __repr__(self) -> str:
        if self.op is LEAF:
            return str(self.attrs["name"])
        if self.op is CONST:
            return repr(self.attrs["value"])
        args = ", ".join(repr(t) for t in self.inputs)
        extra = "".join(f", {k}={v!r}" for k, v in self.attrs.items())
        idx = f"#{self.index}" if self.op.n_out > 1 else ""
        return f"{self.op.name}({args}{extra}){idx}"

    # Terms are compared by identity; make that explicit (and cheap).
    __eq__ = object.__eq__
    __hash__ = object.__hash__


_table: weakref.WeakValueDictionary[Any, Term] = weakref.WeakValueDictionary()


def make_term(
    op: Operator,
    inputs: tuple[Term, ...] = (),
    *,
    index: int = 0,
    attrs: Mapping[str, Any] | None = None,
    shape: Any = None,
    dtype: Any = None,
) -> Term:
    """Build (or find) the term ``op(inputs...)`` with the given output index and type."""
    attrs = dict(attrs or {})
    shape = None if shape is None else Shape(int(d) for d in shape)
    dtype = as_dtype(dtype)
    key = None
    if op.pure:
        key = (op, inputs, index, freeze(attrs), shape, dtype)
        found = _table.get(key)
        if found is not None:
            return found
    t = object.__new__(Term)
    t.op, t.inputs, t.index, t.attrs = op, inputs, index, attrs
    t.shape, t.dtype, t.loc = shape, dtype, None
    if key is not None:
        _table[key] = t
    return t


def leaf(name: str, *, shape: Any = None, dtype: Any = None) -> Term:
    """An input of a term (a graph parameter): ``pm.leaf("a", shape=(4, 8), dtype="f32")``."""
    return make_term(LEAF, (), attrs={"name": name}, shape=shape, dtype=dtype)


def const(value: Any, *, dtype: Any = None) -> Term:
    """A literal: ``pm.const(2.0)``. Scalars get shape ``()``."""
    shape = np.shape(value)
    return make_term(CONST, (), attrs={"value": value}, shape=shape, dtype=dtype)


def _as_term(value: Any) -> Term:
    if isinstance(value, Term):
        return value
    if isinstance(value, bool | int | float | np.ndarray | np.generic):
        return const(value)
    if hasattr(value, "op") and hasattr(value, "inputs"):  # a graph value
        return value
    raise TypeError(f"cannot use {value!r} as a term")


def const_equal(pattern_value: Any, term: Any) -> bool:
    """Does a literal in a pattern denote the constant ``term``?

    Exact equality, or equality after rounding the pattern's literal to the term's floating
    element type (a pattern's ``1.4142135623730951`` is ``1.4142135`` in an f32 program).
    """
    if term.op is not CONST:
        return False
    value = term.attrs["value"]
    if isinstance(value, np.ndarray) and value.size != 1:
        return False
    try:
        if bool(value == pattern_value):
            return True
    except Exception:
        return False
    dt = term.dtype
    if (
        dt is not None
        and dt.name.startswith(("f", "bf"))
        and isinstance(pattern_value, float | int)
    ):
        try:
            np_dt = _numpy_dtype(dt)
            return bool(np.asarray(pattern_value, np_dt) == np.asarray(value, np_dt))
        except TypeError:
            return False
    return False


def _numpy_dtype(dt: DType) -> Any:
    if dt.name == "bf16":
        import ml_dtypes  # ships with numpy-based stacks; not a JAX import

        return ml_dtypes.bfloat16
    return np.dtype(dt.numpy_name)


def term_attr(term: Any, name: str) -> Any:
    """The paper's ⟦α⟧(t): a term's attribute, or UNDEFINED where it has none."""
    if name == "shape":
        return UNDEFINED if term.shape is None else Shape(term.shape)
    if name == "rank":
        return UNDEFINED if term.shape is None else len(term.shape)
    if name in ("dtype", "eltType"):
        return UNDEFINED if term.dtype is None else term.dtype
    if name == "op":
        return term.op
    if name == "op_class":
        return term.op.op_class if term.op.op_class is not None else UNDEFINED
    if name == "index":
        return term.index
    if name == "term":
        # the term itself: guard functions that read a matched region's structure (its
        # operators, inputs and attributes) take it, e.g. the GEMM epilogue region rules
        return term
    attrs = term.attrs
    if name in attrs:
        return attrs[name]
    return UNDEFINED
