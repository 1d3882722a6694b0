"""The deep pre-check (``engine/precheck.py``) against the paper's machine.

Patterns ``o <= W; x <= q`` whose variable x sits four to seven levels below the root, under
applications, operator variables, alternates, definitions called with a sub-pattern and local
constraints, so that the pre-check follows a path down to x and tests q's shape there. A term
the pre-check refuses has no match (the reference machine finds none); compiled patterns that
run it (the machine, generated code with generator functions) give the reference's solutions
in its order; a summary carries it unchanged.
"""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from pypm_jax.core.calculus import (
    PAlt,
    PApp,
    Param,
    Pattern,
    PatternDef,
    PConstr,
    PExists,
    PFunVar,
    PMu,
    PVar,
)
from pypm_jax.core.terms import Term
from pypm_jax.engine import codegen as _codegen
from pypm_jax.engine import machine as _trail
from pypm_jax.engine import precheck as _precheck
from pypm_jax.engine.compiled import from_summary, summary
from pypm_jax.engine.fast import CompiledPattern, MatchRun
from pypm_jax.engine.index import signature
from pypm_jax.semantics import machine as _machine
from pypm_testing.draws import BOOLS, ints, sampled
from pypm_testing.engine import F1, F2, G2, H2, A, B, C, dags, pattern_defs, solution_key
from pypm_testing.strategies import _Abstractor, terms

MAX_SOLUTIONS = 30
UNARY, BINARY = (F1, F2), (G2, H2)
# (strategies made once: see pypm_testing.draws)
_TOP_KINDS = st.sampled_from(["app", "app", "funvar", "alt", "call"])
_KINDS = st.sampled_from(["app", "app", "funvar", "alt", "call", "local"])
_PATH_OPS = st.sampled_from(UNARY + BINARY)
_OTHERS = st.sampled_from((A, B, C))


class _Spine:
    """Builds the pattern for one level of the path from the root down to x."""

    def __init__(self, draw: Any):
        self.draw = draw
        self.names = itertools.count()
        self.params: dict[str, str] = {}

    def fresh(self, stem: str, kind: str = "term", param: bool = True) -> str:
        name = f"{stem}{next(self.names)}"
        if param:
            self.params[name] = kind
        return name

    def level(self, t: Term, below: Pattern, at: int, top: bool) -> Pattern:
        """A pattern for ``t`` whose input ``at`` is matched by ``below``. (Not a local at
        the top: a variable bound at the root is checked there, no deeper.)"""
        draw = self.draw
        args = tuple(below if i == at else PVar(self.fresh("sw")) for i in range(len(t.inputs)))
        kind = draw(_TOP_KINDS if top else _KINDS)
        if kind == "funvar":
            return PFunVar(self.fresh("sF", "op"), args)
        app = PApp(t.op, args)
        if kind == "alt":  # the other alternate: another operator over the same inputs
            others = UNARY if len(args) == 1 else BINARY
            foil = PApp(draw(sampled(tuple(op for op in others if op is not t.op))), args)
            return PAlt(foil, app) if draw(BOOLS) else PAlt(app, foil)
        if kind == "call":  # D(arg) with arg <= below, as the frontend writes D(below)
            arg = self.fresh("sarg", param=False)
            u = self.fresh("su", param=False)
            inner = tuple(PVar(u) if i == at else a for i, a in enumerate(args))
            free = tuple(a.name for i, a in enumerate(args) if i != at)
            params = (Param(u), *(Param(f"p{i}") for i in range(len(free))))
            ren = dict(zip(free, (p.name for p in params[1:]), strict=True))
            body = PApp(t.op, tuple(PVar(ren.get(a.name, a.name)) for a in inner))
            call = PMu(self.fresh("SD", param=False), params, (arg, *free), body)
            return PExists(arg, PConstr(call, arg, below))
        if kind == "local":  # ∃y. y ; (y ≈ app)
            y = self.fresh("sy", param=False)
            return PExists(y, PConstr(PVar(y), y, app))
        return app


@st.composite
def deep_spines(draw: Any) -> tuple[PatternDef, list[Term]]:
    """``o <= W; x <= q`` with x 4-7 levels down W, and terms: the one W and q abstract, the
    same with another term where x is, the same with another operator on the path, and a
    few random ones."""
    bottom = draw(terms(3))
    ab = _Abstractor(draw, bottom, 2, True)
    # (mostly a structure at q's top: there the pre-check has something to test)
    q, _ = (ab.struct if draw(ints(0, 3)) else ab.pat)(bottom, {}, 3)
    sp = _Spine(draw)
    t, p = bottom, PVar("x")
    path: list[tuple[Any, int, tuple]] = []
    levels = draw(ints(4, 7))
    for level in range(levels):
        op = draw(_PATH_OPS)
        n = op.n_in
        at = draw(ints(0, n - 1))
        others = [draw(_OTHERS) for _ in range(n - 1)]
        ins = tuple(others[:at] + [t] + others[at:])
        path.append((op, at, ins))
        t2 = op(*ins)
        p = sp.level(t2, p, at, level == levels - 1)
        t = t2
    body = PConstr(PConstr(PVar("o"), "o", p), "x", q)
    params = [Param("o"), Param("x")]
    params += [Param(x, k) for x, k in {**ab.params, **sp.params}.items()]  # type: ignore[arg-type]

    def rebuild(new_bottom: Term, swap: int | None = None) -> Term:
        t = new_bottom
        for i, (op, at, ins) in enumerate(path):
            if i == swap:
                op = next(o for o in (UNARY if op.n_in == 1 else BINARY) if o is not op)
            t = op(*(t if j == at else x for j, x in enumerate(ins)))
        return t

    targets = [
        t,
        rebuild(draw(terms(3))),
        rebuild(bottom, draw(ints(0, len(path) - 1))),
        draw(terms(4)),
    ]
    return PatternDef("P", tuple(params), body), targets


def reference(pdef: PatternDef, t: Term) -> list:
    sols = itertools.islice(_machine.solutions(pdef.body, t), MAX_SOLUTIONS)
    return [solution_key(theta, phi) for theta, phi in sols]


def compiled(cp: CompiledPattern, t: Term) -> list:
    sols = itertools.islice(cp.solutions(t), MAX_SOLUTIONS)
    return [solution_key(theta, phi) for theta, phi, _ in sols]


def check_a_term_the_deep_pre_check_refuses_has_no_match(pdef: PatternDef, targets: list) -> None:
    deep = _precheck._deep_prefilter(pdef.body)
    machine = CompiledPattern(pdef, backend="machine")
    with mock.patch.object(_codegen, "_INLINE_PATHS", 0):  # (generator functions)
        generated = CompiledPattern(pdef)
    for t in targets:
        expected = reference(pdef, t)
        if deep is not None and not _precheck._fits(deep, t):
            assert expected == [], t
        assert compiled(machine, t) == expected
        assert compiled(generated, t) == expected


def check_a_summary_carries_the_deep_pre_check(pdef: PatternDef, targets: list) -> None:
    cp = CompiledPattern(pdef, backend="machine")
    loaded = from_summary(PatternDef(pdef.name, pdef.params, pdef.body), summary(cp))
    assert loaded is not None and loaded._deep == cp._deep
    # and the machine's early checks, as working them out gives them
    assert _trail._early_shapes(pdef.body) == _trail._find_early_shapes(pdef.body)
    for t in targets:
        assert compiled(loaded, t) == reference(pdef, t)


def test_the_deep_pre_check_follows_the_path_down_to_x():
    # o <= f1(g2(f2(h2(w, f1(x))), w')) with x <= g2(a, a): the term's x is checked at
    # depth five, past the depth of the pre-check
    x_shape = PApp(G2, (PVar("y"), PVar("y")))
    path = PApp(F1, (PApp(G2, (PApp(F2, (PApp(H2, (PVar("w"), PApp(F1, (PVar("x"),)))),)),
                              PVar("v"))),))  # fmt: skip
    body = PConstr(PConstr(PVar("o"), "o", path), "x", x_shape)
    pdef = PatternDef("P", tuple(Param(n) for n in "oxywv"), body)
    deep = _precheck._deep_prefilter(pdef.body)
    assert deep is not None and _precheck._depth(deep) == 5
    good = F1(G2(F2(H2(B, F1(G2(A, A)))), C))
    bad = F1(G2(F2(H2(B, F1(H2(A, A)))), C))
    assert _precheck._fits(deep, good) and not _precheck._fits(deep, bad)
    assert _precheck._prefilter(pdef.body) is not None
    assert _precheck._fits(_precheck._prefilter(pdef.body), bad)  # (too deep for it)
    cp = CompiledPattern(pdef, backend="machine")
    assert cp.first(good) is not None and cp.first(bad) is None
    assert reference(pdef, bad) == []


def test_no_deep_pre_check_where_the_pattern_can_raise():
    # a recursive reference outside its definition raises in the machine: no pre-check may
    # skip the run that raises
    from pypm_jax.core.calculus import PCall

    path = PApp(F1, (PApp(F1, (PApp(F1, (PApp(F1, (PApp(F1, (PVar("x"),)),)),)),)),))
    raising = PApp(G2, (path, PCall("Nowhere", ("o",))))
    body = PConstr(PConstr(PVar("o"), "o", raising), "x", PApp(F2, (PVar("y"),)))
    assert _precheck._deep_prefilter(body) is None


def test_a_summary_with_a_bad_shared_shape_is_refused():
    x_shape = PApp(G2, (PVar("y"), PVar("y")))
    path = PApp(F1, (PApp(F1, (PApp(F1, (PApp(F1, (PApp(F1, (PVar("x"),)),)),)),)),))
    body = PConstr(PConstr(PVar("o"), "o", path), "x", x_shape)
    pdef = PatternDef("P", tuple(Param(n) for n in "oxy"), body)
    data = summary(CompiledPattern(pdef, backend="machine"))
    refs, root = data["deep"]
    assert from_summary(pdef, data) is not None
    for bad in ([refs, 7], [[[7]], root], [refs], "deep", [[*refs, root], len(refs) + 1]):
        assert from_summary(PatternDef("P", pdef.params, body), {**data, "deep": bad}) is None
    assert data["early"] is not None and set(data["early"]) == {"x"}
    for bad in ("early", ["x"], {"x": None}, {"x": [refs, 7]}, {1: data["early"]["x"]}):
        assert from_summary(PatternDef("P", pdef.params, body), {**data, "early": bad}) is None
    # the pre-check's shape is written shared too (summary format 3)
    assert data["shape"] is not None and len(data["shape"]) == 2
    shape_refs, shape_root = data["shape"]
    too_deep: list = [[F1.qualname, 1, None]]  # (an operator of the pattern, too deep)
    for _ in range(_precheck._SHAPE_DEPTH + 1):
        too_deep = [[F1.qualname, 1, [too_deep]]]
    assert from_summary(pdef, {**data, "shape": [[], [[F1.qualname, 1, None]]]}) is not None
    for bad in ([shape_refs, 7], [shape_refs], "shape", [[], too_deep], [[[7]], shape_root]):
        assert from_summary(PatternDef("P", pdef.params, body), {**data, "shape": bad}) is None


# ------------------------------------------------------------ look-ahead at alternates


def machine_run(pdef: PatternDef, t: Term, look: bool) -> tuple[list, int]:
    run = MatchRun()
    off = _trail._ByIdentity(lambda body: False)
    with mock.patch.object(_trail, "_looks_ahead", _trail._looks_ahead if look else off):
        sols = itertools.islice(_trail._trail_machine(pdef.body, t, run=run), MAX_SOLUTIONS)
        keys = [solution_key(theta, phi) for theta, phi, _ in sols]
    return keys, run.steps


@given(pattern_defs(), dags(), st.data())
def test_the_machine_looking_ahead_finds_the_same_solutions(pdef, pool, data):
    t = data.draw(st.sampled_from(pool[-4:]))
    looked, _ = machine_run(pdef, t, True)
    plain, _ = machine_run(pdef, t, False)
    assert looked == plain == reference(pdef, t)


def check_looking_ahead_finds_the_same_solutions(pdef: PatternDef, targets: list) -> None:
    for t in targets:
        looked, _ = machine_run(pdef, t, True)
        plain, _ = machine_run(pdef, t, False)
        assert looked == plain == reference(pdef, t)


@given(deep_spines())
def test_deep_spines_pre_check_summary_and_look_ahead(case):
    """Three properties of deep spines, on the same examples (Hypothesis draws each once;
    each property still sees CI's 2,000): a term the deep pre-check refuses has no match, and
    compiled patterns that run it give the reference's solutions; a summary carries it; the
    machine looking ahead finds the reference's solutions. Each property gets its own copy
    of the definition (caches of compiled patterns are by identity), as a test of its own
    did."""
    pdef, targets = case
    check_a_term_the_deep_pre_check_refuses_has_no_match(pdef, targets)
    check_a_summary_carries_the_deep_pre_check(fresh(pdef), targets)
    check_looking_ahead_finds_the_same_solutions(fresh(pdef), targets)


def fresh(pdef: PatternDef) -> PatternDef:
    return PatternDef(pdef.name, pdef.params, pdef.body, pdef.loc, pdef.alt_locs)


def test_an_alternate_that_cannot_match_is_not_tried():
    # (f1(g2(x, y)) ‖ f1(h2(x, y))) at f1(h2(a, b)): the left side's g2 is refused before
    # it is matched; at f2(a) neither side is tried
    p = PatternDef(
        "P",
        (Param("x"), Param("y")),
        PAlt(
            PApp(F1, (PApp(G2, (PVar("x"), PVar("y"))),)),
            PApp(F1, (PApp(H2, (PVar("x"), PVar("y"))),)),
        ),
    )
    for t, found in ((F1(H2(A, B)), 1), (F1(G2(A, B)), 1), (F2(A), 0)):
        looked, fewer = machine_run(p, t, True)
        plain, steps = machine_run(p, t, False)
        assert len(looked) == found and looked == plain
        assert fewer < steps


def _reads(shape: list, t: Any) -> bool:
    """What a shape says of a term, read plainly (the specification ``_fits`` keeps)."""
    return any(
        (op is None or t.op is op)
        and (n is None or len(t.inputs) == n)
        and (
            kids is None
            or all(k is None or _reads(k, i) for k, i in zip(kids, t.inputs, strict=True))
        )
        for op, n, kids in shape
    )


_OPS = (F1, F2, G2, H2)


@st.composite
def _shapes(draw: Any, depth: int = 3) -> list:
    alts = []
    for _ in range(draw(st.integers(1, 7))):
        op = draw(st.sampled_from((None, *_OPS, A.op)))
        n = draw(st.sampled_from((None, 0, 1, 2)))
        kids = None
        if n is not None and depth > 0 and draw(st.booleans()):
            kids = tuple(draw(st.none() | _shapes(depth - 1)) for _ in range(n))
        alts.append((op, n, kids))
    return alts


_small_terms = st.recursive(
    st.sampled_from((A, B, C)),
    lambda sub: (
        st.builds(F1, sub) | st.builds(F2, sub) | st.builds(G2, sub, sub) | st.builds(H2, sub, sub)
    ),
    max_leaves=8,
)


@settings(max_examples=300)
@given(_shapes(), st.lists(_small_terms, min_size=1, max_size=6))
def test_a_shapes_test_says_what_the_shape_says(shape, targets):
    test = _precheck._make_test(shape)
    assert _precheck._shape_of_test(test) == shape  # (a summary writes the shape back)
    for t in targets:
        assert _precheck._fits(shape, t) == _reads(shape, t)
        assert _precheck._passes(_precheck._test_of(shape), t) == _reads(shape, t)
        # (the function the pre-checks run: closures grouped by operator)
        assert _precheck._check_of(test)(t) == _reads(shape, t)
        # (what the index by signature reads: the shape's first two levels, so a term it
        # refuses is one the pre-check refuses)
        sig = signature(t)
        assert _precheck._admits(test, sig[0], sig[1:]) == _reads(_cut(shape, 1), t)


def _cut(shape: list | None, depth: int) -> list | None:
    """``shape`` read ``depth`` levels below its root, no further."""
    if shape is None:
        return None
    return [
        (op, n, None if kids is None or depth == 0 else tuple(_cut(k, depth - 1) for k in kids))
        for op, n, kids in shape
    ]
