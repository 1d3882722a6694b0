"""Round trips: structure, source locations, bytes, sharing, depth, and matching behaviour."""

from __future__ import annotations

import json

import pytest

import pypm_jax as pm
from pypm_jax import format as _format
from pypm_jax.core.calculus import (
    EAttr,
    ECmp,
    EConst,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PConst,
    PGuard,
    PVar,
    RuleDef,
)
from pypm_jax.core.terms import Operator, leaf
from pypm_jax.engine.select import match_all, match_first
from pypm_jax.format import deserialize, serialize
from pypm_jax.lang import registry as _registry
from pypm_testing.format_samples import (
    EVERYTHING,
    FRESH,
    ITEMS,
    MMXYT,
    RULE,
    Concat,
    Exp,
    MatMul,
    Relu,
    Split,
    Trans,
    assert_same,
    loc,
)


def test_every_construct_round_trips_with_locations():
    blob = serialize(ITEMS)
    out = deserialize(blob, ops=[FRESH])
    assert out == ITEMS
    assert [x.name for x in out] == [x.name for x in ITEMS]
    for original, loaded in zip(ITEMS, out, strict=True):
        assert_same(original, loaded)


def test_samples_cover_every_entry_kind():
    """If the schema grows a kind, the samples must grow with it."""
    doc = json.loads(serialize(ITEMS))
    for table, kinds in (
        ("patterns", _format._PATTERN_KINDS),
        ("exprs", _format._EXPR_KINDS),
        ("rhs", _format._RHS_KINDS),
    ):
        assert {e["k"] for e in doc[table]} == set(kinds), table
    assert {e["k"] for e in doc["values"]} == {
        "none", "bool", "int", "float", "str", "dtype", "opclass", "op", "tuple"
    }  # fmt: skip
    assert {e["k"] for e in doc["items"]} == {"op", "pattern", "rule"}
    floats = [e["v"] for e in doc["values"] if e["k"] == "float"]
    assert {"inf", "-inf", "nan"} <= set(floats) and -0.0 in floats
    ops = {e["name"]: e for e in doc["ops"]}
    assert ops["Concat"]["n_in"] is None and ops["Noise"]["pure"] is False
    assert ops["Conv"]["attrs"] == ["stride", "padding"] and ops["Conv"]["op_class"] == "conv"


def test_literal_types_stay_distinct():
    """1, 1.0, True and -0.0/0.0 are equal in Python but different literals."""
    pats = [
        PatternDef(f"P{i}", (Param("x"),), PApp(Exp, (PConst(v),)))
        for i, v in enumerate([1, 1.0, True, 0.0, -0.0, "1", (1,), (1.0,)])
    ]
    out = deserialize(serialize(pats))
    for p, q in zip(pats, out, strict=True):
        assert_same(p, q)
    doc = json.loads(serialize(pats))
    assert len(doc["values"]) == 8  # the tuples reuse the entries of 1 and 1.0


def test_reserialization_is_byte_identical_and_canonical():
    blob = serialize(ITEMS)
    assert serialize(ITEMS) == blob
    assert serialize(deserialize(blob, ops=[FRESH])) == blob
    assert serialize(deserialize(blob)) == blob  # a fresh FRESH has the same signature
    text = blob.decode("ascii")  # non-ASCII is escaped
    assert json.dumps(json.loads(text), sort_keys=True, separators=(",", ":")) == text
    assert text.startswith('{"defs":') and '"format":"pypm"' in text
    assert '"version":1' in text and '"minor":1' in text


def _rebuild(x):
    """A structural copy with no sharing at all (fresh objects everywhere)."""
    import dataclasses

    if isinstance(x, Operator):
        return x
    if isinstance(x, tuple):
        return tuple(_rebuild(v) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return type(x)(**{f.name: _rebuild(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, int | float | str) and not isinstance(x, bool):
        return type(x)(x) if not isinstance(x, str) else "".join(list(x))
    return x


def test_bytes_depend_on_structure_not_on_sharing():
    shared = PApp(Relu, (PVar("x"),))
    a = PatternDef("S", (Param("x"),), PApp(MatMul, (shared, shared)))
    b = PatternDef(
        "S", (Param("x"),), PApp(MatMul, (PApp(Relu, (PVar("x"),)), PApp(Relu, (PVar("x"),))))
    )
    assert serialize([a]) == serialize([b])
    assert serialize(ITEMS) == serialize(_rebuild(ITEMS))


def test_shared_subpatterns_are_stored_once():
    sub = PVar("x")
    for _ in range(50):
        sub = PApp(Relu, (sub,))
    body = PApp(MatMul, (sub, sub))
    for _ in range(20):
        body = PAlt(body, body)  # 2**20 alternates as a tree, 21 nodes as a DAG
    pdef = PatternDef("Wide", (Param("x"),), body)
    with pytest.raises(pm.FormatError, match="expand"):
        serialize([pdef])  # 2**20 * 100 nodes expanded: refused as absurd
    small = PatternDef("W", (Param("x"),), PAlt(PApp(MatMul, (sub, sub)), PApp(MatMul, (sub, sub))))
    doc = json.loads(serialize([small]))
    assert len(doc["patterns"]) == 1 + 50 + 1 + 1  # x, the chain, MatMul, the alternative
    out = deserialize(serialize([small]))[0]
    assert out == small
    assert out.body.left is out.body.right  # loaded as a DAG, too


def test_rule_pattern_is_the_loaded_definition():
    out = deserialize(serialize([EVERYTHING, RULE, EVERYTHING]))
    assert out[1].pattern is out[0] and out[2] is out[0]
    assert isinstance(out[1], RuleDef) and out[1].single_use is True


@pytest.mark.slow
def test_deep_chain_round_trips_without_recursion():
    depth = 100_000
    p = PVar("x")
    for i in range(depth):
        p = PApp(Relu, (p,)) if i % 2 else PGuard(p, ECmp("==", EAttr("x", "rank"), EConst(2)))
    pdef = PatternDef("Deep", (Param("x"),), p, loc(1))
    blob = serialize([pdef])
    out = deserialize(blob)
    assert serialize(out) == blob  # equality by bytes: `==` on the objects would recurse
    q = out[0].body
    for _ in range(depth // 2):
        assert isinstance(q, PApp) and q.op is Relu
        q = q.args[0]
        assert isinstance(q, PGuard)
        q = q.pat
    assert q == PVar("x")


@pytest.mark.slow
def test_wide_variadic_application():
    pdef = PatternDef(
        "Wide", (Param("x"),), PApp(Concat, tuple(PApp(Exp, (PConst(i),)) for i in range(20_000)))
    )
    out = deserialize(serialize([pdef]))
    assert out == [pdef]


def test_operator_items_round_trip():
    out = deserialize(serialize([MatMul, Split, FRESH, MatMul]))
    assert out[0] is MatMul and out[1] is Split and out[3] is MatMul
    assert out[2] is not FRESH and out[2].qualname == FRESH.qualname
    assert (out[2].n_in, out[2].n_out, out[2].attrs, out[2].op_class, out[2].pure) == (
        3,
        2,
        ("k",),
        pm.OpClass("odd"),
        False,
    )
    assert FRESH.qualname not in _registry.OPS


def test_empty_list():
    blob = serialize([])
    assert deserialize(blob) == []
    assert json.loads(blob)["items"] == []


# ------------------------------------------------------------------------- matching


@pm.op
def FmtAdd(x, y):
    return 1


@pm.op
def FmtMul(x, y):
    return 1


@pm.pattern
def FmtChain(x, f):
    return f(FmtChain(x, f))


@pm.pattern
def FmtChain(x, f):  # noqa: F811 (an alternate)
    return f(x)


@pm.pattern
def FmtBoth(x, y):
    assert x.rank == 2 and y.dtype == pm.f32
    z = pm.var()
    z <= FmtMul(y, y)
    return FmtAdd(x, z)


@pm.pattern
def FmtCalls(x):
    F = pm.Op(1, 1)
    assert F.op_class == pm.opclass("unary_pointwise") or x.rank == 0
    return FmtAdd(FmtChain(x, Relu), F(x))


@pm.rule(FmtBoth)
def fmt_rule(x, y):
    if x.dtype == pm.f32:
        return FmtMul(x, y)
    return FmtAdd(y, x)


A = leaf("fa", shape=(2, 2), dtype="f32")
B = leaf("fb", shape=(2, 2), dtype="f32")
C = leaf("fc", shape=(), dtype="i32")
TERMS = [
    A,
    MatMul(A, Trans(B)),
    MatMul(A, Trans(A)),
    MatMul(C, Trans(B)),
    Relu(Relu(Relu(A))),
    Split(Relu(Relu(A)))[1],
    Split(A)[1],
    FmtAdd(A, FmtMul(B, B)),
    FmtAdd(A, FmtMul(B, A)),
    FmtAdd(C, FmtMul(B, B)),
    FmtAdd(Relu(Relu(C)), Exp(C)),
    FmtAdd(Relu(A), Trans(A)),
    Concat(A, Relu(A), pm.const(1)),
    Exp(pm.const(1.5)),
    Exp(pm.const(-0.0)),
    MatMul(Concat(), Concat()),
]


def _outcome(m):
    if m is None:
        return None
    return (
        m.pattern.name,
        m.root,
        tuple(sorted((k, id(v)) for k, v in m.theta.items())),
        tuple(sorted((k, id(v)) for k, v in m.phi.items())),
    )


def test_matching_is_identical_after_round_trip(engine):
    pdefs = [EVERYTHING, MMXYT, *(p.definition for p in (FmtChain, FmtBoth, FmtCalls))]
    loaded = deserialize(pm.serialize(pdefs), ops=[FRESH])
    assert loaded == pdefs
    matched = 0
    for before, after in zip(pdefs, loaded, strict=True):
        for t in TERMS:
            first = _outcome(match_first(before, t, engine=engine))
            assert _outcome(match_first(after, t, engine=engine)) == first, (before.name, t)
            every = [_outcome(m) for m in match_all(before, t, engine=engine)]
            assert [_outcome(m) for m in match_all(after, t, engine=engine)] == every
            matched += first is not None
    assert matched >= 8  # the terms exercise real matches, not only failures


def test_dsl_definitions_round_trip_with_locations():
    items = [FmtChain, FmtBoth, FmtCalls, fmt_rule, FmtAdd]
    blob = pm.serialize(items)
    out = pm.deserialize(blob)
    expected = [FmtChain.definition, FmtBoth.definition, FmtCalls.definition]
    expected += [fmt_rule.definition, FmtAdd]
    for e, o in zip(expected, out, strict=True):
        assert_same(e, o)
    assert out[0].loc is not None and out[0].loc.file.endswith("test_roundtrip.py")
    assert out[3].pattern is out[1]
    assert pm.serialize(out) == blob
    # the public facade matches with loaded definitions, too
    t = FmtAdd(A, FmtMul(B, B))
    assert pm.match(out[1], t, engine="reference")["x"] is A


def test_the_format_module_imports_nothing_from_jax():
    import subprocess
    import sys

    code = (
        "import sys, pypm_jax.format\n"
        "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith(('jax.', 'jaxlib')))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
