"""``find``: lift a module and report where rules would fire, with source locations.

Rules run on the lifted graph exactly as :func:`pypm_jax.rewrite` runs them on a lifted
jaxpr (greedily, to a fixpoint, so overlapping sites are counted the way ``pm.optimize``
would rewrite them), then inside the lifted region bodies of ``while``/``case``/... ops.
The module itself is not changed: the report says which rule fired, at which node, from
which source line and Flax module.

Before the rules, a few *normalization* rules (:func:`normalize_rules`, written in the
pattern language) take back expansions JAX's lowering makes that the jaxpr does not have:
``logistic(h)`` is lowered as ``1 / (1 + exp(-h))`` (so ``jax.nn.silu`` and
``jax.nn.sigmoid`` match the rules written for their jaxpr).
"""

from __future__ import annotations

__all__ = ["SiteReport", "find", "normalize_rules"]

from collections.abc import Sequence
from typing import Any

import pypm_jax as pm
from pypm_jax import RewriteReport
from pypm_jax.jax import prims as P

from ._lift import lift


class SiteReport(RewriteReport):
    """The sites, in firing order (the entry function first, then region bodies).

    A list of records with ``rule``, ``pattern``, ``root``/``replaced`` (node ids of the
    lifted graph), ``op`` (the root's operator), ``source`` (the user's ``file:line``) and
    ``module_path``; ``counts()`` gives the number of sites per rule, ``str()`` a table.
    ``graph`` is the lifted graph after the rewrites; ``normalized`` the normalization
    rewrites that ran first.
    """

    graph: Any = None
    normalized: RewriteReport

    def __init__(self, records: Any = ()) -> None:
        super().__init__(records)
        self.normalized = RewriteReport()


# ------------------------------------------------------------------ normalization rules


@pm.pattern
def OnePlus(x):
    """1 + x, either operand order."""
    return P.add(1.0, x)


@pm.pattern
def OnePlus(x):  # noqa: F811 (alternates share a name)
    return P.add(x, 1.0)


@pm.pattern
def ExpandedLogistic(h):
    """``1 / (1 + exp(-h))``: how JAX lowers ``logistic`` to StableHLO."""
    return P.div(1.0, OnePlus(P.exp(P.neg(h))))


@pm.rule(ExpandedLogistic)
def raise_logistic(h):
    return P.logistic(h, accuracy=None)


NORMALIZE_RULES = [raise_logistic]


def normalize_rules() -> list[Any]:
    """Rules that rewrite lowering expansions back into the JAX primitive they came from."""
    return list(NORMALIZE_RULES)


# ------------------------------------------------------------------------------ find


def find(
    module: Any,
    rules: Sequence[Any] | None = None,
    *,
    function: str | None = None,
    normalize: bool = True,
    **options: Any,
) -> SiteReport:
    """Where ``rules`` (default: the standard library, ``pypm_jax.rules.default_rules()``)
    fire on a StableHLO module; ``module`` is anything :func:`hlo.lift` takes.

    ``normalize=False`` skips the normalization rules; ``options`` go to
    :func:`pypm_jax.rewrite` (``max_iterations``, ``engine``).
    """
    graph = lift(module, function=function)
    if rules is None:
        from pypm_jax.rules import default_rules

        rules = default_rules()
    rules = list(rules)
    report = SiteReport()
    report.graph = graph
    pending = [graph]
    while pending:
        g = pending.pop()
        if normalize:
            report.normalized.extend(pm.rewrite(g, NORMALIZE_RULES, **options).report)
        report.extend(pm.rewrite(g, rules, **options).report)
        pending.extend(reversed(list(_children(g))))
    return report


def _children(graph: Any) -> Any:
    """The region bodies directly inside ``graph`` (their own bodies come later)."""
    for node in graph.nodes():
        if node.op.namespace == "hlo.opaque":
            yield from node.attrs.get("regions", ())
