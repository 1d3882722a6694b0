"""Single-use rules are not blocked by shared literals or nodes computed from them alone."""

import pypm_jax as pm


@pm.op
def Mul(x, y):
    return 1


@pm.op
def Broadcast(x):
    return 1


@pm.op
def Scaled(x):
    return 1


@pm.pattern
def TimesBroadcast(x):
    c = pm.var()
    return Mul(x, Broadcast(c))


@pm.rule(TimesBroadcast, single_use=True)
def fold(x):
    return Scaled(x)


def test_shared_constant_subexpression_does_not_block_single_use():
    a, b = pm.leaf("a"), pm.leaf("b")
    ones = Broadcast(pm.const(1.0))  # one node, read by both matches
    g = pm.Graph([Mul(a, ones), Mul(b, ones)])
    result = pm.rewrite(g, [fold])
    assert [r.rule for r in result.report] == ["fold", "fold"]
    assert [v.op for v in result.graph.outputs] == [Scaled, Scaled]


def test_shared_computed_value_still_blocks_single_use():
    a, b, w = pm.leaf("a"), pm.leaf("b"), pm.leaf("w")
    shared = Broadcast(w)  # computed from an input: real work, shared
    g = pm.Graph([Mul(a, shared), Mul(b, shared)])
    result = pm.rewrite(g, [fold])
    assert list(result.report) == []
