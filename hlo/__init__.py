"""The StableHLO frontend: lift a module into the same pm Graph as a jaxpr, match rules there.

``hlo.lift(module)`` lifts a ``jax.stages.Lowered`` (``jax.jit(f).lower(*args)``), StableHLO
text, MLIR bytecode / a portable artifact, or a path to a file written by any XLA frontend
into a :class:`pypm_jax.Graph` whose nodes are the JAX primitives' operators
(``pypm_jax.jax.prims``) with JAX's attributes, so the same patterns and rules run on it.
``hlo.find(module)`` reports where the standard rules (or yours) fire, with source lines;
``hlo.emit(module)`` returns the module with those sites replaced by calls to the kernels,
and ``hlo.execute(text, args)`` runs a module on the default device.
See ``docs/HLO.md``.
"""

from __future__ import annotations

from ._editor import execute
from ._emit import Emitted, emit
from ._find import SiteReport, find, normalize_rules
from ._lift import HloError, lift, module_path, nested_graphs
from ._ops import TABLE, OpSpec, opaque_op

__all__ = [
    "lift",
    "find",
    "SiteReport",
    "emit",
    "Emitted",
    "execute",
    "HloError",
    "normalize_rules",
    "nested_graphs",
    "module_path",
    "TABLE",
    "OpSpec",
    "opaque_op",
]
