"""Hypothesis round trips over random closed items (ours) and random matcher patterns
(``pypm_testing.strategies``), with matching compared before and after."""

from __future__ import annotations

from hypothesis import Phase, find, given, settings
from hypothesis import strategies as st

from pypm_jax.engine.select import match_all, match_first
from pypm_jax.format import deserialize, serialize
from pypm_testing import budget
from pypm_testing import format_gen as gen
from pypm_testing.format_samples import FRESH, assert_same

# Generating random items costs more than round-tripping them; these two property tests run
# fewer examples than the profile's default (the fuzzer runs its full 10,000 in CI).
HEAVY = settings(max_examples=budget.examples(ci=500, dev=100, fast=10))


@HEAVY
@given(gen.items)
def test_random_items_round_trip(items):
    blob = serialize(items)
    out = deserialize(blob, ops=[FRESH])
    assert out == items
    for a, b in zip(items, out, strict=True):
        assert_same(a, b)
    assert serialize(out) == blob


def _kinds(items) -> set[tuple[str, str]]:
    import json

    doc = json.loads(serialize(items))
    return {(t, e["k"]) for t in ("patterns", "exprs", "rhs", "values") for e in doc[t]}


def test_generator_reaches_every_construct():
    """A check of the generator itself: each entry kind is reachable."""
    from pypm_jax.format import _EXPR_KINDS, _PATTERN_KINDS, _RHS_KINDS

    wanted = [("patterns", k) for k in _PATTERN_KINDS] + [("exprs", k) for k in _EXPR_KINDS]
    wanted += [("rhs", k) for k in _RHS_KINDS]
    wanted += [("values", k) for k in ("none", "bool", "int", "float", "str", "dtype", "opclass")]
    wanted += [("values", "op"), ("values", "tuple")]
    seen: set[tuple[str, str]] = set()

    def covered(items) -> bool:
        seen.update(_kinds(items))
        return seen >= set(wanted)

    find(
        gen.items,
        covered,
        settings=settings(max_examples=3000, phases=[Phase.generate], database=None),
    )


def _outcome(m):
    if m is None:
        return None
    return (
        tuple(sorted((k, id(v)) for k, v in m.theta.items())),
        tuple(sorted((k, id(v)) for k, v in m.phi.items())),
    )


def _matches(pdef, term, engine):
    try:
        first = _outcome(match_first(pdef, term, engine=engine))
        every = [_outcome(m) for m in match_all(pdef, term, engine=engine)]
        return first, every
    except Exception as exc:  # the same failure before and after counts as the same behaviour
        return type(exc).__name__


@HEAVY
@given(st.data())
def test_core_strategy_patterns_round_trip_and_match_identically(data):
    from pypm_testing.strategies import OPERATORS, pattern_and_term

    pdef, term = data.draw(pattern_and_term(well_moded=data.draw(st.booleans())))
    blob = serialize([pdef])
    (loaded,) = deserialize(blob, ops=OPERATORS)
    assert loaded == pdef
    assert_same(pdef, loaded)
    assert serialize([loaded]) == blob
    assert _matches(loaded, term, "reference") == _matches(pdef, term, "reference")
