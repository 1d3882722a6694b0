"""Every defect of a blob is a FormatError with a useful message (hand-written blobs)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.core.calculus import (
    EAttr,
    ECmp,
    EConst,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    RApp,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax.core.terms import Shape
from pypm_jax.format import MAX_BLOB_BYTES, MAX_ENTRIES, deserialize, serialize
from pypm_testing.format_samples import FRESH, ITEMS, NS, Concat, Conv, MatMul, Relu, Split

OPS = [
    {"name": "MatMul", "namespace": NS, "n_in": 2, "n_out": 1, "attrs": [], "op_class": "matmul", "pure": True},
    {"name": "Relu", "namespace": NS, "n_in": 1, "n_out": 1, "attrs": [], "op_class": "unary_pointwise", "pure": True},
    {"name": "Split", "namespace": NS, "n_in": 1, "n_out": 2, "attrs": [], "op_class": None, "pure": True},
]  # fmt: skip


def doc(**tables):
    """A blob document: header, the three operators above, empty tables, one definition
    ``P(x) = <patterns[-1]>`` if patterns are given, items = that definition."""
    d = {
        "format": "pypm",
        "version": 1,
        "minor": 0,
        "ops": OPS,
        "guard_fns": [],
        "locs": [],
        "values": [],
        "exprs": [],
        "patterns": [],
        "rhs": [],
        "defs": [],
        "rules": [],
        "items": [],
    }
    d.update(tables)
    if d["patterns"] and "defs" not in tables:
        d["defs"] = [
            {"name": "P", "params": [{"name": "x", "kind": "term"}], "body": len(d["patterns"]) - 1,
             "loc": None, "alt_locs": []}
        ]  # fmt: skip
    if d["defs"] and "items" not in tables:
        d["items"] = [{"k": "pattern", "i": 0}]
    return d


def load(d):
    return deserialize(json.dumps(d).encode())


def refused(d, match):
    with pytest.raises(pm.FormatError, match=match):
        load(d)


X = {"k": "var", "name": "x"}


def test_the_base_document_loads():
    (p,) = load(doc(patterns=[X, {"k": "app", "op": 1, "args": [0], "index": 0}]))
    assert p == PatternDef("P", (Param("x"),), PApp(Relu, (PVar("x"),)))


# ----------------------------------------------------------------------------- bytes, JSON


@pytest.mark.parametrize("blob", [None, 42, "text", ["list"], {"format": "pypm"}, 1.5])
def test_not_bytes(blob):
    with pytest.raises(pm.FormatError, match="bytes"):
        deserialize(blob)


def test_bytes_like_inputs_are_accepted():
    blob = serialize(ITEMS[:3])
    ops = [FRESH]
    assert deserialize(bytearray(blob), ops=ops) == deserialize(memoryview(blob), ops=ops)
    assert deserialize(memoryview(blob), ops=ops) == deserialize(blob, ops=ops)


@pytest.mark.parametrize(
    "blob, match",
    [
        (b"", "empty"),
        (b"\xff\xfe", "UTF-8"),
        (b'{"format": "pypm\xc3"}', "UTF-8"),
        (b"\xef\xbb\xbf{}", "JSON"),  # a byte-order mark is not JSON
        (b"{", "JSON"),
        (b"{}", "format"),
        (b"[]", "top level is an array"),
        (b"null", "top level is null"),
        (b'{"a": NaN}', "NaN is not JSON"),
        (b'{"a": -Infinity}', "Infinity is not JSON"),
        (b'{"format": "pypm", "format": "pypm"}', "duplicate key 'format'"),
        (b'{"format": "pypm", "version": 1' + b"0" * 5000 + b"}", "JSON"),  # int too long
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"format": "pypm", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    ],
)
def test_not_a_blob(blob, match):
    with pytest.raises(pm.FormatError, match=match):
        deserialize(blob)


def test_size_limits():
    with pytest.raises(pm.FormatError, match="exceeds the limit"):
        deserialize(b" " * (MAX_BLOB_BYTES + 1))
    too_many = "[" + ",".join(["0"] * (MAX_ENTRIES + 1)) + "]"
    text = json.dumps(doc()).replace('"guard_fns": []', f'"guard_fns": {too_many}')
    with pytest.raises(pm.FormatError, match="exceed the limit"):
        deserialize(text.encode())
    args = json.dumps({"k": "app", "op": 0, "args": [0] * (MAX_ENTRIES + 1), "index": 0})
    text = json.dumps(doc(patterns=[X, "ARGS"])).replace('"ARGS"', args)
    with pytest.raises(pm.FormatError, match="exceed the limit"):
        deserialize(text.encode())


# ------------------------------------------------------------------------- table entries


@pytest.mark.parametrize(
    "entry, match",
    [
        ({"k": "app", "op": 1, "args": [1], "index": 0}, "not an earlier entry"),  # itself
        ({"k": "app", "op": 1, "args": [2], "index": 0}, "not an earlier entry"),  # forward
        ({"k": "app", "op": 1, "args": [-1], "index": 0}, "not an earlier entry"),
        ({"k": "app", "op": 1, "args": [10**30], "index": 0}, "not an earlier entry"),
        ({"k": "app", "op": 1, "args": [True], "index": 0}, "got a boolean"),
        ({"k": "app", "op": 1, "args": [0.0], "index": 0}, "got a number"),
        ({"k": "app", "op": 1, "args": ["0"], "index": 0}, "got a string"),
        ({"k": "app", "op": 1, "args": 0, "index": 0}, "expected an array"),
        ({"k": "app", "op": 3, "args": [0], "index": 0}, "out of range"),
        ({"k": "app", "op": 1, "args": [0], "index": -1}, "index: expected an integer >= 0"),
        ({"k": "app", "op": 1, "args": [0], "index": False}, "index: expected an integer"),
        ({"k": "app", "op": 1, "args": [0]}, "missing 'index'"),
        ({"k": "app", "op": 1, "args": [0], "index": 0, "x": 1}, "unexpected 'x'"),
        ({"k": "apply", "op": 1, "args": [0], "index": 0}, "unknown pattern kind 'apply'"),
        ({"op": 1, "args": [0], "index": 0}, "unknown pattern kind None"),
        ([1, [0], 0], "expected an object, got an array"),
        ({"k": "app", "op": 1, "args": [0, 0], "index": 0}, "Relu takes 1 inputs, got 2"),
        ({"k": "app", "op": 1, "args": [0], "index": 1}, "Relu has 1 output"),
        ({"k": "app", "op": 2, "args": [0], "index": 2}, "Split has 2 output"),
        ({"k": "fun_var", "var": "F", "args": [0], "index": 1, "n_out": 1}, "output 1"),
        ({"k": "fun_var", "var": "F", "args": [0], "index": 0, "n_out": 0}, "n_out"),
        ({"k": "exists", "var": "y", "body": 0, "kind": "type"}, "kind: expected one of"),
        ({"k": "var", "name": ""}, "non-empty string"),
        ({"k": "var", "name": 7}, "non-empty string"),
        ({"k": "mu", "name": "M", "params": [{"name": "a", "kind": "term"}], "args": [], "body": 0},
         "1 parameter"),
        ({"k": "mu", "name": "M", "params": [{"name": "a", "kind": "term"}] * 2,
          "args": ["x", "x"], "body": 0}, "distinct"),
        ({"k": "mu", "name": "M", "params": [{"name": "a", "kind": "fn"}], "args": ["x"],
          "body": 0}, "'term' or 'op'"),
        ({"k": "guard", "pat": 0, "guard": 0, "loc": None}, "out of range"),
        ({"k": "guard", "pat": 0, "guard": None, "loc": None}, "expected an index into exprs"),
    ],
)  # fmt: skip
def test_bad_pattern_entries(entry, match):
    refused(doc(patterns=[X, entry]), match)


@pytest.mark.parametrize(
    "value, match",
    [
        ({"k": "int", "v": 1.0}, "int literal cannot hold a number"),
        ({"k": "int", "v": True}, "int literal cannot hold a boolean"),
        ({"k": "bool", "v": 1}, "bool literal cannot hold an integer"),
        ({"k": "float", "v": 1}, "float literal cannot hold an integer"),
        ({"k": "float", "v": "Infinity"}, "float literal cannot hold a string"),
        ({"k": "str", "v": None}, "str literal"),
        ({"k": "dtype", "v": "float32"}, "unknown element type 'float32'"),
        ({"k": "opclass", "v": ""}, "opclass literal"),
        ({"k": "op", "v": 3}, "out of range"),
        ({"k": "tuple", "items": [0]}, "not an earlier entry"),
        ({"k": "none", "v": None}, "unexpected 'v'"),
        ({"k": "complex", "v": [1, 2]}, "unknown literal kind 'complex'"),
        ({"k": "int"}, "missing 'v'"),
    ],
)
def test_bad_literals(value, match):
    refused(doc(values=[value], patterns=[{"k": "const", "value": 0}]), match)


def test_literal_nesting_and_expansion_are_bounded():
    deep = [{"k": "none"}] + [{"k": "tuple", "items": [i]} for i in range(70)]
    refused(doc(values=deep), "nested deeper than 64")
    bomb = [{"k": "none"}] + [{"k": "tuple", "items": [i] * 4} for i in range(12)]
    refused(doc(values=bomb), "expands to more than")
    fine = [{"k": "none"}] + [{"k": "tuple", "items": [i]} for i in range(64)]
    load(doc(values=fine))


@pytest.mark.parametrize(
    "op, match",
    [
        ({"n_in": -1}, "n_in"),
        ({"n_in": 1.0}, "n_in"),
        ({"n_out": 0}, "n_out"),
        ({"n_out": None}, "n_out"),
        ({"attrs": ["a", 1]}, "attrs"),
        ({"attrs": "ab"}, "attrs"),
        ({"op_class": ""}, "op_class"),
        ({"pure": 1}, "pure"),
        ({"name": ""}, "name"),
        ({"namespace": None}, "namespace"),
    ],
)
def test_bad_operator_entries(op, match):
    entry = {**OPS[0], "namespace": "elsewhere", **op}
    refused(doc(ops=[entry]), match)


def test_duplicate_operator_names_are_refused():
    refused(doc(ops=[OPS[0], OPS[0]]), "declared twice")


def test_bad_locs_and_items():
    refused(doc(locs=[{"file": "f", "line": "1", "text": ""}]), "integer line")
    refused(doc(locs=[{"file": "f", "line": 1}]), "missing 'text'")
    refused(doc(patterns=[X], items=[{"k": "pattern", "i": 1}]), "out of range")
    refused(doc(patterns=[X], items=[{"k": "def", "i": 0}]), "unknown item kind 'def'")
    refused(doc(patterns=[X], items=[0]), "expected an object")
    refused(doc(patterns=[X], items={}), "items: expected an array")


def test_bad_expressions():
    def guarded(expr, *more):
        return doc(
            values=[{"k": "int", "v": 2}],
            exprs=[{"k": "attr", "var": "x", "attr": "rank"}, expr, *more],
            patterns=[X, {"k": "guard", "pat": 0, "guard": 1 + len(more), "loc": None}],
        )

    load(guarded({"k": "cmp", "op": "==", "left": 0, "right": 0}))
    refused(guarded({"k": "cmp", "op": "===", "left": 0, "right": 0}), "expected one of")
    refused(guarded({"k": "bin", "op": "@", "left": 0, "right": 0}), "expected one of")
    refused(guarded({"k": "unary", "op": "~", "operand": 0}), "expected one of")
    refused(guarded({"k": "and", "items": [0, 5]}), "not an earlier entry")
    refused(guarded({"k": "call", "fn": 0, "args": [0]}), "out of range")
    refused(guarded({"k": "const", "value": 1}), "out of range")
    refused(guarded({"k": "lambda", "body": "os.system('x')"}), "unknown expression kind")


def test_bad_rules():
    base = doc(
        patterns=[X],
        exprs=[{"k": "attr", "var": "x", "attr": "dtype"}],
        rhs=[
            {"k": "var", "name": "x"},
            {"k": "app", "op": 1, "args": [0], "attrs": [], "index": 0},
        ],
    )
    rule = {"name": "r", "pattern": 0, "single_use": False, "loc": None,
            "branches": [{"guard": 0, "result": 1, "loc": None}]}  # fmt: skip
    load({**base, "rules": [rule], "items": [{"k": "rule", "i": 0}]})
    for change, match in [
        ({"pattern": 1}, "out of range"),
        ({"single_use": 0}, "single_use: expected a boolean"),
        ({"branches": [{"guard": 0, "result": 1}]}, "missing 'loc'"),
        ({"branches": [{"guard": 0, "result": 2, "loc": None}]}, "out of range"),
        ({"name": None}, "name"),
    ]:
        refused({**base, "rules": [{**rule, **change}]}, match)
    bad_rhs = {**base, "rhs": [{"k": "var", "name": "y"}], "rules": [{**rule, "branches": [
        {"guard": 0, "result": 0, "loc": None}]}]}  # fmt: skip
    refused(bad_rhs, "uses 'y', which is not a term parameter")
    bad_guard = {**base, "exprs": [{"k": "attr", "var": "z", "attr": "dtype"}],
                 "rules": [rule]}  # fmt: skip
    refused(bad_guard, "reads 'z'")


def test_guard_locs_are_a_minor_1_key_one_list_per_rule_and_branch():
    loc = {"file": "rules.py", "line": 7, "text": "assert x.dtype"}
    rule = {"name": "r", "pattern": 0, "single_use": False, "loc": None,
            "branches": [{"guard": 0, "result": 0, "loc": None}]}  # fmt: skip
    base = doc(
        patterns=[X],
        locs=[loc],
        exprs=[{"k": "attr", "var": "x", "attr": "dtype"}],
        rhs=[{"k": "var", "name": "x"}],
        rules=[rule],
        items=[{"k": "rule", "i": 0}],
    )
    (old,) = load(base)  # a minor-0 blob has no guard_locs
    assert old.branches[0].guard_locs == ()
    (new,) = load({**base, "minor": 1, "guard_locs": [[[0]]]})
    assert new.branches[0].guard_locs == (pm.SourceLoc("rules.py", 7, "assert x.dtype"),)
    assert load({**base, "minor": 1, "guard_locs": [[[None]]]})[0].branches[0].guard_locs == (None,)
    refused({**base, "guard_locs": [[[0]]]}, "unknown top-level key")  # not at minor 0
    for bad, match in [
        ([], "0 entries for 1 rules"),
        ([[]], "0 lists for the 1 branches"),
        ([[[1]]], "out of range"),
        ([[0]], "expected an array"),
    ]:
        refused({**base, "minor": 1, "guard_locs": bad}, match)


def test_result_arity_and_attributes():
    conv = {"name": "Conv", "namespace": NS, "n_in": 2, "n_out": 1, "attrs": ["stride", "padding"],
            "op_class": "conv", "pure": True}  # fmt: skip

    def with_rhs(entry):
        return doc(
            ops=[*OPS, conv],
            patterns=[X],
            values=[{"k": "int", "v": 2}],
            exprs=[{"k": "const", "value": 0}],
            rhs=[{"k": "var", "name": "x"}, entry],
            rules=[{"name": "r", "pattern": 0, "single_use": False, "loc": None,
                    "branches": [{"guard": 0, "result": 1, "loc": None}]}],
        )  # fmt: skip

    ok = {
        "k": "app",
        "op": 3,
        "args": [0, 0],
        "attrs": [{"name": "stride", "value": 0}],
        "index": 0,
    }
    load(with_rhs(ok))
    refused(with_rhs({**ok, "args": [0]}), "Conv takes 2 inputs, got 1")
    refused(
        with_rhs({**ok, "attrs": [{"name": "dilation", "value": 0}]}), "no attribute 'dilation'"
    )
    refused(with_rhs({**ok, "attrs": [{"name": "stride", "value": 0}] * 2}), "given twice")
    refused(with_rhs({**ok, "index": 1}), "1 output")


# ------------------------------------------------------------------ scoping and recursion


X_PARAM = (Param("x"),)


def _def(body, params=X_PARAM):
    return PatternDef("P", tuple(params), body)


def _app(op, *args):
    return PApp(op, tuple(args))


MU_OK = PMu("P", (Param("x"),), ("x",), PAlt(_app(Relu, PCall("P", ("x",))), PVar("x")))

CLOSED = [
    _def(PExists("y", _app(MatMul, PVar("x"), PVar("y")))),
    _def(PExists("F", PFunVar("F", (PVar("x"),)), "op")),
    _def(MU_OK),
    _def(PMu("Q", (Param("a"), Param("G", "op")), ("x", Relu), PFunVar("G", (PVar("a"),)))),
    _def(PFunVar("F", (PVar("x"),)), (Param("x"), Param("F", "op"))),
    _def(PExists("y", PGuard(PVar("x"), ECmp("==", EAttr("y", "rank"), EConst(1))))),
    _def(PGuard(PVar("x"), ECmp("==", EAttr("F", "name"), EConst("Relu"))), (Param("x"), Param("F", "op"))),
    # a call inside an inner μ of another name still refers to the outer P
    _def(PMu("P", (Param("x"),), ("x",), PAlt(
        _app(Relu, PMu("Q", (Param("z"),), ("x",), _app(Relu, PCall("P", ("z",))))), PVar("x")))),
    # unused parameters are fine: closed means "no variable other than the parameters"
    _def(PConst(1.0), (Param("x"), Param("y"))),
    # a recursive reference in a match constraint on a variable an application binds
    _def(PMu("P", (Param("x"),), ("x",), PAlt(
        PExists("y", PConstr(_app(Relu, PVar("y")), "y", PCall("P", ("x",)))), PVar("x")))),
]  # fmt: skip


@pytest.mark.parametrize("pdef", CLOSED)
def test_closed_definitions_load(pdef):
    assert deserialize(serialize([pdef])) == [pdef]


NOT_CLOSED = [
    (_def(PVar("y")), "term variable 'y' is not bound"),
    (_def(_app(MatMul, PExists("y", PVar("y")), PVar("y"))), "'y' is not bound"),
    (_def(PFunVar("F", (PVar("x"),))), "operator variable 'F' is not bound"),
    (_def(PExists("F", PVar("F"), "op")), "term variable 'F' is not bound"),
    (_def(PExists("y", PFunVar("y", (PVar("x"),)))), "operator variable 'y'"),
    (_def(PVar("F"), (Param("x"), Param("F", "op"))), "term variable 'F'"),
    (_def(PGuard(PVar("x"), ECmp("==", EAttr("y", "rank"), EConst(1)))), "reads 'y'"),
    (_def(PGuard(PExists("y", PVar("x")), ECmp("==", EAttr("y", "rank"), EConst(1)))), "reads 'y'"),
    (_def(PConstr(PVar("x"), "y", PVar("x"))), "term variable 'y' is not bound"),
    (_def(PCall("P", ("x",))), "outside μ'P'"),
    (_def(PMu("P", (Param("x"),), ("x",), PCall("P", ("x",)))), "without consuming"),
    (_def(PMu("P", (Param("x"),), ("x",), PAlt(PCall("P", ("x",)), PVar("x")))), "without consuming"),
    (_def(PMu("P", (Param("x"),), ("x",), _app(Relu, PCall("P", ("x", "x"))))), "takes 1 argument"),
    # ... but not on a variable bound at the root, or under an application on one path only
    (_def(PMu("P", (Param("x"),), ("x",), PAlt(
        PExists("y", PConstr(PVar("y"), "y", PCall("P", ("x",)))), PVar("x")))), "without consuming"),
    (_def(PMu("P", (Param("x"),), ("x",), PAlt(PExists("y", PConstr(
        PAlt(_app(Relu, PVar("y")), PVar("y")), "y", PCall("P", ("x",)))), PVar("x")))),
     "without consuming"),
    (_def(PMu("P", (Param("x"),), ("x",), _app(Relu, PCall("Q", ("x",))))), "outside μ'Q'"),
    (_def(PMu("P", (Param("x"),), ("y",), PVar("x"))), "term variable 'y' is not bound"),
    (_def(PMu("P", (Param("x"),), (Relu,), PVar("x"))), "operator Relu passed for term parameter"),
    (_def(PMu("P", (Param("a"),), ("x",), _app(MatMul, PVar("a"), PVar("x")))), "'x' is not bound"),
    (_def(PMu("P", (Param("F", "op"),), ("x",), PVar("x"))), "operator variable 'x'"),
]  # fmt: skip


@pytest.mark.parametrize("pdef, match", NOT_CLOSED)
def test_open_or_non_terminating_definitions_are_refused(pdef, match):
    with pytest.raises(pm.FormatError, match=match):
        serialize([pdef])  # the writer checks what the reader would refuse
    blob = json.dumps({**json.loads(serialize([_def(PVar("x"))])), **_tables_of(pdef)}).encode()
    with pytest.raises(pm.FormatError, match=match):
        deserialize(blob)


def _tables_of(pdef):
    """The tables a writer would produce for ``pdef``, bypassing its self-check."""
    from pypm_jax.format import _Writer

    w = _Writer()
    i = w.index("defs", pdef)
    return {**w.tables, "items": [{"k": "pattern", "i": i}]}


def test_duplicate_definition_parameters():
    d = doc(patterns=[X])
    d["defs"][0]["params"] = [{"name": "x", "kind": "term"}, {"name": "x", "kind": "op"}]
    refused(d, "distinct")


def test_expansion_bombs_are_refused_without_expanding():
    # each document would expand to far more than 2**24 nodes (2**59 alternates, 2**60
    # conjuncts, 2000 uses of a 2**24-node tree): a loader that built the expansion before
    # counting it would never return
    patterns = [X, {"k": "app", "op": 0, "args": [0, 0], "index": 0}]
    for i in range(1, 60):
        patterns.append({"k": "alt", "left": i, "right": i})
    refused(doc(patterns=patterns), "expand to more than")
    exprs = [{"k": "attr", "var": "x", "attr": "rank"}]
    for i in range(60):
        exprs.append({"k": "and", "items": [i, i]})
    refused(doc(exprs=exprs, patterns=[X, {"k": "guard", "pat": 0, "guard": 60, "loc": None}]),
            "expand to more than")  # fmt: skip
    many_defs = doc(patterns=patterns[:25])
    many_defs["defs"] = many_defs["defs"] * 2000  # 2000 uses of a 2**24-node tree
    refused(many_defs, "expand to more than")


# ----------------------------------------------------------------- what cannot be written


@pytest.mark.parametrize(
    "value",
    [np.float32(1.0), np.int64(1), [1, 2], {1}, {"a": 1}, b"bytes", 1j, Shape((2, 3)),
     object(), type, (1, [2]), 10**5000],
    ids=lambda v: type(v).__name__,
)  # fmt: skip
def test_unsupported_literals_cannot_be_serialized(value):
    with pytest.raises(pm.FormatError, match="cannot serialize"):
        serialize([_def(PConst(value))])


def test_malformed_structures_cannot_be_serialized():
    bad = [
        _def(PApp(Relu, [PVar("x")])),  # a list, not a tuple
        _def(PApp(Relu, (PVar("x"), PVar("x")))),  # arity
        _def(PApp(Relu, ("x",))),  # a string where a pattern belongs
        _def(PApp(Relu, (PVar("x"),), -1)),
        _def(PApp(Relu, (PVar("x"),), True)),
        _def(PVar("x"), (Param("x", "typ"),)),
        _def(PVar("x"), ("x",)),
        _def(PExists("y", PVar("x"), "var")),
        _def(PGuard(PVar("x"), "x.rank == 2")),
        RuleDef("r", _def(PVar("x")), (RuleBranch(EConst(True), RVar("x"), "line 3"),)),
        RuleDef("r", _def(PVar("x")), [RuleBranch(EConst(True), RVar("x"))]),
        RuleDef("r", _def(PVar("x")), (RuleBranch(EConst(True), RApp(Conv, (RVar("x"),))),)),
        RuleDef("r", _def(PVar("x")), (), single_use=1),
        PatternDef("", (Param("x"),), PVar("x")),
    ]
    for item in bad:
        with pytest.raises(pm.FormatError, match="cannot serialize"):
            serialize([item])
    for items in (_def(PVar("x")), "P", 42, [42], [PVar("x")], [Concat, None]):
        with pytest.raises(pm.FormatError):
            serialize(items)


def test_literal_float_specials_load_as_floats():
    vals = [{"k": "float", "v": s} for s in ("inf", "-inf", "nan")] + [{"k": "float", "v": 1e308}]
    d = doc(values=vals, patterns=[{"k": "const", "value": i} for i in range(4)])
    d["defs"] = [
        {"name": f"P{i}", "params": [], "body": i, "loc": None, "alt_locs": []} for i in range(4)
    ]
    d["items"] = [{"k": "pattern", "i": i} for i in range(4)]
    got = [p.body.value for p in load(d)]
    assert got[0] == math.inf and got[1] == -math.inf and math.isnan(got[2]) and got[3] == 1e308
    assert got[2] is math.nan
    _ = Split  # imported for the operator table above


def test_the_schema_lists_each_entry_class_fields_in_order():
    """The reader builds entries positionally from the schema's fields."""
    import dataclasses

    from pypm_jax.format import _KINDED, _SINGLE

    classes = [c for kinds in _KINDED.values() for c in kinds.values()] + list(_SINGLE.values())
    for cls, fields in classes:
        assert [f.name for f in dataclasses.fields(cls)] == [name for name, _ in fields], cls


def test_a_pinned_read_gives_the_same_items_and_only_format_errors():
    """``format._deserialize_pinned`` (for bytes a checked read accepted) reads what
    ``deserialize`` reads; bytes it cannot read are still a FormatError, never a crash."""
    from pypm_jax.format import _deserialize_pinned

    blob = serialize(ITEMS)
    items, ops = _deserialize_pinned(blob)
    assert serialize(items) == serialize(deserialize(blob)) == blob  # (a fresh operator
    # is made anew by each read: the items compare through their bytes)
    assert ops[MatMul.qualname] is MatMul
    for bad in (blob[: len(blob) // 2], b"", b"[]", blob.replace(b'"n_in":2', b'"n_in":3', 1)):
        with pytest.raises(pm.FormatError):
            _deserialize_pinned(bad)
