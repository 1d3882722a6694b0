"""Operator and guard-function resolution, headers and versions."""

from __future__ import annotations

import json

import pytest

import pypm_jax as pm
from pypm_jax.core.calculus import EAttr, ECall, ECmp, EConst, PApp, Param, PatternDef, PGuard, PVar
from pypm_jax.core.terms import Operator
from pypm_jax.format import VERSION, deserialize, serialize
from pypm_jax.lang import registry as _registry
from pypm_jax.lang.registry import GUARD_FNS
from pypm_testing.format_samples import FRESH, IS_SQUARE, ITEMS, NS, Conv, MatMul, Relu


def edit(blob: bytes, fn) -> bytes:
    doc = json.loads(blob)
    fn(doc)
    return json.dumps(doc).encode()


def uses(op: Operator) -> PatternDef:
    args = tuple(PVar(f"x{i}") for i in range(op.n_in or 0))
    return PatternDef(
        f"Uses{op.name}", tuple(Param(f"x{i}") for i in range(len(args))), PApp(op, args)
    )


# ------------------------------------------------------------------------------ operators


def test_registered_operators_resolve_to_the_same_objects():
    out = deserialize(serialize([uses(MatMul), Conv]))
    assert out[0].body.op is MatMul and out[1] is Conv


def test_ops_argument_comes_first_by_qualname_or_name_or_iterable():
    twin = Operator("MatMul", 2, namespace=NS, op_class="matmul")  # same signature, not registered
    blob = serialize([uses(MatMul)])
    assert deserialize(blob, ops={f"{NS}.MatMul": twin})[0].body.op is twin
    assert deserialize(blob, ops={"MatMul": twin})[0].body.op is twin
    assert deserialize(blob, ops=[twin])[0].body.op is twin
    assert deserialize(blob, ops=(op for op in [twin]))[0].body.op is twin
    assert deserialize(blob, ops={})[0].body.op is MatMul  # falls back to the registry
    assert deserialize(blob, ops={"Other": Relu})[0].body.op is MatMul


def test_ambiguous_plain_names_in_an_iterable_match_only_by_qualname():
    a = Operator("MatMul", 2, namespace="a", op_class="matmul")
    b = Operator("MatMul", 2, namespace="b", op_class="matmul")
    blob = serialize([uses(MatMul)])
    assert deserialize(blob, ops=[a, b])[0].body.op is MatMul  # neither is tests.format.MatMul
    assert deserialize(blob, ops=[a])[0].body.op is a  # unambiguous plain name


def test_unknown_operators_are_recreated_and_not_registered():
    before = dict(_registry.OPS)
    blob = serialize([uses(FRESH), FRESH])
    one, two = deserialize(blob), deserialize(blob)
    assert _registry.OPS == before
    fresh = one[1]
    assert fresh is not FRESH and fresh is not two[1]
    assert one[0].body.op is fresh  # one object per load
    assert (fresh.name, fresh.namespace, fresh.n_in, fresh.n_out) == ("Unregistered", NS, 3, 2)
    assert (fresh.attrs, fresh.op_class, fresh.pure) == (("k",), pm.OpClass("odd"), False)
    assert deserialize(blob, ops=[FRESH])[1] is FRESH


@pytest.mark.parametrize(
    "field, other",
    [
        ("n_in", Operator("MatMul", 3, namespace=NS, op_class="matmul")),
        ("n_in", Operator("MatMul", None, namespace=NS, op_class="matmul")),
        ("n_out", Operator("MatMul", 2, 2, namespace=NS, op_class="matmul")),
        ("attrs", Operator("MatMul", 2, attrs=("t",), namespace=NS, op_class="matmul")),
        ("op_class", Operator("MatMul", 2, namespace=NS)),
        ("op_class", Operator("MatMul", 2, namespace=NS, op_class="gemm")),
        ("pure", Operator("MatMul", 2, namespace=NS, op_class="matmul", pure=False)),
    ],
)
def test_signature_mismatch_with_ops_argument(field, other):
    blob = serialize([uses(MatMul)])
    with pytest.raises(pm.FormatError) as info:
        deserialize(blob, ops=[other])
    message = str(info.value)
    assert f"{NS}.MatMul" in message and f"{field}=" in message and "ops=" in message


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("n_in", 3, "n_in=3"),
        ("n_out", 2, "n_out=2"),
        ("attrs", ["t"], "attrs=('t',)"),
        ("op_class", None, "op_class=None"),
        ("pure", False, "pure=False"),
    ],
)
def test_signature_mismatch_with_the_registry(field, value, shown):
    def change(doc):
        (entry,) = [e for e in doc["ops"] if e["name"] == "MatMul"]
        entry[field] = value

    blob = edit(serialize([uses(MatMul)]), change)
    with pytest.raises(pm.FormatError, match="registered in this process") as info:
        deserialize(blob)
    assert shown in str(info.value) and f"{NS}.MatMul" in str(info.value)


def test_bad_ops_argument_is_a_format_error():
    blob = serialize([uses(MatMul)])
    for bad in ({"MatMul": "not an operator"}, ["MatMul"], 42, "MatMul"):
        with pytest.raises(pm.FormatError):
            deserialize(blob, ops=bad)


def test_two_operators_with_one_qualname_cannot_be_serialized():
    impostor = Operator("MatMul", 2, namespace=NS, op_class="matmul")
    with pytest.raises(pm.FormatError, match="two different operators"):
        serialize([MatMul, impostor])


# ------------------------------------------------------------------------ guard functions


def _guarded(fn_name: str) -> PatternDef:
    g = ECall(GUARD_FNS[fn_name], (EAttr("x", "shape"),))
    return PatternDef("G", (Param("x"),), PGuard(PApp(Relu, (PVar("x"),)), g))


def test_guard_functions_resolve_to_the_registered_objects():
    out = deserialize(serialize([_guarded("tests.format.is_square")]))
    fn = out[0].body.guard.fn
    assert fn is IS_SQUARE and fn.fn((3, 3)) is True
    assert deserialize(serialize([_guarded("len")]))[0].body.guard.fn is GUARD_FNS["len"]


def test_unknown_guard_function_is_refused_by_name():
    blob = edit(
        serialize([_guarded("len")]),
        lambda doc: doc["guard_fns"].__setitem__(0, "nope.fn"),
    )
    with pytest.raises(pm.FormatError) as info:
        deserialize(blob)
    assert "guard function 'nope.fn' is not registered in this process" in str(info.value)


def test_unregistered_guard_function_cannot_be_serialized():
    from pypm_jax.core.calculus import GuardFn

    pdef = PatternDef(
        "G",
        (Param("x"),),
        PGuard(
            PVar("x"), ECmp("==", ECall(GuardFn("ad.hoc", len), (EAttr("x", "shape"),)), EConst(2))
        ),
    )
    with pytest.raises(pm.FormatError, match="'ad.hoc' is not registered"):
        serialize([pdef])


# ------------------------------------------------------------------------ header, version


def test_other_major_version_is_refused_naming_both_versions():
    for other in (0, 2, 99):
        blob = edit(serialize(ITEMS), lambda doc, v=other: doc.__setitem__("version", v))
        with pytest.raises(pm.FormatError) as info:
            deserialize(blob)
        message = str(info.value)
        assert f"version {other}" in message and f"reads version {VERSION}" in message


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda d: d.pop("format"), "format"),
        (lambda d: d.__setitem__("format", "pypn"), "format"),
        (lambda d: d.pop("version"), "version"),
        (lambda d: d.__setitem__("version", "1"), "version"),
        (lambda d: d.__setitem__("version", 1.0), "version"),
        (lambda d: d.__setitem__("version", True), "version"),
        (lambda d: d.pop("minor"), "minor"),
        (lambda d: d.__setitem__("minor", -1), "minor"),
        (lambda d: d.pop("patterns"), "'patterns' is missing"),
        (lambda d: d.pop("items"), "'items' is missing"),
        (lambda d: d.__setitem__("patterns", {}), "patterns: expected an array"),
        (lambda d: d.__setitem__("extra", 1), "unknown top-level key"),
    ],
)
def test_malformed_headers(change, match):
    blob = edit(serialize(ITEMS), change)
    with pytest.raises(pm.FormatError, match=match):
        deserialize(blob)


def test_newer_minor_may_add_top_level_keys():
    def newer(doc):
        doc["minor"] = 7
        doc["future_table"] = [{"anything": [1, 2, 3]}]

    out = deserialize(edit(serialize(ITEMS), newer), ops=[FRESH])
    assert out == ITEMS
