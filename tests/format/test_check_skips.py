"""The reader's scope checks skip the shared parts whose needs the scope meets: they accept
and refuse exactly what the full walks do, with the same message (``format._Needs``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pypm_jax import format as F
from pypm_jax.core.calculus import Param, PatternDef, PCall, PExists, PMu, PVar
from pypm_jax.core.errors import FormatError
from pypm_testing import budget
from pypm_testing import format_gen as gen
from pypm_testing.format_samples import FRESH, MatMul, Relu

NAMES = (*gen.TERM_NAMES, *gen.OP_NAMES, "P", "Q", "M1_0", "M2_1", "M3_0")


def _outcome(blob: bytes) -> object:
    try:
        return ("loaded", F.deserialize(blob, ops=[FRESH]))
    except FormatError as exc:
        return ("refused", str(exc))


def _walked(monkeypatch: pytest.MonkeyPatch, blob: bytes) -> object:
    """The outcome with every part walked: nothing has needs the scope could meet."""
    with monkeypatch.context() as m:
        m.setattr(F._Needs, "of", lambda self, root: None)
        return _outcome(blob)


def _app(op, *args):
    from pypm_jax.core.calculus import PApp

    return PApp(op, args)


def _blob(pdef: PatternDef) -> bytes:
    """``pdef``'s blob, written without the writer's own check (which would refuse it)."""
    w = F._Writer()
    i = w.index("defs", pdef)
    doc = {"format": "pypm", "version": 1, "minor": 1, "guard_locs": []}
    return json.dumps({**doc, **w.tables, "items": [{"k": "pattern", "i": i}]}).encode()


SHARED = _app(Relu, PVar("y"))  # closed where y is bound, open elsewhere
REC = PMu("R", (Param("a"),), ("x",), _app(Relu, PCall("R", ("a",))))  # closed recursion
OUTER = PMu("P", (Param("x"),), ("x",), _app(Relu, PMu("Q", (Param("z"),), ("x",), _app(
    Relu, PCall("P", ("z",))))))  # an inner μ calling the outer one  # fmt: skip

CASES = [
    # a shared part used once where its variable is bound and once where it is not
    PatternDef("D", (Param("x"),), _app(MatMul, PExists("y", SHARED), SHARED)),
    PatternDef("D", (Param("x"),), _app(MatMul, SHARED, PExists("y", SHARED))),
    PatternDef("D", (Param("x"), Param("y")), _app(MatMul, SHARED, SHARED)),
    # a closed recursive μ shared, and one whose argument is unbound at one use
    PatternDef("D", (Param("x"),), _app(MatMul, REC, REC)),
    PatternDef("D", (Param("y"),), _app(MatMul, PExists("x", REC), REC)),
    # a μ inside another calling the outer one: walked through, not skipped
    PatternDef("D", (Param("x"),), _app(MatMul, OUTER, OUTER)),
    # a recursive reference reaching itself without consuming, shared
    PatternDef("D", (Param("x"),), _app(MatMul, *[PMu("S", (Param("a"),), ("x",), PCall("S", ("a",)))] * 2)),
]  # fmt: skip


@pytest.mark.parametrize("pdef", CASES)
def test_shared_parts_report_as_the_full_walk(monkeypatch, pdef):
    blob = _blob(pdef)
    assert _outcome(blob) == _walked(monkeypatch, blob)


def test_the_cases_cover_both_verdicts(monkeypatch):
    verdicts = {_outcome(_blob(p))[0] for p in CASES}
    assert verdicts == {"loaded", "refused"}


def _mutate(doc: dict, picks: list[tuple[int, str]]) -> None:
    """Rename variables and references in the pattern, expression and result tables."""
    spots = []
    for table in ("patterns", "exprs", "rhs"):
        for e in doc[table]:
            for key in ("name", "var"):
                if type(e.get(key)) is str:
                    spots.append((e, key))
            if e.get("k") in ("mu", "call"):
                spots += [(e["args"], i) for i, a in enumerate(e["args"]) if type(a) is str]
            if e.get("k") == "exists":
                spots.append((e, "kind"))
    for n, name in picks:
        if not spots:
            return
        where, key = spots[n % len(spots)]
        if key == "kind":
            where[key] = "op" if where[key] == "term" else "term"
        else:
            where[key] = name


@settings(max_examples=budget.examples(ci=500, dev=150, fast=20))
@given(gen.items, st.lists(st.tuples(st.integers(0, 10_000), st.sampled_from(NAMES)), max_size=3))
def test_mutated_blobs_load_or_fail_as_with_the_full_walk(items, picks):
    doc = json.loads(F.serialize(items))
    _mutate(doc, picks)
    blob = json.dumps(doc).encode()
    with pytest.MonkeyPatch.context() as mp:
        assert _outcome(blob) == _walked(mp, blob)


def test_the_standard_rules_load_as_with_the_full_walk(monkeypatch):
    from pypm_jax.rules import _prebuilt, standard_rules

    rules = standard_rules()
    blob = _prebuilt.read_data().split(b"\n", 2)[2]
    where = _prebuilt._file_prefix(_prebuilt._code_dir(rules))
    blob = blob.replace(b'"file":"' + _prebuilt._MARK.encode(), where)
    skipped, walked = _outcome(blob), _walked(monkeypatch, blob)
    assert skipped[0] == "loaded" and skipped == walked
