"""Guard functions of the rule library: pure Python over attribute values (no JAX)."""

from __future__ import annotations

import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax import prims as P
from pypm_jax.rules import _plans as G

f32, bf16, i32, b1 = pm.f32, pm.bf16, pm.i32, pm.bool_

# Hugging Face / Flax linen: q, k, v [B, S, H, D]; scores einsum("bqhd,bkhd->bhqk");
# output einsum over v first: dot_general(v, p) -> [B, H, D, Sq], then transposed.
BSHD = (2, 8, 2, 32)
S_DN = (((3,), (3,)), ((0, 2), (0, 2)))
O_DN_V_FIRST = (((1,), (3,)), ((0, 2), (0, 1)))


def hf_plan(**kw):
    args = dict(
        shapes=(BSHD, BSHD, BSHD),
        dtypes=(f32, f32, f32),
        scores=(S_DN, (2, 2, 8, 8), (3,)),
        output=(O_DN_V_FIRST, (2, 2, 32, 8), f32),
    )
    args.update(kw)
    return G.attention_plan(**args)


# ------------------------------------------------------------------ small predicates


def test_inserts_unit_axes():
    assert G.inserts_unit_axes((0, 1, 2), (2, 2, 8, 1), (2, 2, 8))
    assert G.inserts_unit_axes((0, 1, 3), (2, 2, 1, 8), (2, 2, 8))  # where: softmax_axes
    assert not G.inserts_unit_axes((1, 0, 2), (2, 2, 8, 1), (2, 2, 8))  # moves axes
    assert not G.inserts_unit_axes((0, 1, 2), (2, 2, 8, 8), (2, 2, 8))  # broadcasts
    assert G.inserts_unit_axes(None, (2, 2, 8, 1), (2, 2, 8))  # reshape
    assert not G.inserts_unit_axes(None, (2, 16), (2, 2, 8))
    assert not G.inserts_unit_axes("junk", (2,), (2,))


def test_unit_broadcast():
    assert G.unit_broadcast((0, 1, 2, 3), (2, 2, 8, 8), (2, 1, 8, 8))
    assert not G.unit_broadcast((0, 2, 3), (2, 2, 8, 8), (2, 8, 8))  # adds an axis
    assert not G.unit_broadcast((0, 1, 2, 3), (2, 2, 8, 8), (2, 3, 8, 8))


def test_interleaved_repeat_is_the_kernels_grouping():
    # jnp.repeat(k, 2, axis=2): [B, S, Hkv, D] -> [B, S, Hkv, 2, D] -> [B, S, 2 Hkv, D]
    assert G.interleaved_repeat((0, 1, 2, 4), (2, 8, 2, 2, 32), (2, 8, 2, 32), (2, 8, 4, 32))
    # jnp.tile-like (new axis before the heads): head h reads kv head h % Hkv -- refused
    assert not G.interleaved_repeat((0, 1, 3, 4), (2, 8, 2, 2, 32), (2, 8, 2, 32), (2, 8, 4, 32))
    assert not G.interleaved_repeat((1, 2, 3, 4), (2, 2, 8, 2, 32), (2, 8, 2, 32), (4, 8, 2, 32))
    assert not G.interleaved_repeat((0, 1, 2, 4), (2, 8, 2, 2, 32), (2, 8, 2, 32), (2, 8, 2, 64))


def test_softmax_axes():
    assert G.softmax_axes((2, 2, 8, 8), (3,), (3,), (2, 2, 8, 1), (2, 2, 8, 1))
    assert G.softmax_axes((2, 2, 8, 8), (-1,), (3,), (2, 2, 8, 1), (2, 2, 8, 1))
    assert not G.softmax_axes((2, 2, 8, 8), (3,), (2,), (2, 2, 8, 1), (2, 2, 1, 8))
    assert not G.softmax_axes((2, 2, 8, 8), (3,), (3,), (2, 2, 1, 8), (2, 2, 8, 1))
    assert not G.softmax_axes((2, 2, 8, 8), (2, 3), (2, 3), (2, 2, 1, 1), (2, 2, 1, 1))


def test_vmapped_softmax_axes():
    # jax.nn.dot_product_attention under vmap: u [B, K, T, G, S], x = transpose(u, (3,0,1,2,4))
    x, kept = (1, 2, 2, 8, 8), (1, 2, 2, 8, 1)
    assert G.vmapped_softmax_axes(x, (3, 0, 1, 2, 4), (4,), (4,), (3, 0, 1, 2), kept, kept)
    assert not G.vmapped_softmax_axes(x, (3, 0, 1, 2, 4), (4,), (4,), (0, 1, 2, 3), kept, kept)
    assert not G.vmapped_softmax_axes(x, (3, 0, 1, 2, 4), (4,), (2,), (3, 0, 1, 2), kept, kept)


def test_head_mask_identity():
    dn = (((), ()), ((0,), (1,)))
    assert G.head_mask_identity(dn, (1, 0, 2, 3), 4)
    assert not G.head_mask_identity(dn, (0, 1, 2, 3), 4)
    assert not G.head_mask_identity((((0,), (1,)), ((), ())), (1, 0, 2, 3), 4)


def test_scale_kind_bias_sign_activation_of():
    assert G.scale_kind(P.mul) == 1 and G.scale_kind(P.div) == -1 and G.scale_kind(P.add) is None
    assert G.bias_sign(P.add) == 1 and G.bias_sign(P.sub) == -1 and G.bias_sign(P.mul) is None
    assert G.activation_of(P.max, P.max) == "relu"
    assert G.activation_of(P.mul, P.tanh) == "gelu_tanh"
    assert G.activation_of(P.mul, P.erfc) == "gelu" == G.activation_of(P.mul, P.erf)
    assert G.activation_of(P.mul, P.logistic) == "silu" == G.activation_of(P.div, P.exp)
    assert G.activation_of(P.logistic, P.logistic) == "sigmoid"
    assert G.activation_of(P.tanh, P.tanh) == "tanh"
    assert G.activation_of(P.mul, P.mul) == "quick_gelu"
    assert G.activation_of(P.mul, P.exp) is None


def test_bias_vector():
    assert G.bias_vector((1, 1, 64), 64) and G.bias_vector((64,), 64)
    assert not G.bias_vector((8, 64), 64) and not G.bias_vector((64, 1), 64)


# --------------------------------------------------------------------- attention plans


def test_attention_plan_hugging_face_layout():
    plan = hf_plan()
    assert plan is not None
    assert plan.layout == "BSHD" and plan.q_operand == 0
    assert plan.perm_q == plan.perm_k == plan.perm_v == (0, 1, 2, 3)
    # kernel [B, S, H, D] -> o's [B, H, D, Sq]
    assert plan.perm_out == (0, 2, 3, 1)
    assert plan.perm_scores == (0, 1, 2, 3)
    assert plan.kernel_shapes[:3] == (BSHD, BSHD, BSHD)
    assert plan.out_shape == (2, 2, 32, 8) and plan.out_dtype == "float32"
    assert plan.bias == 0 and not plan.mask and plan.scale_input == 0


def test_attention_plan_bias_mask_scale_sign():
    plan = hf_plan(bias=((2, 1, 1, 8), f32), mask=((1, 1, 8, 8), b1), scaled=-1, sign=-1)
    assert plan.bias == -1 and plan.mask and plan.scale_input == -1
    assert plan.kernel_shapes[3:] == ((2, 1, 1, 8), (1, 1, 8, 8))
    assert hf_plan(bias=((2, 1, 1, 8), i32)) is None  # the kernel adds float biases
    assert hf_plan(mask=((2, 1, 1, 8), f32)) is None  # masks are boolean/integer
    assert hf_plan(bias=((2, 8), f32)) is None
    scalar = hf_plan(bias=((), f32))  # BEiT's default jnp.array(0.0)
    assert scalar is not None and scalar.bias == 1 and scalar.kernel_shapes[3] == ()
    assert hf_plan(mask=((), b1)) is None  # a mask has the scores' rank


def test_zero_rows_plan_needs_a_mask():
    masked = hf_plan(mask=((1, 1, 8, 8), b1))
    assert masked.masked_rows == "uniform"
    assert G.zero_rows_plan(masked).masked_rows == "zero"
    assert G.zero_rows_plan(hf_plan()) is None and G.zero_rows_plan(None) is None


def test_canonical_layout_predicates():
    assert G.noop_reshape(None, (2, 3), (2, 3)) and not G.noop_reshape(None, (2, 3), (3, 2))
    assert not G.noop_reshape((1, 0), (2, 3), (2, 3))
    assert G.inverse_permutation((1, 2, 0), (2, 0, 1)) and not G.inverse_permutation(
        (1, 2, 0), (1, 2, 0)
    )
    assert G.kept_shape((2, 3, 4), (1,)) == (2, 1, 4) and G.kept_dims((2, 3, 4), (-1,)) == (0, 1)
    assert G.kept_shape((2, 3), (0, 1)) is None and G.row_major(None)


def np_dot_general(x, y, dn):
    """``lax.dot_general`` in numpy: batch axes, then x's free axes, then y's."""
    (cx, cy), (bx, by) = dn
    letters = iter("abcdefghijklmnopqrstuvwxyz")
    xs, ys = [next(letters) for _ in x.shape], [None] * y.ndim
    for i, j in zip((*cx, *bx), (*cy, *by), strict=True):
        ys[j] = xs[i]
    ys = [c or next(letters) for c in ys]
    fx = [xs[i] for i in range(x.ndim) if i not in (*cx, *bx)]
    fy = [ys[j] for j in range(y.ndim) if j not in (*cy, *by)]
    out = "".join([xs[i] for i in bx] + fx + fy)
    return np.einsum(f"{''.join(xs)},{''.join(ys)}->{out}", x, y)


def np_repeat(x, expanded, dims, repeated):
    """``reshape(broadcast_in_dim(x, expanded, dims), repeated)`` in numpy."""
    shape = [1] * len(expanded)
    for d, n in zip(dims, x.shape, strict=True):
        shape[d] = n
    return np.broadcast_to(x.reshape(shape), expanded).reshape(repeated)


# tunix: dot_general(k [B,S,K,D], q5 [B,T,K,G,D]) -> [B,K,S,T,G], moved, merged
K_Q5_DN = (((3,), (4,)), ((0, 2), (0, 2)))


@pytest.mark.parametrize(
    "q5_first, perm, out",
    [
        (False, (0, 1, 4, 3, 2), (2, 6, 5, 7)),  # [B, K, G, T, S] -> [B, N, T, S]: no transpose
        (False, (0, 3, 1, 4, 2), (2, 5, 6, 7)),  # [B, T, K, G, S] -> [B, T, N, S]
        (True, None, None),  # dot_general(q5, k) -> [B, K, T, G, S]: K, G not adjacent
        (True, (0, 1, 3, 2, 4), (2, 6, 5, 7)),  # [B, K, G, T, S]
    ],
)
def test_grouped_scores_plan_computes_the_merged_scores(q5_first, perm, out):
    rng = np.random.default_rng(0)
    q5, k = rng.normal(size=(2, 5, 2, 3, 4)), rng.normal(size=(2, 7, 2, 4))  # T=5, S=7, K=2, G=3
    a, b, dn = (q5, k, (((4,), (3,)), ((0, 2), (0, 2)))) if q5_first else (k, q5, K_Q5_DN)
    s5 = np_dot_general(a, b, dn)
    if out is None:  # [B, K, T, G, S]: K and G are not adjacent, nothing merges them
        assert G.grouped_scores_plan(a.shape, b.shape, dn, None, (2, 2, 15, 7), None) is None
        return
    want = np.transpose(s5, perm).reshape(out)
    plan = G.grouped_scores_plan(a.shape, b.shape, dn, perm, out, None)
    grouped, q4_shape, expanded, dims, repeated, k_first, dn4, perm4 = plan
    assert grouped == (0 if q5_first else 1)
    q4, kr = q5.reshape(q4_shape), np_repeat(k, expanded, dims, repeated)
    got = np_dot_general(*((kr, q4) if k_first else (q4, kr)), dn4)
    if perm4:
        got = np.transpose(got, perm4)
    else:
        assert out == (2, 6, 5, 7)  # the dot_general's own layout: no transpose
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # the kernel rules' Kv reads the repeat
    assert G.interleaved_repeat(dims, expanded, k.shape, repeated)


def test_grouped_scores_plan_refusals():
    q5, k = (2, 5, 2, 3, 4), (2, 7, 2, 4)
    # (G, K) merged group-major is jnp.tile's grouping: [B, K, S, T, G] -> [B, G, K, T, S]
    assert G.grouped_scores_plan(k, q5, K_Q5_DN, (0, 4, 1, 3, 2), (2, 6, 5, 7), None) is None
    # merging (T, G): not heads
    assert G.grouped_scores_plan(k, q5, K_Q5_DN, (0, 1, 2, 3, 4), (2, 2, 7, 15), None) is None
    # not row-major, wrong ranks, malformed dimension numbers
    assert G.grouped_scores_plan(k, q5, K_Q5_DN, (0, 1, 4, 3, 2), (2, 6, 5, 7), (0, 1)) is None
    assert G.grouped_scores_plan(k, k, K_Q5_DN, None, (2, 6, 5, 7), None) is None
    assert G.grouped_scores_plan(k, q5, "dn", None, (2, 6, 5, 7), None) is None
    assert G.grouped_scores_plan(k, q5, K_Q5_DN, (0, 1), (2, 6, 5, 7), None) is None


@pytest.mark.parametrize("v_first", [True, False])
def test_grouped_probs_plan_computes_the_5d_output(v_first):
    rng = np.random.default_rng(1)
    p4, v = rng.normal(size=(2, 6, 5, 7)), rng.normal(size=(2, 7, 2, 4))  # N = K*G = 2*3
    p5 = p4.reshape(2, 2, 3, 5, 7)  # [B, K, G, T, S]
    if v_first:
        x, y, dn = v, p5, (((1,), (4,)), ((0, 2), (0, 1)))
    else:
        x, y, dn = p5, v, (((4,), (1,)), ((0, 1), (0, 2)))
    want = np_dot_general(x, y, dn)
    grouped, expanded, dims, repeated, dn4, split, perm5 = G.grouped_probs_plan(
        x.shape, y.shape, p4.shape, dn, None
    )
    assert grouped == (1 if v_first else 0)
    vr = np_repeat(v, expanded, dims, repeated)
    got = np_dot_general(*((vr, p4) if v_first else (p4, vr)), dn4).reshape(split)
    if perm5:
        got = np.transpose(got, perm5)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    # heads split group-major ([B, G, K, T, S]: G is not the free axis after K) are refused
    gk = (((1,), (4,)), ((0, 2), (0, 2)))
    assert G.grouped_probs_plan(v.shape, (2, 3, 2, 5, 7), p4.shape, gk, None) is None
    assert G.grouped_probs_plan(x.shape, y.shape, (2, 6, 35), dn, None) is None
    assert G.grouped_probs_plan(x.shape, y.shape, p4.shape, dn, (1, 0)) is None


def test_moving_transposes_down_the_scores():
    assert G.sinks_transpose("tanh", "dot_general", 4) and G.sinks_transpose("mul", "tanh", 4)
    assert not G.sinks_transpose("tanh", "dot_general", 5)  # dot_product_attention's moves
    assert not G.sinks_transpose("tanh", "reshape", 4)  # a moved input: not scores
    assert not G.sinks_transpose("integer_pow", "dot_general", 4)  # not re-applied
    assert G.inverse_of((0, 3, 1, 2)) == (0, 2, 3, 1) and G.inverse_of((0, 0)) is None
    assert G.moved_axes((0, 3, 1, 2), (3,)) == (2,) and G.moved_axes((0, 1), (2,)) is None
    rng = np.random.default_rng(2)
    p, v = rng.normal(size=(2, 4, 7, 5)), rng.normal(size=(2, 7, 4, 3))  # p [B, N, S, T]
    perm, dn = (0, 3, 1, 2), (((3,), (1,)), ((0, 2), (0, 2)))  # reads p as [B, T, N, S]
    want = np_dot_general(np.transpose(p, perm), v, dn)
    folded = G.fold_operand_transpose(dn, perm, 0)
    np.testing.assert_allclose(np_dot_general(p, v, folded), want, rtol=1e-12)
    mirrored = (((1,), (3,)), ((0, 2), (0, 2)))
    np.testing.assert_allclose(
        np_dot_general(v, p, G.fold_operand_transpose(mirrored, perm, 1)),
        np_dot_general(v, np.transpose(p, perm), mirrored),
        rtol=1e-12,
    )
    # two free axes swapped by the transpose: the result's layout would change
    assert G.fold_operand_transpose((((2,), (0,)), ((), ())), (1, 0, 2), 0) is None
    assert (
        G.fold_operand_transpose(dn, perm, 2) is None
        and G.fold_operand_transpose("x", perm, 0) is None
    )


def np_broadcast_in_dim(x, shape, dims):
    expanded = np.reshape(
        x, [x.shape[dims.index(i)] if i in dims else 1 for i in range(len(shape))]
    )
    return np.broadcast_to(expanded, shape)


def test_splitting_grouped_scores():
    """``transpose(dot_general(k, q5))`` as ``[B, K, G, T, S]`` (keras-hub's Gemma 2) is the
    split of 4-D scores; the innermost adjacent (K, G) pair is chosen."""
    q5, k = (2, 8, 1, 2, 32), (2, 8, 1, 32)
    dn, perm = (((3,), (4,)), ((0, 2), (0, 2))), (0, 1, 4, 3, 2)  # dot: [B, K, S, T, G]
    assert G.split_scores(k, q5, dn, perm, (2, 1, 2, 8, 8)) == (2, 2, 8, 8)
    # tunix: [B, T, K, G, S]; (B, T) reads as a batch axis and the query after it: not chosen
    q5, k = (2, 8, 2, 2, 32), (2, 8, 2, 32)
    assert G.split_scores(k, q5, dn, (0, 3, 1, 4, 2), (2, 8, 2, 2, 8)) == (2, 8, 4, 8)
    assert G.split_scores(k, q5, dn, (0, 1, 4, 3, 2), (2, 2, 2, 8, 8)) == (2, 4, 8, 8)
    # [B, G, K, T, S]: (G, K) is jnp.tile's grouping
    assert G.split_scores(k, q5, dn, (0, 4, 1, 3, 2), (2, 2, 2, 8, 8)) is None
    assert G.split_scores(k, q5, dn, perm, (2, 2, 8, 8)) is None
    assert G.split_scores("x", q5, dn, perm, (2, 2, 2, 8, 8)) is None


def test_merging_through_the_scores_chain():
    assert G.merges_through("tanh", (2, 1, 2, 8, 8), (2, 2, 8, 8))
    assert G.merges_through("mul", (2, 2, 2, 8, 8), (2, 4, 8, 8))
    assert not G.merges_through("tanh", (2, 2, 2, 8, 8), (2, 2, 16, 4))  # not a merge
    assert not G.merges_through("integer_pow", (2, 2, 2, 8, 8), (2, 4, 8, 8))
    assert not G.merges_through("tanh", (2, 4, 8, 8), (2, 4, 8, 8))
    # the softmax axis: kept, moved by the merge, or merged with a size-1 axis
    assert G.merged_axis((2, 2, 2, 8, 8), (2, 4, 8, 8), (4,)) == (3,)
    assert G.merged_axis((2, 8, 2, 2, 8), (2, 8, 4, 8), (1,)) == (1,)
    assert G.merged_axis((2, 1, 2, 8, 8), (2, 2, 8, 8), (2,)) == (1,)
    assert G.merged_axis((2, 2, 2, 8, 8), (2, 4, 8, 8), (2,)) is None
    assert G.merged_axis((2, 2, 2, 8, 8), (2, 4, 8, 8), (3, 4)) is None


def test_moving_a_split_down_a_transpose():
    """penzai: ``[B, T, K, G, S]`` (the split of ``[B, T, N, S]``) moved to ``[T, S, B, K,
    G]`` is the split of ``[T, S, B, N]``."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 8, 4, 8))
    perm5 = (1, 4, 0, 2, 3)
    perm4 = G.split_permutation(perm5, (2, 8, 2, 2, 8), x.shape, "dot_general")
    assert perm4 == (1, 3, 0, 2)
    want = np.transpose(np.reshape(x, (2, 8, 2, 2, 8)), perm5)
    np.testing.assert_array_equal(np.reshape(np.transpose(x, perm4), want.shape), want)
    assert G.split_permutation((1, 3, 0, 2, 4), (2, 8, 2, 2, 8), x.shape, "dot_general") is None
    assert G.split_permutation((1, 4, 0, 3, 2), (2, 8, 2, 2, 8), x.shape, "dot_general") is None
    # a mask regrouped for jax.nn.dot_product_attention: not scores, left as it is
    assert G.split_permutation(perm5, (2, 8, 2, 2, 8), x.shape, "and") is None
    assert G.split_permutation(perm5, (2, 8, 4, 8), x.shape, "dot_general") is None
    first, then = (0, 2, 1, 3), (1, 3, 0, 2)
    both = G.compose_permutations(first, then)
    np.testing.assert_array_equal(np.transpose(x, both), np.transpose(np.transpose(x, first), then))
    assert G.compose_permutations((0, 1), (0, 1, 2)) is None
    assert G.compose_permutations((0, 0), (0, 1)) is None


def test_softmax_with_its_max_in_another_frame():
    """penzai's ``vmap``-form softmax once split: the max on ``[T, S, B, K, G]``, the
    exponent on ``[T, B, K, G, S]``, both splits of moves of one ``[B, N, T, S]`` value."""
    args = dict(
        x_perm=(2, 0, 1, 3), x_shape=(8, 2, 2, 2, 8), t_shape=(8, 2, 4, 8),
        u_perm=(2, 3, 0, 1), u_shape=(8, 8, 2, 2, 2), s_shape=(8, 8, 2, 4),
        sum_axes=(4,), max_axes=(1,), kept_shape=(8, 2, 2, 2, 1),
    )  # fmt: skip
    assert G.moved_softmax_axis(**args) == (3,)
    assert G.moved_softmax_axis(**{**args, "kept_shape": None}) == (3,)
    assert G.moved_softmax_axis(**{**args, "max_axes": (0,)}) is None  # another axis of w
    assert G.moved_softmax_axis(**{**args, "kept_shape": (8, 2, 2, 2, 8)}) is None
    # the kept axes in another order than x's
    assert G.moved_softmax_axis(**{**args, "u_perm": (2, 3, 1, 0), "s_shape": (8, 8, 4, 2),
                                   "u_shape": (8, 8, 2, 2, 2)}) is None  # fmt: skip
    assert G.moved_softmax_axis(**{**args, "sum_axes": (2,)}) is None  # a split axis


@pytest.mark.parametrize(
    "x_shape, shape, dims",
    [
        ((2, 1, 1, 8, 8), (2, 1, 2, 8, 8), (0, 1, 2, 3, 4)),  # keras-hub's mask, MQA
        ((2, 8, 8), (2, 2, 2, 8, 8), (0, 3, 4)),  # broadcast along K and G
        ((), (2, 2, 2, 8, 8), ()),  # a fill
        ((2, 2, 2, 8), (2, 2, 2, 8, 8), (0, 1, 2, 3)),  # full along K and G
        ((2, 2, 1, 8, 8), (2, 2, 1, 8, 8), (0, 1, 2, 3, 4)),  # G = 1
    ],
)
def test_merged_broadcast_is_the_reshaped_broadcast(x_shape, shape, dims):
    rng = np.random.default_rng(3)
    x = rng.normal(size=x_shape)
    out = (shape[0], shape[1] * shape[2], *shape[3:])
    plan = G.merged_broadcast(dims, x_shape, shape, out)
    assert plan is not None
    split, x_new, dims_new = plan
    src = np.reshape(x, x_new) if split else x
    assert split == (tuple(x_new) != tuple(x_shape))
    want = np.reshape(np_broadcast_in_dim(x, shape, dims), out)
    np.testing.assert_array_equal(np_broadcast_in_dim(src, out, dims_new), want)


def test_merged_broadcast_refusals():
    # varies along K, broadcast along G: jnp.repeat's grouping, not a broadcast
    assert G.merged_broadcast((0, 1, 3, 4), (2, 2, 8, 8), (2, 2, 2, 8, 8), (2, 4, 8, 8)) is None
    assert G.merged_broadcast((0, 2, 3, 4), (2, 2, 8, 8), (2, 2, 2, 8, 8), (2, 4, 8, 8)) is None
    assert G.merged_broadcast((0, 1), (2, 8), (2, 2, 2, 8, 8), (2, 2, 16, 8)) is None  # no merge
    assert G.merged_broadcast((0, 0), (2, 2), (2, 2, 2, 8, 8), (2, 4, 8, 8)) is None
    assert G.merged_broadcast((0,), (3,), (2, 2, 2, 8, 8), (2, 4, 8, 8)) is None
    assert G.merged_broadcast(None, (2,), (2, 2, 2, 8, 8), (2, 4, 8, 8)) is None


def test_attention_plan_bhsd_probabilities_first():
    bhsd = (2, 2, 8, 32)
    plan = G.attention_plan(
        (bhsd, bhsd, bhsd),
        (bf16, bf16, bf16),
        ((((3,), (3,)), ((0, 1), (0, 1))), (2, 2, 8, 8), (3,)),
        ((((3,), (2,)), ((0, 1), (0, 1))), (2, 2, 8, 32), bf16),
    )
    assert plan.layout == "BHSD" and plan.perm_out == (0, 1, 2, 3) and plan.dtype == "bfloat16"


def test_attention_plan_keys_first_in_the_scores():
    # scores = dot_general(k, q) -> [B, H, Skv, Sq], softmax over axis 2
    plan = G.attention_plan(
        (BSHD, BSHD, BSHD),
        (f32, f32, f32),
        (S_DN, (2, 2, 8, 8), (2,)),
        ((((2,), (1,)), ((0, 1), (0, 2))), (2, 2, 8, 32), f32),
    )
    assert plan is not None and plan.q_operand == 1
    assert plan.perm_scores == (0, 1, 3, 2)


def test_attention_plan_grouped_kv_heads():
    kv = (2, 8, 1, 32)  # one kv head for two query heads, before the repeat
    plan = hf_plan(shapes=(BSHD, kv, kv))
    assert plan is not None and plan.kernel_shapes[:3] == (BSHD, kv, kv)
    assert hf_plan(shapes=(kv, BSHD, BSHD)) is None  # fewer *query* heads: not attention
    assert hf_plan(shapes=(BSHD, (2, 8, 3, 32), (2, 8, 3, 32))) is None


def test_attention_plan_rejects_other_contractions():
    assert hf_plan(scores=(S_DN, (2, 2, 8, 8), (1,))) is None  # softmax over heads
    assert hf_plan(scores=(S_DN, (2, 2, 8, 8), (2, 3))) is None
    bad_o = (((3,), (3,)), ((0, 2), (0, 1)))  # contracts v's head dim
    assert hf_plan(output=(bad_o, (2, 2, 32, 8), f32)) is None
    assert hf_plan(output=(O_DN_V_FIRST, (2, 2, 8, 32), f32)) is None  # wrong result shape
    assert hf_plan(shapes=((2, 8, 64), BSHD, BSHD)) is None


def test_attention_plan_refuses_an_ambiguous_operand_order():
    # v laid out [B, H, D, S] with D == S: "p first" and "v first" read the same dimension
    # numbers as different attentions of the same shapes; the plan cannot tell which.
    x = (2, 2, 32, 32)
    plan = G.attention_plan(
        (x, x, x),
        (f32, f32, f32),
        ((((3,), (3,)), ((0, 1), (0, 1))), x, (3,)),
        ((((3,), (3,)), ((0, 1), (0, 1))), x, f32),
    )
    assert plan is None


def test_dpa_plan_nnx_spelling():
    q = (2, 8, 4, 32)
    kv = (2, 8, 2, 32)
    args = dict(
        shapes=(q, kv, kv),
        dtypes=(f32, f32, f32),
        scores=((((4,), (3,)), ((0, 2), (0, 2))), (2, 2, 8, 2, 8), (3, 0, 1, 2, 4), (4,)),
        output=((((1,), (4,)), ((0, 2), (1, 2))), ((3, 0, 4, 1, 2), (1, 2, 3, 0, 4)), q, f32),
    )
    plan = G.dpa_plan(**args)
    assert plan.layout == "BSHD" and plan.kernel_shapes == (q, kv, kv, None, None)
    assert plan.scale_input == 1
    assert G.dpa_plan(**args, mask=((2, 1, 8, 8), b1)).kernel_shapes[4] == (2, 1, 8, 8)
    bad = dict(args, output=(args["output"][0], ((3, 0, 4, 1, 2), (0, 1, 2, 3, 4)), q, f32))
    assert G.dpa_plan(**bad) is None


def test_attention_supported_asks_the_kernel():
    assert G.attention_supported(hf_plan())
    small = (2, 8, 2, 300)  # head dim 300: above the kernel's maximum of 256
    plan = G.attention_plan(
        (small, small, small),
        (f32, f32, f32),
        (S_DN, (2, 2, 8, 8), (3,)),
        (O_DN_V_FIRST, (2, 2, 300, 8), f32),
    )
    assert plan is not None and not G.attention_supported(plan)
    assert not G.attention_supported(None)


# ---------------------------------------------------------------------------- GEMM


def test_gemm_plan():
    dn = (((2,), (0,)), ((), ()))
    plan = G.gemm_plan(
        (2, 8, 64), (64, 32), (f32, f32, f32), dn, ((2, 8, 32), f32), (1, 1, 32), "gelu"
    )
    assert plan == G.GemmPlan("gelu", False, 64, 32, True, "float32", (2, 8, 32), "float32")
    assert G.gemm_supported(plan, (2, 8, 64))
    t = G.gemm_plan((2, 8, 64), (32, 64), (f32,) * 3, (((2,), (1,)), ((), ())), ((2, 8, 32), f32))
    assert t.transpose_w and t.activation == "none" and not t.bias
    assert G.gemm_plan((2, 8, 64), (64, 32), (f32,) * 3, dn, ((2, 8, 32), f32), (8, 32)) is None
    mixed = (bf16, bf16, f32)  # preferred_element_type=f32: the kernel returns bf16
    assert G.gemm_plan((2, 8, 64), (64, 32), mixed, dn, ((2, 8, 32), f32)) is None
    batched = (((2,), (1,)), ((0,), (0,)))
    assert G.gemm_plan((2, 8, 64), (2, 64, 32), (f32,) * 3, batched, ((2, 8, 32), f32)) is None
    assert G.gemm_plan((2, 8, 64), (64, 32), (f32,) * 3, dn, ((2, 8, 32), f32), None, "x") is None
    ints = G.gemm_plan((2, 8, 64), (64, 32), (i32,) * 3, dn, ((2, 8, 32), i32))
    assert ints is not None and not G.gemm_supported(ints, (2, 8, 64))


@pytest.mark.parametrize(
    "name",
    ["rules.attention_plan", "rules.dpa_plan", "rules.gemm_plan", "rules.activation_of"],
)
def test_guard_functions_are_registered_by_name(name):
    from pypm_jax.lang.registry import GUARD_FNS

    assert name in GUARD_FNS


def test_attention_plan_mixed_float_operands_run_in_f32():
    # Hugging Face Llama in bf16: q and k promoted to f32 for the scores, v left in bf16
    plan = hf_plan(dtypes=(f32, f32, bf16))
    assert plan is not None and plan.dtype == "float32"
    assert hf_plan(dtypes=(f32, bf16, bf16)).dtype == "float32"
    assert hf_plan(dtypes=(bf16, bf16, bf16)).dtype == "bfloat16"
    assert hf_plan(dtypes=(f32, f32, i32)) is None  # only floats are promoted
