"""The rewrite driver when a rule goes wrong: a failed rewrite leaves the graph as it was,
replacements keep their type, misspelt guard attributes and raising guard functions are
named, and printed reports cannot be forged by names."""

from __future__ import annotations

import warnings

import pytest

import pypm_jax as pm
from pypm_jax.core.calculus import (
    EConst,
    PApp,
    Param,
    PatternDef,
    PVar,
    RApp,
    RuleBranch,
    RuleDef,
    RVar,
)
from pypm_jax.core.errors import GuardFunctionWarning, RuleError, SourceLoc
from pypm_jax.core.graph import Graph
from pypm_jax.core.terms import Operator, leaf
from pypm_jax.engine.rewrite import RewriteRecord, RewriteReport, rewrite


def _same(*xs, **_):
    return (xs[0].shape, xs[0].dtype)


def _transposed(x, **_):
    return (tuple(reversed(x.shape)), x.dtype)


F = Operator("f", 1, infer=_same, namespace="reliability_tests")
G = Operator("g", 1, infer=_same, namespace="reliability_tests")
H = Operator("h", 2, infer=_same, namespace="reliability_tests")
T = Operator("t", 1, infer=_transposed, namespace="reliability_tests")
A = leaf("a", shape=(2, 3), dtype="f32")
B = leaf("b", shape=(2, 3), dtype="f32")
X = PVar("x")
HERE = SourceLoc(__file__, 1)


def _rule(name, op, result, loc=None):
    pdef = PatternDef(f"{op.name}x", (Param("x"),), PApp(op, (X,)))
    return RuleDef(name, pdef, (RuleBranch(EConst(True), result),), loc=loc)


F_TO_G = _rule("f_to_g", F, RApp(G, (RVar("x"),)))
BROKEN = _rule("broken", G, RApp(H, (RVar("x"),)), loc=HERE)  # h takes two inputs
G_TO_F = _rule("g_to_f", G, RApp(F, (RVar("x"),)))


def _state(g: Graph):
    """Everything a reader of the graph can see, by identity where it matters."""
    values = [v for n in g.nodes() for v in n.outputs] + g.inputs
    return (
        str(g),
        [(n.id, n.op, tuple(id(v) for v in n.inputs), n.alive) for n in g.nodes()],
        [(id(v), sorted(u.id for u in g.users(v))) for v in values],
        [id(v) for v in g.outputs],
        len(g),
    )


def _graph():
    return Graph([H(F(A), F(B)), G(B)])


def test_a_rule_error_leaves_the_graph_exactly_as_it_was():
    g = _graph()
    before = _state(g)
    kept = list(g.nodes())
    with pytest.raises(RuleError, match=f"rule broken \\({__file__}:1\\)") as info:
        rewrite(g, [F_TO_G, BROKEN])  # f_to_g fires twice, then broken fails on a g
    assert info.value.rule is BROKEN
    assert _state(g) == before  # no partial rewrite, no orphan node
    assert all(n.alive for n in kept)
    # and the graph still rewrites as if nothing had happened
    rewrite(g, [F_TO_G])
    assert g.to_terms() == [H(G(A), G(B)), G(B)]


def test_a_rewrite_limit_leaves_the_graph_exactly_as_it_was():
    g = _graph()
    before = _state(g)
    with pytest.raises(pm.RewriteLimitError):
        rewrite(g, [F_TO_G, G_TO_F], max_iterations=10)
    assert _state(g) == before


def test_a_replacement_of_another_shape_is_a_rule_error_when_types_are_checked():
    swap = _rule("swap", F, RApp(T, (RVar("x"),)), loc=HERE)
    g = Graph([G(F(A))])
    before = _state(g)
    with pytest.raises(RuleError, match=r"rule swap \(.*:1\).*f32\[3,2\].*f32\[2,3\].*shape"):
        rewrite(g, [swap], check_types=True)
    assert _state(g) == before
    rewrite(g, [F_TO_G], check_types=True)  # a replacement of the same type is fine
    assert g.to_terms() == [G(G(A))]


def test_a_replacement_of_another_weak_type_is_a_rule_error_where_it_is_known():
    f_to_x = _rule("f_to_x", F, RVar("x"))
    g = Graph([G(F(A))])
    weak = {id(v): v.node.op is F for v in [*g.values(), *g.inputs]}  # f(a) weak, a strong
    with pytest.raises(RuleError, match=r"f_to_x.*weak type \(strong for weak\)"):
        rewrite(g, [f_to_x], check_types=True, weak_type=lambda v: weak.get(id(v)))
    rewrite(g, [f_to_x], check_types=True, weak_type=lambda v: None)  # unknown: no check
    assert g.to_terms() == [G(A)]


# ------------------------------------------------------------------------------ guards


def test_a_misspelt_guard_attribute_is_a_definition_error_naming_the_line():
    @pm.pattern
    def Misspelt(x):
        assert x.dtpye == pm.f32
        return F(x)

    # (a pattern's body is compiled when first used, as a redefinition may add alternates)
    with pytest.raises(pm.PatternDefinitionError, match=r"dtpye.*did you mean 'dtype'") as info:
        pm.match(Misspelt, F(A))
    assert f"{__file__}:" in str(info.value) and "x.dtpye" in str(info.value)


def test_declared_operator_attributes_are_still_readable():
    Scaled = Operator("scaled", 1, attrs=("factor",), namespace="reliability_tests")

    @pm.pattern
    def Big(x):
        y = Scaled(x)
        assert y.factor > 2
        return y

    assert pm.match(Big, Scaled(A, factor=3)) is not None


@pm.guard_fn("reliability_tests.exploding")
def exploding(shape):
    raise ValueError(f"cannot judge {shape}")


@pm.pattern
def Judged(x):
    assert exploding(x.shape)
    return F(x)


@pm.rule(Judged)
def judged(x):
    return G(x)


def test_a_guard_function_that_raises_is_named_with_the_rule():
    g = Graph([F(A)])
    with pytest.warns(GuardFunctionWarning, match="exploding raised ValueError") as record:
        pm.rewrite(g, [judged])
    (w,) = record
    assert "judged" in str(w.message) and f"{__file__}:" in str(w.message)
    assert g.to_terms() == [F(A)]  # its guard does not hold: nothing fired


def test_a_guard_function_that_raises_outside_a_rewrite_warns():
    with pytest.warns(GuardFunctionWarning, match="cannot judge"):
        assert pm.match(Judged, F(A)) is None


def test_guard_functions_that_answer_do_not_warn():
    @pm.guard_fn("reliability_tests.wide")
    def wide(shape):
        return shape[-1] > 2

    @pm.pattern
    def Wide(x):
        assert wide(x.shape)
        return F(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert pm.match(Wide, F(A)) is not None


# ----------------------------------------------------------------------------- reports


def test_printed_reports_escape_control_characters_and_lone_surrogates():
    record = RewriteRecord(
        rule="evil\nrule",
        pattern="pat\r\x1b[2J",
        root=3,
        replaced=(3,),
        source=SourceLoc("x.py\u2028y", 2),
        module_path="mod\ud800",
        op="op\n#  injected",
    )
    text = str(RewriteReport([record]))
    assert len(text.splitlines()) == 2  # the header and one row
    assert "evil\\nrule" in text and "\\ud800" in text and "\\u2028" in text
    text.encode("utf-8")  # printable: no lone surrogate left
    # the table leaves out the pattern and the root's operator; the record's own line has them
    line = str(record)
    assert "\\x1b" in line and "\n" not in line and "\r" not in line
    assert "\n" not in str(record)
