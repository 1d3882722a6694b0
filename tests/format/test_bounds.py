"""Loading and serializing stay bounded: polynomial in chained match constraints, no Python
recursion by pattern depth, limits on what a loaded item may ask of the matching process,
and nothing left behind by a refused blob."""

from __future__ import annotations

import gc
import importlib.util
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pypm_jax as pm
from pypm_jax.core import calculus as _calculus
from pypm_jax.core.calculus import (
    EAttr,
    EBin,
    ECall,
    ECmp,
    EConst,
    EUnary,
    PAlt,
    PApp,
    Param,
    PatternDef,
    PConstr,
    PExists,
    PFunVar,
    PGuard,
    PMu,
    PVar,
    binds_below,
)
from pypm_jax.core.terms import OpClass, Operator
from pypm_jax.format import (
    MAX_EXPONENT,
    MAX_EXPR_DEPTH,
    MAX_INT_BITS,
    MAX_LITERAL_ITEMS,
    MAX_OPERANDS,
    MAX_STRING,
    deserialize,
    serialize,
)
from pypm_jax.lang.registry import GUARD_FNS
from pypm_jax.semantics.guards import guard_holds

F = Operator("F", 1, namespace="tests.bounds")
G = Operator("G", 2, namespace="tests.bounds")


def doc(**tables):
    d = {"format": "pypm", "version": 1, "minor": 1, "items": [], "guard_locs": []}
    for t in ("ops", "guard_fns", "locs", "values", "exprs", "patterns", "rhs", "defs", "rules"):
        d[t] = tables.get(t, [])
    return json.dumps(d).encode()


def chain(n: int) -> PatternDef:
    """``x <= F(y1); x <= F(y2); ...``: n constraints on one variable, each under the last.
    The old closedness check asked binds_below twice per link: 2^n steps."""
    p: _calculus.Pattern = PVar("x")
    for i in range(n):
        p = PConstr(p, "x", PApp(F, (PVar(f"y{i}"),)))
    for i in reversed(range(n)):
        p = PExists(f"y{i}", p)
    return PatternDef("Chain", (Param("x"),), p)


def deep(n: int, leaf: str = "x") -> PatternDef:
    """A pattern n applications deep, with a guard every third level."""
    p: _calculus.Pattern = PVar(leaf)
    for i in range(n):
        p = PApp(F, (p,))
        if i % 3 == 0:
            p = PGuard(p, ECmp(">=", EAttr(leaf, "rank"), EConst(i % 5)))
    return PatternDef("Deep", (Param(leaf),), p)


# ------------------------------------------------------------- constraint chains (item 5)


@pytest.mark.parametrize("n", [40, 60])
def test_chained_constraints_serialize_and_load(n):
    d = chain(n)
    blob = serialize([d, F])  # serialize checks the blob loads: both walks run
    loaded, _ = deserialize(blob, ops=[F])
    assert loaded == d


def test_binds_below_asks_each_question_once():
    """The questions about a chain grow linearly with its length, not exponentially, and a
    memo shared by the questions of one definition answers each once."""
    sizes = []
    for n in (10, 20, 40):
        memo: dict = {}
        body = chain(n).body
        while isinstance(body, PExists):
            body = body.body
        links = []
        while isinstance(body, PConstr):
            links.append(body)
            body = body.pat
        for link in links:
            assert binds_below(link.pat, link.var, memo) is False
        sizes.append(len(memo))
    assert sizes[2] <= 4 * sizes[0] + 20, sizes


def _reference_binds(p, var, below):
    """binds_below as first written: the plain recursive definition (exponential)."""
    match p:
        case PVar(x):
            return not below and x == var
        case PApp(_, args, _) | PFunVar(_, args, _, _):
            return any(_reference_binds(a, var, False) for a in args)
        case PAlt(left, right):
            return _reference_binds(left, var, below) and _reference_binds(right, var, below)
        case PGuard(pat, _):
            return _reference_binds(pat, var, below)
        case PExists(x, pat, kind):
            return not (x == var and kind == "term") and _reference_binds(pat, var, below)
        case PConstr(pat, x, c):
            return (
                _reference_binds(pat, var, below)
                or (below and _reference_binds(c, var, True))
                or (_reference_binds(pat, x, below) and _reference_binds(c, var, False))
            )
        case PMu(_, params, args, body):
            return any(
                arg == var and prm.kind == "term" and _reference_binds(body, prm.name, below)
                for prm, arg in zip(params, args, strict=True)
            )
    return False


NAMES = st.sampled_from(["x", "y", "z"])
small_patterns = st.recursive(
    NAMES.map(PVar),
    lambda inner: st.one_of(
        st.builds(lambda a: PApp(F, (a,)), inner),
        st.builds(lambda a, b: PApp(G, (a, b)), inner, inner),
        st.builds(PAlt, inner, inner),
        st.builds(lambda a: PGuard(a, EConst(True)), inner),
        st.builds(PExists, NAMES, inner),
        st.builds(PConstr, inner, NAMES, inner),
        # a definition instantiated at a variable (``UnaryOp(t)``, body ``F(p)``)
        st.builds(
            lambda prm, arg, body: PMu("Q", (Param(prm),), (arg,), body), NAMES, NAMES, inner
        ),  # fmt: skip
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(small_patterns, NAMES)
def test_binds_below_agrees_with_the_recursive_definition(p, var):
    assert binds_below(p, var) == _reference_binds(p, var, True)


# ------------------------------------------------------------ deep patterns (item 8)


def test_deep_patterns_compare_hash_and_round_trip():
    a, b = deep(10_000), deep(10_000)
    assert a is not b and a == b and hash(a) == hash(b)
    assert a != deep(10_000, "y") and a != deep(9_999)
    assert len({a.body, b.body}) == 1
    (loaded,) = [x for x in deserialize(serialize([a, F]), ops=[F]) if x != F]
    assert loaded == a and hash(loaded) == hash(a)


def test_node_equality_is_structural_as_before():
    """What the dataclass methods said, said without recursion: fields with compare=False
    (source locations) are ignored, 1 == 1.0 inside literals, types must agree."""
    g1 = PGuard(PVar("x"), EConst((1, 2)), loc=_calculus.SourceLoc("a.py", 1, ""))
    g2 = PGuard(PVar("x"), EConst((1.0, 2)), loc=None)
    assert g1 == g2 and hash(g1) == hash(g2)
    assert PVar("x") != EAttr("x", "rank") and PApp(F, (PVar("x"),)) != PApp(F, (PVar("y"),))
    assert PApp(F, (PVar("x"),), 0) != PApp(F, (PVar("x"),), 1)
    shared = deep(50).body
    assert PAlt(shared, shared) == PAlt(deep(50).body, deep(50).body)


# --------------------------------------------------------------------- limits (item 6)

OP = {"name": "Big", "namespace": "tests", "n_in": 1, "n_out": 1, "attrs": [], "op_class": None,
      "pure": True}  # fmt: skip


@pytest.mark.parametrize(
    "blob, match",
    [
        (doc(ops=[{**OP, "n_out": 10**9}]), "MAX_OPERANDS"),
        (doc(ops=[{**OP, "n_in": MAX_OPERANDS + 1}]), "MAX_OPERANDS"),
        (doc(values=[{"k": "int", "v": 1 << MAX_INT_BITS}]), "MAX_INT_BITS"),
        (doc(values=[{"k": "str", "v": "a" * (MAX_STRING + 1)}]), "MAX_STRING"),
        (doc(ops=[{**OP, "name": "n" * (MAX_STRING + 1)}]), "MAX_STRING"),
        (
            doc(values=[{"k": "none"}, {"k": "tuple", "items": [0] * (MAX_LITERAL_ITEMS + 1)}]),
            "MAX_LITERAL_ITEMS",
        ),
        (
            doc(patterns=[{"k": "fun_var", "var": "F", "args": [], "index": 0, "n_out": 10**9}]),
            "MAX_OPERANDS",
        ),
    ],
)
def test_loaded_data_has_limits(blob, match):
    with pytest.raises(pm.FormatError, match=match):
        deserialize(blob)


def _power_guard(exponent):
    """``P(x) = x ; guard(7 ** exponent > 0)``"""
    guard = ECmp(">", EBin("**", EConst(7), exponent), EConst(0))
    return PatternDef("Pow", (Param("x"),), PGuard(PVar("x"), guard))


def test_a_constant_power_is_refused_at_load():
    """The 851-byte reproducer: ``7 ** 30000000 > 0`` took minutes at match time."""
    fine = serialize([_power_guard(EConst(MAX_EXPONENT))])
    bad = json.loads(fine)
    (v,) = [v for v in bad["values"] if v.get("v") == MAX_EXPONENT]
    v["v"] = 30_000_000
    with pytest.raises(pm.FormatError, match="MAX_EXPONENT"):
        deserialize(json.dumps(bad).encode())
    with pytest.raises(pm.FormatError, match="MAX_EXPONENT"):
        serialize([_power_guard(EUnary("-", EConst(30_000_000)))])
    assert len(deserialize(fine)) == 1


def test_guard_arithmetic_is_bounded_at_match_time():
    """Operands a loader cannot see (computed, or read from the graph) are bounded too: the
    guard is undefined, so it does not hold, at once."""
    huge = EBin("*", EConst(30_000), EConst(1_000))
    assert not guard_holds(ECmp(">", EBin("**", EConst(7), huge), EConst(0)), {}, {})
    assert guard_holds(ECmp(">", EBin("**", EConst(7), EConst(300)), EConst(0)), {}, {})
    big = EConst(1 << 1000)
    product = EBin("*", EBin("*", big, big), EBin("*", big, big))
    assert not guard_holds(ECmp(">", EBin("*", product, product), EConst(0)), {}, {})
    repeated = EBin("*", EConst("ab"), EConst(10**8))
    assert not guard_holds(ECmp("==", ECall(GUARD_FNS["len"], (repeated,)), EConst(0)), {}, {})
    fmt = EBin("%", EConst("%099999999d"), EConst(1))
    assert not guard_holds(ECmp("!=", fmt, EConst("")), {}, {})
    prod = ECall(GUARD_FNS["prod"], (EConst((big.value,) * 8),))
    assert not guard_holds(ECmp(">", prod, EConst(0)), {}, {})
    x = pm.leaf("x", shape=(2, 3), dtype="f32")
    dims = EBin("**", EAttr("x", "rank"), EBin("*", EConst(10**6), EAttr("x", "rank")))
    pattern = PatternDef("P", (Param("x"),), PGuard(PVar("x"), ECmp(">", dims, EConst(0))))
    for engine in ("reference", "fast"):  # the fast engine's generated guard code too
        assert pm.match(pattern, x, engine=engine) is None
    small = EBin("**", EAttr("x", "rank"), EBin("*", EConst(3), EAttr("x", "rank")))
    fits = PatternDef("Q", (Param("x"),), PGuard(PVar("x"), ECmp(">", small, EConst(0))))
    for engine in ("reference", "fast"):
        assert pm.match(fits, x, engine=engine) is not None


# -------------------------------------------------------------- refused blobs (item 7)


def test_a_refused_load_leaves_no_interned_names():
    n = 50_000
    values = [{"k": "opclass", "v": f"tests.bounds.leak{i}"} for i in range(n)]
    ops = [{**OP, "name": f"Leak{i}", "op_class": f"tests.bounds.opleak{i}"} for i in range(100)]
    blob = doc(ops=ops, values=values, patterns=[{"k": "var", "name": ""}])
    gc.collect()
    before = len(OpClass._interned)
    for _ in range(3):
        try:
            deserialize(blob)
        except pm.FormatError:
            pass
        else:
            raise AssertionError("the blob should be refused")
        assert len(OpClass._interned) == before
    with pytest.raises(pm.FormatError) as info:  # even while the error is kept
        deserialize(blob)
    assert len(OpClass._interned) == before
    del info


def test_interning_still_gives_one_object_per_name():
    kept = OpClass("tests.bounds.kept")
    guard = ECmp("==", EAttr("x", "op_class"), EConst(OpClass("tests.bounds.kept")))
    (p,) = deserialize(serialize([PatternDef("P", (Param("x"),), PGuard(PVar("x"), guard))]))
    assert p.body.guard.right.value is kept


@pm.pattern
def HugePower(x):
    assert x.rank**30_000_000 > 0
    return x


def test_the_dsl_refuses_a_constant_power_at_definition():
    with pytest.raises(pm.PatternDefinitionError, match="MAX_EXPONENT") as info:
        _ = HugePower.definition
    assert "test_bounds.py" in str(info.value)


def test_guard_expressions_have_a_depth_limit():
    """Guards are evaluated recursively at match time: a loaded one cannot be 10,000 deep."""
    values = [{"k": "int", "v": 1}]
    exprs = [{"k": "const", "value": 0}]
    for i in range(MAX_EXPR_DEPTH - 1):
        exprs.append({"k": "unary", "op": "-", "operand": i})
    patterns = [{"k": "var", "name": "x"}, {"k": "guard", "pat": 0, "guard": 0, "loc": None}]
    deserialize(doc(values=values, exprs=exprs, patterns=patterns))
    exprs.append({"k": "not", "operand": len(exprs) - 1})
    with pytest.raises(pm.FormatError, match="MAX_EXPR_DEPTH"):
        deserialize(doc(values=values, exprs=exprs, patterns=patterns))


def test_a_dsl_pattern_with_40_chained_constraints_serializes(tmp_path):
    """The issue's second reproducer: 30 chained constraints took 11 s in pm.serialize."""
    n = 40
    source = [
        "import pypm_jax as pm",
        "@pm.op",
        "def G(x):",
        "    return 1",
        "@pm.pattern",
        "def Chain(x):",
        *(f"    y{i} = pm.var()" for i in range(n)),
        *(f"    x <= G(y{i})" for i in range(n)),
        "    return x",
    ]
    path = tmp_path / "chain40.py"
    path.write_text("\n".join(source) + "\n")
    spec = importlib.util.spec_from_file_location("chain40", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (loaded,) = deserialize(serialize([module.Chain.definition]), ops=[module.G])
    assert loaded == module.Chain.definition
