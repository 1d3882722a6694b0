"""Element types as interned objects, so guards compare ``x.dtype == pm.f32`` by identity."""

from __future__ import annotations

__all__ = ["DType", "as_dtype", "DTYPES"]

from typing import Any


class DType:
    """An element type. One object per name: ``as_dtype("float32") is as_dtype("f32")``."""

    __slots__ = ("name", "numpy_name")

    def __init__(self, name: str, numpy_name: str):
        self.name = name
        self.numpy_name = numpy_name

    def __repr__(self) -> str:
        return self.name

    def __reduce__(self):  # keep interning through copy/pickle
        return (as_dtype, (self.name,))


_CANON = [
    ("bool", "bool"),
    ("i4", "int4"),
    ("i8", "int8"),
    ("i16", "int16"),
    ("i32", "int32"),
    ("i64", "int64"),
    ("u4", "uint4"),
    ("u8", "uint8"),
    ("u16", "uint16"),
    ("u32", "uint32"),
    ("u64", "uint64"),
    ("f8e4m3", "float8_e4m3fn"),
    ("f8e5m2", "float8_e5m2"),
    ("bf16", "bfloat16"),
    ("f16", "float16"),
    ("f32", "float32"),
    ("f64", "float64"),
    ("c64", "complex64"),
    ("c128", "complex128"),
]

DTYPES: dict[str, DType] = {}
_ALIASES: dict[str, DType] = {}
for _short, _np in _CANON:
    _d = DType(_short, _np)
    DTYPES[_short] = _d
    _ALIASES[_short] = _d
    _ALIASES[_np] = _d
_ALIASES["float8_e4m3"] = DTYPES["f8e4m3"]


def as_dtype(value: Any) -> DType | None:
    """Canonicalize a dtype given as DType, short or numpy name, or numpy/JAX dtype."""
    if value is None or isinstance(value, DType):
        return value
    if isinstance(value, str):
        key = value
    else:
        key = getattr(value, "name", None) or str(getattr(value, "dtype", value))
    try:
        return _ALIASES[key]
    except KeyError:
        raise TypeError(f"unknown element type {value!r}") from None
