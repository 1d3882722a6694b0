"""Building a zoo model leaves the process as it found it: gemma's import replaces
``flax.linen.Module.param`` for the whole process, which broke every Hugging Face Flax model
built after it in the same pytest worker (``param(name, lambda _, shape: ..., shape)``)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from pypm_testing import zoo


class _HFStyleNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("weight", lambda _, shape: jnp.ones(shape), x.shape[-1])


@pytest.mark.slow  # gemma's import loads tensorflow: ~10 s of CPU
def test_building_gemma_leaves_flax_param_alone():
    if not zoo.has(zoo.LIBRARY["gemma_gm"]):
        pytest.skip("gemma is not installed (make zoo)")
    before = nn.Module.param
    zoo.build("gemma_gm")
    assert nn.Module.param is before
    params = _HFStyleNorm().init(jax.random.PRNGKey(0), jnp.ones((2, 4)))
    assert params["params"]["weight"].shape == (4,)
