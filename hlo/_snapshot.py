"""A parsed StableHLO module as plain frozen Python data: what the lifter reads.

:func:`hlo._reader.load` fills it from MLIR; nothing here touches MLIR, so the lifter and the
site finder never hold an MLIR object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["Loc", "UNKNOWN", "Dense", "Op", "Block", "Func", "Module", "TypeSpec"]

# (shape, pm dtype name) of a value; shape None for non-tensor types (tokens, tuples), a
# dimension None where it is dynamic.
TypeSpec = tuple[tuple[int | None, ...] | None, str | None]


# ----------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class Loc:
    """An op's MLIR location, flattened: ``NameLoc`` names (outermost first) and
    ``FileLineColLoc`` frames ``(file, line)`` (innermost call first, as ``callsite``
    nests them)."""

    names: tuple[str, ...] = ()
    frames: tuple[tuple[str, int], ...] = ()


UNKNOWN = Loc()


@dataclass(frozen=True, slots=True)
class Dense:
    """The value of a dense constant: ``splat`` with a Python scalar ``value``, a small numpy
    ``array``, or neither (too large to read, or of an element type numpy lacks)."""

    shape: tuple[int, ...]
    dtype: str | None
    splat: bool
    value: Any = None  # Python scalar when splat
    array: np.ndarray | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Op:
    """One operation: its name (``stablehlo.add``), operand and result value ids, result
    and operand types, attributes as Python values, the entry blocks of its regions."""

    name: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    types: tuple[TypeSpec, ...]
    operand_types: tuple[TypeSpec, ...]
    attrs: dict[str, Any]
    regions: tuple[Block | None, ...]
    loc: Loc


@dataclass(frozen=True, slots=True, eq=False)
class Block:
    """A region's (single) block: arguments, operations, and the terminator's operands."""

    args: tuple[int, ...]
    arg_types: tuple[TypeSpec, ...]
    arg_names: tuple[str | None, ...]
    ops: tuple[Op, ...]
    returns: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)
class Func:
    name: str
    public: bool
    body: Block
    result_names: tuple[str | None, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class Module:
    name: str | None
    funcs: dict[str, Func] = field(default_factory=dict)
