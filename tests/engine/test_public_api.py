"""The engine through the public DSL: patterns and rules written with ``@pm.pattern`` and
``@pm.rule`` (sub-pattern calls, alternates, guards with real source lines)."""

from __future__ import annotations

import pypm_jax as pm
from pypm_jax.engine.fast import compile_pattern


@pm.op
def MatMul(x, y):
    return 1


@pm.op
def Trans(x):
    return 1


@pm.op
def Div(x, y):
    return 1


@pm.op
def Mul(x, y):
    return 1


@pm.op
def Plus(x, y):
    return 1


@pm.op
def Erf(x):
    return 1


@pm.op
def FusedMM(x, y):
    return 1


@pm.op
def FusedGelu(x):
    return 1


@pm.pattern
def MMxyT(x, y):
    assert x.shape.rank == 2  # the guard explain should point at
    return MatMul(x, Trans(y))


@pm.rule(MMxyT)
def fused_mm(x, y):
    return FusedMM(x, y)


@pm.pattern
def Half(x):
    return Div(x, 2)


@pm.pattern
def Half(x):  # noqa: F811
    return Mul(x, 0.5)


@pm.pattern
def Gelu(x):
    return Mul(Half(x), Plus(1, Erf(Div(x, 1.4142135623730951))))


@pm.rule(Gelu)
def gelu(x):
    return FusedGelu(x)


A = pm.leaf("a", shape=(4, 8), dtype="f32")
B = pm.leaf("b", shape=(4, 8), dtype="f32")
A3 = pm.leaf("a3", shape=(2, 4, 8), dtype="f32")


def gelu_term(x, half_by_mul: bool):
    half = Mul(x, 0.5) if half_by_mul else Div(x, 2)
    return Mul(half, Plus(1, Erf(Div(x, 1.4142135623730951))))


def test_dsl_patterns_compile_to_generated_code_and_agree_with_the_reference():
    for pat, t in [(MMxyT, MatMul(A, Trans(B))), (Gelu, gelu_term(A, True))]:
        pdef = pat.definition
        assert compile_pattern(pdef).backend == "generated"
        fast = pm.match(pat, t, engine="fast")
        ref = pm.match(pat, t, engine="reference")
        assert fast is not None and fast.theta == ref.theta


def test_rewrite_through_the_facade():
    g = pm.Graph([gelu_term(A, True), gelu_term(B, False), MatMul(A, Trans(B))])
    result = pm.rewrite(g, [fused_mm, gelu])
    assert g.to_terms() == [FusedGelu(A), FusedGelu(B), FusedMM(A, B)]
    assert result.report.counts() == {"gelu": 2, "fused_mm": 1}
    # the result's types are public names
    assert isinstance(result, pm.RewriteResult) and isinstance(result.report, pm.RewriteReport)
    assert all(isinstance(r, pm.RewriteRecord) for r in result.report)


def test_explain_points_at_the_assert_that_failed():
    e = pm.explain(MMxyT, MatMul(A3, Trans(B)))
    failure = e.best.failure
    assert failure.kind == "guard_failed"
    assert failure.loc is not None and failure.loc.file.endswith("test_public_api.py")
    assert "assert x.shape.rank == 2" in failure.loc.text
    text = str(e)
    assert f"test_public_api.py:{failure.loc.line}" in text
    assert "x.shape.rank = 3" in text or "x.rank = 3" in text
