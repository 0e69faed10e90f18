"""CacheOptions (``tq_compile/options.py``): the seven cache options, declared and checked once,
passed whole from the config and the Hugging Face cache to every cache they build."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tq_compile import CacheOptions, TurboQuantKVCache, TurboQuantKVConfig, quantize_


def test_keywords_and_options_make_the_same_cache():
    """``preset=..., window=...`` as keywords, or whole as ``options=``, or both (keywords
    replacing the options' fields), build the same cache; the cache holds the options object."""
    options = CacheOptions(preset="3bit_nc", window=16, sinks=2)
    whole = TurboQuantKVCache(1, 2, 64, 64, options=options)
    keywords = TurboQuantKVCache(1, 2, 64, 64, preset="3bit_nc", window=16, sinks=2)
    replaced = TurboQuantKVCache(
        1, 2, 64, 64, options=dataclasses.replace(options, window=8), window=16
    )
    assert whole.options is options
    assert keywords.options == options == replaced.options
    assert (whole.kv_format.name, whole.window, whole.sinks) == ("3bit_nc", 16, 2)


def test_sinks_default_follows_the_window():
    """``sinks=None`` stays the default, so a later window change derives it again (replaced
    options, keywords over options); a given count stays."""
    assert CacheOptions().sink_count == 4
    assert CacheOptions(window=0).sink_count == 0
    assert CacheOptions(window=0, sinks=3).sink_count == 3
    assert dataclasses.replace(CacheOptions(window=0), window=64).sink_count == 4
    assert TurboQuantKVCache(1, 2, 64, 64, options=CacheOptions(), window=0).sinks == 0
    assert TurboQuantKVConfig("3bit_nc", options=CacheOptions(preset="k8v4")).preset == "3bit_nc"


def test_ring_for_sizes_the_ring_to_the_capacity():
    """ring_for(capacity): the window at most the capacity, the sinks at most the positions that
    can leave it; the two sum to the capacity exactly when they cover it."""
    assert CacheOptions().ring_for(1024) == (128, 4)
    assert CacheOptions().ring_for(130) == (128, 2)
    assert CacheOptions().ring_for(64) == (64, 0)
    assert CacheOptions(window=0, sinks=8).ring_for(4) == (0, 4)
    assert CacheOptions(window=0).ring_for(4) == (0, 0)
    assert CacheOptions().quantizes_nothing(64) and CacheOptions().quantizes_nothing(132)
    assert not CacheOptions().quantizes_nothing(133) and not CacheOptions(
        window=0
    ).quantizes_nothing(4)


def test_the_config_passes_its_options_whole():
    """quantize_'s caches get the config's one CacheOptions, not a copy of its fields."""
    from examples.model import ModelArgs, Transformer

    model = Transformer(ModelArgs.from_name("tiny")).to(torch.bfloat16)
    model.setup_caches(1, 64)
    config = TurboQuantKVConfig("k8v4", window=16, keep_first=1)
    quantize_(model, config)
    caches = [layer.attention.kv_cache for layer in model.layers[1:]]
    assert all(cache.options is config.options for cache in caches)
    assert config.preset == "k8v4" and config.keep_first == 1


def test_the_hf_cache_passes_its_options_whole():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    from tq_compile.hf import TurboQuantCache, TurboQuantLayer

    cache = TurboQuantCache(config, 32, preset="tq4_nc", window=8, keep_last=1)
    layers = [layer for layer in cache.layers if isinstance(layer, TurboQuantLayer)]
    assert len(layers) == 2 and all(layer.options is cache.options for layer in layers)
    assert cache.options == CacheOptions(preset="tq4_nc", window=8)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: TurboQuantKVCache(1, 2, 64, 64, fmt="4bit_nc"),
            "unknown cache option(s) ['fmt'] (the format is `preset`)",
        ),
        (lambda: TurboQuantKVConfig(windw=16), "unknown cache option(s) ['windw']"),
        (
            lambda: TurboQuantKVCache(1, 2, 64, 64, options={"window": 8}),
            "options must be a CacheOptions, got dict",
        ),
        (lambda: CacheOptions(preset="5bit"), "unknown KV format '5bit'"),
    ],
)
def test_bad_options_name_the_argument(build, message):
    with pytest.raises((TypeError, ValueError)) as error:
        build()
    assert message in str(error.value)


def test_options_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheOptions().window = 0
