"""Property tests: every engine against the declarative semantics, and engines against
each other.

The paper's soundness theorem, both halves, plus what ``match_all`` promises:

(a) success is sound: the bindings a matcher returns satisfy the declarative rules;
(b) failure is sound: when a matcher fails, no binding of the parameters to subterms
    (operators, for operator parameters) of the term satisfies them;
(c) ``match_all`` yields only valid, pairwise distinct solutions, first ``match_first``'s;
(d) the fast engine and the reference machine agree exactly (first solution and the whole
    ``match_all`` sequence, bindings compared by identity);
(e) ``match_all`` is complete: every declarative solution agrees with one it yields on the
    parameters that solution binds (a parameter left unbound may take any value).

(b) and (e) need well-moded patterns (see pypm_testing/strategies.py): SEMANTICS.md §3-4 make the
machine backtrack on a variable that is not bound yet, where the declarative rules may
choose it freely; test_core_matching.py shows both sides of that on small examples.
Terms are small and patterns have at most three parameters, so the exhaustive enumeration
in (b) and (e) stays at a few hundred candidate bindings.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from hypothesis import event, given, note

from pypm_jax.core.calculus import PatternDef, show
from pypm_jax.core.match import Match
from pypm_jax.engine.select import match_all, match_first
from pypm_jax.semantics.declarative import holds_def
from pypm_testing.strategies import pattern_and_term, subterms

MAX_PARAMS = 3


def visible(m: Match) -> dict[str, Any]:
    """The parameters a solution binds."""
    return {k: v for k, v in m.items() if v is not None}


def declarative_solutions(pdef: PatternDef, t: Any) -> Iterator[dict[str, Any]]:
    """Every binding of all parameters, over subterms / operators of t, that holds."""
    if len(pdef.params) > MAX_PARAMS:
        raise ValueError(f"{len(pdef.params)} parameters: enumeration would not stay small")
    terms = subterms(t)
    ops = list({id(u.op): u.op for u in terms}.values())
    names = [p.name for p in pdef.params]
    domains = [ops if p.kind == "op" else terms for p in pdef.params]
    for values in itertools.product(*domains):
        bindings = dict(zip(names, values, strict=True))
        if holds_def(pdef, t, bindings):
            yield bindings


def describe(pdef: PatternDef, t: Any) -> None:
    note(f"pattern: {show(pdef.body)}")
    note(f"params:  {[(p.name, p.kind) for p in pdef.params]}")
    note(f"term:    {t!r}")


# (a) and (c) read the same examples, as do (b) and (e): one test each, so that Hypothesis
# draws each example once for two properties (each still sees CI's 2,000 examples). The
# second property gets a copy of the definition: the fast engine compiles it afresh, as it
# did when the property was a test of its own.


def fresh(pdef: PatternDef) -> PatternDef:
    """An equal definition the fast engine has not compiled (its cache is by identity)."""
    return PatternDef(pdef.name, pdef.params, pdef.body, pdef.loc, pdef.alt_locs)


def check_a_success_is_declaratively_sound(engine: str, pdef: PatternDef, t: Any) -> None:
    m = match_first(pdef, t, engine=engine)
    event("match" if m is not None else "no match")
    if m is not None:
        note(f"solution: {m!r}")
        assert holds_def(pdef, t, visible(m))


def check_b_failure_means_no_declarative_solution(engine: str, pdef: PatternDef, t: Any) -> None:
    m = match_first(pdef, t, engine=engine)
    event("match" if m is not None else "no match")
    if m is None:
        witness = next(declarative_solutions(pdef, t), None)
        assert witness is None, f"the matcher failed, but {witness} satisfies the rules"


def check_c_match_all_is_valid_distinct_and_starts_with_match_first(
    engine: str, pdef: PatternDef, t: Any
) -> None:
    found = list(match_all(pdef, t, engine=engine))
    event(f"{min(len(found), 3)}{'+' if len(found) > 3 else ''} solutions")
    keys = [m.key() for m in found]
    assert len(set(keys)) == len(keys)
    for m in found:
        assert m.root is t
        assert holds_def(pdef, t, visible(m)), m
    first = match_first(pdef, t, engine=engine)
    assert (first is None) == (not found)
    if first is not None:
        assert first.key() == found[0].key()


def check_e_match_all_is_complete(engine: str, pdef: PatternDef, t: Any) -> None:
    found = [visible(m) for m in match_all(pdef, t, engine=engine)]
    for bindings in declarative_solutions(pdef, t):
        covered = any(all(bindings[k] is v for k, v in s.items()) for s in found)
        assert covered, f"{bindings} satisfies the rules; match_all found only {found}"


@given(pattern_and_term(well_moded=False))
def test_a_success_is_sound_and_c_match_all_is_valid(engine, pt):
    pdef, t = pt
    describe(pdef, t)
    check_a_success_is_declaratively_sound(engine, pdef, t)
    check_c_match_all_is_valid_distinct_and_starts_with_match_first(engine, fresh(pdef), t)


@given(pattern_and_term())
def test_b_failure_is_sound_and_e_match_all_is_complete_for_well_moded_patterns(engine, pt):
    pdef, t = pt
    describe(pdef, t)
    check_b_failure_means_no_declarative_solution(engine, pdef, t)
    check_e_match_all_is_complete(engine, fresh(pdef), t)


@given(pattern_and_term(well_moded=False))
def test_d_fast_engine_agrees_with_the_reference_machine(pt):
    pdef, t = pt
    describe(pdef, t)
    ref, fast = match_first(pdef, t, engine="reference"), match_first(pdef, t, engine="fast")
    assert (ref is None) == (fast is None)
    if ref is not None:
        assert ref.key() == fast.key(), (ref, fast)
    ref_all = [m.key() for m in match_all(pdef, t, engine="reference")]
    fast_all = [m.key() for m in match_all(pdef, t, engine="fast")]
    assert ref_all == fast_all
