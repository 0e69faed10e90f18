"""A small gpt-fast-style Llama: the model our users copy, and the one our tests decode with.

Modelled on pytorch-labs/gpt-fast's ``model.py`` and kept as plain as it: a bf16 ``KVCache``
with the ``update(input_pos, k_val, v_val) -> (k_out, v_out)`` contract, grouped-query attention
by ``F.scaled_dot_product_attention(..., enable_gqa=True)`` with a boolean causal mask (or, as
gpt-fast writes it, ``repeat_interleave`` of K/V up to the query heads first:
``Attention.gqa``), RoPE, RMSNorm and a SwiGLU feed-forward. Weights are random
(``init_weights``); nothing is downloaded.

The KV cache is the one thing meant to be swapped: ``setup_caches(..., cache_factory=...)`` or
assigning a module with the same ``update`` contract to ``layer.attention.kv_cache``. The
attention code does not change. ``decode_one_token`` is the step users wrap in
``torch.compile(..., fullgraph=True)``; ``generate`` is gpt-fast's greedy loop around it.

Shapes: B batch, T new tokens, S_max cache length, Hq query heads, Hk key/value heads, D head
dimension, V vocabulary size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def find_multiple(n: int, k: int) -> int:
    """The smallest multiple of ``k`` that is ``>= n``."""
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class ModelArgs:
    """Model shape. Derived when left out: ``n_local_heads`` (= ``n_head``, no GQA),
    ``head_dim`` (= ``dim // n_head``), ``intermediate_size`` (Llama's 8/3 * dim rounded)."""

    block_size: int = 2048  # longest sequence RoPE is precomputed for
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32  # Hq
    dim: int = 4096
    intermediate_size: int | None = None
    n_local_heads: int = -1  # Hk (key/value heads); -1: same as n_head
    head_dim: int | None = None  # D
    rope_base: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.head_dim is None:
            self.head_dim = self.dim // self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = find_multiple(int(2 * 4 * self.dim / 3), 256)
        if self.n_head % self.n_local_heads:
            raise ValueError(f"n_head={self.n_head} not a multiple of {self.n_local_heads=}")

    @classmethod
    def from_name(cls, name: str) -> ModelArgs:
        """The preset ``name`` (one of ``transformer_configs``)."""
        if name not in transformer_configs:
            raise ValueError(f"unknown model {name!r}; known: {sorted(transformer_configs)}")
        return cls(**transformer_configs[name])


transformer_configs = {
    # CPU-sized, for tests: Hq=4, Hk=2, D=64.
    "tiny": dict(
        block_size=256,
        vocab_size=256,
        n_layer=2,
        n_head=4,
        n_local_heads=2,
        dim=128,
        head_dim=64,
        intermediate_size=256,
    ),
    # Llama-3.2-1B's shape with D=128 (as Qwen3 has): 16 layers, Hq=32, Hk=8; q/o project
    # 2048 <-> 4096. ~1.1B parameters besides the 2 x 0.26B of embedding and output.
    "1b-shape": dict(
        block_size=32768,
        vocab_size=128256,
        n_layer=16,
        n_head=32,
        n_local_heads=8,
        dim=2048,
        head_dim=128,
        intermediate_size=8192,
        rope_base=500000.0,
    ),
    # Llama-3-8B: 32 layers, Hq=32, Hk=8, D=128.
    "8b-shape": dict(
        block_size=32768,
        vocab_size=128256,
        n_layer=32,
        n_head=32,
        n_local_heads=8,
        dim=4096,
        intermediate_size=14336,
        rope_base=500000.0,
    ),
}


class KVCache(nn.Module):
    """Full-precision cache: ``k_cache``, ``v_cache`` ``[B, Hk, S_max, D]`` of ``dtype``.

    Its constructor is the ``cache_factory`` signature of ``Transformer.setup_caches``.
    """

    def __init__(
        self,
        max_batch_size: int,
        n_local_heads: int,
        max_seq_length: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        cache_shape = (max_batch_size, n_local_heads, max_seq_length, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos: Tensor, k_val: Tensor, v_val: Tensor) -> tuple[Tensor, Tensor]:
        """Write new keys and values at ``input_pos``; return the whole cache.

        Args:
            input_pos: ``[T] int64`` positions of the new tokens.
            k_val, v_val: ``[B, Hk, T, D]`` new keys (after RoPE) and values.

        Returns:
            ``(k_out, v_out)``, each ``[B, Hk, S_max, D]``; slots not yet written are masked.
        """
        assert input_pos.shape[0] == k_val.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val
        return k_out, v_out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def precompute_freqs_cis(seq_len: int, n_elem: int, base: float = 10000.0) -> Tensor:
    """RoPE rotations ``[seq_len, n_elem // 2, 2] float32`` as (cos, sin) pairs."""
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: n_elem // 2].float() / n_elem))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """Rotate ``x [B, T, H, D]`` by ``freqs_cis [T, D // 2, 2]``; same shape and dtype."""
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)  # [B, T, H, D // 2, 2]
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )
    return x_out.flatten(3).type_as(x)


GQA_MODES = ("enable_gqa", "repeat_interleave")


class Attention(nn.Module):
    """Attention with a KV cache. ``gqa`` says how the Hk key/value heads serve the Hq query
    heads: ``"enable_gqa"`` passes them to SDPA as they are (what a careful user writes);
    ``"repeat_interleave"`` copies them to Hq heads first, as gpt-fast does (a dense cache is
    then copied 4x per layer and step at Hq / Hk = 4; a TurboQuantKVTensor repeats lazily)."""

    def __init__(self, config: ModelArgs, gqa: str = "enable_gqa"):
        super().__init__()
        if gqa not in GQA_MODES:
            raise ValueError(f"gqa must be one of {GQA_MODES}, got {gqa!r}")
        self.gqa = gqa
        self.n_head = config.n_head
        self.n_local_heads = config.n_local_heads
        self.head_dim = config.head_dim
        q_size, kv_size = config.n_head * config.head_dim, config.n_local_heads * config.head_dim
        self.wqkv = nn.Linear(config.dim, q_size + 2 * kv_size, bias=False)
        self.wo = nn.Linear(q_size, config.dim, bias=False)
        self.kv_cache: nn.Module | None = None

    def forward(
        self, x: Tensor, freqs_cis: Tensor, mask: Tensor | None, input_pos: Tensor
    ) -> Tensor:
        """``x [B, T, dim]``, ``freqs_cis [T, D // 2, 2]``, ``mask [1, 1, T, S] bool``; ``mask``
        None: the T tokens are a prompt from position 0, attending causally over themselves
        (``is_causal`` over the cache's first T positions, no mask: what Hugging Face's SDPA
        attention does for a prefill into an empty static cache, so that SDPA may pick its
        fastest kernel)."""
        bsz, seqlen, _ = x.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]

        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)  # [B, Hk, S_max, D]
        if mask is None:
            k, v = k[:, :, :seqlen], v[:, :, :seqlen]
        if self.gqa == "repeat_interleave":
            k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)  # [B, Hq, S, D]
            v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=mask is None,
            enable_gqa=self.gqa == "enable_gqa",
        )

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, q_size)
        return self.wo(y)


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(
        self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor | None
    ) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        freqs_cis = precompute_freqs_cis(config.block_size, config.head_dim, config.rope_base)
        self.register_buffer("freqs_cis", freqs_cis, persistent=False)  # [block_size, D//2, 2]
        self.register_buffer("causal_mask", None, persistent=False)  # [S_max, S_max] bool
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(
        self,
        max_batch_size: int,
        max_seq_length: int,
        dtype: torch.dtype | None = None,
        cache_factory: Callable[..., nn.Module] | None = None,
    ) -> None:
        """Give every layer a fresh KV cache of ``max_seq_length`` slots, on the model's device.

        Args:
            max_batch_size: B of the caches.
            max_seq_length: S_max, at most ``config.block_size``.
            dtype: cache dtype; default the model's.
            cache_factory: ``(max_batch_size, n_local_heads, max_seq_length, head_dim, dtype)
                -> module`` with ``update(input_pos, k_val, v_val) -> (k, v [B, Hk, S_max, D])``;
                default ``KVCache``.
        """
        if max_seq_length > self.config.block_size:
            raise ValueError(f"{max_seq_length=} exceeds block_size={self.config.block_size}")
        cache_factory = KVCache if cache_factory is None else cache_factory
        dtype = self.output.weight.dtype if dtype is None else dtype
        self.max_batch_size, self.max_seq_length = max_batch_size, max_seq_length
        c = self.config
        with torch.device(self.output.weight.device):
            for layer in self.layers:
                layer.attention.kv_cache = cache_factory(
                    max_batch_size, c.n_local_heads, max_seq_length, c.head_dim, dtype
                )
            self.causal_mask = torch.tril(
                torch.ones(max_seq_length, max_seq_length, dtype=torch.bool)
            )

    def forward(
        self, idx: Tensor, input_pos: Tensor, causal_prompt: bool = False, last_only: bool = False
    ) -> Tensor:
        """Logits ``[B, T, V]`` for tokens ``idx [B, T] int64`` at positions ``input_pos [T]``.

        With caches, attends to everything cached up to each position. Without (no
        ``setup_caches``), plain causal attention over ``idx`` alone.

        Args:
            causal_prompt: ``idx`` is a prompt from position 0: attention is SDPA's
                ``is_causal`` over its own positions instead of gpt-fast's mask over the
                cache (the same result; SDPA's flash / cuDNN kernels take no mask).
            last_only: logits of the last position only, ``[B, 1, V]`` (a prefill needs no
                more: at 32k tokens the others are 8 GB).
        """
        if causal_prompt:
            mask = None
        elif self.causal_mask is None:
            seqlen = idx.shape[1]
            mask = torch.ones(seqlen, seqlen, dtype=torch.bool, device=idx.device).tril()
            mask = mask[None, None]  # [1, 1, T, T]
        else:
            mask = self.causal_mask[None, None, input_pos]  # [1, 1, T, S_max]
        freqs_cis = self.freqs_cis[input_pos]  # [T, D // 2, 2]
        x = self.tok_embeddings(idx)  # [B, T, dim]
        for layer in self.layers:
            x = layer(x, input_pos, freqs_cis, mask)
        if last_only:
            x = x[:, -1:]
        return self.output(self.norm(x))


def init_weights(model: Transformer, seed: int, std: float = 0.02) -> Transformer:
    """Fill linear and embedding weights with ``N(0, std)`` from ``seed``; norms with ones.

    The same seed gives the same weights on the same device type.
    """
    gen = torch.Generator(device=model.output.weight.device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)
    return model


def prefill(model: Transformer, idx: Tensor, input_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Run the prompt ``idx [B, T]`` at ``input_pos [T]`` through the model, filling the caches.

    Returns:
        ``(next_token [B, 1] int64, logits [B, V])`` greedy choice after the last position.
    """
    logits = model(idx, input_pos)[:, -1]
    return logits.argmax(dim=-1, keepdim=True), logits


def decode_one_token(
    model: Transformer, cur_token: Tensor, input_pos: Tensor
) -> tuple[Tensor, Tensor]:
    """One decode step: ``cur_token [B, 1]`` at ``input_pos [1]``; the step to compile.

    Returns:
        ``(next_token [B, 1] int64, logits [B, V])``.
    """
    assert input_pos.shape[-1] == 1
    logits = model(cur_token, input_pos)[:, -1]
    return logits.argmax(dim=-1, keepdim=True), logits


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: Tensor,
    max_new_tokens: int,
    decode_fn: Callable[[Transformer, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
) -> Tensor:
    """Greedy decoding into the caches set up by ``model.setup_caches``.

    Args:
        prompt: ``[B, T] int64``, B the caches' ``max_batch_size``.
        max_new_tokens: tokens to generate (>= 1).
        decode_fn: the decode step, e.g. ``torch.compile(decode_one_token, fullgraph=True)``;
            default ``decode_one_token``.

    Returns:
        ``[B, T + max_new_tokens] int64``: the prompt followed by the new tokens.
    """
    decode_fn = decode_one_token if decode_fn is None else decode_fn
    bsz, seqlen = prompt.shape
    if bsz != model.max_batch_size or seqlen + max_new_tokens - 1 > model.max_seq_length:
        raise ValueError(f"{prompt.shape=} and {max_new_tokens=} do not fit the caches")
    input_pos = torch.arange(seqlen, device=prompt.device)
    next_token, _ = prefill(model, prompt, input_pos)
    new_tokens = [next_token]
    input_pos = torch.tensor([seqlen], device=prompt.device)
    for _ in range(max_new_tokens - 1):
        next_token, _ = decode_fn(model, next_token, input_pos)
        # a CUDA graph's output is overwritten by its next replay: neither kept nor fed back
        # (two TP ranks failed recording a graph whose input was the previous step's token)
        next_token = next_token.clone()
        input_pos += 1
        new_tokens.append(next_token)
    return torch.cat([prompt, *new_tokens], dim=1)
