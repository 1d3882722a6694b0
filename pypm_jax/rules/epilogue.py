"""GEMM epilogue regions: a GEMM and the pointwise operators after it → one fused kernel.

The paper's directed graph partitioning (``PwSubgraph`` / ``MatMulEpilog``, in the corrected
form of ``tests/pypm_testing/paper_patterns.py``) as a standard rule. ``PwRegion`` matches a
value computed from one GEMM ``y`` by pointwise operators, recursively: unary operators and
casts of a region, binary operators of two regions, ``select_n`` and ``clamp`` of regions,
literals, and one binary operator applying an operand ``o`` (a bias, a per-row scale, a
residual, a scalar tensor) to the GEMM itself. Operator variables with op-class guards match
the operators, like the paper's ``UnaryOp``; :func:`~pypm_jax.rules._gemm_regions.region_prim`
keeps the ones the kernel's epilogue lowers. ``y`` is a bare ``dot_general`` contracting x's
last axis with a matrix, or a GEMM kernel node a rule already built (``GemmRegion``,
``GemmEpilogue``), so a region grows rewrite by rewrite: each rewrite absorbs the pointwise
operators whose other readers are all inside the match (``single_use``), and at most one new
operand; the next rewrite continues from the node it built. A region therefore ends where a
value is read outside it, at an operator the kernel cannot lower, or at an operand the kernel
cannot tile (``pm.explain`` names the node and the check).

The rule's guard function :func:`~pypm_jax.rules._gemm_regions.region_plan` turns the match
into the region as data (:mod:`pypm_jax.rules._region`) and the kernel plan; the
``GemmRegion`` node carries both, the report shows the region, and lowering compiles it into
``pallas_kernels.gemm_fused``'s epilogue.

``Gemm`` also takes MoE experts run densely (``transpose(dot_general)`` of a weight
``[E, K, N]`` and an activation every expert shares, into ``[E, *lead, N]``): their regions
lower to ``pallas_kernels.gemm_fused_experts``. The opt-in rule ``gemm_epilogue_pair``
(``PAIR_RULES``) makes a region whose last operand is a second GEMM of its own x one
``GemmPairRegion`` computing both (``pallas_kernels.gemm_fused_pair``).
"""

from __future__ import annotations

from ..lang import frontend as pm
from ..vocab import prims as P
from ._gemm_regions import (
    beyond_linear,
    computed_from_literals,
    experts_gemm,
    gemm_has_bias,
    pair_plan,
    reads_gemm,
    region_plan,
    region_prim,
)
from ._kernels import GemmEpilogue, GemmPairRegion, GemmRegion, RegionOperands

__all__ = [
    "EPILOGUE_RULES",
    "PAIR_RULES",
    "PwRegion",
    "Gemm",
    "gemm_epilogue_region",
    "gemm_epilogue_pair",
]


@pm.pattern
def Gemm(x, w, u):
    """A GEMM kernel node a rule built (``GemmRegion(x, w, u)``, ``GemmEpilogue(x, w, u)``)."""
    G = pm.Op(3, 1)
    assert G.op_class == pm.opclass("gemm")
    return G(x, w, u)


@pm.pattern
def Gemm(x, w, u):  # noqa: F811 (alternates share a name)
    """A bare ``dot_general(x, w)`` (u stays unbound)."""
    return P.dot_general(x, w)


@pm.pattern
def Gemm(x, w, u):  # noqa: F811
    """MoE experts run densely: ``transpose(dot_general(w, x))`` of a weight ``[E, K, N]``
    and an activation ``[*lead, K]`` shared by every expert, into ``[E, *lead, N]``
    (keras-hub's Mixtral: ``einsum("th,ehm->etm")``)."""
    y, d = pm.var(), pm.var()
    y <= P.transpose(d)
    d <= P.dot_general(w, x)
    assert experts_gemm(y.term) == 0
    return y


@pm.pattern
def Gemm(x, w, u):  # noqa: F811
    """The same, the activation the ``dot_general``'s lhs."""
    y, d = pm.var(), pm.var()
    y <= P.transpose(d)
    d <= P.dot_general(x, w)
    assert experts_gemm(y.term) == 1
    return y


@pm.pattern
def GemmRoot(v):
    """What a ``Gemm`` can be rooted at: a ``dot_general``, a ``transpose`` or an
    operator of class ``gemm`` (one guard, so that the many values a region's recursion
    meets that are none of these are turned away before ``Gemm``'s alternates are tried)."""
    assert v.op == P.dot_general or v.op == P.transpose or v.op_class == pm.opclass("gemm")
    return v


@pm.pattern
def GemmValue(y, x, w, u):
    y <= GemmRoot(y)
    y <= Gemm(x, w, u)
    return y


@pm.pattern
def PwRegion(y, x, w, u, o):
    """The GEMM itself (where the recursion ends)."""
    return GemmValue(y, x, w, u)


@pm.pattern
def PwRegion(y, x, w, u, o):  # noqa: F811
    """A literal."""
    c = pm.var()
    assert computed_from_literals(c.term)
    return c


@pm.pattern
def PwRegion(y, x, w, u, o):  # noqa: F811
    """The operand ``o`` applied to the GEMM: ``y + bias``, ``y * row_scale``..."""
    F = pm.Op(2, 1)
    assert F.op_class == pm.opclass("binary_pointwise") and region_prim(F.name)
    assert not computed_from_literals(o.term) and not reads_gemm(o.term)
    return F(GemmValue(y, x, w, u), o)


@pm.pattern
def PwRegion(y, x, w, u, o):  # noqa: F811
    F = pm.Op(2, 1)
    assert F.op_class == pm.opclass("binary_pointwise") and region_prim(F.name)
    assert not computed_from_literals(o.term) and not reads_gemm(o.term)
    return F(o, GemmValue(y, x, w, u))


@pm.pattern
def UnaryOp(t):
    """``F(t)``, F a unary pointwise operator or a cast the epilogue lowers (the paper's
    ``UnaryOp``). A sub-pattern's guard is checked as soon as its body matched, and a match
    constraint after the pattern it constrains: ``t <= PwRegion(..); return UnaryOp(t)``
    turns any other operator away before exploring its operand, where a guard beside
    ``F(PwRegion(..))`` would be checked only once the recursion had walked back through
    every operator of that arity (the whole network behind a residual add)."""
    F = pm.Op(1, 1)
    assert (
        F.op_class == pm.opclass("unary_pointwise") or F.op_class == pm.opclass("conversion")
    ) and region_prim(F.name)
    return F(t)


@pm.pattern
def BinaryOp(t, t2):
    """``F(t, t2)``, F a binary pointwise operator the epilogue lowers (see :func:`UnaryOp`)."""
    F = pm.Op(2, 1)
    assert F.op_class == pm.opclass("binary_pointwise") and region_prim(F.name)
    return F(t, t2)


@pm.pattern
def PwRegion(y, x, w, u, o):  # noqa: F811
    """A unary pointwise operator or a cast of a region."""
    t = pm.var()
    t <= PwRegion(y, x, w, u, o)
    return UnaryOp(t)


@pm.pattern
def PwRegion(y, x, w, u, o):  # noqa: F811
    """A binary pointwise operator of two regions (or a region and a literal)."""
    t, t2 = pm.var(), pm.var()
    t <= PwRegion(y, x, w, u, o)
    t2 <= PwRegion(y, x, w, u, o)
    return BinaryOp(t, t2)


@pm.pattern
def PwRegion(y, x, w, u, o):  # noqa: F811
    return P.select_n(PwRegion(y, x, w, u, o), PwRegion(y, x, w, u, o), PwRegion(y, x, w, u, o))


@pm.pattern
def PwRegion(y, x, w, u, o):  # noqa: F811
    return P.clamp(PwRegion(y, x, w, u, o), PwRegion(y, x, w, u, o), PwRegion(y, x, w, u, o))


@pm.pattern
def FedByGemm(v):
    """Any value a GEMM feeds through pointwise operators, and not only by steps XLA folds
    into its own GEMM (two cheap walks, no backtracking: ``region_plan`` refuses a linear
    region on a bare GEMM, so the recursion need not find every one to be refused)."""
    assert reads_gemm(v.term)
    assert beyond_linear(v.term)
    return v


@pm.pattern
def RegionStep(v):
    """A step a region can end with: a unary or binary operator the epilogue lowers, a
    ``select_n`` or a ``clamp`` (what ``PwRegion`` matches, the GEMM and literals aside).
    Its operator variables' op-class guards give the pattern's root index: only values of
    those classes and operators are tried (:func:`pypm_jax.engine.analysis.root_set`)."""
    return UnaryOp(pm.var())


@pm.pattern
def RegionStep(v):  # noqa: F811
    return BinaryOp(pm.var(), pm.var())


@pm.pattern
def RegionStep(v):  # noqa: F811
    return P.select_n(pm.var(), pm.var(), pm.var())


@pm.pattern
def RegionStep(v):  # noqa: F811
    return P.clamp(pm.var(), pm.var(), pm.var())


@pm.pattern
def GemmEpilogueRegion(r, y, x, w, u, o):
    """A region's root; ``FedByGemm`` first, so the recursion only explores values a GEMM
    feeds. A value ``FedByGemm`` lets in is no GEMM and no literal, so a region there ends
    with a step (``RegionStep``)."""
    r <= FedByGemm(r)
    r <= RegionStep(r)
    r <= PwRegion(y, x, w, u, o)
    return r


@pm.rule(GemmEpilogueRegion, single_use=True)
def gemm_epilogue_region(r, y, x, w, u, o):
    dtypes = (x.dtype, w.dtype, y.dtype)
    alone = region_plan(r.term, y.term, None, x.shape, w.shape, dtypes)
    if y.op == P.dot_general:
        if alone != None:  # noqa: E711 (guards compare with None by value)
            return GemmRegion(x, w, 0, region=alone[0], plan=alone[1])
        with_o = region_plan(r.term, y.term, o.term, x.shape, w.shape, dtypes)
        assert with_o != None  # noqa: E711
        return GemmRegion(x, w, RegionOperands(0, o), region=with_o[0], plan=with_o[1])
    elif y.op == P.transpose:  # experts (the Gemm alternates above)
        if alone != None:  # noqa: E711
            return GemmRegion(x, w, 0, region=alone[0], plan=alone[1])
        with_o = region_plan(r.term, y.term, o.term, x.shape, w.shape, dtypes)
        assert with_o != None  # noqa: E711
        return GemmRegion(x, w, RegionOperands(0, o), region=with_o[0], plan=with_o[1])
    elif y.op == GemmRegion:
        if alone != None:  # noqa: E711
            return GemmRegion(x, w, u, region=alone[0], plan=alone[1])
        with_o = region_plan(r.term, y.term, o.term, x.shape, w.shape, dtypes)
        assert with_o != None  # noqa: E711
        return GemmRegion(x, w, RegionOperands(u, o), region=with_o[0], plan=with_o[1])
    elif y.op == GemmEpilogue and gemm_has_bias(y.plan):
        if alone != None:  # noqa: E711
            return GemmRegion(x, w, RegionOperands(0, u), region=alone[0], plan=alone[1])
        with_o = region_plan(r.term, y.term, o.term, x.shape, w.shape, dtypes)
        assert with_o != None  # noqa: E711
        packed = RegionOperands(RegionOperands(0, u), o)
        return GemmRegion(x, w, packed, region=with_o[0], plan=with_o[1])
    elif y.op == GemmEpilogue:
        if alone != None:  # noqa: E711
            return GemmRegion(x, w, 0, region=alone[0], plan=alone[1])
        with_o = region_plan(r.term, y.term, o.term, x.shape, w.shape, dtypes)
        assert with_o != None  # noqa: E711
        return GemmRegion(x, w, RegionOperands(0, o), region=with_o[0], plan=with_o[1])


EPILOGUE_RULES = [gemm_epilogue_region]


@pm.pattern
def GatedPair(r, x, w, rest, w2, d):
    """A region whose last operand is a second GEMM of its own x: ``act(x @ w1) * (x @ w2)``
    after the rules above (the activation's kernel reading the other GEMM as a full
    tile)."""
    r <= GemmRegion(x, w, RegionOperands(rest, d))
    d <= P.dot_general(x, w2)
    assert pair_plan(r.term, d.term) != None  # noqa: E711
    return r


@pm.rule(GatedPair, single_use=True)
def gemm_epilogue_pair(r, x, w, rest, w2, d):
    """Both GEMMs of a gated pair in one kernel (``pallas_kernels.gemm_fused_pair``): the
    second one's tiles are computed next to the first's instead of read back."""
    plan = pair_plan(r.term, d.term)
    return GemmPairRegion(x, w, w2, rest, region=r.region, plan=plan)


PAIR_RULES = [gemm_epilogue_pair]
