"""The loader against 100,000 inputs per run: generated constraint chains and deep patterns
(valid by construction, so every check runs on them), their mutations at the JSON level
(wrong types, indices, kinds, huge numbers and strings, guard bombs) and at the byte level.
Every input loads or raises FormatError, nothing else; what loads serializes again.

A plain seeded generator rather than Hypothesis, so that 100,000 inputs fit in about a
minute; ``PYPM_FUZZ_INPUTS`` and ``PYPM_FUZZ_SEED`` change the count and the seed.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

import pytest

import pypm_jax as pm
from pypm_jax.core.calculus import PatternDef, RuleDef
from pypm_jax.core.terms import Operator
from pypm_jax.format import deserialize, serialize

INPUTS = int(os.environ.get("PYPM_FUZZ_INPUTS", 100_000))
SEED = int(os.environ.get("PYPM_FUZZ_SEED", 20))

OPS = [
    {"name": "F", "namespace": "fuzz", "n_in": 1, "n_out": 1, "attrs": [],
     "op_class": "unary_pointwise", "pure": True},
    {"name": "G", "namespace": "fuzz", "n_in": 2, "n_out": 2, "attrs": ["k"],
     "op_class": None, "pure": True},
]  # fmt: skip
TABLES = ("ops", "guard_fns", "locs", "values", "exprs", "patterns", "rhs", "defs", "rules")


class _Doc:
    """A blob document under construction: append entries, get their indices."""

    def __init__(self) -> None:
        self.t: dict[str, list[Any]] = {t: [] for t in TABLES}
        self.t["ops"] = [dict(op) for op in OPS]
        self.t["guard_fns"] = ["len"]
        self.t["locs"] = [{"file": "fuzz.py", "line": 1, "text": "x <= F(y)"}]

    def add(self, table: str, entry: Any) -> int:
        self.t[table].append(entry)
        return len(self.t[table]) - 1

    def guard(self, var: str) -> int:
        zero = self.add("values", {"k": "int", "v": 0})
        const = self.add("exprs", {"k": "const", "value": zero})
        rank = self.add("exprs", {"k": "attr", "var": var, "attr": "rank"})
        return self.add("exprs", {"k": "cmp", "op": ">=", "left": rank, "right": const})

    def finish(self, rng: random.Random, body: int, params: list[str]) -> dict[str, Any]:
        d = self.add(
            "defs",
            {"name": "P", "params": [{"name": p, "kind": "term"} for p in params],
             "body": body, "loc": 0, "alt_locs": []},
        )  # fmt: skip
        items = [{"k": "pattern", "i": d}]
        guard_locs = []
        if rng.random() < 0.5:
            result = self.add("rhs", {"k": "var", "name": params[0]})
            branch = {"guard": self.guard(params[0]), "result": result, "loc": None}
            self.add("rules", {"name": "r", "pattern": d, "branches": [branch],
                               "single_use": False, "loc": None})  # fmt: skip
            items.append({"k": "rule", "i": 0})
            guard_locs.append([[0]])
        return {"format": "pypm", "version": 1, "minor": 1, **self.t, "items": items,
                "guard_locs": guard_locs}  # fmt: skip


def _size(rng: random.Random, large: int) -> int:
    """Mostly small (each input must cost well under a millisecond), now and then ``large``."""
    if rng.random() < 0.01:
        return rng.randint(large // 2, large)
    return min(large, 1 + int(rng.expovariate(1 / 4)))


def chain_doc(rng: random.Random) -> dict[str, Any]:
    """``x <= F(y0); y_j <= F(y1); ...``: up to 80 chained constraints (exponential for the
    old loader: 24 took 22 s), some guarded, the locals bound by ∃ around them all."""
    doc = _Doc()
    body = doc.add("patterns", {"k": "var", "name": "x"})
    names: list[str] = []
    for i in range(_size(rng, 80)):
        target = rng.choice(names) if names and rng.random() < 0.4 else "x"
        y = f"y{i}"
        names.append(y)
        leaf = doc.add("patterns", {"k": "var", "name": y})
        inner = doc.add("patterns", {"k": "app", "op": 0, "args": [leaf], "index": 0})
        body = doc.add(
            "patterns",
            {"k": "constr", "pat": body, "var": target, "constraint": inner, "loc": 0},
        )
        if rng.random() < 0.1:
            body = doc.add(
                "patterns", {"k": "guard", "pat": body, "guard": doc.guard(target), "loc": None}
            )
    for y in reversed(names):
        body = doc.add("patterns", {"k": "exists", "var": y, "body": body, "kind": "term"})
    return doc.finish(rng, body, ["x"])


def deep_doc(rng: random.Random) -> dict[str, Any]:
    """A pattern up to 10,000 constructs deep (applications, guards, ∃, alternates, operator
    variables); most are much shallower, to keep the run short."""
    doc = _Doc()
    depth = 10_000 if rng.random() < 0.0002 else _size(rng, 300)
    body = doc.add("patterns", {"k": "var", "name": "x"})
    other = doc.add("patterns", {"k": "var", "name": "w"})
    for i in range(depth):
        kind = rng.random()
        if kind < 0.4:
            body = doc.add("patterns", {"k": "app", "op": 0, "args": [body], "index": 0})
        elif kind < 0.5:
            body = doc.add("patterns", {"k": "app", "op": 1, "args": [body, other], "index": i % 2})
        elif kind < 0.6:
            body = doc.add(
                "patterns", {"k": "guard", "pat": body, "guard": doc.guard("x"), "loc": None}
            )
        elif kind < 0.7:
            body = doc.add("patterns", {"k": "exists", "var": "z", "body": body, "kind": "term"})
        elif kind < 0.8:
            body = doc.add(
                "patterns",
                {"k": "exists", "var": "H", "kind": "op", "body": doc.add(
                    "patterns", {"k": "fun_var", "var": "H", "args": [body], "index": 0,
                                 "n_out": None})},
            )  # fmt: skip
        else:
            body = doc.add("patterns", {"k": "alt", "left": body, "right": other})
    return doc.finish(rng, body, ["x", "w"])


HUGE = [
    -1, 0, 1, 2, 3, 10**9, 1 << 2000, -(1 << 70), 0.5, True, None, "", "x", "**",
    "a" * 70_000, [], {}, [0], {"k": "var"}, "jaxEVIL", 65_537,
]  # fmt: skip
KINDS = ["var", "app", "const", "alt", "guard", "exists", "constr", "fun_var", "mu", "call",
         "attr", "bin", "cmp", "tuple", "op", "int", "str", "opclass", "nope"]  # fmt: skip


def mutate(rng: random.Random, doc: dict[str, Any]) -> None:
    """One random edit, in place."""
    how = rng.random()
    tables = [t for t in TABLES if type(doc.get(t)) is list and doc[t]]
    if how < 0.05:
        key = rng.choice([*TABLES, "format", "version", "minor", "items", "guard_locs"])
        if rng.random() < 0.5:
            doc.pop(key, None)
        else:
            doc[key] = rng.choice(HUGE)
        return
    if how < 0.1:  # a guard bomb or an operator asking too much
        if not {"values", "exprs", "ops"} <= set(tables):
            return
        if rng.random() < 0.5:
            seven = len(doc["values"])
            exponent = rng.choice([30_000_000, 1025, 1024])
            doc["values"] += [{"k": "int", "v": 7}, {"k": "int", "v": exponent}]
            a = len(doc["exprs"])
            doc["exprs"] += [
                {"k": "const", "value": seven},
                {"k": "const", "value": seven + 1},
                {"k": "bin", "op": "**", "left": a, "right": a + 1},
            ]
        else:
            op = rng.choice(doc["ops"])
            if type(op) is dict:
                op[rng.choice(["n_in", "n_out"])] = rng.choice([10**9, 65_537, 65_536, 0, None])
        return
    if not tables:
        return
    table = rng.choice(tables)
    rows = doc[table]
    i = rng.randrange(len(rows))
    row = rows[i]
    if how < 0.2:
        rows.append(json.loads(json.dumps(row)))
    elif how < 0.25:
        j = rng.randrange(len(rows))
        rows[i], rows[j] = rows[j], rows[i]
    elif how < 0.3:
        del rows[rng.randrange(len(rows)) :]
    elif not isinstance(row, dict) or not row:
        rows[i] = rng.choice(HUGE)
    else:
        row = rows[i] = dict(row)
        key = rng.choice(sorted(row))
        edit = rng.random()
        if edit < 0.15:
            del row[key]
        elif edit < 0.3 and "k" in row:
            row["k"] = rng.choice(KINDS)
        elif edit < 0.55 and type(row[key]) is int:
            row[key] = row[key] + rng.choice([-1, 1, i + 1 - row[key], len(rows), -row[key] - 1])
        else:
            row[key] = rng.choice(HUGE)


def mutate_bytes(rng: random.Random, blob: bytes) -> bytes:
    b = bytearray(blob)
    how = rng.random()
    i = rng.randrange(len(b))
    if how < 0.4:
        b[i] ^= rng.randrange(1, 256)
    elif how < 0.6:
        del b[i:]
    elif how < 0.8:
        del b[i : i + rng.randint(1, 8)]
    else:
        b[i:i] = rng.choice([b"[", b"]", b"{", b"}", b",", b'"', b"0", b"-", b"9" * 400])
    return bytes(b)


def _compact(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def check(blob: bytes, must_load: bool, fixpoint: bool = True) -> bool:
    """The property; returns whether the input loaded. ``fixpoint`` also checks that the
    reserialized blob is a fixpoint of load + serialize (the test asks it of every eighth
    loaded input: the round trip costs twice the load, and test_roundtrip checks it too)."""
    try:
        out = deserialize(blob)
    except pm.FormatError:
        assert not must_load, "a valid generated document was refused"
        return False
    assert isinstance(out, list)
    assert all(isinstance(x, Operator | PatternDef | RuleDef) for x in out)
    again = serialize(out)  # what loads is valid: it serializes (and that checks it loads)
    if fixpoint:
        assert serialize(deserialize(again)) == again
    return True


@pytest.mark.slow
def test_loader_fuzz_100k():
    rng = random.Random(SEED)
    loaded = refused = 0
    for n in range(INPUTS):
        doc = chain_doc(rng) if rng.random() < 0.5 else deep_doc(rng)
        edits = rng.choice([0, 0, 1, 1, 1, 2, 3])
        if edits == 0:
            blob, must_load = _compact(doc), True
        else:
            for _ in range(edits):
                mutate(rng, doc)
            blob, must_load = _compact(doc), False
            if rng.random() < 0.3:
                blob = mutate_bytes(rng, blob)
        try:
            ok = check(blob, must_load, fixpoint=loaded % 8 == 0)
        except Exception as exc:  # name the input, so it can be replayed
            raise AssertionError(
                f"input {n} (PYPM_FUZZ_SEED={SEED}): {type(exc).__name__}: {exc}"
            ) from exc
        loaded += ok
        refused += not ok
    assert loaded + refused == INPUTS >= 100_000 or "PYPM_FUZZ_INPUTS" in os.environ
    assert loaded > INPUTS // 10 and refused > INPUTS // 10  # both sides are exercised
