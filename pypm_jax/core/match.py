"""The result of a successful match, as every matcher returns it."""

from __future__ import annotations

__all__ = ["Match"]

from collections.abc import Iterator, Mapping
from typing import Any

from .calculus import PatternDef


class Match(Mapping[str, Any]):
    """Bindings of a pattern's parameters: ``m["x"]`` is a term, ``m["f"]`` an operator.

    ``theta`` and ``phi`` hold the full substitutions (including the machine's fresh names
    for local variables); the mapping interface shows only the pattern's parameters.
    """

    __slots__ = ("pattern", "root", "theta", "phi", "_view")

    def __init__(
        self,
        pattern: PatternDef,
        root: Any,
        theta: Mapping[str, Any],
        phi: Mapping[str, Any],
        *,
        owned: bool = False,
    ):
        # ``owned``: the matcher made these dicts for this match alone (every engine
        # yields fresh ones), so keep them rather than copy; a scan of a big graph makes
        # one Match per matched value and the copies were most of its allocation
        self.pattern = pattern
        self.root = root
        self.theta = theta if owned else dict(theta)
        self.phi = phi if owned else dict(phi)
        self._view: dict[str, Any] | None = None

    @property
    def _params(self) -> dict[str, Any]:
        """The parameters' bindings, made on first use (most matches of a scan are only
        counted or handed to the rewrite driver, which reads θ and φ)."""
        view = self._view
        if view is None:
            theta, phi = self.theta, self.phi
            view = self._view = {
                p.name: (phi if p.kind == "op" else theta).get(p.name) for p in self.pattern.params
            }
        return view

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
