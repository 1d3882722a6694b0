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


@pm.op
def Heavy(x):
    return 1


@pm.op
def Iota():
    return 1


def test_shareable_plumbing_does_not_block_single_use():
    """``shareable`` (pm.optimize passes its mask plumbing): a shared interior node it accepts,
    with its ancestors in the match, no longer blocks; anything else still does."""
    a, b, w = pm.leaf("a"), pm.leaf("b"), pm.leaf("w")
    shared = Broadcast(w)
    g = pm.Graph([Mul(a, shared), Mul(b, shared)])
    result = pm.rewrite(g, [fold], shareable=lambda n: n.op is Broadcast)
    assert [r.rule for r in result.report] == ["fold", "fold"]
    assert [v.op for v in result.graph.outputs] == [Scaled, Scaled]
    # the shared value is plumbing over real work inside the match: it still blocks
    heavy = Broadcast(Heavy(w))

    @pm.pattern
    def TimesHeavy(x):
        c = pm.var()
        return Mul(x, Broadcast(Heavy(c)))

    @pm.rule(TimesHeavy, single_use=True)
    def fold_heavy(x):
        return Scaled(x)

    g = pm.Graph([Mul(a, heavy), Mul(b, heavy)])
    assert list(pm.rewrite(g, [fold_heavy], shareable=lambda n: n.op is Broadcast).report) == []


def test_an_input_free_pure_node_is_a_constant():
    """An iota reads nothing: what is computed from it alone is shared freely."""
    a, b = pm.leaf("a"), pm.leaf("b")
    idx = Broadcast(Iota())
    g = pm.Graph([Mul(a, idx), Mul(b, idx)])
    assert [r.rule for r in pm.rewrite(g, [fold]).report] == ["fold", "fold"]
