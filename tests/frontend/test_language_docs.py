"""docs/LANGUAGE.md: every ``python`` block runs, in order, as one script (patterns are
compiled from their source, so the blocks are written to a real file first), and a pattern
defined without a source file fails as the guide says."""

from __future__ import annotations

import os
import re
import runpy

import pytest

import pypm_jax as pm

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "LANGUAGE.md")


def _doc() -> str:
    with open(DOC, encoding="utf-8") as fh:
        return fh.read()


def test_the_language_guides_examples_run(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", _doc(), flags=re.S)
    assert len(blocks) >= 10
    script = tmp_path / "language_md_examples.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "does not fire at MatMul(i, Trans(b))" in out and "language_md_examples.py" in out


def test_a_pattern_defined_by_exec_fails_with_the_error_the_guide_shows():
    namespace: dict = {"pm": pm}
    exec(  # noqa: S102 - what a user typing at the prompt does
        compile("@pm.pattern\ndef E(x):\n    return x\n", "<string>", "exec"), namespace
    )
    with pytest.raises(pm.PatternDefinitionError) as info:
        pm.match(namespace["E"], pm.leaf("a"))
    message = str(info.value)
    assert message.startswith("cannot read the source of E: patterns must be defined in a file")
    assert message.split(": ", 1)[1].split(" (")[0] in _doc().replace("\n", " ")
