"""Greedy decoding with a KV cache (Hugging Face Flax ``init_cache`` / ``past_key_values``).

Generation runs two programs: the prefill (the prompt against an empty cache of
``MAX`` positions) and the decode step (one token against the cache). Both are rewritten:
their attention reads the cache through ``dynamic_update_slice`` and a causal table sliced
at the cache index (``dynamic_slice``, not provably causal: no ``mask_is_causal``), with
queries 8 or 1 long against ``MAX`` keys. The optimized loop must pick the same tokens, with
logits and caches matching ``jax.jit``'s, kernels interpreted.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pypm_jax as pm
from pypm_jax.jax.report import OptimizationFallbackWarning
from pypm_testing import corpus
from pypm_testing.rules import assert_kernels_run_as, rel_close

# Every test decodes with a Hugging Face model (up to a minute each).
pytestmark = pytest.mark.slow

B, PROMPT, MAX, STEPS = 2, 8, 32, 3


def _gpt2():
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100, n_positions=MAX)
    return corpus._hf(FlaxGPT2LMHeadModel, cfg, (B, PROMPT), corpus.SMALL)


def _llama():
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
        max_position_embeddings=2 * MAX,  # >= 2 * head_dim: see corpus.hf_llama
    )
    return corpus._hf(FlaxLlamaForCausalLM, cfg, (B, PROMPT), corpus.SMALL)


MODELS = {
    "gpt2": (_gpt2, {"attention_bias": 2, "gemm_epilogue": 2}),
    "llama": (
        _llama,
        {"attention_bias": 2, "gemm_epilogue_no_bias": 2, "gemm_epilogue_region": 2},
    ),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_decoding_with_a_kv_cache(name):
    if not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    build, counts = MODELS[name]
    model, params = build()
    mask = jnp.ones((B, MAX), jnp.int32)

    def run(params, ids, cache, start):
        pos = start + jnp.broadcast_to(jnp.arange(ids.shape[1])[None], ids.shape)
        out = model(
            ids, attention_mask=mask, position_ids=pos, past_key_values=cache, params=params
        )
        return out.logits[:, -1], out.past_key_values

    prompt = jax.random.randint(jax.random.PRNGKey(1), (B, PROMPT), 0, 100)
    fast = pm.optimize(run)
    slow = jax.jit(run)
    fast_cache = want_cache = model.init_cache(B, MAX)
    ids, start = prompt, jnp.int32(0)
    for step in range(STEPS + 1):  # the prefill, then one token at a time
        args = (params, ids, fast_cache, start)
        with warnings.catch_warnings():
            warnings.simplefilter("error", OptimizationFallbackWarning)
            fast_logits, fast_cache = fast(*args)
        report = fast.report(*args)
        assert report.fallback is None and report.counts() == counts, f"{name} {step}\n{report}"
        want_logits, want_cache = slow(params, ids, want_cache, start)
        what = f"{name} step {step} (queries {ids.shape[1]}, keys {MAX})"
        rel_close(want_logits, fast_logits, what)
        rel_close(want_cache, fast_cache, f"{what}: cache")
        tokens = jnp.argmax(fast_logits, -1)
        np.testing.assert_array_equal(tokens, jnp.argmax(want_logits, -1), err_msg=what)
        if step <= 1:  # the prefill's program and the decode step's
            assert_kernels_run_as(fast, args, "interpret")
        ids, start = tokens[:, None], start + ids.shape[1]


def test_hugging_face_generate_under_optimize():
    """``model.generate`` (greedy; its steps in a ``lax.while_loop``) as one optimized
    function: the attention and MLP sites of the prompt's call and of the loop's body are
    rewritten, and the tokens are ``jax.jit``'s."""
    if not corpus.has_transformers():
        pytest.skip("transformers is not installed")
    model, params = _gpt2()
    prompt = jax.random.randint(jax.random.PRNGKey(1), (B, PROMPT), 0, 100)

    def generate(params, ids):
        out = model.generate(ids, params=params, max_length=PROMPT + 6, pad_token_id=0)
        return out.sequences

    fast = pm.optimize(generate)
    args = (params, prompt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OptimizationFallbackWarning)
        got = fast(*args)
    report = fast.report(*args)
    assert report.fallback is None, report.fallback
    # two model calls (the prompt, the loop's body), two layers each; init_cache traces the
    # model too, but nothing reads that call's outputs: it is not lifted (dead code)
    assert report.counts() == {"attention_bias": 4, "gemm_epilogue": 4}, str(report)
    np.testing.assert_array_equal(got, jax.jit(generate)(*args))
    assert_kernels_run_as(fast, args, "interpret")
