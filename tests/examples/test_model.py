"""examples/model.py: cached decoding against a cache-free forward, compiled decode, cache swap."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

from examples.model import (
    KVCache,
    ModelArgs,
    Transformer,
    decode_one_token,
    generate,
    init_weights,
    prefill,
)

PROMPT_LEN, NEW_TOKENS, BATCH, MAX_SEQ = 16, 8, 2, 32
# Wider than init_weights' default so attention is peaked and cache mistakes show in the logits.
STD = 0.1


def _tiny(dtype: torch.dtype, seed: int = 0) -> Transformer:
    return init_weights(Transformer(ModelArgs.from_name("tiny")), seed, std=STD).to(dtype)


def _prompt(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(
        0, ModelArgs.from_name("tiny").vocab_size, (BATCH, PROMPT_LEN), generator=gen
    )


@torch.no_grad()
def _decode(model: Transformer, prompt: torch.Tensor, decode_fn=decode_one_token):
    """Prefill, then NEW_TOKENS greedy decode steps.

    Returns tokens ``[B, T + NEW_TOKENS + 1]`` and the logits of every step
    ``[B, NEW_TOKENS + 1, V]`` (the prefill's last position first).
    """
    token, logits = prefill(model, prompt, torch.arange(prompt.shape[1]))
    tokens, step_logits = [token], [logits]
    input_pos = torch.tensor([prompt.shape[1]])
    for _ in range(NEW_TOKENS):
        token, logits = decode_fn(model, token, input_pos)
        input_pos += 1
        tokens.append(token.clone())
        step_logits.append(logits.clone())
    return torch.cat([prompt, *tokens], dim=1), torch.stack(step_logits, dim=1)


@pytest.mark.parametrize(
    "dtype, atol", [(torch.float32, 5e-5), (torch.bfloat16, 1e-1)], ids=["fp32", "bf16"]
)
def test_cached_decode_matches_forward_without_cache(dtype, atol, seeded):
    """Prefill + greedy decode through the KV cache gives the cache-free forward's logits."""
    model = _tiny(dtype)
    model.setup_caches(BATCH, MAX_SEQ)
    tokens, step_logits = _decode(model, _prompt(seeded))

    reference = _tiny(dtype)  # same weights, no caches: causal attention over the whole prefix
    with torch.no_grad():
        expected = reference(tokens[:, :-1], torch.arange(tokens.shape[1] - 1))
    expected = expected[:, PROMPT_LEN - 1 :]  # [B, NEW_TOKENS + 1, V]
    assert expected.float().std() > 0.5  # logits spread enough to mean something
    torch.testing.assert_close(step_logits.float(), expected.float(), rtol=0, atol=atol)
    if dtype == torch.float32:
        assert torch.equal(tokens[:, PROMPT_LEN:], expected.argmax(dim=-1))


def test_compiled_decode_matches_eager_without_recompiles(seeded):
    """torch.compile(decode_one_token, fullgraph=True) on CPU: eager's tokens, one graph."""
    prompt = _prompt(seeded)
    model = _tiny(torch.float32)
    model.setup_caches(BATCH, MAX_SEQ)
    eager_tokens, eager_logits = _decode(model, prompt)

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(decode_one_token, fullgraph=True, backend=counter)

    def compiled_step(*args):
        out = compiled(*args)
        torch._dynamo.config.error_on_recompile = True  # from the first compiled step on
        return out

    # Restored by hand: pytest's monkeypatch deletes dynamo config entries on undo.
    error_on_recompile = torch._dynamo.config.error_on_recompile
    model.setup_caches(BATCH, MAX_SEQ)  # fresh caches
    try:
        tokens, logits = _decode(model, prompt, compiled_step)
    finally:
        torch._dynamo.config.error_on_recompile = error_on_recompile
        torch._dynamo.reset()

    assert counter.frame_count == 1
    assert torch.equal(tokens, eager_tokens)
    torch.testing.assert_close(logits, eager_logits, rtol=1e-5, atol=1e-5)


class CountingKVCache(KVCache):
    """A KVCache that counts its updates: the smallest possible replacement cache."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.updates = 0

    def update(self, input_pos, k_val, v_val):
        self.updates += 1
        return super().update(input_pos, k_val, v_val)


def test_cache_factory_and_assignment_swap_the_cache(seeded):
    """A cache from cache_factory, or assigned to layer.attention.kv_cache, is the one used."""
    prompt = _prompt(seeded)
    model = _tiny(torch.float32)
    model.setup_caches(BATCH, MAX_SEQ)
    expected = generate(model, prompt, NEW_TOKENS)

    model.setup_caches(BATCH, MAX_SEQ, cache_factory=CountingKVCache)
    caches = [layer.attention.kv_cache for layer in model.layers]
    assert all(type(cache) is CountingKVCache for cache in caches)
    assert caches[0].k_cache.shape == (BATCH, 2, MAX_SEQ, 64)
    assert torch.equal(generate(model, prompt, NEW_TOKENS), expected)
    assert [cache.updates for cache in caches] == [NEW_TOKENS] * len(caches)  # prefill + 7

    model.setup_caches(BATCH, MAX_SEQ)
    model.layers[1].attention.kv_cache = swapped = CountingKVCache(
        BATCH, 2, MAX_SEQ, 64, torch.float32
    )
    assert torch.equal(generate(model, prompt, NEW_TOKENS), expected)
    assert swapped.updates == NEW_TOKENS


def test_presets():
    """The presets have the documented shapes; an unknown name is a clear error."""
    args = ModelArgs.from_name("1b-shape")
    assert (args.n_layer, args.n_head, args.n_local_heads, args.head_dim) == (16, 32, 8, 128)
    tiny = ModelArgs.from_name("tiny")
    assert (tiny.n_head, tiny.n_local_heads, tiny.head_dim, tiny.vocab_size) == (4, 2, 64, 256)
    with pytest.raises(ValueError, match="unknown model"):
        ModelArgs.from_name("70b")
