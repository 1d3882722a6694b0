"""Where the standard rules' definitions come from (pypm_jax.rules._prebuilt): data shipped in
the package, current with the rules' sources and loaded as the frontend builds them; nothing
in a cache directory is read or written, so a planted file changes nothing."""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import io
import json
import logging
import os
import stat
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
import pypm_jax.rules as R
from pypm_jax.engine import compiled as _compiled
from pypm_jax.engine import fast as _fast
from pypm_jax.engine import machine as _trail
from pypm_jax.engine import rewrite as _rewrite
from pypm_jax.engine.rewrite import guarded_pattern
from pypm_jax.jax import lift, prims
from pypm_jax.jax.optimize import rewrite_nested
from pypm_jax.lang.frontend import Rule

PACKAGE = os.path.dirname(os.path.abspath(pm.__file__))


def fresh_rules() -> list[Rule]:
    """Copies of the default rules whose definitions are not built yet."""
    return [Rule(r.pattern, r.fn, r.name, r.single_use) for r in R.default_rules()]


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


# ------------------------------------------------------------------ the shipped data


def test_the_shipped_data_is_current():
    from pypm_jax.rules import _prebuilt

    shipped = _prebuilt.read_data()
    assert shipped is not None, f"{_prebuilt.DATA_PATH} is missing: run {_prebuilt.REGENERATE}"
    assert shipped == _prebuilt.render(R.standard_rules()), (
        f"{_prebuilt.DATA_PATH} is not what the rules' sources build: run {_prebuilt.REGENERATE}"
    )


def test_the_command_line_checks_the_shipped_data(capsys):
    from pypm_jax.rules import __main__ as cli

    assert cli.main(["--check"]) == 0
    assert "current" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main([])  # --regenerate or --check is required


def test_the_shipped_data_is_package_data():
    import tomllib

    with open(os.path.join(os.path.dirname(PACKAGE), "pyproject.toml"), "rb") as f:
        config = tomllib.load(f)
    assert "_prebuilt.pypm" in config["tool"]["setuptools"]["package-data"]["pypm_jax.rules"]


def test_a_load_gives_what_the_frontend_builds(frontend_runs):
    from pypm_jax.rules import _prebuilt

    loaded = fresh_rules()
    _prebuilt.prime(loaded)
    assert frontend_runs == []  # every definition came from the file
    reference = fresh_rules()
    assert built(loaded) == built(reference)
    for a, b in zip(reference, loaded, strict=True):
        assert a.definition == b.definition
        assert a.definition.loc == b.definition.loc  # this checkout's files, not the generator's
        assert [x.guard_locs for x in a.definition.branches] == [
            x.guard_locs for x in b.definition.branches
        ]
        # the pattern the driver compiles is primed from its summary, for the machine (also
        # the causal rules', which would be generated code), as compiling it would decide
        pdef = guarded_pattern(b.definition)
        assert id(pdef) in _compiled._compiled.entries
        fresh = _fast.CompiledPattern(guarded_pattern(a.definition), backend="machine")
        primed = _fast.compile_pattern(pdef)
        assert primed.backend == "machine"
        assert (primed.root_ops, primed._test) == (fresh.root_ops, fresh._test)
        assert primed._deep == fresh._deep
        # the machine's early checks, loaded rather than worked out at the first match
        assert id(pdef.body) in _trail._early_shapes.entries
        assert _trail._early_shapes(pdef.body) == _trail._find_early_shapes(fresh.pdef.body)
        # and the driver's reach of the pattern, as it would work it out
        reach = _rewrite._reach_of.entries[id(b.definition.pattern)]
        assert reach == (b.definition.pattern, _rewrite._reach(a.definition.pattern.body, [500]))


def test_loaded_rules_rewrite_identically():
    from pypm_jax.rules import _prebuilt

    def block(q, k, v, x, w, b):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        s = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), s, -1e30)  # causal: rules/causal.py
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)
        return a, jax.nn.gelu(x @ w + b)

    shapes = [(2, 8, 2, 32)] * 3 + [(2, 8, 64), (64, 32), (32,)]
    closed = jax.make_jaxpr(block)(*[jnp.ones(s, jnp.float32) for s in shapes])
    built_by_frontend = fresh_rules()
    loaded = fresh_rules()
    _prebuilt.prime(loaded)
    out = []
    for rules in (built_by_frontend, loaded):
        prog = lift(closed)
        result = rewrite_nested(prog, rules)
        out.append((str(prog.graph), [str(r) for r in result.report]))
    assert out[0] == out[1]
    assert len(out[0][1]) == 3  # one attention (then its causal mask), one epilogue


def _debug_lines(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.name == "pypm_jax.rules")


def test_edited_rule_sources_are_built_by_the_frontend(tmp_path, monkeypatch, caplog):
    # an edited rule (here: a byte more in one rules module) no longer has the file's key
    from pypm_jax.rules import _prebuilt

    for name in os.listdir(_prebuilt.RULES_DIR):
        if name.endswith(".py"):
            (tmp_path / name).write_bytes(
                open(os.path.join(_prebuilt.RULES_DIR, name), "rb").read()
            )
    assert _prebuilt.sources_key(str(tmp_path)) == _prebuilt.sources_key()
    with open(tmp_path / "gemm.py", "a") as f:
        f.write("\n")
    assert _prebuilt.sources_key(str(tmp_path)) != _prebuilt.sources_key()
    monkeypatch.setattr(_prebuilt, "RULES_DIR", str(tmp_path))
    rules = fresh_rules()
    with caplog.at_level(logging.DEBUG, logger="pypm_jax.rules"):
        _prebuilt.prime(rules)
    assert all(r._definition is None for r in rules)  # built lazily, as without the file
    assert "other rule sources" in _debug_lines(caplog)
    assert _prebuilt.REGENERATE in _debug_lines(caplog)


def _damaged(damage: str) -> bytes:
    from pypm_jax.rules import _prebuilt

    good = _prebuilt.read_data()
    head, summaries, blob = good.split(b"\n", 2)
    header = json.loads(head)
    rules = fresh_rules()

    def with_header(**change) -> bytes:
        return json.dumps({**header, **change}).encode() + b"\n" + summaries + b"\n" + blob

    defs = json.loads(blob)
    defs["rules"][0], defs["rules"][1] = defs["rules"][1], defs["rules"][0]
    swapped = json.dumps(defs, sort_keys=True, separators=(",", ":")).encode()
    return {
        "empty": b"",
        "header not json": b"{" + good,
        "another layout": with_header(format="pypm-prebuilt-rules 0"),
        "other rules": with_header(rules=[r.name for r in rules][::-1]),
        "an unregistered operator": with_header(ops=header["ops"] + ["jax.no_such_op"]),
        "truncated blob": good[: len(head) + len(summaries) + 2 + len(blob) // 2],
        "summaries not a list": head + b"\n{}\n" + blob,
        "too few summaries": head + b"\n[null]\n" + blob,
        "definitions not the rules'": head + b"\n" + summaries + b"\n" + swapped,
    }[damage]


@pytest.mark.parametrize(
    "damage",
    [
        "empty",
        "header not json",
        "another layout",
        "other rules",
        "an unregistered operator",
        "truncated blob",
        "summaries not a list",
        "too few summaries",
        "definitions not the rules'",
    ],
)
def test_data_that_is_not_the_rules_is_not_used(tmp_path, frontend_runs, caplog, damage):
    from pypm_jax.rules import _prebuilt

    path = tmp_path / "_prebuilt.pypm"
    path.write_bytes(_damaged(damage))
    rules = fresh_rules()
    with caplog.at_level(logging.DEBUG, logger="pypm_jax.rules"):
        _prebuilt.prime(rules, str(path))  # never raises
    assert all(r._definition is None for r in rules)
    assert _debug_lines(caplog)
    assert built(rules) == built(fresh_rules())  # the frontend builds them on demand


def test_a_summary_that_does_not_fit_is_compiled_as_usual(tmp_path, caplog):
    from pypm_jax.rules import _prebuilt

    head, summaries, blob = _prebuilt.read_data().split(b"\n", 2)
    n = len(json.loads(summaries))
    bogus = [{"backend": "machine", "root_ops": ["no.such_op"], "shape": None}] * n
    path = tmp_path / "_prebuilt.pypm"
    path.write_bytes(head + b"\n" + json.dumps(bogus).encode() + b"\n" + blob)
    rules = fresh_rules()
    with caplog.at_level(logging.DEBUG, logger="pypm_jax.rules"):
        _prebuilt.prime(rules, str(path))
    assert all(r._definition is not None for r in rules)  # definitions loaded
    assert "does not fit" in _debug_lines(caplog)
    for r in rules:
        assert id(guarded_pattern(r.definition)) not in _compiled._compiled.entries


def test_the_shipped_bytes_are_pinned_and_not_checked_again(monkeypatch):
    from pypm_jax import format as F
    from pypm_jax.engine.compiled import _operators_of
    from pypm_jax.rules import _prebuilt, _prebuilt_digest

    assert _prebuilt.digest(_prebuilt.read_data()) == _prebuilt_digest.DIGEST
    assert _prebuilt.check(R.standard_rules()) is None
    pinned_reads: list[bytes] = []
    original = F._deserialize_pinned
    monkeypatch.setattr(F, "_deserialize_pinned", lambda b: pinned_reads.append(b) or original(b))
    pinned = _prebuilt._load(fresh_rules())
    assert len(pinned_reads) == 1  # the shipped file takes the pinned path
    checked = _prebuilt._load(fresh_rules(), pinned=False)
    assert len(pinned_reads) == 1 and checked[2] is None
    # the same definitions and summaries as a load with every check
    assert pm.serialize(pinned[0]) == pm.serialize(checked[0])
    assert pinned[0] == checked[0] and pinned[1] == checked[1]
    # the operators the summaries may name include every one the patterns name, the same
    # objects the definitions hold
    for d in pinned[0]:
        named = _operators_of(guarded_pattern(d).body)
        assert named.items() <= pinned[2].items()


def test_bytes_not_pinned_get_every_check(tmp_path, monkeypatch, frontend_runs, caplog):
    from pypm_jax import format as F
    from pypm_jax.rules import _prebuilt

    # a definition reading a variable nothing binds: refused only by the checks that a
    # pinned read leaves out
    head, summaries, blob = _prebuilt.read_data().split(b"\n", 2)
    doc = json.loads(blob)
    first_var = next(p for p in doc["patterns"] if p["k"] == "var")
    first_var["name"] = "nowhere"
    bad = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    F._deserialize_pinned(bad)  # (no error: what a pinned read does not check)
    with pytest.raises(pm.FormatError, match="nowhere"):
        pm.deserialize(bad)
    path = tmp_path / "_prebuilt.pypm"
    path.write_bytes(head + b"\n" + summaries + b"\n" + bad)

    def not_pinned(blob):
        raise AssertionError("bytes that are not the pinned ones read without checks")

    monkeypatch.setattr(F, "_deserialize_pinned", not_pinned)
    rules = fresh_rules()
    with caplog.at_level(logging.DEBUG, logger="pypm_jax.rules"):
        _prebuilt.prime(rules, str(path))
    assert all(r._definition is None for r in rules)
    assert "nowhere" in _debug_lines(caplog)
    assert built(rules) == built(fresh_rules())  # the frontend builds them on demand


def test_regenerate_pins_only_data_that_loads(tmp_path, monkeypatch):
    from pypm_jax.rules import _prebuilt

    data, pin = tmp_path / "_prebuilt.pypm", tmp_path / "_prebuilt_digest.py"
    rules = R.standard_rules()
    assert _prebuilt.regenerate(rules, str(data), str(pin))
    assert data.read_bytes() == _prebuilt.read_data()
    assert pin.read_bytes() == _prebuilt.read_data(_prebuilt.DIGEST_PATH)
    assert not _prebuilt.regenerate(rules, str(data), str(pin))  # both current
    pin.write_bytes(b"DIGEST = ''\n")
    assert _prebuilt.regenerate(rules, str(data), str(pin))  # a stale digest is rewritten
    # data that would not load is never pinned
    monkeypatch.setattr(_prebuilt, "validate", lambda rules, data: "a summary does not fit")
    data.unlink()
    with pytest.raises(ValueError, match="does not fit"):
        _prebuilt.regenerate(rules, str(data), str(pin))
    assert not data.exists()


def test_regenerate_writes_atomically_for_every_reader(tmp_path):
    from pypm_jax.rules import _prebuilt

    path, pin = tmp_path / "_prebuilt.pypm", tmp_path / "_prebuilt_digest.py"
    path.write_bytes(b"old")
    rules = R.standard_rules()
    assert _prebuilt.regenerate(rules, str(path), str(pin)) is True
    assert path.read_bytes() == _prebuilt.read_data()
    for written in (path, pin):
        assert stat.S_IMODE(written.stat().st_mode) == 0o644  # package data, as the code
    assert sorted(os.listdir(tmp_path)) == sorted([pin.name, path.name])  # no temporary file left
    assert _prebuilt.regenerate(rules, str(path), str(pin)) is False  # already current


# ------------------------------------------------------------- reading without trust


def _read_in_thread(path: str, **kw):
    """read_data(path) run in a thread, so that a blocking open fails the test, not hangs it."""
    from pypm_jax.rules import _prebuilt

    out: list = []
    t = threading.Thread(target=lambda: out.append(_prebuilt.read_data(path, **kw)), daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # blocked on the FIFO: give it a writer so the thread ends
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        t.join(60)
        pytest.fail(f"opening {path} blocked")
    return out[0]


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "directory", "huge file"])
def test_only_a_regular_file_of_bounded_size_is_read(tmp_path, caplog, kind):
    path = str(tmp_path / "_prebuilt.pypm")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        os.mkdir(path)
    else:
        with open(path, "wb") as f:
            f.truncate(1001)  # one byte over the limit below (sparse: no disk used)
    with caplog.at_level(logging.DEBUG, logger="pypm_jax.rules"):
        assert _read_in_thread(path, limit=1000) is None
    assert path in _debug_lines(caplog)


def test_a_regular_file_within_the_limit_is_read(tmp_path):
    path = tmp_path / "data"
    path.write_bytes(b"x" * 1000)
    assert _read_in_thread(str(path), limit=1000) == b"x" * 1000


def test_the_shipped_file_is_read_without_blocking_and_bounded(monkeypatch):
    from pypm_jax.rules import _prebuilt

    opened = []
    real_open = os.open

    def spy(path, flags, *args, **kw):
        opened.append((path, flags))
        return real_open(path, flags, *args, **kw)

    rules = fresh_rules()  # (priming the library's own rules, when this test runs first)
    monkeypatch.setattr(os, "open", spy)
    _prebuilt.prime(rules)
    assert [p for p, _ in opened] == [_prebuilt.DATA_PATH]
    assert opened[0][1] & os.O_NONBLOCK
    assert os.path.getsize(_prebuilt.DATA_PATH) < _prebuilt.MAX_BYTES


# ------------------------------------------- a cache directory changes nothing (issue 20)
#
# The rules were once cached in ``$PYPM_CACHE_DIR/default_rules.pypm`` under a key anyone can
# compute from the public sources, and loaded after checking names only. These plant such a
# file (and worse) where that cache lived and check that the default rules ignore it.


def _public_key() -> str:
    """The key that cache used: a hash of public data only."""
    from pypm_jax import format as _format

    h = hashlib.sha256()
    h.update(f"{_format.FORMAT} {_format.VERSION}.{_format.MINOR}\n".encode())
    h.update(f"{sys.version}\njax {jax.__version__}\n".encode())
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, PACKAGE).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read())
                h.update(b"\0")
    return h.hexdigest()


@pytest.fixture
def cache_dirs(tmp_path, monkeypatch):
    """Every directory a cache could live in, under tmp_path; the default rules unbuilt, as
    in a new process."""
    dirs = {}
    for var in ("PYPM_CACHE_DIR", "XDG_CACHE_HOME", "HOME"):
        dirs[var] = tmp_path / var.lower()
        dirs[var].mkdir()
        monkeypatch.setenv(var, str(dirs[var]))
    for r in unprimed():
        monkeypatch.setattr(r, "_definition", None)
    return dirs


def unprimed() -> list[Rule]:
    """The default rules, as ``default_rules()`` gives them but without loading anything."""
    return R.standard_rules()


def _plant(cache_dirs, defs) -> None:
    """A file of the old cache's layout holding ``defs`` under the public key, everywhere."""
    summaries = json.dumps([None] * len(defs)).encode()
    data = _public_key().encode() + b"\n" + summaries + b"\n" + pm.serialize(defs)
    for where in (cache_dirs["PYPM_CACHE_DIR"], cache_dirs["XDG_CACHE_HOME"] / "pypm_jax"):
        where.mkdir(exist_ok=True)
        (where / "default_rules.pypm").write_bytes(data)


def _disguised(d, as_rule: Rule):
    """Definition ``d`` renamed as ``as_rule`` (the names a name check compares)."""
    pattern = dataclasses.replace(d.pattern, name=as_rule.pattern.name)
    return dataclasses.replace(d, name=as_rule.name, pattern=pattern, single_use=as_rule.single_use)


def test_a_planted_cache_cannot_change_a_result(cache_dirs):
    @pm.pattern
    def exp_times(x, y):
        return prims.mul(prims.exp(x), y)

    @pm.rule(exp_times)
    def to_log(x, y):
        return prims.mul(prims.log(x), y)

    genuine = [Rule(r.pattern, r.fn, r.name, r.single_use) for r in unprimed()]
    defs = [r.definition for r in genuine]
    defs[0] = _disguised(to_log.definition, genuine[0])
    _plant(cache_dirs, defs)

    x = jnp.linspace(0.5, 2.0, 8, dtype=jnp.float32)
    fast = pm.optimize(lambda x: jnp.exp(x) * 2)
    np.testing.assert_allclose(fast(x), np.exp(np.asarray(x)) * 2, rtol=1e-6)
    assert list(fast.report(x)) == []


def test_a_planted_cache_cannot_turn_the_default_rules_off(cache_dirs):
    @pm.op
    def Never(x):
        return 1

    @pm.pattern
    def never(x):
        return Never(x)

    @pm.rule(never)
    def nothing(x):
        return x

    _plant(cache_dirs, [_disguised(nothing.definition, r) for r in unprimed()])

    def dense(x, w, b):
        return jax.nn.relu(x @ w + b)

    args = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64,)))
    fired = [r.rule for r in pm.optimize(dense).report(*args)]
    assert fired and all(name.startswith("gemm_epilogue") for name in fired)


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "directory", "huge file"])
def test_nothing_in_a_cache_directory_is_opened(cache_dirs, monkeypatch, kind):
    # (a read of the FIFO would block, of /dev/zero exhaust memory: the guard stops both)
    for where in (cache_dirs["PYPM_CACHE_DIR"], cache_dirs["XDG_CACHE_HOME"] / "pypm_jax"):
        where.mkdir(exist_ok=True)
        path = str(where / "default_rules.pypm")
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "symlink to /dev/zero":
            os.symlink("/dev/zero", path)
        elif kind == "directory":
            os.mkdir(path)
        else:
            with open(path, "wb") as f:
                f.truncate(1 << 33)  # sparse
    roots = tuple(str(d) for d in cache_dirs.values())

    class Touched(Exception):  # not an OSError: nothing may swallow it
        pass

    def guard(opener):
        def guarded(path, *args, **kw):
            if isinstance(path, str | os.PathLike) and os.fspath(path).startswith(roots):
                raise Touched(os.fspath(path))
            return opener(path, *args, **kw)

        return guarded

    monkeypatch.setattr(builtins, "open", guard(builtins.open))
    monkeypatch.setattr(io, "open", guard(io.open))
    monkeypatch.setattr(os, "open", guard(os.open))
    rules = R.default_rules()
    assert all(r._definition is not None for r in rules)


def test_nothing_is_written_to_a_cache_directory(cache_dirs):
    def dense(x, w, b):
        return jax.nn.gelu(x @ w + b)

    args = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64,)))
    jax.block_until_ready(pm.optimize(dense)(*args))
    for d in cache_dirs.values():
        assert list(d.iterdir()) == []
