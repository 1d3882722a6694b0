"""The on-disk cache of the default rules' definitions (pypm_jax.rules._cache): a hit gives
exactly what the frontend builds; a missing, stale, corrupt or foreign file is rebuilt."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import pypm_jax as pm
import pypm_jax.rules as R
from pypm_jax import _fast
from pypm_jax._frontend import Rule
from pypm_jax._rewrite import guarded_pattern
from pypm_jax.jax import lift
from pypm_jax.jax.optimize import rewrite_nested
from pypm_jax.rules import _cache


def fresh_rules() -> list[Rule]:
    """Copies of the default rules whose definitions are not built yet."""
    return [Rule(r.pattern, r.fn, r.name, r.single_use) for r in R.default_rules()]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PYPM_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def frontend_runs(monkeypatch):
    """How many rules the frontend built (Rule._compile calls)."""
    calls: list[str] = []
    original = Rule._compile

    def counting(self):
        calls.append(self.name)
        return original(self)

    monkeypatch.setattr(Rule, "_compile", counting)
    return calls


def built(rules: list[Rule]) -> bytes:
    """The rules' definitions as canonical bytes (source locations included)."""
    return pm.serialize([r.definition for r in rules])


def test_a_hit_loads_what_the_frontend_builds(cache_dir, frontend_runs):
    first = fresh_rules()
    _cache.prime(first)  # a miss: built by the frontend, then written
    assert len(frontend_runs) == len(first)
    path = _cache.cache_path()
    assert path is not None and os.path.dirname(path) == str(cache_dir)
    assert open(path, "rb").read().startswith(_cache.cache_key().encode() + b"\n")

    frontend_runs.clear()
    second = fresh_rules()
    _cache.prime(second)
    assert frontend_runs == []  # every definition came from the file
    assert built(second) == built(first)
    for a, b in zip(first, second, strict=True):
        assert a.definition == b.definition
        assert a.definition.loc == b.definition.loc
        assert [x.guard_locs for x in a.definition.branches] == [
            x.guard_locs for x in b.definition.branches
        ]


def test_cached_rules_rewrite_identically(cache_dir):
    def block(q, k, v, x, w, b):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        s = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), s, -1e30)  # causal: rules/causal.py
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        return a, jax.nn.gelu(x @ w + b)

    shapes = [(2, 8, 2, 32)] * 3 + [(2, 8, 64), (64, 32), (32,)]
    args = [jnp.ones(s, jnp.float32) for s in shapes]
    closed = jax.make_jaxpr(block)(*args)
    built_by_frontend = fresh_rules()
    _cache.prime(built_by_frontend)
    loaded = fresh_rules()
    _cache.prime(loaded)
    assert all(r._definition is not None for r in loaded)
    out = []
    for rules in (built_by_frontend, loaded):
        prog = lift(closed)
        result = rewrite_nested(prog, rules)
        out.append((str(prog.graph), [str(r) for r in result.report]))
    assert out[0] == out[1]
    # one attention (then its causal mask), one epilogue; the loaded causal rule ran on the
    # machine (its summary's), the frontend's as generated code
    assert len(out[0][1]) == 3
    causal = [r for r in loaded if r.name == "attention_causal_mask"][0]
    assert _fast.compile_pattern(guarded_pattern(causal.definition)).backend == "machine"


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize(
    "damage",
    [
        "stale key",
        "no key line",
        "truncated blob",
        "not json",
        "other rules",
        "summaries not json",
        "too few summaries",
        "empty",
    ],
)
def test_a_bad_file_is_rebuilt(cache_dir, frontend_runs, damage):
    reference = fresh_rules()
    _cache.prime(reference)
    path = _cache.cache_path()
    good = open(path, "rb").read()
    key, _, rest = good.partition(b"\n")
    blob = rest.split(b"\n", 1)[1]
    bad = {
        "stale key": b"0" * len(key) + b"\n" + blob,
        "no key line": blob,
        "truncated blob": key + b"\n" + blob[: len(blob) // 2],
        "not json": key + b"\n" + b"import os; os.system('echo never run')",
        "other rules": key
        + b"\n"
        + rest.split(b"\n", 1)[0]
        + b"\n"
        + pm.serialize([r.definition for r in reference[:3]]),
        "summaries not json": key + b"\n" + b"[{" + b"\n" + blob,
        "too few summaries": key + b"\n" + b"[null]" + b"\n" + blob,
        "empty": b"",
    }[damage]
    _write(path, bad)
    frontend_runs.clear()
    rules = fresh_rules()
    _cache.prime(rules)  # never raises: the frontend builds them and the file is rewritten
    assert len(frontend_runs) == len(rules)
    assert built(rules) == built(reference)
    assert open(path, "rb").read() == good


def test_the_key_depends_on_the_sources(cache_dir, monkeypatch, tmp_path):
    key = _cache.cache_key()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(_cache, "_PACKAGE", str(pkg))
    monkeypatch.setattr(_cache, "_key", None)
    k1 = _cache.cache_key()
    monkeypatch.setattr(_cache, "_key", None)
    (pkg / "a.py").write_text("x = 2\n")
    k2 = _cache.cache_key()
    assert len({key, k1, k2}) == 3


def test_an_empty_cache_dir_turns_the_cache_off(monkeypatch, tmp_path, frontend_runs):
    monkeypatch.setenv("PYPM_CACHE_DIR", "")
    monkeypatch.chdir(tmp_path)
    assert _cache.cache_path() is None
    rules = fresh_rules()
    _cache.prime(rules)
    assert all(r._definition is None for r in rules)  # built lazily, as without a cache
    assert frontend_runs == []
    assert list(tmp_path.iterdir()) == []


def test_an_unwritable_cache_dir_is_not_an_error(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("PYPM_CACHE_DIR", str(blocker / "sub"))  # under a file: cannot exist
    rules = fresh_rules()
    _cache.prime(rules)
    assert built(rules) == built(fresh_rules())


def test_rules_already_built_are_kept(cache_dir, frontend_runs):
    rules = fresh_rules()
    before = rules[0].definition
    _cache.prime(rules)
    assert rules[0].definition is before


def _compiled_like(a: _fast.CompiledPattern, b: _fast.CompiledPattern) -> bool:
    return (a.backend, a.root_ops, getattr(a, "_shape", None), a.unique) == (
        b.backend,
        b.root_ops,
        getattr(b, "_shape", None),
        b.unique,
    )


def test_a_hit_gives_the_patterns_compiled_as_the_frontend_s(cache_dir):
    # the summaries are of the patterns the rewrite driver compiles (guards joined in)
    built_by_frontend = fresh_rules()
    _cache.prime(built_by_frontend)
    loaded = fresh_rules()
    _cache.prime(loaded)
    for a, b in zip(built_by_frontend, loaded, strict=True):
        pdef = guarded_pattern(b.definition)
        assert pdef is not b.definition.pattern  # (every standard rule has one guarded branch)
        assert id(pdef) in _fast._compiled.entries  # primed from its summary, not compiled
        # for the machine, also the causal rules' patterns, which would be generated code
        fresh = _fast.CompiledPattern(guarded_pattern(a.definition), backend="machine")
        assert _compiled_like(_fast.compile_pattern(pdef), fresh)
        assert _fast.summary(fresh) == _fast.summary(_fast.compile_pattern(pdef))


def test_bad_summaries_are_dropped(cache_dir):
    reference = fresh_rules()
    _cache.prime(reference)
    path = _cache.cache_path()
    key, _, blob = open(path, "rb").read().split(b"\n", 2)
    bogus = [{"backend": "machine", "root_ops": ["no.such_op"], "shape": None}] * len(reference)
    _write(path, key + b"\n" + _json(bogus) + b"\n" + blob)
    rules = fresh_rules()
    _cache.prime(rules)  # definitions loaded, summaries refused: compiled as usual
    for a, b in zip(reference, rules, strict=True):
        pdef = guarded_pattern(b.definition)
        assert id(pdef) not in _fast._compiled.entries
        assert _compiled_like(
            _fast.compile_pattern(pdef), _fast.CompiledPattern(guarded_pattern(a.definition))
        )


def _json(value) -> bytes:
    import json

    return json.dumps(value).encode()


@pytest.mark.parametrize(
    "data",
    [
        None,
        [],
        {"backend": "generated"},
        {"backend": "machine", "root_ops": "jax.dot_general", "shape": None},
        {"backend": "machine", "root_ops": [None], "shape": None},
        {"backend": "machine", "root_ops": None, "shape": [["jax.dot_general", 2, [None]]]},
        {"backend": "machine", "root_ops": None, "shape": [["jax.dot_general", -1, None]]},
        # an operator the pattern does not name (the rule's replacement)
        {"backend": "machine", "root_ops": None, "shape": [[R.FlashAttention.qualname, 6, None]]},
        {"backend": "machine", "root_ops": None, "shape": [[None, 1]]},
        {"backend": "machine", "root_ops": None, "shape": []},
    ],
)
def test_from_summary_refuses_what_does_not_fit(data):
    pdef = R.attention_rule.definition.pattern
    before = _fast.compile_pattern(pdef)
    assert _fast.from_summary(pdef, data) is None
    assert _fast.compile_pattern(pdef) is before
