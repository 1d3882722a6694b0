"""Attention spellings real code produces, each rewritten to one flash-attention kernel.

Every test writes an attention the way some library or tutorial does, optimizes it with the
standard rules, checks which rule fired (exactly once), and compares the rewritten program
with the original on random inputs (kernels in the Pallas interpreter).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from pypm_testing.rules import check, kernel_nodes

B, S, H, D = 2, 8, 2, 32  # the kernel takes head dims 1..256
SKV = 12


def qkv(layout="BSHD", seed=0, skv=S, dtype=jnp.float32, kv_heads=H):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    if layout == "BSHD":
        shapes = (B, S, H, D), (B, skv, kv_heads, D)
    else:
        shapes = (B, H, S, D), (B, kv_heads, skv, D)
    q = jax.random.normal(kq, shapes[0], dtype)
    k = jax.random.normal(kk, shapes[1], dtype)
    v = jax.random.normal(kv, shapes[1], dtype)
    return q, k, v


def padding(skv=S):
    keep = jnp.ones((B, skv), bool).at[1, -3:].set(False)
    return keep


# --------------------------------------------------------------------- plain attention


@pytest.mark.slow
def test_flax_style_bshd_scale_on_q():
    """linen/HF: q / sqrt(d) (a runtime sqrt of a literal), einsum, jax.nn.softmax."""

    def attn(q, k, v):
        q = q / jnp.sqrt(q.shape[-1]).astype(q.dtype)
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k))
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    fast = check(attn, qkv(), {"attention": 1}, grad=True)
    (node,) = kernel_nodes(fast, qkv())
    assert node.attrs["plan"].layout == "BSHD"


@pytest.mark.slow
def test_bhsd_matmul_scale_on_k():
    def attn(q, k, v):
        s = q @ jnp.swapaxes(k * (1 / math.sqrt(D)), -1, -2)
        return jax.nn.softmax(s, axis=-1) @ v

    fast = check(attn, qkv("BHSD"), {"attention": 1}, grad=True)
    (node,) = kernel_nodes(fast, qkv("BHSD"))
    assert node.attrs["plan"].layout == "BHSD"


def test_scores_divided_by_runtime_sqrt():
    """``(q @ k^T) / jnp.sqrt(d)``: the scale is computed at run time, so q is scaled."""

    def attn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / jnp.sqrt(jnp.float32(D))
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s), v)

    check(attn, qkv("BHSD"), {"attention_scaled": 1}, grad=True)


def test_scores_times_a_literal():
    def attn(q, k, v):
        s = 0.125 * jnp.einsum("bqhd,bkhd->bhqk", q, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    fast = check(attn, qkv(), {"attention_scaled": 1})
    (node,) = kernel_nodes(fast, qkv())
    assert node.attrs["plan"].scale_input == 1


def test_keys_first_in_the_scores_and_transposed_keys():
    """DistilBERT-style k pre-transposed to [B, H, D, S]; scores einsum with k first."""

    def attn(q, k, v):
        kt = jnp.transpose(k, (0, 2, 3, 1))  # [B, H, D, Skv]
        s = jnp.einsum("bhdk,bqhd->bhkq", kt, q / 4.0)  # keys first: softmax over axis 2
        w = jax.nn.softmax(s, axis=2)
        return jnp.einsum("bhkq,bkhd->bqhd", w, v)

    fast = check(attn, qkv(), {"attention": 1}, grad=True)
    (node,) = kernel_nodes(fast, qkv())
    assert node.attrs["plan"].q_operand == 1


def test_cross_attention_longer_keys():
    check(
        lambda q, k, v: jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)).__matmul__(
            jnp.swapaxes(v, 1, 2)
        ),
        qkv(skv=SKV),
        {"attention": 1},
    )


# ------------------------------------------------------------------------ softmax forms


@pytest.mark.slow
def test_custom_jvp_softmax():
    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    with jax.softmax_custom_jvp(True):
        check(attn, qkv(), {"attention": 1}, grad=True)


def test_handwritten_softmax_without_stop_gradient_or_clamp():
    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
        w = e / jnp.sum(e, axis=-1, keepdims=True)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    check(attn, qkv(), {"attention": 1})


def test_unstabilised_softmax():
    def attn(q, k, v):
        e = jnp.exp(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k))
        return jnp.einsum("bhqk,bkhd->bqhd", e / e.sum(-1, keepdims=True), v)

    check(attn, qkv(), {"attention": 1})


# ----------------------------------------------------------------------- biases, masks


def test_hugging_face_padding_bias():
    def attn(q, k, v, keep):
        bias = jax.lax.select(
            keep[:, None, None, :] > 0,
            jnp.zeros(keep[:, None, None, :].shape, q.dtype),
            jnp.full(keep[:, None, None, :].shape, jnp.finfo(q.dtype).min),
        )
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k) + bias
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    check(attn, (*qkv(), padding()), {"attention_bias": 1}, grad=True)


def test_alibi_bias_and_bias_first_operand():
    slopes = jnp.array([0.5, 0.25])
    rel = jnp.arange(S)[None, :] - jnp.arange(S)[:, None]

    def attn(q, k, v):
        alibi = slopes[None, :, None, None] * rel[None, None].astype(jnp.float32)
        s = alibi + jnp.einsum("bhqd,bhkd->bhqk", q / 8.0, k)
        return jax.nn.softmax(s) @ v

    check(attn, qkv("BHSD"), {"attention_bias": 1}, grad=True)


def test_subtracted_bias_distilbert():
    def attn(q, k, v, keep):
        m = keep.astype(jnp.float32)[:, None, None, :]
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k) - 1e30 * (1.0 - m)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    fast = check(attn, (*qkv(), padding()), {"attention_bias": 1})
    (node,) = kernel_nodes(fast, (*qkv(), padding()))
    assert node.attrs["plan"].bias == -1


@pytest.mark.slow
def test_causal_mask_with_where():
    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k)
        causal = jnp.tril(jnp.ones((S, S), bool))
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    # the mask is jnp.tril's: the kernel may skip the blocks above the diagonal too
    check(attn, qkv(), {"attention_mask": 1, "attention_causal_mask": 1}, grad=True)


def test_inverted_mask_equal_zero():
    def attn(q, k, v, keep):
        s = jnp.einsum("bhqd,bhkd->bhqk", q / 8.0, k)
        s = jnp.where(keep[:, None, None, :].astype(jnp.int32) == 0, -1e9, s)
        return jax.nn.softmax(s) @ v

    check(attn, (*qkv("BHSD"), padding()), {"attention_mask": 1})


@pytest.mark.slow
def test_flax_dot_product_attention_with_bias_and_mask():
    import flax.linen as nn

    def attn(q, k, v, keep):
        bias = 0.1 * jnp.arange(S, dtype=jnp.float32)[None, None, None, :]
        mask = nn.make_attention_mask(jnp.ones((B, S)), keep)
        return nn.dot_product_attention(q, k, v, bias=bias, mask=mask)

    check(attn, (*qkv(), padding()), {"attention_bias_mask": 1}, grad=True)


def test_scaled_scores_with_bias_and_mask():
    def attn(q, k, v, keep):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (D**-0.5)
        s = s + 0.01 * jnp.arange(S, dtype=jnp.float32)
        s = jnp.where(keep[:, None, None, :], s, -1e30)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s), v)

    check(attn, (*qkv(), padding()), {"attention_scaled_bias_mask": 1})


# ------------------------------------------------------------------ grouped kv, dtypes


@pytest.mark.slow
def test_grouped_kv_heads_by_repeat():
    def attn(q, k, v):
        k, v = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k))
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    args = qkv(kv_heads=1)
    fast = check(attn, args, {"attention": 1}, grad=True)
    (node,) = kernel_nodes(fast, args)
    q_shape, k_shape = node.attrs["plan"].kernel_shapes[:2]
    assert q_shape[2] == 2 and k_shape[2] == 1  # the kernel reads the unrepeated kv heads


def test_bf16_attention_probabilities_cast():
    """bf16 like Flax with dtype=bf16: f32 softmax cast down before the output einsum."""

    def attn(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q / 8.0, k, preferred_element_type=jnp.float32)
        w = jax.nn.softmax(s).astype(jnp.bfloat16)
        return jnp.einsum("bhqk,bkhd->bqhd", w, v)

    check(attn, qkv(dtype=jnp.bfloat16), {"attention": 1})


# ---------------------------------------------------------- jax.nn.dot_product_attention


@pytest.mark.slow
@pytest.mark.parametrize("masked", [False, True])
def test_jax_nn_dot_product_attention_xla(masked):
    q, k, v = qkv(kv_heads=1)
    q = jnp.concatenate([q, q[:, :, :1] * 0.5], axis=2)[:, :, :2]  # 2 query heads, 1 kv head

    if masked:

        def attn(q, k, v, keep):
            mask = keep[:, None, None, :]
            return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")

        check(attn, (q, k, v, padding()), {"attention_dpa_mask": 1}, grad=True)
    else:

        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, implementation="xla")

        check(attn, (q, k, v), {"attention_dpa": 1}, grad=True)


def _bias(heads=H, seed=7, skv=S, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, heads, S, skv), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("kv_heads", [H, 1])
def test_jax_nn_dot_product_attention_causal(kv_heads):
    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    # is_causal's [1, 1, T, S] triangle is the kernel's mask (GQA too: it is per-head-free),
    # and, being provably causal, turns the kernel's causal flag on
    counts = {"attention_dpa_mask": 1, "attention_causal_mask": 1}
    fast = check(attn, qkv(kv_heads=kv_heads), counts, grad=True)
    (node,) = kernel_nodes(fast, qkv(kv_heads=kv_heads))
    assert node.attrs["plan"].kernel_shapes[4] == (1, 1, S, S)
    assert node.attrs["plan"].mask_is_causal


@pytest.mark.slow
def test_jax_nn_dot_product_attention_causal_longer_keys():
    def attn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    counts = {"attention_dpa_mask": 1, "attention_causal_mask": 1}  # top-left, as the kernel's
    check(attn, qkv(skv=SKV), counts, grad=True)


@pytest.mark.slow
@pytest.mark.parametrize("bias_heads", [H, 1])
def test_jax_nn_dot_product_attention_bias(bias_heads):
    def attn(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")

    check(attn, (*qkv(), _bias(bias_heads)), {"attention_dpa_bias": 1}, grad=True)


@pytest.mark.slow
def test_jax_nn_dot_product_attention_bias_grouped_kv_heads():
    def attn(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")

    check(attn, (*qkv(kv_heads=1), _bias()), {"attention_dpa_bias": 1}, grad=True)


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
def test_jax_nn_dot_product_attention_bias_and_mask(causal):
    if causal:

        def attn(q, k, v, bias):
            return jax.nn.dot_product_attention(
                q, k, v, bias=bias, is_causal=True, implementation="xla"
            )

        args = (*qkv(), _bias())
    else:

        def attn(q, k, v, bias, keep):
            mask = keep[:, None, None, :]
            return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, implementation="xla")

        args = (*qkv(), _bias(), padding())
    counts = {"attention_dpa_bias_mask": 1} | ({"attention_causal_mask": 1} if causal else {})
    check(attn, args, counts, grad=True)


@pytest.mark.slow
def test_jax_nn_dot_product_attention_bf16_bias():
    def attn(q, k, v, bias):  # the bias is converted to the f32 logits' dtype first
        return jax.nn.dot_product_attention(q, k, v, bias=bias, implementation="xla")

    args = (*qkv(dtype=jnp.bfloat16), _bias(dtype=jnp.bfloat16))
    check(attn, args, {"attention_dpa_bias": 1})


@pytest.mark.slow
@pytest.mark.parametrize(
    "kv_heads, skv, with_bias", [(H, S, False), (1, SKV, False), (H, S, True), (1, SKV, True)]
)
def test_jax_nn_dot_product_attention_mask_and_causal(kv_heads, skv, with_bias):
    """``mask=`` and ``is_causal=True`` together: two masks and-ed; the kernel takes the mask
    and its own causal flag for the triangle (top-left, as jax's)."""

    def attn(q, k, v, keep, *bias):
        mask = keep[:, None, None, :]
        return jax.nn.dot_product_attention(
            q, k, v, *bias, mask=mask, is_causal=True, implementation="xla"
        )

    keep = jnp.ones((B, skv), bool).at[1, :3].set(False)  # left padding: rows with no key
    args = (*qkv(skv=skv, kv_heads=kv_heads), keep, *((_bias(skv=skv),) if with_bias else ()))
    rule = "attention_dpa_bias_mask_causal" if with_bias else "attention_dpa_mask_causal"
    fast = check(attn, args, {rule: 1}, grad=True)
    (node,) = kernel_nodes(fast, args)
    assert node.attrs["plan"].causal and node.attrs["plan"].kernel_shapes[4] == (B, 1, 1, skv)


@pytest.mark.slow
def test_jax_nn_dot_product_attention_layers_sharing_a_mask():
    """Two layers pass the same mask: their regrouped masks are one value, read by both
    attentions. It is mask plumbing (pm.optimize's ``shareable``), so it does not stop the
    single-use rules: both attentions are rewritten (an NNX model's every layer)."""

    def attn(q, k, v, keep):
        mask = keep[:, None, None, :]
        h = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
        return jax.nn.dot_product_attention(h, k, v, mask=mask, implementation="xla")

    check(attn, (*qkv(), padding()), {"attention_dpa_mask": 2}, grad=True)
