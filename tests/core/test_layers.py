"""The package's layers import one way: each only from the layers before it.

Order (README, "Layout"): core, semantics, lang, vocab (the JAX-free vocabulary), engine,
format, jax (the bridge), rules (the standard library), then the facade
(``pypm_jax/__init__``, the CLI, the demo, the testing helpers). Every import counts,
module-level or inside a function: a lazy import that goes back up the layers is still a
cycle in the design. Beyond the order: the rules never import the bridge (only the
vocabulary), the bridge never names the rules (the facade hands them in), and the vocabulary
and the rules import without JAX.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pypm_jax

ROOT = Path(pypm_jax.__file__).parent
LAYERS = ("core", "semantics", "lang", "vocab", "engine", "format", "jax", "rules")
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
        elif isinstance(node, ast.Import):  # import pypm_jax (the facade) / pypm_jax.x
            found += [
                (node.lineno, a.name)
                for a in node.names
                if a.name == "pypm_jax" or a.name.startswith("pypm_jax.")
            ]
    return found


def _layer_files(layer: str) -> list[Path]:
    return sorted((ROOT / layer).rglob("*.py"))


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, text) of every string constant that is not a docstring."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


_NAMES_RULES = re.compile(r"pypm_jax\.rules|^\.*rules(\.|$)")


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
        "    import pypm_jax as pm\n"
    )
    found = _imports(module, "pypm_jax.core.fake")
    assert found == [(1, "pypm_jax.engine"), (5, "pypm_jax.rules"), (6, "pypm_jax")]
    assert all(_layer(t) > _layer("pypm_jax.core.fake") for _, t in found)


def test_the_rules_import_the_vocabulary_never_the_bridge():
    wrong = []
    for path in _layer_files("rules"):
        for line, target in _imports(path, _module_name(path)):
            if target == "pypm_jax.jax" or target.startswith("pypm_jax.jax."):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: imports {target}")
    assert not wrong, "the rules import the JAX bridge:\n" + "\n".join(wrong)


def test_the_bridge_never_names_the_rules():
    """Not by import (the layer order) and not by a name in a string (``importlib``)."""
    wrong = []
    for path in _layer_files("jax"):
        for line, text in _strings(ast.parse(path.read_text(), str(path))):
            if _NAMES_RULES.search(text):
                wrong.append(f"{path.relative_to(ROOT.parent)}:{line}: {text!r}")
    assert not wrong, "the bridge names the rule library:\n" + "\n".join(wrong)


def test_the_string_check_sees_a_rule_library_named_by_string():
    tree = ast.parse(
        '"""Docs may say pypm_jax.rules."""\nimport importlib\n\n\n'
        'def f():\n    """pypm_jax.rules, in a docstring."""\n'
        '    return importlib.import_module("pypm_jax.rules"), "..rules", "rules="\n'
    )
    named = sorted((line, t) for line, t in _strings(tree) if _NAMES_RULES.search(t))
    assert named == [(7, "..rules"), (7, "pypm_jax.rules")]


def test_the_vocabulary_never_imports_jax():
    wrong = []
    for path in _layer_files("vocab"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            wrong += [
                f"{path.relative_to(ROOT.parent)}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0] in ("jax", "jaxlib")
            ]
    assert not wrong, "the vocabulary imports JAX:\n" + "\n".join(wrong)


# Run with JAX unimportable: every ``import jax...`` raises ImportError.
_WITHOUT_JAX = textwrap.dedent(
    """
    import sys

    class NoJax:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("jax", "jaxlib"):
                raise ImportError(f"JAX is unimportable here: {name}")
            return None

    sys.meta_path.insert(0, NoJax())
    """
)


def _run_without_jax(code: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT.parent), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_JAX + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_standard_rules_build_without_jax():
    """The rules, their kernels' registrations and the shipped data's rendering (every rule
    built afresh by the frontend and compiled) need only the vocabulary and the layers below;
    the bridge itself does need JAX (the check does block it)."""
    out = _run_without_jax(
        """
        import pypm_jax as pm
        import pypm_jax.rules as R
        from pypm_jax.rules import _prebuilt
        from pypm_jax.vocab import KERNEL_IMPLS, partitioning_for, prims

        rules = R.default_rules()
        defs = [r.definition for r in rules]
        blob = _prebuilt.render(rules)
        assert R.FlashAttention in KERNEL_IMPLS and partitioning_for(R.FlashAttention)
        assert pm.register_impl is sys.modules["pypm_jax.vocab"].register_impl
        assert prims.exp(pm.leaf("x")).shape is None  # an untyped op needs no JAX
        try:  # a typed one needs JAX's inference, which the bridge installs
            prims.exp(pm.leaf("x", shape=(2,), dtype="f32"))
        except pm.PyPMError as exc:
            assert "import pypm_jax.jax" in str(exc), exc
        else:
            raise AssertionError("a typed op was typed without JAX")
        try:
            import pypm_jax.jax
        except ImportError as exc:
            assert "unimportable" in str(exc), exc
        else:
            raise AssertionError("the bridge imported without JAX")
        print(len(defs), len(blob) > 0, sorted(m for m in sys.modules if m.startswith("jax")))
        """
    )
    import pypm_jax.rules

    n, rendered, jax_modules = out.split(maxsplit=2)
    assert int(n) == len(pypm_jax.rules.default_rules()) and rendered == "True"
    assert jax_modules.strip() == "[]"


def test_the_benchmarks_import_names_that_exist():
    """The benchmark programs run by hand (some need a GPU or the ``peers`` extra), so no
    other test notices when a name they import from ``pypm_jax`` moves: each one must
    resolve. (``benchmarks/passes.py`` imported ``default_rules`` from the bridge after it
    had moved to ``pypm_jax.rules``.)"""
    missing = []
    for path in sorted((ROOT.parent / "benchmarks").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in names:
                if module.split(".")[0] != "pypm_jax":
                    continue
                try:
                    found = importlib.import_module(module)
                    if name is not None and not hasattr(found, name):
                        importlib.import_module(f"{module}.{name}")
                except ImportError:
                    where = f"{path.name}:{node.lineno}"
                    missing.append(f"{where}: {module}" + ("" if name is None else f".{name}"))
    assert not missing, missing
