"""The package's layers import one way: each only from the layers before it.

Order (README, "Layout"): core, semantics, lang, engine, format, jax (the bridge), rules (the
standard library), then the facade (``pypm_jax/__init__``, the CLI, the demo, the testing
helpers). Every import counts, module-level or inside a function: a lazy import that goes
back up the layers is still a cycle in the design.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pypm_jax

ROOT = Path(pypm_jax.__file__).parent
LAYERS = ("core", "semantics", "lang", "engine", "format", "jax", "rules")
FACADE = len(LAYERS)


def _layer(module: str) -> int:
    """The layer index of ``pypm_jax.<module...>``."""
    first = module.split(".")[1] if "." in module else ""
    return LAYERS.index(first) if first in LAYERS else FACADE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of a pypm_jax module in ``path``, the module
    ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "pypm_jax":  # from pypm_jax import core / from .. import format
                found += [(node.lineno, f"pypm_jax.{a.name}") for a in node.names]
            elif target.startswith("pypm_jax."):
                found.append((node.lineno, target))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("pypm_jax.")]
    return found


def test_every_import_goes_to_an_earlier_layer_or_its_own():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        here = _module_name(path)
        for line, target in _imports(path, here):
            if _layer(target) > _layer(here):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {here} imports {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_layer_check_sees_an_import_against_the_order(tmp_path):
    module = tmp_path / "fake.py"
    module.write_text(
        "from ..engine import fast\n\n\ndef f():\n    from ..rules import attention\n"
    )
    found = _imports(module, "pypm_jax.core.fake")
    assert found == [(1, "pypm_jax.engine"), (5, "pypm_jax.rules")]
    assert all(_layer(t) > _layer("pypm_jax.core.fake") for _, t in found)
