"""The fuzzer: whatever bytes arrive, only FormatError escapes deserialize, nothing is
imported or executed, and whatever is accepted is a valid, re-serializable set of items.

Inputs: (a) random bytes, (b) random JSON values, with and without a valid header and
schema-shaped tables, (c) mutations of valid blobs: byte flips, truncations, splices, and
JSON-level edits (deleted keys, changed types, swapped/huge/negative/forward/self indices,
changed kinds, 100k-deep nesting). At least 10,000 cases in CI.
"""

from __future__ import annotations

import builtins
import importlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

import pypm_jax as pm
from pypm_jax.core.calculus import PatternDef, RuleDef
from pypm_jax.core.terms import Operator
from pypm_jax.format import _EXPR_KINDS, _PATTERN_KINDS, _RHS_KINDS, deserialize, serialize
from pypm_jax.lang import registry
from pypm_testing import budget
from pypm_testing.format_samples import (
    EVERYTHING,
    FRESH,
    ITEMS,
    MMXYT,
    RULE,
    RULE2,
    Concat,
    MatMul,
    Split,
)

FUZZ_EXAMPLES = budget.examples(ci=10_000, dev=1_000, fast=200)

CORPUS = [
    serialize([MMXYT]),
    serialize([RULE2, Split]),
    serialize([MatMul, MMXYT, RULE2, Concat]),
    serialize([RULE]),
    serialize(ITEMS),
]
SMALL = CORPUS[:3]


def _note(label: str) -> None:
    """Count outcomes in ``--hypothesis-show-statistics`` (when run under Hypothesis)."""
    if currently_in_test_context():
        event(label)


def check(blob: Any) -> None:
    """The property: FormatError or a valid result; never anything else."""
    try:
        out = deserialize(blob)
    except pm.FormatError as exc:
        _note(f"refused at {str(exc).split(':')[0].split('[')[0][:24]}")
        return
    _note("accepted")
    assert isinstance(out, list)
    assert all(isinstance(x, Operator | PatternDef | RuleDef) for x in out)
    again = serialize(out)  # what was accepted is valid: it serializes (and self-checks)
    assert serialize(deserialize(again)) == again


# ---------------------------------------------------------------------- random JSON values

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=8),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["x", "y", "F", "k", "pypm", "", "nan", "inf", "f32", "len", "os.system"]),
    st.text(max_size=5),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=6,
)

KINDS = {"exprs": list(_EXPR_KINDS), "patterns": list(_PATTERN_KINDS), "rhs": list(_RHS_KINDS)}
TABLES = ("ops", "guard_fns", "locs", "values", "exprs", "patterns", "rhs", "defs", "rules")


def _entry_pools() -> dict[str, list[Any]]:
    """Every distinct entry of the corpus, per table, plus a few odd ones (shared objects:
    only ``mutate_json`` edits documents, and it edits a copy)."""
    pools: dict[str, set[str]] = {t: set() for t in TABLES}
    for blob in CORPUS:
        doc = json.loads(blob)
        for t in TABLES:
            pools[t].update(json.dumps(e) for e in doc[t])
    pools["guard_fns"].update(json.dumps(n) for n in ("os.system", "", "max"))
    pools["values"].update(
        json.dumps(v) for v in ({"k": "tuple", "items": [0, 0]}, {"k": "op", "v": 0})
    )
    pools["patterns"].add(json.dumps({"k": "call", "name": "MMxyT", "args": ["x"]}))
    pools["patterns"].add(
        json.dumps({"k": "mu", "name": "MMxyT", "params": [], "args": [], "body": 0})
    )
    return {t: [json.loads(e) for e in sorted(p)] for t, p in pools.items()}


POOLS = _entry_pools()


_TABLE_LISTS = {t: st.lists(st.sampled_from(POOLS[t]), max_size=5) for t in TABLES}
_ITEM_LIST = st.lists(
    st.fixed_dictionaries(
        {"k": st.sampled_from(["op", "pattern", "rule"]), "i": st.integers(0, 4)}
    ),
    max_size=3,
)
_MINOR = st.sampled_from([0, 0, 1])


@st.composite
def schema_shaped_docs(draw) -> dict[str, Any]:
    """A valid header and tables of real entries in random order and number: indices now
    point at random places, which exercises range, kind, arity and scope checks."""
    doc: dict[str, Any] = {"format": "pypm", "version": 1, "minor": draw(_MINOR)}
    for t in TABLES:
        doc[t] = draw(_TABLE_LISTS[t])
    doc["items"] = draw(_ITEM_LIST)
    return doc


# ------------------------------------------------------------------------- mutations
# Strategies are built once here: building them inside each draw costs more than the test.

DEEP = "[" * 100_000 + "]" * 100_000
_EDITS = st.integers(1, 3)
_HOW = st.sampled_from(
    ["delete", "replace", "nudge", "retype", "swap", "self", "kind", "deep", "dup"]
)
_DELTA = st.sampled_from([-1, 1, 2, -(10**9), 10**9, 2**63, 10**30, None])
_RETYPE = st.integers(0, 6)
_SMALL = st.integers(0, 2)
_KIND = st.sampled_from(sorted({k for ks in KINDS.values() for k in ks} | {"op", "rule"}))
_BYTES_HOW = st.sampled_from(["flip", "truncate", "delete", "insert", "duplicate"])
_FLIPS = st.integers(1, 4)
_XOR = st.integers(1, 255)
_SPAN = st.integers(1, 16)
_INSERTS = st.binary(min_size=1, max_size=8) | st.sampled_from(
    [b"[", b"]", b"{", b"}", b",", b'"', b"0", b"-", b"\\"]
)
_SOURCE = st.sampled_from(
    ["bytes"] * 2
    + ["json", "header_json", "schema", "schema_mutated", "non_bytes"]
    + ["byte_mutation"] * 3
    + ["json_mutation"] * 3
)
_RANDOM_BYTES = st.binary(max_size=512)
_HEADER_EXTRA = st.dictionaries(
    st.sampled_from([*TABLES, "items", "extra"]), json_values, max_size=4
)
_NON_BYTES = st.sampled_from(
    [None, "text", 0, [b"{}"], bytearray(CORPUS[0]), memoryview(CORPUS[1])]
)
_BLOB = st.sampled_from(SMALL) | st.sampled_from(CORPUS)


def _index(data, n: int) -> int:
    return data.draw(st.integers(0, n - 1))


def _paths(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) in a JSON document, iteratively."""
    out: list[tuple[Any, Any]] = []
    todo = [doc]
    while todo:
        node = todo.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node))
        for key in keys:
            out.append((node, key))
            if isinstance(node[key], dict | list):
                todo.append(node[key])
    return out


_DESCEND = st.integers(0, 4)


def _random_place(data, doc: Any) -> tuple[Any, Any] | None:
    """A random (container, key), found by a random walk down from the root."""
    node = doc
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        if not keys:
            return None
        key = keys[_index(data, len(keys))]
        child = node[key]
        if not isinstance(child, dict | list) or not child or data.draw(_DESCEND) == 0:
            return node, key
        node = child


def mutate_json(data, doc: Any) -> str:
    """Apply one to three random edits to a copy; return the JSON text (DEEP spliced in)."""
    doc = json.loads(json.dumps(doc))
    deep = False
    for _ in range(data.draw(_EDITS)):
        place = _random_place(data, doc)
        if place is None:
            break
        node, key = place
        value = node[key]
        how = data.draw(_HOW)
        if how == "delete":
            del node[key]
        elif how == "replace":
            node[key] = data.draw(json_values)
        elif how == "nudge" and type(value) is int:
            delta = data.draw(_DELTA)
            node[key] = -1 if delta is None else value + delta
        elif how == "retype":
            node[key] = [str(value), [value], {"v": value}, None, True, 0.5, -1][data.draw(_RETYPE)]
        elif how == "swap" and isinstance(value, list) and len(value) >= 2:
            i, j = _index(data, len(value)), _index(data, len(value))
            value[i], value[j] = value[j], value[i]
        elif how == "self" and isinstance(node, list) and isinstance(value, dict):
            # make an entry refer to itself or to a later entry: a would-be cycle
            for field in value:
                if type(value[field]) is int:
                    value[field] = key + data.draw(_SMALL)
        elif how == "kind" and isinstance(value, dict) and "k" in value:
            value["k"] = data.draw(_KIND)
        elif how == "deep":
            deep = True
            node[key] = "__DEEP__"
        elif how == "dup" and isinstance(value, list) and value:
            value.extend(value[: 1 + _index(data, len(value))])
    text = json.dumps(doc, separators=(",", ":"))
    return text.replace('"__DEEP__"', DEEP, 1) if deep else text


def mutate_bytes(data, blob: bytes) -> bytes:
    b = bytearray(blob)
    how = data.draw(_BYTES_HOW)
    if how == "flip":
        for _ in range(data.draw(_FLIPS)):
            b[_index(data, len(b))] ^= data.draw(_XOR)
    elif how == "truncate":
        del b[_index(data, len(b)) :]
    elif how == "delete":
        i = _index(data, len(b))
        del b[i : i + data.draw(_SPAN)]
    elif how == "insert":
        i = _index(data, len(b) + 1)
        b[i:i] = data.draw(_INSERTS)
    else:
        i = _index(data, len(b))
        j = min(len(b), i + data.draw(_SPAN) * 4)
        b[j:j] = b[i:j]
    return bytes(b)


class _Drawer:
    """Adapts a composite's ``draw`` to the ``data.draw`` interface the mutators use."""

    def __init__(self, draw):
        self.draw = draw


@st.composite
def fuzz_inputs(draw) -> Any:
    data = _Drawer(draw)
    source = draw(_SOURCE)
    _note(f"source: {source}")
    if source == "bytes":
        return draw(_RANDOM_BYTES)
    if source == "json":
        return json.dumps(draw(json_values)).encode()
    if source == "header_json":
        return json.dumps(
            {"format": "pypm", "version": 1, "minor": 0, **draw(_HEADER_EXTRA)}
        ).encode()
    if source == "schema":
        return json.dumps(draw(schema_shaped_docs())).encode()
    if source == "schema_mutated":
        return mutate_json(data, draw(schema_shaped_docs())).encode()
    if source == "non_bytes":
        return draw(_NON_BYTES)
    blob = draw(_BLOB)
    if source == "byte_mutation":
        return mutate_bytes(data, blob)
    return mutate_json(data, json.loads(blob)).encode()


@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(fuzz_inputs())
def test_fuzz_only_format_error_escapes(blob):
    check(blob)


# ---------------------------------------------------------------- deterministic sweeps


@pytest.mark.slow
def test_every_truncation_is_refused():
    for blob in CORPUS[:4]:
        for n in range(len(blob)):
            with pytest.raises(pm.FormatError):
                deserialize(blob[:n])


def test_every_single_byte_deletion():
    blob = CORPUS[1]
    for i in range(len(blob)):
        check(blob[:i] + blob[i + 1 :])


def test_deep_nesting_everywhere():
    """[[[...]]] 100k deep in every position of a valid blob's document."""
    doc = json.loads(CORPUS[2])
    for node, key in _paths(doc):
        saved = node[key]
        node[key] = "__DEEP__"
        text = json.dumps(doc).replace('"__DEEP__"', DEEP)
        node[key] = saved
        with pytest.raises(pm.FormatError, match="nested too deeply"):
            deserialize(text.encode())


def test_deep_but_valid_json_of_other_shapes():
    for text in ('{"a":' * 50_000 + "1" + "}" * 50_000, "[" * 999 + "]" * 999):
        with pytest.raises(pm.FormatError):
            deserialize(text.encode())


# ------------------------------------------------------------------ no code execution


HOSTILE_NAMES = [
    "os.system",
    "subprocess.run",
    "builtins.eval",
    "__import__('os').system('touch /tmp/pwned')",
    "importlib.import_module",
    "pypm_jax.format.serialize",
]


def _hostile_blobs() -> list[bytes]:
    blobs = []
    base = json.loads(serialize([EVERYTHING]))
    for name in HOSTILE_NAMES:
        ns, _, short = name.rpartition(".")
        ops = [dict(e) for e in base["ops"]]
        ops[0].update(name=short or name, namespace=ns)
        blobs.append(json.dumps({**base, "ops": ops}).encode())  # unknown op: recreated, inert
        blobs.append(json.dumps({**base, "guard_fns": [name] * len(base["guard_fns"])}).encode())
        values = base["values"] + [{"k": "str", "v": name}, {"k": "opclass", "v": name}]
        blobs.append(json.dumps({**base, "values": values}).encode())
        blobs.append(json.dumps({**base, "format": name}).encode())
        blobs.append(json.dumps({**base, "py/object": name, "minor": 3}).encode())
    return blobs


def test_loading_never_imports_or_calls_anything(monkeypatch):
    calls: list[str] = []

    def trap(label):
        def f(*a, **k):
            calls.append(label)
            raise AssertionError(f"{label} called during deserialize")

        return f

    blobs = _hostile_blobs()
    before = set(sys.modules)
    real_import = builtins.__import__
    for name, target in [
        ("system", os),
        ("popen", os),
        ("run", subprocess),
        ("Popen", subprocess),
        ("import_module", importlib),
        ("eval", builtins),
        ("exec", builtins),
        ("compile", builtins),
    ]:
        monkeypatch.setattr(target, name, trap(f"{target.__name__}.{name}"))
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda *a, **k: (calls.append(f"import {a[0]}"), real_import(*a, **k))[1],
    )
    accepted = 0
    for blob in blobs:
        try:
            out = deserialize(blob)
            accepted += 1
            assert all(isinstance(x, Operator | PatternDef | RuleDef) for x in out)
        except pm.FormatError:
            pass
    monkeypatch.undo()
    assert calls == []
    assert set(sys.modules) == before
    assert accepted >= len(HOSTILE_NAMES)  # an unknown operator name is harmless: loaded inert
    assert not os.path.exists("/tmp/pwned")


def test_hostile_operator_names_become_inert_operators():
    base = json.loads(serialize([MatMul]))
    base["ops"][0].update(name="system", namespace="os")
    (op,) = deserialize(json.dumps(base).encode())
    assert type(op) is Operator and op.qualname == "os.system" and op.infer is None
    assert "os.system" not in registry.OPS
    _ = FRESH
