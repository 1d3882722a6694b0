"""A corpus of real models from small configs with random weights (never downloaded).

Each builder takes an optional :class:`Size` (default :data:`SMALL`: 2 layers, hidden 32,
seq 8) and returns ``(apply_fn, example_inputs, description)``: ``apply_fn(*example_inputs)``
is a pure function of arrays (parameters first) returning a pytree of arrays, suitable for
``pm.optimize``/``jax.jit``/``jax.grad``. Builders are cached: a model is built once per test
process (``from pypm_testing import corpus``; the benchmarks put ``tests/`` on the path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Model = tuple[Callable[..., Any], tuple[Any, ...], str]


@dataclass(frozen=True)
class Size:
    """A model size; the tests use :data:`SMALL`, the end-to-end benchmark bigger ones."""

    batch: int = 2
    seq: int = 8
    hidden: int = 32
    heads: int = 4
    ffn: int = 64
    layers: int = 2
    dtype: str = "float32"  # of the weights and float inputs

    @property
    def positions(self) -> int:
        return max(32, self.seq)


SMALL = Size()


def _dims(size: Size) -> str:
    return (
        f"{size.layers} layers, hidden {size.hidden}, {size.heads} heads, batch {size.batch}, "
        f"seq {size.seq}, {size.dtype}"
    )


def _key(i: int) -> jax.Array:
    return jax.random.PRNGKey(i)


def _ids(seed: int, size: Size, vocab: int = 100) -> jax.Array:
    return jax.random.randint(_key(seed), (size.batch, size.seq), 0, vocab, dtype=jnp.int32)


def random_like(tree: Any, seed: int = 0, scale: float = 0.05, dtype: Any = None) -> Any:
    """Random weights of the shapes of ``tree`` (e.g. from ``jax.eval_shape(init, ...)``).

    Filled with numpy, so building a model compiles nothing (initializers would).
    """
    rng = np.random.default_rng(seed)

    def fill(s: Any) -> Any:
        if jnp.issubdtype(s.dtype, jnp.floating):
            return jnp.asarray(rng.normal(0.0, scale, s.shape), dtype or s.dtype)
        return jnp.zeros(s.shape, s.dtype)

    return jax.tree.map(fill, tree)


def _hf(cls: Any, config: Any, input_shape: tuple[int, ...], size: Size) -> tuple[Any, Any]:
    """A Hugging Face Flax model with random weights."""
    model = cls(config, seed=0, _do_init=False, dtype=jnp.dtype(size.dtype))
    shapes = jax.eval_shape(functools.partial(model.init_weights, input_shape=input_shape), _key(0))
    return model, random_like(shapes, dtype=jnp.dtype(size.dtype))


# ------------------------------------------------------------------------ Hugging Face


@functools.cache
def hf_bert(size: Size = SMALL) -> Model:
    from transformers import BertConfig, FlaxBertModel

    cfg = BertConfig(
        vocab_size=100,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.ffn,
        max_position_embeddings=size.positions,
    )
    model, params = _hf(FlaxBertModel, cfg, (size.batch, size.seq), size)
    mask = jnp.ones((size.batch, size.seq), jnp.int32).at[-1, -max(1, size.seq // 3) :].set(0)

    def apply(params: Any, ids: jax.Array, mask: jax.Array) -> Any:
        return model(ids, attention_mask=mask, params=params, train=False).to_tuple()

    return apply, (params, _ids(1, size), mask), f"FlaxBertModel ({_dims(size)}, padding mask)"


@functools.cache
def hf_gpt2(size: Size = SMALL) -> Model:
    from transformers import FlaxGPT2Model, GPT2Config

    cfg = GPT2Config(
        vocab_size=100,
        n_embd=size.hidden,
        n_layer=size.layers,
        n_head=size.heads,
        n_positions=size.positions,
    )
    model, params = _hf(FlaxGPT2Model, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(2, size)), f"FlaxGPT2Model ({_dims(size)}, causal)"


@functools.cache
def hf_llama(size: Size = SMALL) -> Model:
    from transformers import FlaxLlamaModel, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=100,
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=2,
        intermediate_size=size.ffn,
        # transformers' Flax RoPE table keeps only max_position_embeddings of its 2 * head_dim
        # columns (`out[:, :, :num_pos]`): fewer positions than that breaks the model
        max_position_embeddings=max(size.positions, 2 * size.hidden // size.heads),
    )
    model, params = _hf(FlaxLlamaModel, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(3, size)), f"FlaxLlamaModel ({_dims(size)}, GQA, RoPE)"


@functools.cache
def hf_vit(size: Size = SMALL) -> Model:
    from transformers import FlaxViTModel, ViTConfig

    image = 4 * max(2, round(size.seq**0.5))  # about seq patches

    cfg = ViTConfig(
        hidden_size=size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        intermediate_size=size.ffn,
        image_size=image,
        patch_size=4,
        num_channels=3,
    )
    model, params = _hf(FlaxViTModel, cfg, (size.batch, image, image, 3), size)
    shape = (size.batch, 3, image, image)  # NCHW, as HF takes
    pixels = jax.random.normal(_key(4), shape, jnp.float32).astype(size.dtype)

    def apply(params: Any, pixels: jax.Array) -> Any:
        return model(pixels, params=params, train=False).to_tuple()

    return apply, (params, pixels), f"FlaxViTModel ({_dims(size)}, {image}x{image} images, patch 4)"


@functools.cache
def hf_bart(size: Size = SMALL) -> Model:
    from transformers import BartConfig, FlaxBartModel

    cfg = BartConfig(
        vocab_size=100,
        d_model=size.hidden,
        encoder_layers=size.layers,
        decoder_layers=size.layers,
        encoder_attention_heads=size.heads,
        decoder_attention_heads=size.heads,
        encoder_ffn_dim=size.ffn,
        decoder_ffn_dim=size.ffn,
        max_position_embeddings=size.positions,
    )
    model, params = _hf(FlaxBartModel, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array, dec_ids: jax.Array) -> Any:
        out = model(ids, decoder_input_ids=dec_ids, params=params, train=False)
        return out.last_hidden_state, out.encoder_last_hidden_state

    return (
        apply,
        (params, _ids(5, size), _ids(6, size)),
        f"FlaxBartModel ({_dims(size)}, encoder+decoder)",
    )


@functools.cache
def hf_distilbert(size: Size = SMALL) -> Model:
    from transformers import DistilBertConfig, FlaxDistilBertModel

    cfg = DistilBertConfig(
        vocab_size=100, dim=size.hidden, n_layers=size.layers, n_heads=size.heads, hidden_dim=size.ffn,
        max_position_embeddings=size.positions,
    )  # fmt: skip
    model, params = _hf(FlaxDistilBertModel, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(7, size)), f"FlaxDistilBertModel ({_dims(size)})"


# -------------------------------------------- more Hugging Face Flax models (the wider corpus)
#
# Checked by tests/rules/test_rules_corpus.py (sites, outputs, gradients; kernels
# interpreted) but kept out of ALL_MODELS, so the GPU tests and benchmarks/e2e.py keep their
# model list. Not here: FlaxT5Model (transformers' Flax T5 calls jnp.clip(a_max=...), which
# jax 0.10 removed).


def _hf_ids_model(cls: Any, cfg: Any, size: Size, seed: int, desc: str) -> Model:
    """A decoder- or encoder-only model called as ``model(ids).last_hidden_state``."""
    model, params = _hf(cls, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(seed, size)), f"{cls.__name__} ({_dims(size)}{desc})"


@functools.cache
def hf_roberta(size: Size = SMALL) -> Model:
    from transformers import FlaxRobertaModel, RobertaConfig

    cfg = RobertaConfig(
        vocab_size=100, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.ffn,
        max_position_embeddings=size.positions + 2,  # RoBERTa's positions start at 2
    )  # fmt: skip
    model, params = _hf(FlaxRobertaModel, cfg, (size.batch, size.seq), size)
    mask = jnp.ones((size.batch, size.seq), jnp.int32).at[0, -max(1, size.seq // 4) :].set(0)

    def apply(params: Any, ids: jax.Array, mask: jax.Array) -> Any:
        return model(ids, attention_mask=mask, params=params, train=False).last_hidden_state

    return apply, (params, _ids(21, size), mask), f"FlaxRobertaModel ({_dims(size)}, padding mask)"


@functools.cache
def hf_electra(size: Size = SMALL) -> Model:
    from transformers import ElectraConfig, FlaxElectraModel

    cfg = ElectraConfig(
        vocab_size=100, embedding_size=size.hidden // 2, hidden_size=size.hidden,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        intermediate_size=size.ffn, max_position_embeddings=size.positions,
    )  # fmt: skip
    return _hf_ids_model(FlaxElectraModel, cfg, size, 22, ", embedding projection")


@functools.cache
def hf_albert(size: Size = SMALL) -> Model:
    from transformers import AlbertConfig, FlaxAlbertModel

    cfg = AlbertConfig(
        vocab_size=100, embedding_size=size.hidden // 2, hidden_size=size.hidden,
        num_hidden_layers=size.layers, num_attention_heads=size.heads,
        intermediate_size=size.ffn, max_position_embeddings=size.positions,
    )  # fmt: skip
    return _hf_ids_model(FlaxAlbertModel, cfg, size, 23, ", shared layers")


@functools.cache
def hf_gpt_neo(size: Size = SMALL) -> Model:
    from transformers import FlaxGPTNeoModel, GPTNeoConfig

    cfg = GPTNeoConfig(
        vocab_size=100, hidden_size=size.hidden, num_layers=size.layers,
        num_heads=size.heads, intermediate_size=size.ffn,
        attention_types=[[["global", "local"], size.layers // 2]],
        max_position_embeddings=size.positions, window_size=max(2, size.seq // 2),
    )  # fmt: skip
    return _hf_ids_model(FlaxGPTNeoModel, cfg, size, 24, ", global + local attention")


@functools.cache
def hf_gptj(size: Size = SMALL) -> Model:
    from transformers import FlaxGPTJModel, GPTJConfig

    cfg = GPTJConfig(
        vocab_size=100, n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
        n_inner=size.ffn, rotary_dim=size.hidden // size.heads // 2, n_positions=size.positions,
    )  # fmt: skip
    return _hf_ids_model(FlaxGPTJModel, cfg, size, 25, ", partial rotary")


@functools.cache
def hf_bloom(size: Size = SMALL) -> Model:
    from transformers import BloomConfig, FlaxBloomModel

    cfg = BloomConfig(
        vocab_size=100, hidden_size=size.hidden, n_layer=size.layers, n_head=size.heads
    )
    model, params = _hf(FlaxBloomModel, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array) -> Any:
        return model(ids, params=params, train=False).last_hidden_state

    return apply, (params, _ids(26, size)), f"FlaxBloomModel ({_dims(size)}, ALiBi)"


@functools.cache
def hf_clip_text(size: Size = SMALL) -> Model:
    from transformers import CLIPTextConfig, FlaxCLIPTextModel

    cfg = CLIPTextConfig(
        vocab_size=100, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.ffn,
        max_position_embeddings=size.positions,
    )  # fmt: skip
    return _hf_ids_model(FlaxCLIPTextModel, cfg, size, 27, ", causal, quick GELU")


@functools.cache
def hf_mbart(size: Size = SMALL) -> Model:
    from transformers import FlaxMBartModel, MBartConfig

    cfg = MBartConfig(
        vocab_size=100, d_model=size.hidden, encoder_layers=size.layers // 2 or 1,
        decoder_layers=size.layers // 2 or 1, encoder_attention_heads=size.heads,
        decoder_attention_heads=size.heads, encoder_ffn_dim=size.ffn,
        decoder_ffn_dim=size.ffn, max_position_embeddings=size.positions,
    )  # fmt: skip
    model, params = _hf(FlaxMBartModel, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array, dec_ids: jax.Array) -> Any:
        return model(ids, decoder_input_ids=dec_ids, params=params, train=False).last_hidden_state

    return (
        apply,
        (params, _ids(28, size), _ids(29, size)),
        f"FlaxMBartModel ({_dims(size)}, pre-LN)",
    )


@functools.cache
def hf_whisper(size: Size = SMALL) -> Model:
    from transformers import FlaxWhisperModel, WhisperConfig

    frames = 2 * size.seq  # the encoder's stride-2 convolution halves them
    cfg = WhisperConfig(
        vocab_size=100, d_model=size.hidden, encoder_layers=size.layers // 2 or 1,
        decoder_layers=size.layers // 2 or 1, encoder_attention_heads=size.heads,
        decoder_attention_heads=size.heads, encoder_ffn_dim=size.ffn,
        decoder_ffn_dim=size.ffn, num_mel_bins=8, max_source_positions=size.seq,
        max_target_positions=size.positions,
    )  # fmt: skip
    model = FlaxWhisperModel(cfg, seed=0, _do_init=False, dtype=jnp.dtype(size.dtype))
    init = functools.partial(model.init_weights, input_shape=(size.batch, 8, frames))
    params = random_like(jax.eval_shape(init, _key(0)), dtype=jnp.dtype(size.dtype))
    feats = jax.random.normal(_key(30), (size.batch, 8, frames), jnp.float32).astype(size.dtype)

    def apply(params: Any, feats: jax.Array, dec_ids: jax.Array) -> Any:
        return model(feats, decoder_input_ids=dec_ids, params=params, train=False).last_hidden_state

    return apply, (params, feats, _ids(31, size)), f"FlaxWhisperModel ({_dims(size)}, audio)"


@functools.cache
def hf_beit(size: Size = SMALL) -> Model:
    from transformers import BeitConfig, FlaxBeitModel

    cfg = BeitConfig(
        hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
        intermediate_size=size.ffn, image_size=16, patch_size=4, use_relative_position_bias=True,
    )  # fmt: skip
    model, params = _hf(FlaxBeitModel, cfg, (size.batch, 16, 16, 3), size)
    pixels = jax.random.normal(_key(32), (size.batch, 3, 16, 16), jnp.float32).astype(size.dtype)

    def apply(params: Any, pixels: jax.Array) -> Any:
        return model(pixels, params=params, train=False).last_hidden_state

    return apply, (params, pixels), f"FlaxBeitModel ({_dims(size)}, relative position bias)"


@functools.cache
def hf_mistral(size: Size = SMALL) -> Model:
    from transformers import FlaxMistralModel, MistralConfig

    cfg = MistralConfig(
        vocab_size=100, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=max(1, size.heads // 2),
        intermediate_size=size.ffn, sliding_window=None,
        max_position_embeddings=max(size.positions, 2 * size.hidden // size.heads),
    )  # fmt: skip
    return _hf_ids_model(FlaxMistralModel, cfg, size, 33, ", GQA, RoPE")


@functools.cache
def hf_gemma(size: Size = SMALL) -> Model:
    from transformers import FlaxGemmaModel, GemmaConfig

    head_dim = size.hidden // size.heads
    cfg = GemmaConfig(
        vocab_size=100, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, num_key_value_heads=1, head_dim=head_dim,
        intermediate_size=size.ffn, hidden_activation="gelu_pytorch_tanh",
        max_position_embeddings=max(size.positions, 2 * head_dim),
    )  # fmt: skip
    return _hf_ids_model(FlaxGemmaModel, cfg, size, 34, ", MQA, RoPE")


@functools.cache
def hf_opt(size: Size = SMALL) -> Model:
    from transformers import FlaxOPTModel, OPTConfig

    cfg = OPTConfig(
        vocab_size=100, hidden_size=size.hidden, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, ffn_dim=size.ffn, word_embed_proj_dim=size.hidden,
        max_position_embeddings=size.positions,
    )  # fmt: skip
    model, params = _hf(FlaxOPTModel, cfg, (size.batch, size.seq), size)

    def apply(params: Any, ids: jax.Array) -> Any:  # OPT's flag is `deterministic`
        return model(ids, params=params, deterministic=True).last_hidden_state

    return apply, (params, _ids(35, size)), f"FlaxOPTModel ({_dims(size)}, ReLU MLP)"


MORE_HF_MODELS: dict[str, Callable[..., Model]] = {
    "roberta": hf_roberta,
    "electra": hf_electra,
    "albert": hf_albert,
    "gpt_neo": hf_gpt_neo,
    "gptj": hf_gptj,
    "bloom": hf_bloom,
    "clip_text": hf_clip_text,
    "mbart": hf_mbart,
    "whisper": hf_whisper,
    "beit": hf_beit,
    "mistral": hf_mistral,
    "gemma": hf_gemma,
    "opt": hf_opt,
}


# ------------------------------------------------------------------------ Flax linen / nnx


def _x(seed: int, size: Size) -> jax.Array:
    shape = (size.batch, size.seq, size.hidden)
    return jax.random.normal(_key(seed), shape, jnp.float32).astype(size.dtype)


@functools.cache
def linen_mha(masked: bool = False, size: Size = SMALL) -> Model:
    import flax.linen as nn

    class Attn(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
            return nn.MultiHeadDotProductAttention(
                num_heads=size.heads, dtype=size.dtype, name="attention"
            )(x, x, mask=mask)

    model = Attn()
    x = _x(8, size)
    mask = nn.make_causal_mask(jnp.ones((size.batch, size.seq))) if masked else None
    variables = random_like(jax.eval_shape(model.init, _key(9), x, mask), 9, dtype=size.dtype)
    what = "causal mask" if masked else "no mask"
    if masked:
        return (
            model.apply,
            (variables, x, mask),
            f"linen.MultiHeadDotProductAttention ({_dims(size)}, {what})",
        )
    return (
        model.apply,
        (variables, x),
        f"linen.MultiHeadDotProductAttention ({_dims(size)}, {what})",
    )


@functools.cache
def nnx_mha(masked: bool = False, size: Size = SMALL) -> Model:
    from flax import nnx

    module = nnx.MultiHeadAttention(
        num_heads=size.heads,
        in_features=size.hidden,
        decode=False,
        dtype=size.dtype,
        param_dtype=size.dtype,
        rngs=nnx.Rngs(10),
    )
    graphdef, state = nnx.split(module)
    x = _x(11, size)
    what = "causal mask" if masked else "no mask"

    if masked:
        mask = nnx.make_causal_mask(jnp.ones((size.batch, size.seq)))

        def apply_masked(state: Any, x: jax.Array, mask: jax.Array) -> jax.Array:
            return nnx.merge(graphdef, state)(x, mask=mask)

        return apply_masked, (state, x, mask), f"nnx.MultiHeadAttention ({_dims(size)}, {what})"

    def apply(state: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x)

    return apply, (state, x), f"nnx.MultiHeadAttention ({_dims(size)}, {what})"


def _block_cls(size: Size) -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        """A pre-LN transformer block, scanned over layers."""

        @nn.compact
        def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
            dt = size.dtype
            y = nn.LayerNorm(dtype=dt, name="ln1")(x)
            y = nn.MultiHeadDotProductAttention(num_heads=size.heads, dtype=dt, name="attention")(y)
            x = x + y
            y = nn.Dense(size.ffn, dtype=dt, name="fc1")(nn.LayerNorm(dtype=dt, name="ln2")(x))
            y = nn.gelu(y)
            x = x + nn.Dense(size.hidden, dtype=dt, name="fc2")(y)
            return x, None

    return Block


@functools.cache
def linen_scan(remat: bool = False, size: Size = SMALL) -> Model:
    import flax.linen as nn

    block = _block_cls(size)
    if remat:
        block = nn.remat(block)

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            layers = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=size.layers,
            )
            x, _ = layers(name="layers")(x, None)
            return nn.Dense(size.hidden, dtype=size.dtype, name="head")(x)

    model = Stack()
    x = _x(12, size)
    variables = random_like(jax.eval_shape(model.init, _key(13), x), 13, dtype=size.dtype)
    what = "scan over remat blocks" if remat else "scan over layers"
    return model.apply, (variables, x), f"linen transformer ({_dims(size)}, {what})"


HF_MODELS: dict[str, Callable[..., Model]] = {
    "bert": hf_bert,
    "gpt2": hf_gpt2,
    "llama": hf_llama,
    "vit": hf_vit,
    "bart": hf_bart,
    "distilbert": hf_distilbert,
}

FLAX_MODELS: dict[str, Callable[..., Model]] = {
    "linen_mha": lambda size=SMALL: linen_mha(False, size),
    "linen_mha_masked": lambda size=SMALL: linen_mha(True, size),
    "nnx_mha": lambda size=SMALL: nnx_mha(False, size),
    "nnx_mha_masked": lambda size=SMALL: nnx_mha(True, size),
    "linen_scan": lambda size=SMALL: linen_scan(False, size),
    "linen_scan_remat": lambda size=SMALL: linen_scan(True, size),
}

# name -> builder(size=SMALL) -> (apply_fn, example_inputs, description)
ALL_MODELS: dict[str, Callable[..., Model]] = {**FLAX_MODELS, **HF_MODELS}


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
