"""The corpus acceptance (test_rules_corpus.py) on a GPU, with the real Pallas kernels.

The same models, at sizes a GPU runs as real work and still fast (2 layers, batch 2, seq 256,
head dim 64), go through ``pm.optimize`` with every substituted kernel lowered through Triton
(``PYPM_KERNEL_IMPL=pallas``: a kernel that cannot run raises, which ``optimize`` reports as a
fallback, which fails the test). For each model: the report counts exactly the sites the CPU
test counts, the program really calls Triton kernels (none interpreted, none replaced by the
XLA reference), outputs match the original, and so does ``jax.grad`` of a loss.

f32 runs under ``jax.default_matmul_precision("highest")`` (the kernels honour it as XLA
does) and is held to 1e-4 of each output's scale, as the kernel tests on GPU are; bf16 to
5e-2 (the kernels keep in f32 what the original rounds to bf16). Skipped cleanly without a
GPU backend (tests/conftest.py).
"""

from __future__ import annotations

import contextlib

import jax
import pytest

from pypm_testing import corpus
from pypm_testing.rules import (
    CORPUS_BF16,
    CORPUS_SITES,
    assert_kernels_run_as,
    build_corpus_model,
    check,
    corpus_params,
)

pytestmark = pytest.mark.gpu

IMPL = "pallas"
TOL = {"float32": (1e-4, 1e-4), "bfloat16": (5e-2, 5e-2)}

# Head dim 64 everywhere: 256 / 4 heads; Llama 512 / 8 query heads on the corpus's 2 kv heads
# (grouped-query attention). ViT: 64x64 images in 4x4 patches, 256 patches + [CLS].
GPU = corpus.Size(batch=2, seq=256, hidden=256, heads=4, ffn=1024, layers=2)
LLAMA = corpus.Size(batch=2, seq=256, hidden=512, heads=8, ffn=1024, layers=2)
BF16 = corpus.Size(batch=2, seq=256, hidden=256, heads=4, ffn=1024, layers=2, dtype="bfloat16")


@pytest.fixture(autouse=True)
def _gpu_kernels(monkeypatch, _interpret_kernels):
    """Replaces the rule tests' interpret-mode default (tests/rules/conftest.py)."""
    monkeypatch.setenv("PYPM_KERNEL_IMPL", IMPL)


def _precision(dtype: str):
    if dtype == "float32":
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def _run(name: str, size: corpus.Size, grad: bool) -> None:
    fn, args, desc = build_corpus_model(name, size)
    with _precision(size.dtype):
        fast = check(fn, args, CORPUS_SITES[name], what=desc, grad=grad, tol=TOL[size.dtype])
        assert_kernels_run_as(fast, args, IMPL)


@pytest.mark.parametrize("name", corpus_params(CORPUS_SITES))
def test_every_site_rewritten_outputs_and_gradients_match_gpu(name):
    _run(name, LLAMA if name == "llama" else GPU, grad=True)


@pytest.mark.parametrize("name", corpus_params(CORPUS_BF16))
def test_bf16_models_gpu(name):
    _run(name, BF16, grad=False)
