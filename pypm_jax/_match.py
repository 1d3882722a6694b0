"""The result of a successful match, as every matcher returns it."""

from __future__ import annotations

__all__ = ["Match"]

from collections.abc import Iterator, Mapping
from typing import Any

from ._calculus import PatternDef


class Match(Mapping[str, Any]):
    """Bindings of a pattern's parameters: ``m["x"]`` is a term, ``m["f"]`` an operator.

    ``theta`` and ``phi`` hold the full substitutions (including the machine's fresh names
    for local variables); the mapping interface shows only the pattern's parameters.
    """

    __slots__ = ("pattern", "root", "theta", "phi", "_params")

    def __init__(
        self, pattern: PatternDef, root: Any, theta: Mapping[str, Any], phi: Mapping[str, Any]
    ):
        self.pattern = pattern
        self.root = root
        self.theta = dict(theta)
        self.phi = dict(phi)
        self._params = {
            p.name: (self.phi if p.kind == "op" else self.theta).get(p.name) for p in pattern.params
        }

    def __getitem__(self, name: str) -> Any:
        return self._params[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._params)

    def __len__(self) -> int:
        return len(self._params)

    def key(self) -> tuple[tuple[str, int], ...]:
        """Identity of the visible solution (for de-duplicating ``match_all``)."""
        return tuple((k, id(v)) for k, v in self._params.items())

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._params.items())
        return f"Match({self.pattern.name}: {inner})"
