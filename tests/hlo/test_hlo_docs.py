"""Every ``python`` block of docs/HLO.md runs, in order, as one script.

Patterns are compiled from their source, so the blocks are written to a real file first.
"""

from __future__ import annotations

import os
import re
import runpy
import warnings

import pytest

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "HLO.md")


@pytest.mark.slow
def test_docs_examples_run(tmp_path, capsys):
    with open(DOC, encoding="utf-8") as fh:
        text = fh.read()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 2
    script = tmp_path / "hlo_md_examples.py"
    script.write_text("\n\n".join(blocks), encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "attention" in out and "gemm_epilogue" in out and "hlo_md_examples.py" in out
    assert "Block/attention" in out
