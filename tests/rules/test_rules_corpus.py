"""Acceptance on real models: every attention and every dense + activation site rewritten.

The corpus (``tests/pypm_testing/corpus.py``) is built at head dim 32, so every site is one the kernels
take. For each model the report must count
exactly the model's sites, the optimized outputs must match the original (f32: 1e-5 relative
to each output's scale; bf16: 3e-2), and ``jax.grad`` of a loss through the optimized model
must match the original's gradient. Kernels run in the Pallas interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pypm_testing import corpus
from pypm_testing.rules import (
    CORPUS_BF16,
    CORPUS_SITES,
    MORE_SITES,
    assert_kernels_run_as,
    build_corpus_model,
    check,
    corpus_params,
    kernel_nodes,
    rewrite,
)


@dataclass(frozen=True)
class Size(corpus.Size):
    """Head dim 32; HF Flax Llama's rotary table needs ``max_position_embeddings >= 2 * head
    dim`` (it slices the concatenated sin/cos table to ``num_pos`` columns)."""

    @property
    def positions(self) -> int:
        return max(64, self.seq)


SMALL = Size(hidden=64, heads=2)
# Hugging Face models, scans and NNX attention take 10-20 s each (outputs and
# gradients, kernels interpreted): `make test` runs them, `make test-fast` the other models.
SLOW = {*corpus.HF_MODELS, "linen_scan", "linen_scan_remat", "nnx_mha", "nnx_mha_masked"}
LLAMA = Size(hidden=128, heads=4)  # 4 query heads on the corpus's 2 kv heads
BF16 = Size(hidden=64, heads=2, dtype="bfloat16")


def _build(name, size=None):
    fn, args, desc = build_corpus_model(name, size or (LLAMA if name == "llama" else SMALL))
    return fn, args, desc, CORPUS_SITES[name]


@pytest.mark.parametrize("name", corpus_params(CORPUS_SITES, slow=SLOW))
def test_every_site_rewritten_outputs_and_gradients_match(name):
    fn, args, desc, counts = _build(name)
    check(fn, args, counts, what=desc, grad=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MORE_SITES))
def test_wider_corpus_every_site_outputs_and_gradients(name):
    """Thirteen more Hugging Face Flax models: ALiBi, relative position bias, local attention,
    MQA/GQA with RoPE, shared layers, encoder-decoder with audio input, BLOOM's GELU."""
    fn, args, desc = build_corpus_model(name, SMALL)
    check(fn, args, MORE_SITES[name], what=desc, grad=True)


@pytest.mark.parametrize("name", corpus_params(CORPUS_BF16, slow=SLOW))
def test_bf16_models(name):
    fn, args, desc, counts = _build(name, BF16)
    check(fn, args, counts, what=desc)


def test_kernels_are_pallas_calls_in_scan_bodies_too():
    """The check test_rules_corpus_gpu.py makes with Triton kernels, here interpreted."""
    fn, args, _desc, _counts = _build("linen_scan")
    fast, _, _ = rewrite(fn, args)
    assert_kernels_run_as(fast, args, "interpret")


def test_report_names_the_user_source_and_module():
    fn, args, _desc, _counts = _build("linen_mha_masked")
    _, _, report = rewrite(fn, args)
    (record,) = [r for r in report if r.rule.startswith("attention")]
    assert record.module_path and "attention" in record.module_path
    assert record.source is not None


@pytest.mark.slow
def test_llama_kernel_reads_grouped_kv_heads():
    fn, args, _desc, _counts = _build("llama")
    fast, _, _ = rewrite(fn, args)
    nodes = [n for n in kernel_nodes(fast, args) if n.op.name == "FlashAttention"]
    assert len(nodes) == 2
    for node in nodes:
        q_shape, k_shape, v_shape = node.attrs["plan"].kernel_shapes[:3]
        heads = 2 if node.attrs["plan"].layout == "BSHD" else 1
        assert (q_shape[heads], k_shape[heads], v_shape[heads]) == (4, 2, 2)
