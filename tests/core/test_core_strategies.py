"""The shared strategies keep their promises: every construct shows up, the patterns are
closed, small, guarded and have unique bound names, and the terms share subterms."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from pypm_jax.core.calculus import (
    EAnd,
    EAttr,
    EBin,
    EIndex,
    ENot,
    EOpAttr,
    EOr,
    PAlt,
    PApp,
    Pattern,
    PatternDef,
    PCall,
    PConst,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
)
from pypm_jax.core.terms import Operator
from pypm_jax.semantics import machine as _machine
from pypm_testing.strategies import (
    SQRT2_LITERAL,
    G,
    dag_terms,
    free_vars,
    pattern_and_term,
    patterns,
    subterms,
)

_PATTERN_TYPES = (PVar, PApp, PConst, PAlt, PGuard, PExists, PConstr, PFunVar, PMu, PCall)


def nodes(x: Any) -> Iterator[Any]:
    """Every pattern and expression node under ``x`` (PMu bodies included)."""
    todo = [x]
    while todo:
        node = todo.pop()
        yield node
        for name in getattr(node, "__slots__", ()):
            value = getattr(node, name)
            for item in value if isinstance(value, tuple) else (value,):
                if hasattr(item, "__slots__") and not isinstance(item, Operator | str):
                    todo.append(item)


def has(pred: Callable[[Any], bool]) -> Callable[[tuple[PatternDef, Any]], bool]:
    return lambda pt: any(pred(n) for n in nodes(pt[0].body))


def _var_used_twice(pt: tuple[PatternDef, Any]) -> bool:
    names = [n.name for n in nodes(pt[0].body) if isinstance(n, PVar)]
    return len(names) != len(set(names))


def _recursive(n: Any) -> bool:
    return isinstance(n, PMu) and any(isinstance(m, PCall) for m in nodes(n.body))


def _kinds(mu: PMu) -> list[str]:
    return [p.kind for p in mu.params]


CONSTRUCTS: dict[str, Callable[[tuple[PatternDef, Any]], bool]] = {
    "variable used nonlinearly": _var_used_twice,
    "application": has(lambda n: isinstance(n, PApp) and n.args),
    "second output of a multi-output node": has(lambda n: isinstance(n, PApp) and n.index == 1),
    "literal": has(lambda n: isinstance(n, PConst)),
    "literal equal after f32 rounding": has(lambda n: n == PConst(SQRT2_LITERAL)),
    "alternate": has(lambda n: isinstance(n, PAlt)),
    "guard on rank": has(lambda n: isinstance(n, EAttr) and n.attr == "rank"),
    "guard on shape[i]": has(lambda n: isinstance(n, EIndex)),
    "guard on dtype": has(lambda n: isinstance(n, EAttr) and n.attr == "dtype"),
    "guard on a term's op_class": has(lambda n: isinstance(n, EAttr) and n.attr == "op_class"),
    "guard on an operator variable": has(lambda n: isinstance(n, EOpAttr)),
    "guard arithmetic": has(lambda n: isinstance(n, EBin)),
    "guard and": has(lambda n: isinstance(n, EAnd)),
    "guard or": has(lambda n: isinstance(n, EOr)),
    "guard not": has(lambda n: isinstance(n, ENot)),
    "existential term variable": has(lambda n: isinstance(n, PExists) and n.kind == "term"),
    "existential operator variable": has(lambda n: isinstance(n, PExists) and n.kind == "op"),
    "match constraint": has(lambda n: isinstance(n, PConstr)),
    "operator variable": has(lambda n: isinstance(n, PFunVar) and n.n_out is None),
    "operator variable with n_out": has(lambda n: isinstance(n, PFunVar) and n.n_out),
    "non-recursive call": has(lambda n: isinstance(n, PMu) and not _recursive(n)),
    "recursion": has(_recursive),
    "operator passed to a call": has(
        lambda n: isinstance(n, PMu) and any(isinstance(a, Operator) for a in n.args)
    ),
    "the paper's UnaryChain": has(lambda n: _recursive(n) and _kinds(n) == ["term", "op"]),
    "the paper's P(x, f, g)": has(lambda n: _recursive(n) and _kinds(n) == ["term", "op", "op"]),
    "a pair that matches": lambda pt: _machine.match_first(*pt) is not None,
    "a pair that does not match": lambda pt: _machine.match_first(*pt) is None,
    "a pair with several solutions": lambda pt: len(list(_machine.match_all(*pt))) > 1,
}

# Generation only: the test needs one example with the construct, not a shrunk one.
FIND = settings(
    max_examples=5000,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("construct", CONSTRUCTS)
def test_every_construct_is_generated(construct):
    find(pattern_and_term(), CONSTRUCTS[construct], settings=FIND)


def test_terms_share_subterms():
    def shared(t: Any) -> bool:
        return any(len(u.inputs) == 2 and u.inputs[0] is u.inputs[1] for u in subterms(t))

    t = find(dag_terms(), lambda t: shared(t) and t.op is G, settings=FIND)
    assert shared(t)  # hash-consing made the two inputs one object


def _app_binds(p: Pattern, x: str) -> bool:
    """p is an application (maybe under guards/existentials) with the variable x among its
    operands: the one shape the strategies give a recursive match constraint."""
    match p:
        case PApp(_, args, _) | PFunVar(_, args, _, _):
            return PVar(x) in args
        case PGuard(pat, _) | PExists(_, pat, _):
            return _app_binds(pat, x)
    return False


def _guarded(p: Pattern, under_app: bool = False) -> bool:
    """Every recursive reference sits under an application, or in a match constraint on a
    variable bound under one (SEMANTICS.md §9)."""
    match p:
        case PCall():
            return under_app
        case PApp(_, args, _) | PFunVar(_, args, _, _):
            return all(_guarded(a, True) for a in args)
        case PMu(_, _, _, body):
            return _guarded(body, False)
        case PAlt(left, right):
            return _guarded(left, under_app) and _guarded(right, under_app)
        case PGuard(pat, _) | PExists(_, pat, _):
            return _guarded(pat, under_app)
        case PConstr(pat, x, constraint):
            # a constraint on a variable an application of pat binds matches a proper subterm
            below = under_app or _app_binds(pat, x)
            return _guarded(pat, under_app) and _guarded(constraint, below)
        case PVar() | PConst():
            return True
    raise TypeError(p)


@given(patterns())
def test_generated_patterns_are_closed_small_guarded_and_uniquely_bound(pdef):
    params = {p.name: p.kind for p in pdef.params}
    assert len(params) == len(pdef.params) <= 3
    assert set(free_vars(pdef.body).items()) <= set(params.items())
    binders = [n.var for n in nodes(pdef.body) if isinstance(n, PExists)]
    mu_bodies = [n for n in nodes(pdef.body) if isinstance(n, PMu)]
    # the bodies of μ-definitions are copied at each unfolding, which renames their binders
    top_binders = [n.var for n in _outside_mu(pdef.body) if isinstance(n, PExists)]
    assert len(set(top_binders)) == len(top_binders)
    assert not set(binders) & set(params)
    assert _guarded(pdef.body)
    for mu in mu_bodies:
        assert set(free_vars(mu.body)) <= {p.name for p in mu.params}


def _outside_mu(p: Pattern) -> Iterator[Pattern]:
    todo = [p]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, PMu):
            continue
        for name in node.__slots__:
            value = getattr(node, name)
            for item in value if isinstance(value, tuple) else (value,):
                if isinstance(item, _PATTERN_TYPES):
                    todo.append(item)
