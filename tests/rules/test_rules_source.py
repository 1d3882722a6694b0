"""The library's pattern and rule bodies read and rewritten exactly as the plain pipeline would.

The frontend finds a definition's end from one parse of its file and places the nodes it
builds as it builds them; the plain pipeline (``inspect.getsourcelines``, ``increment_lineno``,
``ast.fix_missing_locations``) must give the same tree, positions included: the positions
are the source lines that guards and errors report.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

import pypm_jax.rules.attention as attention
import pypm_jax.rules.gemm as gemm
from pypm_jax.lang import rewrite_ast as _rewrite_ast
from pypm_jax.lang.frontend import PatternFunction, Rule


def _library_functions() -> list:
    found = []
    for module in (attention, gemm):
        for value in vars(module).values():
            if isinstance(value, PatternFunction):
                found.extend(value.functions)
            elif isinstance(value, Rule):
                found.append(value.fn)
    return found


FUNCTIONS = _library_functions()


def _rewrite(fn, tree: ast.Module, located) -> ast.Module:
    """Run the frontend's transformer on ``tree`` (one function) with ``located`` placing
    the nodes that replace a node."""
    fdef = tree.body[0]
    fdef.decorator_list = []
    saved = _rewrite_ast._located
    _rewrite_ast._located = located
    try:
        all_lines = inspect.getsourcelines(inspect.getmodule(fn))[0]
        transformer = _rewrite_ast._Transformer(inspect.getsourcefile(fn), all_lines)
        fdef.body = [transformer.visit(s) for s in fdef.body]
    finally:
        _rewrite_ast._located = saved
    return tree


def test_the_library_has_pattern_and_rule_bodies():
    assert len(FUNCTIONS) >= 50


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__qualname__)
def test_bodies_are_read_and_rewritten_as_the_plain_pipeline_does(fn):
    lines, first = _rewrite_ast._source_lines(fn)
    plain_lines, plain_first = inspect.getsourcelines(fn)
    assert first == plain_first
    assert "".join(lines).rstrip() == "".join(plain_lines).rstrip()

    padded = "\n" * (first - 1) + textwrap.dedent("".join(lines))
    got = _rewrite(fn, ast.parse(padded), _rewrite_ast._located)
    # the plain way: parse the block alone and shift it; copy a replaced node's position
    # onto its replacement and let fix_missing_locations place everything else
    plain = ast.parse(textwrap.dedent("".join(plain_lines)))
    ast.increment_lineno(plain, plain_first - 1)
    want = ast.fix_missing_locations(_rewrite(fn, plain, ast.copy_location))
    assert ast.dump(got, include_attributes=True) == ast.dump(want, include_attributes=True)
    compile(got, "<test>", "exec")  # every node has a position
