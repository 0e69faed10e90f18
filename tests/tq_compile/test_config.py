"""tq_compile.quantize_ / TurboQuantKVConfig (``tq_compile/config.py``): swapping a model's KV
caches, and the bytes they hold before and after."""

from __future__ import annotations

import expecttest
import torch
from helpers import rel_error
from torchao.quantization import quantize_ as torchao_quantize_

from examples.model import (
    KVCache,
    ModelArgs,
    Transformer,
    decode_one_token,
    init_weights,
    prefill,
)
from tq_compile import TurboQuantKVCache, TurboQuantKVConfig, is_kv_cache, quantize_


def _model(layers: int = 4) -> Transformer:
    args = ModelArgs.from_name("tiny")
    args.n_layer = layers
    model = init_weights(Transformer(args), seed=0).to(torch.float16)
    model.setup_caches(2, 64)
    return model


def _cache_types(model: Transformer) -> list[str]:
    return [type(layer.attention.kv_cache).__name__ for layer in model.layers]


def test_swaps_exactly_the_caches_with_same_capacity():
    """Every KVCache (and nothing else) becomes a TurboQuantKVCache of the same batch, heads,
    length, head dim, dtype and device."""
    model = _model()
    before = {n: type(m) for n, m in model.named_modules() if not is_kv_cache(m)}
    quantize_(model, TurboQuantKVConfig("k3v4_nc", seed=3))
    assert _cache_types(model) == ["TurboQuantKVCache"] * 4
    cache = model.layers[0].attention.kv_cache
    assert (cache.max_batch_size, cache.k_codes.shape[1], cache.max_seq_length) == (2, 2, 64)
    assert cache.rotation.shape == (64, 64) and cache.model_dtype == torch.float16
    assert cache.kv_format.name == "k3v4_nc"
    assert cache.window == 64  # the default 128, capped at the capacity
    quantize_(model := _model(), TurboQuantKVConfig("4bit_nc", window=16, sinks=4))
    assert model.layers[0].attention.kv_cache.window == 16
    assert model.layers[0].attention.kv_cache.sinks == 4
    after = {n: type(m) for n, m in model.named_modules() if n in before}
    assert after == before  # linears, norms etc. untouched


def test_keep_first_and_last_in_full_precision():
    model = _model(layers=5)
    quantize_(model, TurboQuantKVConfig("3bit_nc", keep_first=2, keep_last=1))
    assert _cache_types(model) == [
        "KVCache",
        "KVCache",
        "TurboQuantKVCache",
        "TurboQuantKVCache",
        "KVCache",
    ]


@torch.no_grad()
def test_quantized_model_compiled_decode_matches_eager():
    """After quantize_, torch.compile(decode_one_token) (aot_eager) gives eager's tokens and
    logits over 6 steps, to rounding: the compiled step attends its own token beside the cache
    (tq.decode_step), the eager one after storing it (the window holds all 22 tokens, so both
    read the same values, summed in another order)."""
    eager, compiled = _model(), _model()
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        quantize_(m, TurboQuantKVConfig("4bit_nc"))
    prompt = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    tok_e, _ = prefill(eager, prompt, torch.arange(16))
    tok_c, _ = prefill(compiled, prompt, torch.arange(16))
    torch._dynamo.reset()
    step = torch.compile(decode_one_token, backend="aot_eager", fullgraph=True)
    for i in range(6):
        pos = torch.tensor([16 + i])
        tok_e, logits_e = decode_one_token(eager, tok_e, pos)
        tok_c, logits_c = step(compiled, tok_c, pos)
        assert rel_error(logits_c, logits_e) < 1e-3  # measured: 4e-4
        assert torch.equal(tok_c, tok_e)
    torch._dynamo.reset()


class TestQuantizeErrors(expecttest.TestCase):
    def test_errors(self):
        """Matching nothing, unknown presets, torchao's default (Linear) filter, options of the
        wrong type and a second quantize_ are clear, naming the argument (issue 51, defect 8:
        raw Python errors and "Set the caches up first" on e30c341)."""
        messages = []
        no_caches = Transformer(ModelArgs.from_name("tiny"))  # setup_caches not called
        cases = {
            "caches not set up": lambda: quantize_(no_caches, TurboQuantKVConfig()),
            "everything kept": lambda: quantize_(_model(2), TurboQuantKVConfig(keep_first=2)),
            "unknown preset": lambda: TurboQuantKVConfig("5bit"),
            "negative window": lambda: TurboQuantKVConfig(window=-1),
            "negative sinks": lambda: TurboQuantKVConfig(sinks=-1),
            "torchao default filter": lambda: torchao_quantize_(_model(2), TurboQuantKVConfig()),
            "a window as a string": lambda: TurboQuantKVConfig(window="16"),
            "a fractional keep_first": lambda: TurboQuantKVConfig(keep_first=1.5),
            "a seed as a string": lambda: TurboQuantKVConfig(seed="x"),
            "page_size 0": lambda: TurboQuantKVConfig(page_size=0),
            "quantized twice": lambda: quantize_(
                quantize_(_model(2), TurboQuantKVConfig()), TurboQuantKVConfig("k8v4")
            ),
        }
        for case, fn in cases.items():
            with self.assertRaises((ValueError, TypeError)) as ctx:
                fn()
            messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
caches not set up: ValueError: TurboQuantKVConfig('4bit_nc') matched no KV cache to quantize: 0 module(s) passed the filter and 0 are kept in full precision (keep_first / keep_last). Set the caches up first (gpt-fast: model.setup_caches(...)), or pass a filter_fn that selects them.
everything kept: ValueError: TurboQuantKVConfig('4bit_nc') matched no KV cache to quantize: 2 module(s) passed the filter and 2 are kept in full precision (keep_first / keep_last). Set the caches up first (gpt-fast: model.setup_caches(...)), or pass a filter_fn that selects them.
unknown preset: ValueError: unknown KV format '5bit': expected one of ['3bit_nc', '4bit_nc', 'fp8', 'int8', 'k2v2_nc', 'k2v4_nc', 'k3v4_nc', 'k8v4', 'tq2_nc', 'tq3_nc', 'tq4_nc', 'tqk4v2_nc', 'tqk5v3_nc']
negative window: ValueError: window must be an integer >= 0, got -1
negative sinks: ValueError: sinks must be an integer >= 0, got -1
torchao default filter: TypeError: TurboQuantKVConfig applies to KV-cache modules (with k_cache / v_cache buffers [B, Hk, S_max, D]), not Linear: torchao's quantize_ selects nn.Linear layers by default. Call tq_compile.quantize_(model, config), or pass filter_fn=tq_compile.is_kv_cache.
a window as a string: ValueError: window must be an integer >= 0, got '16'
a fractional keep_first: ValueError: keep_first must be an integer >= 0, got 1.5
a seed as a string: ValueError: seed must be an integer (the rotation's random signs), got 'x'
page_size 0: ValueError: page_size must be an integer >= 1, got 0
quantized twice: ValueError: TurboQuantKVConfig('k8v4'): the model's KV caches are TurboQuant caches already (2, e.g. 'layers.0.attention.kv_cache'); quantize_ converts dense caches. To change the format, set the dense caches up again (gpt-fast: model.setup_caches(...)) and quantize those.""",  # noqa: E501
        )


def test_torchao_quantize_with_the_kv_filter():
    """torchao's own quantize_ works with filter_fn=is_kv_cache."""
    model = _model(2)
    torchao_quantize_(model, TurboQuantKVConfig("k8v4"), filter_fn=is_kv_cache)
    assert all(isinstance(layer.attention.kv_cache, TurboQuantKVCache) for layer in model.layers)
    assert not any(isinstance(layer.attention.kv_cache, KVCache) for layer in model.layers)


def test_kv_cache_nbytes_before_and_after():
    """kv_cache_nbytes counts dense k_cache/v_cache buffers, then every buffer of the quantized
    caches: planes, the recent window's rings and their int32 slot positions, the rotation and
    the block table."""
    from tq_compile import kv_cache_nbytes

    model = _model(layers=2)  # B=2, Hk=2, S=64, D=64, fp16 caches
    assert kv_cache_nbytes(model) == 2 * 2 * (2 * 2 * 64 * 64 * 2)
    quantize_(model, TurboQuantKVConfig("4bit_nc", window=0))
    expected = sum(layer.attention.kv_cache.nbytes() for layer in model.layers)
    constants = 64 * 64 * 4 + 2 * 4 * 4  # rotation [D, D] float32, block table [B, 4 pages] int32
    assert kv_cache_nbytes(model) == expected == 2 * (2 * 2 * 64 * 70 + constants)
    quantize_(model := _model(layers=2), TurboQuantKVConfig("4bit_nc", window=8, sinks=0))
    ring = 2 * 2 * (8 * 64 * 2 * 2 + 8 * 4)  # [B, Hk, 8] K and V of fp16, positions int32
    assert kv_cache_nbytes(model) == 2 * (2 * 2 * 64 * 70 + ring + constants)
    quantize_(model := _model(layers=2), TurboQuantKVConfig("4bit_nc", window=8))  # 4 sinks
    ring = 2 * 2 * (12 * 64 * 2 * 2 + 12 * 4)
    assert kv_cache_nbytes(model) == 2 * (2 * 2 * 64 * 70 + ring + constants)
