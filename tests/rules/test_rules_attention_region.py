"""Attention score and mask modifiers as regions (``rules/attention_region.py``).

A table of hand-written logits spellings the fixed attention rules do not match, each in
two forms: every one is rewritten into one ``AttentionRegion`` kernel node whose region the
report shows, and equals the original in values and in gradients (to q, k, v and every float
operand: learned biases, ALiBi slopes), with the kernel in the Pallas interpreter. Masks
built from iota comparisons become the kernel's ``mask_mod`` and the band it may skip
outside; regions the kernel cannot take are left alone, and ``pm.explain`` says where.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.rules import AttentionRegion, default_rules
from pypm_jax.rules._plans import RegionPlan
from pypm_jax.rules._region import describe
from pypm_jax.rules.attention_region import attention_region
from pypm_testing.rules import rel_close, rewrite

B, S, H, D = 1, 24, 2, 32
SCALE = D**-0.5
NEG = -1e9


def scores(q, k):
    return jnp.einsum("bqhd,bkhd->bhqk", q, k)


def out(s, v):
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def positions():
    """Query and key positions as ``[S, 1]`` and ``[1, S]`` iotas."""
    return jnp.arange(S)[:, None], jnp.arange(S)[None, :]


def softcap_a(q, k, v):
    return out(jnp.tanh(scores(q, k) * SCALE / 30.0) * 30.0, v)


def softcap_b(q, k, v):
    return out(30.0 * jnp.tanh(scores(q * SCALE, k) * (1 / 30.0)), v)


def alibi_before_scale_a(q, k, v, bias):
    return out((scores(q, k) + bias) * SCALE, v)


def alibi_before_scale_b(q, k, v, bias):
    return out(SCALE * (bias + scores(q, k)), v)


def window_abs_scaled_after(q, k, v):
    i, j = positions()
    return out(jnp.where(jnp.abs(i - j) < 5, scores(q, k), NEG) * SCALE, v)


def window_abs_fill_first(q, k, v):
    i, j = positions()
    return out(jnp.where(jnp.abs(i - j) >= 5, -jnp.inf, scores(q, k) * SCALE), v)


def window_and_scaled_after(q, k, v):
    i, j = positions()
    return out(jnp.where((j > i - 5) & (j <= i), scores(q, k), NEG) * SCALE, v)


def window_and_fill_first(q, k, v):
    i, j = positions()
    return out(jnp.where(~((j > i - 5) & (j <= i)), NEG, scores(q, k) * SCALE), v)


def chunked_a(q, k, v):
    i, j = positions()
    return out(jnp.where(i // 8 == j // 8, scores(q, k), NEG) * SCALE, v)


def chunked_b(q, k, v):
    i, j = positions()
    return out(jnp.where(i // 8 != j // 8, NEG, scores(q, k) * SCALE), v)


def chunked_causal(q, k, v):
    """Llama 4's local attention: causal within chunks of 8 keys. (Written as
    ``where(keep, scores * scale, fill)`` the fixed rules take it, the mask as data.)"""
    i, j = positions()
    return out(jnp.where((i // 8 != j // 8) | (j > i), NEG, scores(q, k) * SCALE), v)


def chunked_at_most(q, k, v):
    i, j = positions()
    return out(jnp.where(j // 8 > i // 8, -jnp.inf, scores(q, k) * SCALE), v)


def causal_masked_first(q, k, v):
    i, j = positions()
    return out(jnp.where(j > i, -jnp.inf, scores(q, k)) * SCALE, v)


def causal_fill_second(q, k, v):
    i, j = positions()
    return out(jnp.where(j > i, NEG, scores(q, k) * SCALE), v)


def padding_and_causal_nested(q, k, v, keep):
    i, j = positions()
    s = jnp.where(i >= j, scores(q, k) * SCALE, NEG)
    return out(jnp.where(keep[:, None, None, :], s, NEG), v)


def padding_and_causal_anded(q, k, v, keep):
    i, j = positions()
    mask = keep[:, None, None, :] & (i >= j)
    return out(jnp.where(mask, scores(q, k), NEG) * SCALE, v)


def relative_bias_before_scale(q, k, v, table):
    i, j = positions()
    bias = table[:, i - j + S - 1]  # learned [H, 2S - 1] table: a gather, captured
    return out((scores(q, k) + bias) * SCALE, v)


def relative_bias_scale_first(q, k, v, table):
    i, j = positions()
    return out(SCALE * (table[:, i - j + S - 1] + scores(q, k)), v)


def scale_twice(q, k, v):
    return out(scores(q, k) * 0.25 * SCALE, v)


def scale_divided_then_multiplied(q, k, v):
    return out(0.5 * (scores(q, k) / 3.0), v)


def gemma2_local_a(q, k, v):
    i, j = positions()
    s = jnp.tanh(scores(q, k) * SCALE / 50.0) * 50.0
    return out(jnp.where((i >= j) & (i - j < 6), s, NEG), v)


def gemma2_local_b(q, k, v):
    i, j = positions()
    s = 50.0 * jnp.tanh(scores(q, k) * (SCALE / 50.0))
    return out(jnp.where((i < j) | (i - j >= 6), NEG, s), v)


def alibi_slopes_before_scale(q, k, v, slopes):
    i, j = positions()
    return out((scores(q, k) + slopes[:, None, None] * (j - i)) * SCALE, v)


def alibi_slopes_subtracted(q, k, v, slopes):
    i, j = positions()
    return out((scores(q, k) - slopes[:, None, None] * jnp.abs(i - j)) * SCALE, v)


def bias_after_mask_a(q, k, v, bias):
    i, j = positions()
    return out(jnp.where(i >= j, scores(q, k) * SCALE, NEG) + bias, v)


def bias_after_mask_b(q, k, v, bias):
    i, j = positions()
    return out(bias + jnp.where(i >= j, scores(q, k) * SCALE, NEG), v)


def clipped_a(q, k, v):
    return out(jnp.clip(scores(q, k) * SCALE, -2.0, 2.0), v)


def clipped_b(q, k, v):
    return out(jnp.minimum(jnp.maximum(scores(q, k), -4.0), 4.0) * SCALE, v)


def extra(kind):
    key = jax.random.PRNGKey(7)
    if kind == "bias":
        return (jax.random.normal(key, (B, H, S, S)),)
    if kind == "keep":
        return (jnp.arange(S)[None, :] < S - 5,)
    if kind == "table":
        return (jax.random.normal(key, (H, 2 * S - 1)),)
    if kind == "slopes":
        return (jnp.array([0.5, 0.25]),)
    return ()


# (spelling, extra argument, band the mask proves)
TABLE = [
    (softcap_a, None, None),
    (softcap_b, None, None),
    (alibi_before_scale_a, "bias", None),
    (alibi_before_scale_b, "bias", None),
    (window_abs_scaled_after, None, None),
    (window_abs_fill_first, None, (-4, 4)),
    (window_and_scaled_after, None, None),
    (window_and_fill_first, None, (-4, 0)),
    (chunked_a, None, None),
    (chunked_b, None, (-7, 7)),
    (chunked_causal, None, (-7, 0)),
    (chunked_at_most, None, (None, 7)),
    (causal_masked_first, None, None),
    (causal_fill_second, None, (None, 0)),
    (padding_and_causal_nested, "keep", (None, 0)),
    (padding_and_causal_anded, "keep", None),
    (relative_bias_before_scale, "table", None),
    (relative_bias_scale_first, "table", None),
    (scale_twice, None, None),
    (scale_divided_then_multiplied, None, None),
    (gemma2_local_a, None, (-5, 0)),
    (gemma2_local_b, None, (-5, 0)),
    (alibi_slopes_before_scale, "slopes", None),
    (alibi_slopes_subtracted, "slopes", None),
    (bias_after_mask_a, "bias", None),
    (bias_after_mask_b, "bias", None),
    (clipped_a, None, None),
    (clipped_b, None, None),
]


def qkv():
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    return tuple(jax.random.normal(x, (B, S, H, D)) for x in (kq, kk, kv))


def region_nodes(fast, args):
    return [n for n in fast.lifted(*args).graph.nodes() if n.op is AttentionRegion]


def values_and_grads(fn, args):
    """fn's outputs and the gradients of a loss of them to every float argument, in one
    jitted call (one trace of the kernel's forward and backward)."""
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

    def run(*xs):
        def f(*fs):
            ys = list(xs)
            for i, x in zip(floats, fs, strict=True):
                ys[i] = x
            return fn(*ys)

        o, pull = jax.vjp(f, *(xs[i] for i in floats))
        return o, pull(jnp.cos(o))

    return jax.jit(run)(*args)


def record_replays(monkeypatch):
    """The plans (or refusals) the first rule's guard replays (``finish_region``)."""
    from pypm_jax.rules import _region_walk

    replays = []
    real = _region_walk.finish_region

    def finish_region(*args):
        replays.append(real(*args))
        return replays[-1]

    monkeypatch.setattr(_region_walk, "finish_region", finish_region)
    return replays


@pytest.mark.parametrize(("fn", "kind", "band"), TABLE, ids=[t[0].__name__ for t in TABLE])
def test_region_spelling(fn, kind, band, monkeypatch):
    args = (*qkv(), *extra(kind))
    replays = record_replays(monkeypatch)
    fast = pm.optimize(fn, rules=default_rules())
    report = fast.report(*args)
    assert report.fallback is None, report.fallback
    counts = report.counts()
    assert counts.get("attention_region") == 1 and counts.get("attention_region_done") == 1, report
    assert all(r.rule.startswith("attention_region") for r in report)
    (node,) = region_nodes(fast, args)
    plan = node.attrs["plan"]
    assert isinstance(plan, RegionPlan) and not plan.spine
    assert plan.band == band
    # the first rule's guard replayed the later rules: the plan it foresaw is the one built
    assert replays and all(r == plan for r in replays), replays
    assert report[-1].detail == plan.describe() and "logits = " in str(report)
    (want, want_grads), (got, got_grads) = values_and_grads(fn, args), values_and_grads(fast, args)
    rel_close(want, got, fn.__name__)
    for w, h in zip(want_grads, got_grads, strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(h, w, rtol=1e-4, atol=1e-5 * max(scale, 1.0))


def test_index_masks_compile_to_mask_mod():
    """A mask from iota comparisons reads no array: the kernel gets positions, not data."""
    fast, _, _ = rewrite(window_and_fill_first, qkv())
    (node,) = region_nodes(fast, qkv())
    plan = node.attrs["plan"]
    assert plan.captures == ()
    assert describe(plan.region) == f"acc * {float(np.float32(SCALE))!r}"
    assert describe(plan.mask) == "not((k > (q - 5)) & (k <= q)) != True"


def test_chunked_band_at_length_256():
    """Llama 4's chunked causal mask over 256 keys, chunks of 32: the band (-31, 0) lets the
    kernel skip the key blocks wholly outside (its blocks are 64 keys and up to 128 queries
    here); values and gradients equal the original's. The mask reads no array: jnp's floor
    division of positions is taken into the region whole (``region_index_expr``)."""
    n, c = 256, 32

    def fn(q, k, v):
        i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * SCALE
        s = jnp.where((i // c != j // c) | (j > i), NEG, s)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    kq, kk, kv = jax.random.split(jax.random.PRNGKey(5), 3)
    args = tuple(jax.random.normal(x, (1, n, 1, D)) for x in (kq, kk, kv))
    fast, _, report = rewrite(fn, args)
    (node,) = region_nodes(fast, args)
    plan = node.attrs["plan"]
    assert plan.band == (1 - c, 0) and plan.captures == (), plan.describe()
    (want, want_grads), (got, got_grads) = values_and_grads(fn, args), values_and_grads(fast, args)
    rel_close(want, got, "chunked")
    for w, h in zip(want_grads, got_grads, strict=True):
        np.testing.assert_allclose(
            h, w, rtol=1e-4, atol=1e-5 * max(float(jnp.max(jnp.abs(w))), 1.0)
        )


def test_region_rules_round_trip_serialize():
    """The region rules are portable data like every rule, and the region they build is
    plain data on the node: loaded rules build the same plan."""
    from pypm_jax.rules import attention_rules

    rules = attention_rules()
    loaded = pm.deserialize(pm.serialize(rules))
    plans = []
    for rs in (rules, loaded):
        (node,) = region_nodes(pm.optimize(softcap_a, rules=rs), qkv())
        plans.append(node.attrs["plan"])
    assert plans[0] == plans[1] and "tanh" in plans[0].describe()


def test_unlowerable_region_left_alone():
    """A cumulative sum over the keys is not pointwise: no rule fires, nothing half-done,
    and ``pm.explain`` on ``attention_region`` shows where the match stopped."""

    def fn(q, k, v):
        return out(jnp.tanh(jnp.cumsum(scores(q, k), axis=-1) / 30.0) * 30.0, v)

    args = qkv()
    fast, got, report = rewrite(fn, args)
    assert len(report) == 0
    rel_close(jax.jit(fn)(*args), got, "outputs")
    text = str(pm.explain(attention_region, fast.lifted(*args).graph))
    assert "cumsum" in text


def seven_biases(q, k, v, biases):
    s = scores(q, k)
    for b in biases:
        s = s + b
    return out(s * SCALE, v)


def test_region_needing_seven_captures_left_alone():
    """A region that would capture more operands at once than the node has inputs is
    refused by the first rule's guard, in words: that attention is left as written, the
    other one in the program is rewritten, and nothing falls back."""
    biases = tuple(
        jax.random.normal(key, (B, H, S, S)) for key in jax.random.split(jax.random.PRNGKey(3), 7)
    )

    def fn(q, k, v, biases):
        return seven_biases(q, k, v, biases) + softcap_a(k, q, v)  # (other scores)

    args = (*qkv(), biases)
    fast, got, report = rewrite(fn, args)  # (a fallback warning is an error there)
    assert report.counts().get("attention_region") == 1, report
    assert report.counts().get("attention_region_done") == 1
    assert len(region_nodes(fast, args)) == 1
    assert "tanh" in region_nodes(fast, args)[0].attrs["plan"].describe()
    rel_close(jax.jit(fn)(*args), got, "outputs")
    text = str(pm.explain(attention_region, fast.lifted(*args).graph))
    assert "the region captures 7 operands at add; the kernel takes at most 6" in text, text


def test_region_with_six_captures_is_rewritten():
    biases = tuple(
        jax.random.normal(key, (B, H, S, S)) for key in jax.random.split(jax.random.PRNGKey(3), 6)
    )
    args = (*qkv(), biases)
    _, got, report = rewrite(seven_biases, args)
    assert report.counts().get("attention_region_done") == 1, report
    rel_close(jax.jit(seven_biases)(*args), got, "outputs")


def test_finish_region_refuses_what_the_kernel_does_not_take():
    """The replay ends in ``region_done``'s checks: a region the kernel cannot compute or
    take is a refusal that says why, before the first rule fires."""
    from pypm_jax.rules._plans import AttentionPlan, region_done_or_why

    att = AttentionPlan("BSHD", 0, *(((0, 1, 2, 3),) * 5), 0, 0, False,
                        ((1, 8, 2, 32),) * 3 + (None, None), "float32", (), "")  # fmt: skip
    bad_op = RegionPlan(att, (("cumsum", (), (("acc",),)),), ())
    assert "no kernel lowering" in region_done_or_why(bad_op)
    bad_capture = RegionPlan(att, (("add", (), (("acc",), ("in", 0))),), (((3, 8), (2, 3)),))
    assert "not broadcastable" in region_done_or_why(bad_capture)
    ok = RegionPlan(att, (("add", (), (("acc",), ("in", 0))),), (((8, 8), (2, 3)),))
    assert isinstance(region_done_or_why(ok), RegionPlan)


# ------------------------------------------------- probabilities re-zeroed by the mask
#
# Keras's ``Softmax(mask=)`` masks the logits and re-zeroes the probabilities with the same
# mask (Falcon: ALiBi added before the scale, then that). The region takes the logits, the
# kernel's ``masked_rows="zero"`` the re-zeroing: a row whose every key is masked gives 0.


def weighted(p, v):
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def keep_rows():
    """A causal ``[1, 1, S, S]`` mask, rows 5 and 9 wholly masked."""
    i, j = positions()
    return ((j <= i) & (i != 5) & (i != 9))[None, None]


def zeroed_bias_before_scale(q, k, v, bias, keep):
    s = jnp.where(keep, (scores(q, k) + bias) * SCALE, NEG)
    return weighted(jnp.where(keep, jax.nn.softmax(s, axis=-1), 0.0), v)


def zeroed_softcap(q, k, v, keep):
    s = jnp.where(keep, jnp.tanh(scores(q, k) * SCALE / 30.0) * 30.0, NEG)
    return weighted(jax.nn.softmax(s, axis=-1) * keep.astype(jnp.float32), v)


def zeroed_softcap_mask_eq_zero(q, k, v, keep):
    s = jnp.where(keep == 0, NEG, jnp.tanh(scores(q, k) * SCALE / 30.0) * 30.0)
    return weighted(jnp.where(keep, jax.nn.softmax(s, axis=-1), 0.0), v)


def zeroed_slopes_padding_and_causal(q, k, v, slopes, pad):
    """ALiBi slopes before the scale; Keras's padding mask and-ed with a causal one from
    iotas (the first keys padded: the first rows are wholly masked)."""
    i, j = positions()
    keep = pad[:, None, None, :] & (j <= i)
    s = (scores(q, k) + slopes[:, None, None] * (j - i)) * SCALE
    s = jnp.where(keep, s, NEG)
    return weighted(jnp.where(keep, jax.nn.softmax(s, axis=-1), 0.0), v)


ZEROED = [
    (zeroed_bias_before_scale, lambda: (jax.random.normal(jax.random.PRNGKey(7), (B, H, S, S)),
                                        keep_rows()), (5, 9)),
    (zeroed_softcap, lambda: (keep_rows(),), (5, 9)),
    (zeroed_softcap_mask_eq_zero, lambda: (keep_rows(),), (5, 9)),
    (zeroed_slopes_padding_and_causal, lambda: (jnp.array([0.5, 0.25]),
                                                jnp.arange(S)[None, :] >= 3), (0, 1, 2)),
]  # fmt: skip


@pytest.mark.parametrize(("fn", "make", "empty"), ZEROED, ids=[t[0].__name__ for t in ZEROED])
def test_region_zeroed_rows(fn, make, empty, monkeypatch):
    """Rewritten into one region node with ``masked_rows="zero"``; values and gradients
    equal the original's, and the wholly masked rows give 0."""
    args = (*qkv(), *make())
    replays = record_replays(monkeypatch)
    fast, _, report = rewrite(fn, args)
    counts = report.counts()
    assert counts.get("attention_region_zero") == 1, report
    assert counts.get("attention_region_done") == 1, report
    (node,) = region_nodes(fast, args)
    plan = node.attrs["plan"]
    assert plan.attention.masked_rows == "zero" and plan.mask and not plan.spine
    assert replays and all(r == plan for r in replays), replays
    assert "zero-rows" in str(report)
    (want, want_grads), (got, got_grads) = values_and_grads(fn, args), values_and_grads(fast, args)
    rel_close(want, got, fn.__name__)
    np.testing.assert_array_equal(np.asarray(got)[:, list(empty)], 0.0)
    for w, h in zip(want_grads, got_grads, strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(h, w, rtol=1e-4, atol=1e-5 * max(scale, 1.0))


def test_zeroed_by_another_mask_left_alone():
    """Probabilities re-zeroed by a mask that is not the logits' own: not the kernel's
    ``masked_rows="zero"``; left alone, and ``pm.explain`` says why."""
    from pypm_jax.rules.attention_region import attention_region_zero

    def fn(q, k, v, keep, other):
        s = jnp.where(keep, jnp.tanh(scores(q, k) * SCALE / 30.0) * 30.0, NEG)
        return weighted(jnp.where(other, jax.nn.softmax(s, axis=-1), 0.0), v)

    i, j = positions()
    args = (*qkv(), keep_rows(), (j < i)[None, None])
    fast, got, report = rewrite(fn, args)
    assert len(report) == 0, report
    rel_close(jax.jit(fn)(*args), got, "outputs")
    text = str(pm.explain(attention_region_zero, fast.lifted(*args).graph))
    assert "not the outermost mask of the logits" in text, text


def test_zeroed_with_two_masks_left_alone():
    """Logits masked twice, probabilities re-zeroed by one of the masks: a row the other
    empties is not zero in the program, so the rule refuses, in words."""
    from pypm_jax.rules.attention_region import attention_region_zero

    def fn(q, k, v, keep, other):
        s = jnp.where(keep, jnp.where(other, scores(q, k) * SCALE, NEG), NEG)
        return weighted(jnp.where(keep, jax.nn.softmax(s, axis=-1), 0.0), v)

    args = (*qkv(), keep_rows(), jnp.arange(S)[None, None, None, :] >= 3)
    fast, got, report = rewrite(fn, args)
    assert len(report) == 0, report
    rel_close(jax.jit(fn)(*args), got, "outputs")
    text = str(pm.explain(attention_region_zero, fast.lifted(*args).graph))
    assert "the logits are masked by 2 where steps" in text, text


def test_scores_read_twice_left_alone():
    """A value read from the scores elsewhere (``s - mean(s)``) would have to be computed
    outside the kernel: the rule refuses the match."""

    def fn(q, k, v):
        s = scores(q, k) * SCALE
        return out(jnp.tanh(s - jnp.mean(s, axis=-1, keepdims=True)), v)

    fast, _, report = rewrite(fn, qkv())
    assert len(report) == 0


def test_fixed_spellings_keep_their_rules():
    """What the fixed attention rules match is still theirs."""

    def fn(q, k, v, bias):
        return out(scores(q, k) * SCALE + bias, v)

    _, _, report = rewrite(fn, (*qkv(), *extra("bias")))
    assert report.counts() == {"attention_scaled_bias": 1}


def test_default_rules_hold_the_region_rules():
    names = [r.name for r in default_rules()]
    assert names.index("attention_region") > names.index("attention")
    assert names.index("attention_region") < names.index("attention_causal_mask")


# ------------------------------------------------------------------ guard functions

Q, K = ("idx", "q"), ("idx", "k")


def lit(v):
    return ("lit", v)


@pytest.mark.parametrize(
    ("mask", "band"),
    [
        ((("ge", (), (Q, K)),), (None, 0)),  # k <= q
        ((("lt", (), (K, Q)),), (None, -1)),  # k < q
        ((("sub", (), (Q, lit(3))), ("gt", (), (K, ("step", 0)))), (-2, None)),  # k > q - 3
        ((("sub", (), (Q, K)), ("abs", (), (("step", 0),)), ("lt", (), (("step", 1), lit(4)))),
         (-3, 3)),  # |q - k| < 4
        ((("ge", (), (Q, K)), ("and", (), (("in", 0), ("step", 0)))),
         (None, 0)),  # a data mask and-ed: the index part's band
        ((("gt", (), (K, Q)), ("ne", (), (("step", 0), lit(True)))), (None, 0)),  # not k > q
        ((("gt", (), (K, Q)), ("lt", (), (K, Q)), ("or", (), (("step", 0), ("step", 1)))),
         None),  # k != q: no band
        ((("eq", (), (Q, K)),), (0, 0)),
        ((("mul", (), (Q, lit(2))), ("ge", (), (("step", 0), K))), None),  # 2q >= k: not a band
        ((("ne", (), (("in", 0), lit(False))),), None),  # data alone
        ((("div", (), (Q, lit(4))), ("div", (), (K, lit(4))), ("eq", (), (("step", 0), ("step", 1)))),
         (-3, 3)),  # q // 4 == k // 4
        ((("div", (), (K, lit(4))), ("div", (), (Q, lit(4))), ("lt", (), (("step", 0), ("step", 1)))),
         (None, -1)),  # k // 4 < q // 4
        ((("div", (), (Q, lit(4))), ("div", (), (K, lit(4))), ("le", (), (("step", 0), ("step", 1)))),
         (-3, None)),  # q // 4 <= k // 4
        ((("div", (), (Q, lit(4))), ("div", (), (K, lit(2))), ("eq", (), (("step", 0), ("step", 1)))),
         None),  # other chunk sizes
        ((("div", (), (Q, lit(4))), ("div", (), (K, lit(4))), ("ne", (), (("step", 0), ("step", 1)))),
         None),  # other chunks
        ((("sub", (), (Q, K)), ("div", (), (("step", 0), lit(4))), ("eq", (), (("step", 1), lit(0)))),
         None),  # (q - k) // 4: not a position's chunk
    ],
)  # fmt: skip
def test_band(mask, band):
    from pypm_jax.rules._plans import _band

    assert _band(mask) == band


def test_mask_split_takes_outer_wheres_only():
    from pypm_jax.rules._plans import _mask_split

    region = (
        ("mul", (), (("acc",), lit(0.5))),
        ("ge", (), (Q, K)),
        ("select_n", (), (("step", 1), lit(-1e30), ("step", 0))),  # where(q >= k, s, -1e30)
        ("select_n", (), (("in", 0), ("step", 2), lit(float("-inf")))),  # where(p, -inf, .)
    )
    score, mask = _mask_split(region)
    assert score == (("mul", (), (("acc",), lit(0.5))),)
    assert describe(mask) == "(in0 != True) & ((q >= k) != False)"
    # a fill above -1e9 stays in the scores
    soft = (("select_n", (), (("in", 0), lit(-1e4), ("acc",))),)
    assert _mask_split(soft) == (soft, ())


def test_region_push_renumbers_steps_and_captures():
    from pypm_jax.rules._plans import AttentionPlan, region_push

    att = AttentionPlan("BSHD", 0, *(((0, 1, 2, 3),) * 5), 0, 0, False, (), "float32", (), "")
    plan = RegionPlan(att, (("tanh", (), (("acc",),)),), (((2, 1, 1), (1, 2, 3)),))
    plan = region_push(plan, "add", (("acc",), ("in", 0)), (), ((4, 4),))
    assert plan.region == (
        ("add", (), (("acc",), ("in", 0))),
        ("tanh", (), (("step", 0),)),
    )
    assert plan.captures == (((4, 4), (2, 3)), ((2, 1, 1), (1, 2, 3)))
    assert region_push(plan._replace(spine=False), "neg", (("acc",),)) is None
