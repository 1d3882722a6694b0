"""Acceptance on the living corpus (``pypm_testing.zoo``): model code maintained today,
from tiny configs with random weights.

For each model, ``pm.optimize`` (the default rules, kernels interpreted) must give the
outputs and gradients of ``jax.jit`` (f32: 1e-5 relative to each output's scale, gradients
2e-3; bf16: 3e-2, the original rounding intermediates to bf16 that the kernels keep in f32),
and the rules must cover at least the sites they cover today: :data:`COVERED` is a ratchet,
raised when a rule covers more. Both numbers are measured by ``zoo.coverage`` on the lifted
programs (sites in the original, sites left in the rewrite), not read from the report.
"""

from __future__ import annotations

import jax
import pytest

from pypm_testing import zoo
from pypm_testing.rules import TOL, grads_close, rel_close, rewrite

# model -> (attention sites covered, attention sites, dense+activation covered, dense sites).
# The site counts are the models' own (2 layers: 2 attentions, 2 MLPs; BERT's pooler and the
# Gemma 2 final logit soft-cap are a dense + tanh each; equinox's MHA has no MLP).
COVERED: dict[str, tuple[int, int, int, int]] = {
    "keras_bert": (2, 2, 3, 3),
    "keras_gpt2": (2, 2, 2, 2),
    "keras_opt": (2, 2, 2, 2),
    "keras_falcon": (2, 2, 2, 2),
    "keras_gemma2": (2, 2, 2, 2),
    "keras_mixtral": (2, 2, 2, 2),
    "keras_llama3": (2, 2, 2, 2),
    "tunix_llama3": (2, 2, 2, 2),
    "tunix_gemma2": (2, 2, 3, 3),
    "gemma_gm": (2, 2, 3, 3),
    "penzai_llama": (2, 2, 2, 2),
    "equinox_mha": (1, 1, 0, 0),
    "attnax_decoder": (2, 2, 2, 2),
}


def _build(name: str, dtype: str = "float32") -> zoo.Model:
    library = zoo.LIBRARY[name]
    if not zoo.has(library):
        pytest.skip(f"{library} is not installed (make zoo)")
    return zoo.build(name, dtype)


def test_every_zoo_model_has_a_ratchet():
    assert set(COVERED) == set(zoo.BUILDERS)
    assert set(zoo.BF16) <= set(COVERED)
    assert {zoo.LIBRARY[n] for n in zoo.BF16} == set(zoo.MODELS)  # one per library


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COVERED))
def test_sites_covered_outputs_and_gradients_match(name):
    fn, args, desc = _build(name)
    fast, got, report = rewrite(fn, args)
    cov = zoo.coverage(fn, args, fast)
    att_covered, att, dense_covered, dense = COVERED[name]
    assert (cov.attention, cov.dense) == (att, dense), desc
    if cov.attention_covered < att_covered or cov.dense_covered < dense_covered:
        why = "\n".join(zoo.explain_left(cov))
        now = f"attention {cov.attention_covered}/{att}, dense {cov.dense_covered}/{dense}"
        pytest.fail(f"{desc}: coverage dropped to {now}\n{report}\n{why}")
    want = grads_close(fn, fast, args, desc)  # the original's outputs, from its gradient program
    rel_close(want, got, desc)


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.BF16)
def test_bf16_outputs_match(name):
    fn, args, desc = _build(name, "bfloat16")
    _fast, got, _report = rewrite(fn, args)
    # bf16 tolerance even where a model returns f32 (penzai's logits): the kernels round the
    # bf16 intermediates differently (one rounding of the f32 epilogue), at bf16's precision
    rel_close(jax.jit(fn)(*args), got, desc, tol=TOL["bfloat16"])
