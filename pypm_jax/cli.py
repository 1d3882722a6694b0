"""``pypm-jax``, the command line: where the rules fire in a program, and why not elsewhere.

    pypm-jax find   model.mlir                                   # a StableHLO/MLIR file
    pypm-jax report mypkg.model:forward --arg f32[2,128,768] --arg i32[2,128]

``find`` prints the table of sites the rules rewrite; ``report`` adds the counts by kernel
and module and the attention-like and GEMM+activation-like sites no rule rewrote, each with
the check that stopped it. A target is a file written by any XLA frontend (StableHLO text,
MLIR bytecode: what ``hlo.lift`` reads), or ``module:function`` traced with example
arguments given as ``--arg DTYPE[SHAPE]`` (``f32[2,8,64]``, ``bf16[4]``, ``i32[]``; one per
positional argument; no data is allocated). ``--rules module:attr`` names a list of rules
to use instead of the standard library; ``--json`` prints the same as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any

_ARG = re.compile(r"^\s*([A-Za-z0-9_]+)\s*(?:\[\s*([0-9,\s]*)\s*\])?\s*$")


class CliError(Exception):
    """A bad command line: printed as ``pypm-jax: error: ...`` with exit status 2."""


def parse_arg(text: str) -> Any:
    """``f32[2,8,64]`` as a ``jax.ShapeDtypeStruct`` (``f32`` or ``f32[]``: a scalar)."""
    import jax

    from .core.dtypes import as_dtype

    m = _ARG.match(text)
    try:
        dtype = as_dtype(m.group(1)) if m else None
    except TypeError:
        dtype = None
    if m is None or dtype is None:
        raise CliError(f"--arg {text!r}: expected DTYPE[SHAPE], e.g. f32[2,8,64] or i32[]")
    dims = [d for d in (m.group(2) or "").replace(" ", "").split(",") if d]
    return jax.ShapeDtypeStruct(tuple(int(d) for d in dims), dtype.numpy_name)


def _load(spec: str, what: str) -> Any:
    """``module:attr`` (the attribute may be dotted: ``pkg.mod:Model.forward``)."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise CliError(f"{what} {spec!r}: expected module:name")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a module beside the user, as `python -m` finds it
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise CliError(f"{what} {spec!r}: cannot import {module}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliError(f"{what} {spec!r}: {module} has no attribute {attr}")
        obj = getattr(obj, part)
    return obj


def _rules(spec: str | None) -> list[Any] | None:
    if spec is None:
        return None
    rules = _load(spec, "--rules")
    if not isinstance(rules, list | tuple):
        raise CliError(f"--rules {spec!r} is a {type(rules).__name__}, not a list of rules")
    return list(rules)


def _from_file(path: str, rules: list[Any] | None) -> tuple[Any, Any]:
    """(report, missed) of a StableHLO/MLIR file."""
    import hlo
    from pypm_jax.jax.missed import missed_sites
    from pypm_jax.lang.frontend import as_rule_def
    from pypm_jax.rules import default_rules

    defs = [as_rule_def(r) for r in (default_rules() if rules is None else rules)]
    report = hlo.find(path, defs)
    return report, lambda: missed_sites(report.graph, defs)


def _from_function(spec: str, args: Sequence[str], rules: list[Any] | None) -> tuple[Any, Any]:
    """(report, missed) of ``module:function`` traced with ``args``."""
    import pypm_jax as pm

    fn = _load(spec, "target")
    if not callable(fn):
        raise CliError(f"target {spec!r} is not callable")
    examples = [parse_arg(a) for a in args]
    fast = pm.optimize(fn, rules=rules)
    return fast.report(*examples), lambda: fast.missed(*examples)


def run(argv: Sequence[str] | None = None) -> str:
    """The text ``pypm-jax`` prints for ``argv`` (raises :class:`CliError` on bad input)."""
    ap = argparse.ArgumentParser(prog="pypm-jax", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (
        ("find", "the sites the rules rewrite"),
        ("report", "the sites, counts by kernel and module, and the sites missed and why"),
    ):
        p = sub.add_parser(name, help=helptext, description=helptext)
        p.add_argument("target", help="a StableHLO/MLIR file, or module:function")
        p.add_argument(
            "--arg", action="append", default=[], metavar="DTYPE[SHAPE]",
            help="an example positional argument of module:function, e.g. f32[2,8,64]",
        )  # fmt: skip
        p.add_argument("--rules", metavar="MODULE:ATTR", help="a list of rules to use")
        p.add_argument("--json", action="store_true", help="print JSON")
    ns = ap.parse_args(argv)
    rules = _rules(ns.rules)
    if os.path.isfile(ns.target):
        if ns.arg:
            raise CliError("--arg is for module:function targets; a module file has its types")
        report, missed = _from_file(ns.target, rules)
    elif ":" in ns.target:
        report, missed = _from_function(ns.target, ns.arg, rules)
    else:
        raise CliError(f"target {ns.target!r} is neither a file nor module:function")
    if ns.command == "find":
        if ns.json:
            return json.dumps(report.rows(), indent=2)
        return _report_table(report)
    gone = missed()
    if ns.json:
        return json.dumps({**report.to_dict(), "missed": gone.to_dict()}, indent=2)
    return f"{report}\n\nmissed:\n{gone}" if gone else f"{report}\n\n{gone}"


def _report_table(report: Any) -> str:
    from pypm_jax.engine import report as _report
    from pypm_jax.engine.rewrite import printable

    return _report.table(report.rows(), printable) if len(report) else "no rewrites"


def main(argv: Sequence[str] | None = None) -> int:
    try:
        print(run(argv))
    except CliError as exc:
        print(f"pypm-jax: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
