"""Golden files: a printed form that is a contract is compared with ``tests/golden/NAME.txt``.

``PYPM_UPDATE_GOLDEN=1`` (re)writes the files instead of comparing; review the diff before
committing it. The text is made independent of the checkout first: paths under the repository
root are printed relative to it. A golden text must not hold what changes between runs
(object addresses, absolute paths, timings): :func:`assert_golden` refuses such text.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = ROOT / "tests" / "golden"

_UNSTABLE = (
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "an object address"),
    (re.compile(r"(?<![\w.])/(?:tmp|home|usr|work|root)/"), "an absolute path"),
    (re.compile(r"\b\d+(?:\.\d+)?\s?(?:ms|µs|us|ns)\b"), "a timing"),
)


def normalize(text: str) -> str:
    """Paths under the repository root, relative to it; one trailing newline."""
    text = text.replace(str(ROOT) + os.sep, "")
    return text.rstrip("\n") + "\n"


def assert_golden(name: str, text: str) -> None:
    """``text`` (normalized) equals ``tests/golden/<name>.txt``, or rewrite it on request."""
    text = normalize(text)
    for pattern, what in _UNSTABLE:
        found = pattern.search(text)
        assert found is None, f"golden text {name!r} holds {what} ({found.group()!r})"
    path = GOLDEN_DIR / f"{name}.txt"
    if os.environ.get("PYPM_UPDATE_GOLDEN"):
        path.write_text(text, encoding="utf-8")
        return
    assert path.exists(), f"no golden file {path.relative_to(ROOT)}: run with PYPM_UPDATE_GOLDEN=1"
    expected = path.read_text(encoding="utf-8")
    if text != expected:
        diff = "".join(
            difflib.unified_diff(
                expected.splitlines(keepends=True),
                text.splitlines(keepends=True),
                f"{path.relative_to(ROOT)} (golden)",
                "printed now",
            )
        )
        raise AssertionError(
            f"printed form differs from its golden file (PYPM_UPDATE_GOLDEN=1 rewrites it):\n{diff}"
        )
