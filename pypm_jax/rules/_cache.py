"""An on-disk cache of the standard rules' core definitions, in the portable format.

Turning a ``@pm.rule`` into its :class:`~pypm_jax._calculus.RuleDef` runs the frontend
(rewrite each body's AST, compile it, execute it symbolically): about 40 ms for the
standard library, paid again in every new process, inside ``pm.optimize``'s first call.
Loading the same definitions from a blob of :mod:`pypm_jax._format` takes about a third of
that, so :func:`prime` gives the rules definitions read from a cache file, written the
first time they were built. The file also keeps what compiling each rule's pattern for the
matching machine decided (:func:`pypm_jax._fast.summary`: root operators and structural
pre-check, as data), another ~25 ms a process would spend again. The pattern summarized is
the one the rewrite driver compiles: :func:`pypm_jax._rewrite.guarded_pattern`. Every rule is
summarized for the machine, also one whose pattern would otherwise become generated code
(the causal rules': ~5 ms each to generate, and they only ever run at the few attention
kernel nodes), since generated code is code and the file holds none: a hit runs it on the
machine, which finds the same matches in the same order.

Why it is safe:

* **Loading never executes code**: the blob is read by :func:`pypm_jax._format.deserialize`
  (operators and guard functions resolve by name among those this process registered).
* **A stale file is never used**: its first line is a key hashing the source of every
  module of ``pypm_jax`` (the rules, the frontend and the format among them), the Python and
  JAX versions; any other key means the file was written for other code and is rebuilt.
* **A bad file is never used**: a FormatError, or definitions that are not the rules' (their
  number, names or patterns' names differ), mean the frontend builds them and the file is
  rewritten; a pattern summary that is malformed or names an operator its pattern does not
  is dropped (that pattern is compiled as usual). Failing to read or write the file only
  costs the time it would have saved.

``PYPM_CACHE_DIR`` names the directory (default: ``$XDG_CACHE_HOME/pypm_jax``, else
``~/.cache/pypm_jax``); setting it to the empty string turns the cache off.
"""

from __future__ import annotations

__all__ = ["prime", "cache_path", "cache_key"]

import hashlib
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

from .. import _fast, _format
from .._errors import FormatError
from .._frontend import Rule
from .._rewrite import guarded_pattern

_FILE = "default_rules.pypm"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # pypm_jax/
_key: str | None = None


def cache_path() -> str | None:
    """The cache file, or None when ``PYPM_CACHE_DIR`` is set to the empty string."""
    where = os.environ.get("PYPM_CACHE_DIR")
    if where is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        where = os.path.join(base, "pypm_jax")
    elif not where:
        return None
    return os.path.join(where, _FILE)


def cache_key() -> str:
    """A hash of what the definitions depend on: every ``pypm_jax`` source file (path and
    bytes), the format's version, Python's and JAX's versions. Computed once per process."""
    global _key
    if _key is None:
        import jax

        h = hashlib.sha256()
        h.update(f"{_format.FORMAT} {_format.VERSION}.{_format.MINOR}\n".encode())
        h.update(f"{sys.version}\njax {jax.__version__}\n".encode())
        for root, dirs, files in os.walk(_PACKAGE):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for name in sorted(files):
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    h.update(os.path.relpath(path, _PACKAGE).encode() + b"\0")
                    with open(path, "rb") as f:
                        h.update(f.read())
                    h.update(b"\0")
        _key = h.hexdigest()
    return _key


def _load(path: str, key: str, rules: Sequence[Rule]) -> tuple[list[Any], list[Any]] | None:
    """The cached definitions of ``rules`` (in order) and their patterns' summaries, or None
    if the file is missing, stale or not theirs."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    header, sep, rest = data.partition(b"\n")
    if not sep or header != key.encode():
        return None
    line, sep, blob = rest.partition(b"\n")
    try:
        summaries = json.loads(line) if sep else None
        defs = _format.deserialize(blob)
    except (FormatError, ValueError, RecursionError):
        return None
    if type(summaries) is not list or len(summaries) != len(rules):
        return None
    if len(defs) != len(rules):
        return None
    for r, d in zip(rules, defs, strict=True):
        if (
            getattr(d, "name", None) != r.name
            or getattr(getattr(d, "pattern", None), "name", None) != _pattern_name(r)
            or d.single_use != r.single_use
        ):
            return None
    return defs, summaries


def _pattern_name(r: Rule) -> str | None:
    return getattr(r.pattern, "name", None)


def _summary_of(d: Any) -> Any:
    try:
        pdef = guarded_pattern(d)
        cp = _fast.compile_pattern(pdef)
        if cp.backend != "machine":
            cp = _fast.CompiledPattern(pdef, backend="machine")
        return _fast.summary(cp)
    except Exception:  # the rewrite will raise it; the cache just has no summary
        return None


def _store(path: str, key: str, defs: Sequence[Any]) -> None:
    """Write the file atomically (a reader sees the old file or the new one, whole): the key,
    the patterns' summaries (one JSON line), the definitions' blob."""
    try:
        blob = _format.serialize(defs)
    except FormatError:
        return
    summaries = [_summary_of(d) for d in defs]
    line = json.dumps(summaries, separators=(",", ":")).encode()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".rules-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(key.encode() + b"\n" + line + b"\n" + blob)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def prime(rules: Sequence[Rule]) -> None:
    """Give each rule of ``rules`` whose definition is not built yet the cached one; on a
    miss, build them all with the frontend and write the cache."""
    todo = [r for r in rules if isinstance(r, Rule) and r._definition is None]
    if not todo:
        return
    path = cache_path()
    if path is None:
        return  # built lazily by the frontend, as without a cache
    key = cache_key()
    rules = [r for r in rules if isinstance(r, Rule)]
    loaded = _load(path, key, rules)
    if loaded is None:
        _store(path, key, [r.definition for r in rules])
        return
    defs, summaries = loaded
    for r, d, s in zip(rules, defs, summaries, strict=True):
        if r._definition is None:
            r._definition = d
            if s is not None:
                _fast.from_summary(guarded_pattern(d), s)
