"""TurboQuantCache (``tq_compile/hf.py``) on tiny random-weight transformers models: Llama,
Qwen2 (q/k/v biases), Mistral (sliding-window layers), and eager attention (Llama with
``attn_implementation="eager"``, Gemma 2 with its logit softcapping and sliding layers), against
transformers' StaticCache."""

from __future__ import annotations

import copy
import warnings

import expecttest
import pytest
import torch
from conftest import triton_kernels
from helpers import TINY_DECODER

transformers = pytest.importorskip("transformers")

from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402
from transformers import StaticCache  # noqa: E402

from custom_ops import compat  # noqa: E402
from custom_ops.formats import FORMATS  # noqa: E402
from tq_compile.hf import TurboQuantCache, TurboQuantLayer  # noqa: E402
from tq_compile.kv_tensor import TurboQuantKVTensor  # noqa: E402
from tq_compile.options import CacheOptions  # noqa: E402

PROMPT, NEW, CAPACITY = 12, 32, 64
_COMMON = TINY_DECODER
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # sliding layers (window 24 < the 44 tokens generated) are served as full layers
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
    # eager attention, served through the "turboquant" attention function
    "llama_eager": ("LlamaConfig", "LlamaForCausalLM", {"attn_implementation": "eager"}),
    # eager only; scores scaled by 1 (not 1/8) and capped at 2, since Gemma 2's 50 would not
    # bind on a tiny random model; sliding layers of 24 tokens between full ones
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "attn_implementation": "eager",
            "attn_logit_softcapping": 2.0,
            "sliding_window": 24,
            "query_pre_attn_scalar": 1,
        },
    ),
}
EAGER_ARCHS = ("llama_eager", "gemma2")

# Relative logit error bounds, teacher forced (measured on these models: int8 0.9%, a window
# holding every token 0.55% = bf16 rounding, 4-bit vs dense attention over the same dequantized
# cache 0.6%); a broken kernel (zeros, wrong rows) gives 30% or more.
INT8_BOUND = 0.02
SAME_QUANTIZATION_BOUND = 0.02


def tiny_model(arch: str, seed: int = 0, **overrides):
    """A random-weight bf16 model of ``arch`` (``overrides``: config fields, e.g. head counts)."""
    config_name, model_name, extra = ARCHS[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.bfloat16).eval()
    return config, model


def prompt_batch(seed: int = 0, left_pad: int = 4, length: int = PROMPT):
    """Two prompts of ``length`` tokens, the second left-padded by ``left_pad``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, length), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :left_pad] = 0
    return ids, mask


@torch.no_grad()
def teacher_forced_logits(model, cache, ids, mask, tokens, step=None):
    """Float32 logits ``[T + 1, B, V]`` of the prompt's last position and of each of ``tokens
    [B, T]`` fed one at a time, with left-padding-aware positions (as generate computes them).
    ``step`` (default: the model) runs the one-token forwards, with a 2-D mask of fixed width
    CAPACITY (the causal mask hides the positions not written yet), so shapes stay static."""
    step = step or model
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    out = model(ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    logits = [out.logits[:, -1].float()]
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], CAPACITY - mask.shape[1])], dim=1)
    positions = positions[:, -1:]
    for token in tokens.unbind(1):
        positions = positions + 1
        out = step(
            token[:, None], attention_mask=full_mask, position_ids=positions, past_key_values=cache
        )
        logits.append(out.logits[:, -1].float())
    return torch.stack(logits)


def rel_error(got, want) -> float:
    return ((got - want).norm() / want.norm()).item()


def static_run(model, config, ids, mask):
    """StaticCache greedy tokens ``[B, NEW]`` and their teacher-forced logits."""
    out = model.generate(
        ids,
        attention_mask=mask,
        past_key_values=StaticCache(config, CAPACITY),
        max_new_tokens=NEW,
        do_sample=False,
    )
    tokens = out[:, PROMPT:]
    logits = teacher_forced_logits(model, StaticCache(config, CAPACITY), ids, mask, tokens[:, :-1])
    return tokens, logits


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_int8_generation_matches_static_cache(arch):
    """Greedy generate with an int8 TurboQuantCache (every token quantized) equals StaticCache's
    wherever its logits are not near-tied, left padding included; logits within int8's bound."""
    config, model = tiny_model(arch)
    ids, mask = prompt_batch()
    tokens, static_logits = static_run(model, config, ids, mask)
    cache = TurboQuantCache(config, CAPACITY, preset="int8", window=0)
    tq_logits = teacher_forced_logits(model, cache, ids, mask, tokens[:, :-1])
    assert rel_error(tq_logits, static_logits) < INT8_BOUND
    bound = 2 * (tq_logits - static_logits).abs().amax()
    top2 = static_logits.topk(2, dim=-1).values
    decided = (top2[..., 0] - top2[..., 1]) > bound  # [T, B]: not near-tied
    assert decided.sum() >= 16, "the test model's logits are too flat to decide anything"
    assert torch.equal(tq_logits.argmax(-1)[decided], static_logits.argmax(-1)[decided])
    # and generate() itself: the same tokens up to the first near-tie
    cache = TurboQuantCache(config, CAPACITY, preset="int8", window=0)
    out = model.generate(
        ids, attention_mask=mask, past_key_values=cache, max_new_tokens=NEW, do_sample=False
    )
    for row in range(ids.shape[0]):
        ties = (~decided[:, row]).nonzero()
        agree = NEW if ties.numel() == 0 else int(ties[0])
        assert torch.equal(out[row, PROMPT : PROMPT + agree], tokens[row, :agree])


class _DequantizedLayer(TurboQuantLayer):
    """Reference: the same quantized cache, read back as dense tensors for plain SDPA (a decode
    token as SDPA over the views attends it: the cache as it was and the token, exact; the next
    update stores it)."""

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        return keys.dequantize(store_pending=False), values.dequantize(store_pending=False)


def _reference_cache(
    config, preset: str, window: int, sinks: int = 0, center: bool = False
) -> TurboQuantCache:
    options = CacheOptions(preset=preset, window=window, sinks=sinks, center_keys=center)
    cache = TurboQuantCache(config, CAPACITY, options=options)
    cache.layers = [_DequantizedLayer(CAPACITY, options) for _ in cache.layers]
    return cache


@pytest.mark.parametrize(
    ("preset", "window", "sinks", "center"),
    [
        ("4bit_nc", 0, 0, False),
        ("4bit_nc", 8, 0, False),
        ("k8v4", 0, 0, False),
        ("3bit_nc", 8, 0, False),
        ("3bit_nc", 8, 4, False),
        ("4bit_nc", 0, 4, False),
        ("tq2_nc", 8, 4, True),
        ("tqk4v2_nc", 8, 0, True),
    ],
)
def test_quantized_logits_match_dense_attention_over_the_same_codes(preset, window, sinks, center):
    """4-, 3- and 2-bit caches (with sinks and key centering too): logits equal (to bf16
    rounding) those of dense SDPA over the same cache dequantized (centred keys given their
    centres back), so the decode path adds no error of its own; and they differ from the
    unquantized model by the format's error, not more."""
    config, model = tiny_model("llama")
    ids, mask = prompt_batch(seed=1)
    tokens, static_logits = static_run(model, config, ids, mask)
    cache = TurboQuantCache(
        config, CAPACITY, preset=preset, window=window, sinks=sinks, center_keys=center
    )
    tq = teacher_forced_logits(model, cache, ids, mask, tokens[:, :-1])
    if center:
        assert bool((cache.layers[0].kv.key_center != 0).any()), "no centre was set"
    reference = teacher_forced_logits(
        model, _reference_cache(config, preset, window, sinks, center), ids, mask, tokens[:, :-1]
    )
    assert rel_error(tq, reference) < SAME_QUANTIZATION_BOUND
    assert rel_error(tq, static_logits) < 0.3  # 3-bit: 20%; zeros would be 100%


@pytest.mark.parametrize(
    ("preset", "window", "sinks"), [("4bit_nc", 0, 0), ("4bit_nc", 8, 4), ("tq4_nc", 8, 0)]
)
@pytest.mark.parametrize("arch", EAGER_ARCHS)
def test_eager_attention_logits_match_dense_attention_over_the_same_codes(
    arch, preset, window, sinks
):
    """Eager models through the "turboquant" attention function: logits equal those of the
    model's own eager attention over the same cache dequantized (Gemma 2: scores capped, sliding
    layers masked), so the kernels and the capped prefill add no error of their own; and the
    cap binds: without it the same codes give logits several times the bound away."""
    config, model = tiny_model(arch)
    ids, mask = prompt_batch(seed=1)
    tokens, static_logits = static_run(model, config, ids, mask)
    cache = TurboQuantCache(config, CAPACITY, preset=preset, window=window, sinks=sinks)
    assert model.config._attn_implementation == "turboquant"
    tq = teacher_forced_logits(model, cache, ids, mask, tokens[:, :-1])
    reference = teacher_forced_logits(
        model, _reference_cache(config, preset, window, sinks), ids, mask, tokens[:, :-1]
    )
    assert rel_error(tq, reference) < SAME_QUANTIZATION_BOUND
    assert rel_error(tq, static_logits) < 0.3
    if arch == "gemma2":
        uncapped = copy.deepcopy(model)
        uncapped.config.attn_logit_softcapping = None
        for layer in uncapped.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        off = teacher_forced_logits(
            uncapped, _reference_cache(config, preset, window, sinks), ids, mask, tokens[:, :-1]
        )
        assert rel_error(off, reference) > 3 * SAME_QUANTIZATION_BOUND  # measured: 10%


def test_window_holding_every_token_is_exact():
    """A window as long as the sequence keeps every token in bf16: logits equal StaticCache's to
    bf16 rounding."""
    config, model = tiny_model("qwen2")
    ids, mask = prompt_batch(seed=2)
    tokens, static_logits = static_run(model, config, ids, mask)
    cache = TurboQuantCache(config, CAPACITY, preset="3bit_nc", window=CAPACITY)
    tq = teacher_forced_logits(model, cache, ids, mask, tokens[:, :-1])
    assert rel_error(tq, static_logits) < 0.01


def test_compiled_decode_fullgraph_no_recompile():
    """torch.compile(model.forward, fullgraph=True) over 32 decode steps: one graph (no break,
    no recompile), the same logits as eager."""
    config, model = tiny_model("llama")
    ids, mask = prompt_batch(seed=3, left_pad=0)
    tokens, _ = static_run(model, config, ids, mask)
    eager = teacher_forced_logits(
        model, TurboQuantCache(config, CAPACITY, window=8), ids, mask, tokens[:, :-1]
    )
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model.forward, backend=counter, fullgraph=True)
    got = teacher_forced_logits(
        model,
        TurboQuantCache(config, CAPACITY, window=8),
        ids,
        mask,
        tokens[:, :-1],
        step=compiled,
    )
    assert counter.frame_count == 1
    # the compiled step attends the token leaving the 8-token window exactly one step longer
    # than the eager one (tq.decode_step; eager stores it first): 1.28% measured
    assert rel_error(got, eager) < SAME_QUANTIZATION_BOUND


PREFILL_LEN, PREFILL_CAPACITY = 200, 256  # a prompt longer than a 128-token window


@pytest.mark.parametrize("window", [0, 128])
@torch.no_grad()
def test_single_forward_prefill_equals_static_cache(window):
    """A 200-token prompt prefilled in one forward attends over its own keys and values, not
    over their codes: for every format its logits are StaticCache's bit for bit (on the CPU both
    run SDPA's flash kernel over the prompt), and left-padded prompts (a mask the chunk check
    rejects: the op's float32 path) are within bf16 rounding of them, twice the bf16 model's
    own distance from float32. Attending over the stored codes instead (before tq.prefill) put
    the logits 0.9% (int8) to 41% (k2v2_nc) away, 9% for 4bit_nc."""
    config, model = tiny_model("llama")
    ids, mask = prompt_batch(seed=11, left_pad=7, length=PREFILL_LEN)
    plain = model(ids, past_key_values=StaticCache(config, PREFILL_CAPACITY)).logits
    padded = model(
        ids, attention_mask=mask, past_key_values=StaticCache(config, PREFILL_CAPACITY)
    ).logits
    exact = copy.deepcopy(model).float()(
        ids, attention_mask=mask, past_key_values=StaticCache(config, PREFILL_CAPACITY)
    )
    bound = 2 * max(
        rel_error(padded[0], exact.logits[0]), rel_error(padded[1, 7:], exact.logits[1, 7:])
    )
    for preset in sorted(FORMATS):
        cache = TurboQuantCache(config, PREFILL_CAPACITY, preset=preset, window=window)
        assert torch.equal(model(ids, past_key_values=cache).logits, plain), preset
        cache = TurboQuantCache(config, PREFILL_CAPACITY, preset=preset, window=window)
        got = model(ids, attention_mask=mask, past_key_values=cache).logits
        errors = rel_error(got[0], padded[0]), rel_error(got[1, 7:], padded[1, 7:])
        assert max(errors) < bound, (preset, errors, bound)


@torch.no_grad()
def test_chunked_prefill_reads_the_compressed_prefix():
    """A prompt prefilled 50 tokens per forward (``generate``'s ``prefill_chunk_size``; more
    than 16, so every chunk is a prefill, not a verify step): each chunk attends over itself
    exactly and over the cached prefix. A window holding the whole prompt keeps the prefix in
    bf16: StaticCache's logits to bf16 rounding; int8 without a window reads its pages: within
    int8's bound; the Triton kernels (interpreter on the CPU, CUDA on a GPU) give the reference
    path's logits (the store kernels' codes may differ by a level, as in the bounds above);
    ``generate`` runs the same chunks."""
    config, model = tiny_model("qwen2")
    ids, _ = prompt_batch(seed=12, left_pad=7, length=PREFILL_LEN)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def chunked(cache, chunk=50, device="cpu"):
        with torch.device(device):
            return torch.cat(
                [
                    model.to(device)(
                        ids[:, s : s + chunk].to(device), past_key_values=cache
                    ).logits.cpu()
                    for s in range(0, PREFILL_LEN, chunk)
                ],
                dim=1,
            )

    static = chunked(StaticCache(config, PREFILL_CAPACITY))
    whole = TurboQuantCache(config, PREFILL_CAPACITY, preset="3bit_nc", window=PREFILL_CAPACITY)
    assert rel_error(chunked(whole), static) < 0.01
    assert (
        rel_error(
            chunked(TurboQuantCache(config, PREFILL_CAPACITY, preset="int8", window=0)), static
        )
        < INT8_BOUND
    )
    reference = chunked(TurboQuantCache(config, PREFILL_CAPACITY, window=16))
    with triton_kernels(device):
        kernels = chunked(TurboQuantCache(config, PREFILL_CAPACITY, window=16), device=device)
    model.cpu()
    assert rel_error(kernels, reference) < SAME_QUANTIZATION_BOUND
    out = model.generate(
        ids,
        past_key_values=TurboQuantCache(config, PREFILL_CAPACITY, window=16),
        max_new_tokens=3,
        do_sample=False,
        prefill_chunk_size=50,
    )
    assert out.shape == (2, PREFILL_LEN + 3)
    assert torch.equal(out[:, PREFILL_LEN], reference[:, -1].argmax(-1))


@torch.no_grad()
def test_compiled_prefill_of_a_fresh_cache():
    """A compiled forward of a fresh cache (``generate``'s chunked prefill under compile) never
    traces the layers' construction, quantized or kept dense: with ``fullgraph=True`` it fails
    naming ``early_initialization``; after ``early_initialization`` it compiles whole; without
    ``fullgraph`` the layers are built at a graph break, their buffers marked static (which
    CUDA graphs need)."""
    config, model = tiny_model("llama")
    ids, _ = prompt_batch(seed=13, left_pad=0)

    def chunks(forward, cache):
        halves = (ids[:, : PROMPT // 2], ids[:, PROMPT // 2 :])
        return torch.cat([forward(input_ids=h, past_key_values=cache).logits for h in halves], 1)

    def fresh():
        return TurboQuantCache(config, CAPACITY, preset="4bit_nc", window=4, keep_first=1)

    eager = chunks(model, fresh())
    torch._dynamo.reset()
    whole = torch.compile(model.forward, backend="eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="early_initialization"):
        whole(input_ids=ids, past_key_values=fresh())
    cache = fresh()
    cache.early_initialization(
        2, config.num_key_value_heads, config.head_dim, torch.bfloat16, "cpu"
    )
    # the compiled forwards attend through tq.decode (transformers builds a mask while
    # tracing), the eager first chunk through tq.prefill: the same codes, within the
    # same-quantization bound (measured 0.74%)
    assert rel_error(chunks(whole, cache), eager) < SAME_QUANTIZATION_BOUND
    torch._dynamo.reset()
    breaking = torch.compile(model.forward, backend="eager")
    cache = fresh()
    assert torch.equal(chunks(breaking, cache), eager)
    dense, quantized = cache.layers
    buffers = [dense.keys, dense.values, *quantized.kv.buffers(), quantized.cumulative_length]
    assert all(compat.has_static_address(buffer) for buffer in buffers)


def test_triton_kernels_match_reference_path():
    """The same generation through the Triton kernels (interpreter on CPU, CUDA on a GPU)
    gives the reference path's logits."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config, model = tiny_model("mistral")
    model = model.to(device)
    ids, mask = (t.to(device) for t in prompt_batch(seed=4))
    tokens = torch.randint(3, 256, (2, 4), generator=torch.Generator().manual_seed(4)).to(device)
    cache = TurboQuantCache(config, CAPACITY, preset="4bit_nc", window=8)
    with triton_kernels(device):
        kernels = teacher_forced_logits(model, cache, ids, mask, tokens)
    reference = teacher_forced_logits(
        model.cpu(),
        TurboQuantCache(config, CAPACITY, window=8),
        ids.cpu(),
        mask.cpu(),
        tokens.cpu(),
    )
    assert rel_error(kernels.cpu(), reference) < SAME_QUANTIZATION_BOUND


@pytest.mark.parametrize(
    "chunk, prompt, prompt_chunk", [(1, 0, 0), (5, 0, 0), (1, 10, 0), (3, 10, 4)]
)
def test_teacher_forced_chunks_equal_one_parallel_forward(chunk, prompt, prompt_chunk):
    """``examples.hf_eval.teacher_forced`` with ``chunk`` tokens per forward (5: the last chunk
    shorter), after a prompt of 10 tokens prefilled in one forward or in chunks of 4, gives each
    position's next-token NLL and argmax as one parallel forward does (float32 StaticCache:
    rounding only, 1e-4; targets one position off differ by 0.1 or more); a TurboQuantCache
    without a window reads the same codes in chunks of 1 and of 4 or 5 (bf16 rounding of the
    logits, as in the bounds above); progress reaches the end; a chunk below 1 is refused."""
    from examples.hf_eval import teacher_forced

    config, model = tiny_model("llama")
    model = model.float()
    ids = torch.randint(3, 256, (23,), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1]
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, ids[1:, None])[:, 0]
    seen = []
    run = teacher_forced(
        model,
        StaticCache(config, CAPACITY),
        ids,
        lambda done, total: seen.append((done, total)),
        chunk=chunk,
        prompt=prompt,
        prompt_chunk=prompt_chunk,
    )
    torch.testing.assert_close(run.nll, nll, rtol=0, atol=1e-4)
    assert torch.equal(run.argmax, logits.argmax(-1))
    assert seen[-1] == (22, 22)
    model = model.bfloat16()
    one, chunked = (
        teacher_forced(model, TurboQuantCache(config, CAPACITY, window=0), ids, chunk=c)
        for c in (1, max(chunk, 4))
    )
    assert rel_error(chunked.nll, one.nll) < SAME_QUANTIZATION_BOUND
    with pytest.raises(ValueError, match="chunk must be >= 1 and prompt, prompt_chunk >= 0"):
        teacher_forced(model, StaticCache(config, CAPACITY), ids, chunk=0)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (32, 1), (64, 1)])
def test_views_reach_the_decode_op(heads, kv_heads, monkeypatch):
    """update() returns TurboQuantKVTensor views [B, Hk, max_cache_len, D]; a decode step calls
    tq.decode once per layer and never dequantizes, whatever the GQA group (multi-query models:
    32 and 64 query heads per kv-head), with the logits of dense attention over the same
    codes."""
    config, model = tiny_model("llama", num_attention_heads=heads, num_key_value_heads=kv_heads)
    ids, mask = prompt_batch(seed=5, left_pad=0)
    step_mask = torch.cat([mask, mask[:, :1]], 1)
    cache = TurboQuantCache(config, CAPACITY, preset="4bit_nc", window=0)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
        reference = copy.deepcopy(cache)  # the same codes, read back dense by the step
        for layer in reference.layers:
            layer.__class__ = _DequantizedLayer
        expected = model(ids[:, :1], attention_mask=step_mask, past_key_values=reference).logits
    calls, views = [], []
    for name in ("decode", "dequantize"):
        op = getattr(torch.ops.tq, name)
        monkeypatch.setattr(
            torch.ops.tq,
            name,
            lambda *a, _op=op, _n=name, **k: (calls.append(_n), _op(*a, **k))[1],
        )
    update = TurboQuantLayer.update
    monkeypatch.setattr(
        TurboQuantLayer, "update", lambda *a, **k: (views.append(update(*a, **k)), views[-1])[1]
    )
    with torch.no_grad():
        logits = model(ids[:, :1], attention_mask=step_mask, past_key_values=cache).logits
    assert calls == ["decode"] * config.num_hidden_layers
    assert all(
        isinstance(t, TurboQuantKVTensor) and t.shape == (2, kv_heads, CAPACITY, 64)
        for pair in views
        for t in pair
    )
    assert rel_error(logits.float(), expected.float()) < SAME_QUANTIZATION_BOUND


def test_reset_reorder_crop():
    """reset() empties the cache (a second generate gives the same tokens); reorder_cache swaps
    sequences (beam search); crop() rolls back a window-0 cache exactly."""
    config, model = tiny_model("llama")
    ids, mask = prompt_batch(seed=6, left_pad=0)
    cache = TurboQuantCache(config, CAPACITY, preset="4bit_nc", window=0)
    first = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    cache.reset()
    again = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert torch.equal(first, again)
    assert int(cache.get_seq_length()) == PROMPT + 7

    tokens = first[:, PROMPT:]
    swapped = TurboQuantCache(config, CAPACITY, preset="4bit_nc", window=0)
    plain_cache = TurboQuantCache(config, CAPACITY, preset="4bit_nc", window=0)
    plain = teacher_forced_logits(model, plain_cache, ids, mask, tokens[:, :2])
    with torch.no_grad():
        model(ids.flip(0), past_key_values=swapped)
    swapped.reorder_cache(torch.tensor([1, 0]))
    with torch.no_grad():
        out = model(tokens[:, :1], past_key_values=swapped)
    assert torch.allclose(out.logits[:, -1].float(), plain[1], atol=1e-2)

    cropped = TurboQuantCache(config, CAPACITY, preset="4bit_nc", window=0)
    teacher_forced_logits(model, cropped, ids, mask, tokens[:, :4])
    cropped.crop(-4)  # transformers' convention: minus the tokens removed
    assert int(cropped.get_seq_length()) == PROMPT
    with torch.no_grad():
        out = model(tokens[:, :1], past_key_values=cropped)
    assert torch.allclose(out.logits[:, -1].float(), plain[1], atol=1e-2)


def test_reorder_moves_the_key_centres():
    """reorder_cache moves each sequence's keys' centres with its pages and rings: a centring
    cache (window 4, 2 sinks; the 12-token prompt sets the centres) filled with the batch in
    reverse order and reordered gives the logits of one filled in order."""
    config, model = tiny_model("llama")
    ids, _ = prompt_batch(seed=6, left_pad=0)
    options = dict(preset="4bit_nc", window=4, sinks=2, center_keys=True)
    plain, swapped = (TurboQuantCache(config, CAPACITY, **options) for _ in range(2))
    with torch.no_grad():
        model(ids, past_key_values=plain)
        model(ids.flip(0), past_key_values=swapped)
        centres = swapped.layers[0].kv.key_center.clone()
        swapped.reorder_cache(torch.tensor([1, 0]))
        assert torch.equal(swapped.layers[0].kv.key_center, centres.flip(0))
        assert not torch.equal(centres[0], centres[1])
        token = ids[:, -1:]
        expected = model(token, past_key_values=plain).logits[:, -1].float()
        actual = model(token, past_key_values=swapped).logits[:, -1].float()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-2)


def test_crop_with_a_window():
    """crop() with a window of 8 (prompt 12): 4 tokens push positions 4..7 out of the ring,
    crop(-4) drops the tokens, and the logits of another token at position 12 are as close to
    bf16 ones (StaticCache) as a cache that quantizes every token gets, or closer (before the
    ring recorded its slots' positions, writing position 12 would have moved the cropped
    token 16's row into the page of position 4; a crop with a window was refused)."""
    config, model = tiny_model("llama")
    ids, mask = prompt_batch(seed=6, left_pad=0)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, config.vocab_size, (2, 5), generator=gen)
    exact = teacher_forced_logits(
        model, StaticCache(config, max_cache_len=CAPACITY), ids, mask, tokens[:, 4:5]
    )[1]
    quantized = teacher_forced_logits(
        model, TurboQuantCache(config, CAPACITY, window=0), ids, mask, tokens[:, 4:5]
    )[1]
    cropped = TurboQuantCache(config, CAPACITY, window=8)
    assert cropped.is_croppable
    teacher_forced_logits(model, cropped, ids, mask, tokens[:, :4])
    cropped.crop(-4)
    assert int(cropped.get_seq_length()) == PROMPT
    full_mask = torch.cat([mask, mask.new_ones(2, CAPACITY - PROMPT)], dim=1)
    with torch.no_grad():
        out = model(
            tokens[:, 4:5],
            attention_mask=full_mask,
            position_ids=torch.full((2, 1), PROMPT),
            past_key_values=cropped,
        )
    out = out.logits[:, -1].float()
    assert (out - exact).norm() <= (quantized - exact).norm() * 1.01


def test_nbytes_and_kept_layers():
    """keep_first / keep_last layers are dense (StaticLayers); nbytes counts both kinds after the
    first forward; a 4bit_nc cache with window 0 takes its pages, rotation and block table."""
    config, model = tiny_model("llama")
    ids, _ = prompt_batch(left_pad=0)
    cache = TurboQuantCache(config, CAPACITY, keep_first=1)
    assert [type(layer).__name__ for layer in cache.layers] == ["DenseLayer", "TurboQuantLayer"]
    assert cache.is_compileable
    with torch.no_grad():
        model(ids, past_key_values=cache)
    dense_layer = 2 * 2 * 2 * CAPACITY * 64 * 2 + 8  # K+V, B, Hk, S, D, bf16; the int64 length
    assert cache.dense_nbytes() == 2 * dense_layer
    compact = TurboQuantCache(config, CAPACITY, window=0)
    with torch.no_grad():
        model(ids, past_key_values=compact)
    # per layer: pages of 70 bytes per token-head (D = 64), the rotation [D, D] float32, the
    # block table [B, 4] int32, the length
    assert compact.nbytes() == 2 * (2 * 2 * CAPACITY * 70 + 64 * 64 * 4 + 2 * 4 * 4 + 8)


def held_storages(cache) -> int:
    """Bytes of every tensor storage the cache's layers hold (attributes, and their modules'
    buffers), each storage once."""
    storages = {}
    for layer in cache.layers:
        for value in vars(layer).values():
            tensors = value.buffers() if isinstance(value, torch.nn.Module) else [value]
            for tensor in tensors:
                if isinstance(tensor, torch.Tensor):
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_a_short_cache_warns_once_with_the_bytes_it_will_hold():
    """TurboQuantCache(config, 64) with the default window of 128 and 4 sinks quantizes nothing
    (issue 53: silently larger than StaticCache): it warns once, at construction (the user's
    line), naming max_cache_len, window, sinks and the bytes it will hold against StaticCache's,
    the ones nbytes() / dense_nbytes() report after the first forward; nbytes() counts every
    tensor the layers hold, a kept dense layer's included. A cache that quantizes does not
    warn."""
    config, model = tiny_model("llama")
    ids, _ = prompt_batch(left_pad=0)
    with pytest.warns(UserWarning) as record:
        cache = TurboQuantCache(config, CAPACITY, max_batch_size=2, keep_first=1)
        model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False)
    ours = [w for w in record if "no token is ever quantized" in str(w.message)]
    assert len(ours) == 1 and ours[0].filename == __file__
    for part in (
        f"max_cache_len={CAPACITY}",
        "window (128)",
        "sinks (4)",
        "For 2 sequence(s)",
        f"{cache.nbytes():,} bytes",
        f"{cache.dense_nbytes():,} of a bf16 / fp16 StaticCache",
    ):
        assert part in str(ours[0].message), part
    assert cache.nbytes() == held_storages(cache) > cache.dense_nbytes()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compact = TurboQuantCache(config, CAPACITY, window=16)
    with torch.no_grad():
        model(ids, past_key_values=compact)
    assert compact.nbytes() == held_storages(compact) < compact.dense_nbytes()


def test_for_generation_sizes_the_cache_for_the_request():
    """for_generation(model, ids, max_new_tokens, ...) holds the prompt plus the new tokens for
    the prompts times max(num_beams, num_return_sequences) (by default the model's generation
    config's, as generate reads them), with the options given; generate through it equals
    generate through the same cache built by hand."""
    config, model = tiny_model("llama")
    ids, mask = prompt_batch()
    cache = TurboQuantCache.for_generation(model, ids, NEW, preset="int8", window=8)
    layer = cache.layers[0]
    assert (layer.max_cache_len, layer.max_batch_size) == (PROMPT + NEW, 2)
    assert (layer.options.preset, layer.options.window) == ("int8", 8)
    by_hand = TurboQuantCache(config, PROMPT + NEW, preset="int8", window=8)
    out, want = (
        model.generate(
            ids, attention_mask=mask, past_key_values=c, max_new_tokens=NEW, do_sample=False
        )
        for c in (cache, by_hand)
    )
    assert torch.equal(out, want)
    beams = TurboQuantCache.for_generation(model, ids, 4, num_beams=3, num_return_sequences=2)
    assert beams.layers[0].max_batch_size == 6
    model.generation_config.num_return_sequences = 4
    assert TurboQuantCache.for_generation(model, ids, 4).layers[0].max_batch_size == 8


def test_kept_layers_with_a_smaller_batch_and_assisted_generation():
    """With keep_first and a max_batch_size above the batch, every layer reports the batch
    (the cache's batch_size does not raise), and assisted generation (prompt lookup, which
    crops every layer) runs and gives plain greedy decoding's tokens (issue 51, defects 6 and
    7: 'StaticLayer' has no 'crop'; 'not consistent across layers' on e30c341)."""
    config, model = tiny_model("llama")
    ids, mask = prompt_batch(seed=5)
    cache = TurboQuantCache(config, CAPACITY, keep_first=1, max_batch_size=4, window=16)
    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache)
    assert cache.batch_size == 2
    # assisted generation takes one sequence; a repeated run gives prompt lookup matches
    repeated = torch.cat([ids[:1], ids[:1, -6:], ids[:1, -6:]], dim=1)
    kwargs = dict(max_new_tokens=12, do_sample=False)
    plain = model.generate(
        repeated,
        past_key_values=TurboQuantCache(config, CAPACITY, keep_first=1, window=16),
        **kwargs,
    )
    assisted = model.generate(
        repeated,
        past_key_values=TurboQuantCache(config, CAPACITY, keep_first=1, window=16),
        prompt_lookup_num_tokens=3,
        **kwargs,
    )
    assert torch.equal(assisted, plain)


def test_forward_with_grad_enabled_works():
    """A plain forward with autograd on (a user's own loop without torch.no_grad) works as with
    StaticCache (on 7ccf1d3 it raised "does not support autograd"): prompt and decode-step
    logits equal the no_grad forward's to bf16 rounding, backward reaches the weights through
    the attention, and the cache holds what the no_grad forward stored: the same lengths, and
    the first quantized layer byte for byte (later layers' inputs differ by bf16 rounding, the
    prompt attended by dense SDPA over the chunk instead of the flash kernel)."""
    config, model = tiny_model("qwen2")
    ids, mask = prompt_batch(seed=6)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    step_mask = torch.cat([mask, mask.new_ones(2, 1)], dim=1)
    step_ids, step_positions = ids[:, -1:], positions[:, -1:] + 1
    for keep_first in (0, 1):  # a dense first layer too
        trained, plain = (
            TurboQuantCache(config, CAPACITY, window=8, keep_first=keep_first) for _ in range(2)
        )
        got = [
            model(ids, attention_mask=mask, position_ids=positions, past_key_values=trained).logits
        ]
        got.append(
            model(
                step_ids,
                attention_mask=step_mask,
                position_ids=step_positions,
                past_key_values=trained,
            ).logits
        )
        with torch.no_grad():
            want = [
                model(
                    ids, attention_mask=mask, position_ids=positions, past_key_values=plain
                ).logits
            ]
            want.append(
                model(
                    step_ids,
                    attention_mask=step_mask,
                    position_ids=step_positions,
                    past_key_values=plain,
                ).logits
            )
        for g, w in zip(got, want, strict=True):
            assert g.requires_grad and rel_error(g.float(), w.float()) < 0.01
        model.zero_grad()
        sum(g.float().square().mean() for g in got).backward()
        q_grad = model.model.layers[-1].self_attn.q_proj.weight.grad
        assert q_grad is not None and bool(q_grad.isfinite().all()) and bool(q_grad.any())
        lengths = [int(layer.get_seq_length()) for layer in trained.layers]
        assert lengths == [int(layer.get_seq_length()) for layer in plain.layers] == [13, 13]
        first, reference = trained.layers[keep_first].kv, plain.layers[keep_first].kv
        assert all(
            torch.equal(a, b) for a, b in zip(first.buffers(), reference.buffers(), strict=True)
        )
    model.zero_grad()


class TestMessages(expecttest.TestCase):
    def test_bad_arguments_raise_before_allocating(self):
        config, model = tiny_model("llama")
        ids, _ = prompt_batch(left_pad=0)
        flex = copy.deepcopy(config)
        flex._attn_implementation = "flex_attention"
        lines = []
        for build in (
            lambda: TurboQuantCache(config, CAPACITY, preset="5bit"),
            lambda: TurboQuantCache(config, 0),
            lambda: TurboQuantCache(config, CAPACITY, window=-1),
            lambda: TurboQuantCache(config, CAPACITY, sinks=-1),
            lambda: TurboQuantCache(config, CAPACITY, max_batch_size=0),
            lambda: TurboQuantCache(config, CAPACITY, window="16"),
            lambda: TurboQuantCache(config, CAPACITY, keep_first=1.5),
            lambda: TurboQuantCache(config, CAPACITY, seed="x"),
            lambda: TurboQuantCache(config, CAPACITY, num_splits=3),
            lambda: TurboQuantCache(config, CAPACITY, keep_first=1, keep_last=1),
            lambda: TurboQuantCache(flex, CAPACITY),
        ):
            with self.assertRaises((ValueError, TypeError)) as ctx:
                build()
            lines.append(f"{type(ctx.exception).__name__}: {ctx.exception}")
        small = TurboQuantCache(config, CAPACITY, max_batch_size=1)
        with self.assertRaises(ValueError) as ctx, torch.no_grad():
            model(ids, past_key_values=small)
        lines.append(f"{type(ctx.exception).__name__}: {ctx.exception}")
        windowed = TurboQuantCache(config, CAPACITY, window=8)
        with torch.no_grad():
            model(ids, past_key_values=windowed)
        windowed.crop(0)  # a no-op, as transformers calls it every step on some devices
        with self.assertRaises(ValueError) as ctx:
            windowed.crop(2)
        lines.append(f"{type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(lines),
            """\
ValueError: unknown KV format '5bit': expected one of ['3bit_nc', '4bit_nc', 'fp8', 'int8', 'k2v2_nc', 'k2v4_nc', 'k3v4_nc', 'k8v4', 'tq2_nc', 'tq3_nc', 'tq4_nc', 'tqk4v2_nc', 'tqk5v3_nc']
ValueError: max_cache_len must be an integer >= 1, got 0
ValueError: window must be an integer >= 0, got -1
ValueError: sinks must be an integer >= 0, got -1
ValueError: max_batch_size must be None or an integer >= 1, got 0
ValueError: window must be an integer >= 0, got '16'
ValueError: keep_first must be an integer >= 0, got 1.5
ValueError: seed must be an integer (the rotation's random signs), got 'x'
ValueError: num_splits must be None (chosen per device) or a power of two in [1, 512], got 3
ValueError: TurboQuantCache would quantize no layer: keep_first=1 and keep_last=1 keep all 2 layers in full precision (use StaticCache for that, or keep fewer)
ValueError: TurboQuantCache serves attn_implementation 'sdpa' or 'eager' (the latter through 'turboquant'); this model's config says 'flex_attention': load it with attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))
ValueError: TurboQuantCache: batch 2 exceeds max_batch_size=1
ValueError: TurboQuantCache.crop takes a negative count of tokens to remove (or 0), as transformers' caches do, got 2""",  # noqa: E501
        )

    def test_for_generation_bad_arguments_name_them(self):
        config, model = tiny_model("llama")
        ids, _ = prompt_batch(left_pad=0)
        lines = []
        for build in (
            lambda: TurboQuantCache.for_generation(config, ids, 8),
            lambda: TurboQuantCache.for_generation(model, {"input_ids": ids}, 8),
            lambda: TurboQuantCache.for_generation(model, ids.float(), 8),
            lambda: TurboQuantCache.for_generation(model, ids[0], 8),
            lambda: TurboQuantCache.for_generation(model, ids[:, :0], 8),
            lambda: TurboQuantCache.for_generation(model, ids, 0),
            lambda: TurboQuantCache.for_generation(model, ids, 8, num_beams=0),
            lambda: TurboQuantCache.for_generation(model, ids, 8, num_return_sequences=1.0),
            lambda: TurboQuantCache.for_generation(model, ids, 8, fmt="int8"),
            lambda: TurboQuantCache.for_generation(model, ids, 8, preset="5bit"),
        ):
            with self.assertRaises((ValueError, TypeError)) as ctx:
                build()
            lines.append(f"{type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(lines),
            """\
TypeError: TurboQuantCache.for_generation: model must be a transformers model (a PreTrainedConfig as .config), got LlamaConfig
TypeError: TurboQuantCache.for_generation: input_ids must be the [batch, prompt_length] integer tensor given to generate (tokenizer(...)['input_ids']), got dict
TypeError: TurboQuantCache.for_generation: input_ids must be the [batch, prompt_length] integer tensor given to generate (tokenizer(...)['input_ids']), got a torch.float32 tensor
ValueError: TurboQuantCache.for_generation: input_ids must be [batch, prompt_length] with both >= 1, got shape (12,)
ValueError: TurboQuantCache.for_generation: input_ids must be [batch, prompt_length] with both >= 1, got shape (2, 0)
ValueError: max_new_tokens must be an integer >= 1, got 0
ValueError: num_beams must be an integer >= 1, got 0
ValueError: num_return_sequences must be an integer >= 1, got 1.0
TypeError: unknown cache option(s) ['fmt'] (the format is `preset`): the options are ['preset', 'window', 'sinks', 'center_keys', 'page_size', 'seed', 'num_splits']
ValueError: unknown KV format '5bit': expected one of ['3bit_nc', '4bit_nc', 'fp8', 'int8', 'k2v2_nc', 'k2v4_nc', 'k3v4_nc', 'k8v4', 'tq2_nc', 'tq3_nc', 'tq4_nc', 'tqk4v2_nc', 'tqk5v3_nc']""",  # noqa: E501
        )
