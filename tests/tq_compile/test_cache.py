"""TurboQuantKVCache (``tq_compile/cache.py``): update() and its views, the model-dtype cast,
and the example gpt-fast model with TurboQuant caches: eager against the bf16 cache, compiled,
the FX graph of a decode step, CUDA graphs, bytes."""

from __future__ import annotations

import functools
import re
import warnings
from unittest import mock

import expecttest
import pytest
import torch
import torch._dynamo
import torch._dynamo.testing
import torch.nn.functional as F
from helpers import inductor_flat_kernels, rel_error
from kv_views import GROUP, HK, S_MAX, WINDOW, B, D, filled_tq_cache
from torch._dynamo.backends.common import aot_autograd
from torch._inductor.utils import run_and_get_code
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from custom_ops import ops
from custom_ops.formats import FORMATS
from custom_ops.triton.decode import plan
from examples.model import (
    ModelArgs,
    Transformer,
    decode_one_token,
    init_weights,
    prefill,
)
from tq_compile import TurboQuantKVCache, TurboQuantKVTensor


def test_update_returns_views_of_the_whole_cache():
    """update() writes, then returns key/value views [B, Hk, S_max, D] of the model's dtype
    whose lengths are input_pos.max() + 1."""
    cache, keys, values = filled_tq_cache(length=37)
    assert isinstance(keys, TurboQuantKVTensor) and is_traceable_wrapper_subclass(keys)
    assert keys.shape == (B, HK, S_MAX, D) and keys.dtype == torch.bfloat16
    assert (keys.side, values.side) == ("key", "value")
    assert keys.seq_lens.tolist() == [37, 37]
    assert keys.k_codes.data_ptr() == cache.k_codes.data_ptr()  # a view, no copy


def test_eager_updates_return_the_cache_views_with_the_new_lengths():
    """Eagerly, every update of one token and one batch size returns the same two views (built
    once: host time per layer), holding that update's lengths, like a dense cache returning its
    buffers; another batch size has its own views, and a module move (``.to()``, new buffers)
    new ones over the new buffers. An update of several tokens (a prefill chunk) returns fresh
    views that carry its keys and values."""
    cache, prompt_keys, _ = filled_tq_cache(length=36)
    assert prompt_keys.chunk_k is not None and prompt_keys.chunk_k.shape[2] == 36
    kv = torch.randn(B, HK, 1, D, dtype=torch.bfloat16)
    keys, values = cache.update(torch.tensor([36]), kv, kv)
    assert keys is not prompt_keys and keys.chunk_k is None
    again_keys, again_values = cache.update(torch.tensor([37]), kv, kv)
    assert again_keys is keys and again_values is values
    assert keys.seq_lens.tolist() == [38] * B
    first_keys, _ = cache.update(torch.tensor([38]), kv[:1], kv[:1])
    assert first_keys is not keys and first_keys.shape[0] == 1
    assert first_keys.seq_lens.tolist() == [39] and keys.seq_lens.tolist() == [38] * B
    cache.to(torch.float16)  # a module conversion (the rings follow it): new views
    kv = kv.half()
    moved_keys, _ = cache.update(torch.tensor([39]), kv, kv)
    assert moved_keys is not keys and moved_keys.k_codes is cache.k_codes
    cache.rotation = cache.rotation.clone()  # a buffer assigned: the ops take the new one
    assigned_keys, _ = cache.update(torch.tensor([40]), kv, kv)
    assert assigned_keys is not moved_keys and assigned_keys.rotation is cache.rotation


def test_update_takes_int32_and_int64_positions():
    """Positions of either integer dtype write the same cache (an int32 start is broadcast to
    the batch as a contiguous vector, as the kernels read it)."""
    caches = []
    for dtype in (torch.int64, torch.int32):
        torch.manual_seed(0)
        cache = TurboQuantKVCache(B, HK, S_MAX, D, window=8)
        for start, n in ((0, 11), (11, 1), (12, 1)):
            kv = torch.randn(B, HK, n, D, dtype=torch.bfloat16)
            keys, _ = cache.update(torch.arange(start, start + n, dtype=dtype), kv, kv)
        assert keys.seq_lens.tolist() == [13] * B
        caches.append(cache)
    for (name, a), b in zip(caches[0].named_buffers(), caches[1].buffers(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("stored_first", [False, True])
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_update_then_attend_sees_the_new_token(backend, stored_first, monkeypatch):
    """Stale-read guard: in one compiled graph, update() writes a token and SDPA on the returned
    views must see it. A query aligned with the new key attends almost only to it, so a stale
    read (the pre-write cache) would give a different output. Both traced routes: the token
    pending in the views (tq.decode_step stores it), and stored by update() first (the route
    past 512 sequence-heads)."""
    if stored_first:
        monkeypatch.setattr(plan, "STEP_MAX_SEQUENCE_HEADS", 0)
    cache_e, _, _ = filled_tq_cache(length=10, seed=5)
    cache_c, _, _ = filled_tq_cache(length=10, seed=5)
    gen = torch.Generator().manual_seed(6)
    new_k = torch.randn(B, HK, 1, D, generator=gen).bfloat16() * 4
    new_v = torch.randn(B, HK, 1, D, generator=gen).bfloat16()
    q = new_k.repeat_interleave(GROUP, 1)  # [B, Hq, 1, D]

    def step(cache, pos, k, v, q):
        keys, values = cache.update(pos, k, v)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    pos = torch.tensor([10])
    expected = step(cache_e, pos, new_k, new_v, q)
    torch._dynamo.reset()
    actual = torch.compile(step, backend=backend, fullgraph=True)(cache_c, pos, new_k, new_v, q)
    torch._dynamo.reset()
    torch.testing.assert_close(actual, expected, rtol=1e-2, atol=1e-2)
    # the new value dominates the output: the write was seen
    assert rel_error(actual, new_v.repeat_interleave(GROUP, 1)) < 0.3


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_step_reading_its_views_only_through_dequantize_stores_its_token(backend):
    """A traced decode step's token is pending in the views until SDPA over them stores it; a
    compiled step that reads them only through .dequantize() (an eager-attention model) stores
    it too: its cache then holds the bytes of one stored eagerly, and each .dequantize() returns
    the cache after the step (the token at its position)."""
    compiled_cache, eager_cache = (filled_tq_cache(length=30, seed=7)[0] for _ in range(2))
    gen = torch.Generator().manual_seed(8)
    new_k = torch.randn(B, HK, 1, D, generator=gen).bfloat16()
    new_v = torch.randn(B, HK, 1, D, generator=gen).bfloat16()
    pos = torch.tensor([30])

    def read(cache):
        keys, values = cache.update(pos, new_k, new_v)
        return keys.dequantize(), values.dequantize()

    torch._dynamo.reset()
    dense_k, dense_v = torch.compile(read, backend=backend, fullgraph=True)(compiled_cache)
    torch._dynamo.reset()
    eager_cache.update(pos, new_k, new_v)
    for (name, a), b in zip(compiled_cache.named_buffers(), eager_cache.buffers(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(dense_k[:, :, 30], new_k[:, :, 0])
    assert torch.equal(dense_v[:, :, 30], new_v[:, :, 0])
    assert not dense_k[:, :, 31:].any()


def test_compiled_step_of_a_wide_gqa_group_stores_then_decodes():
    """A compiled decode step whose GQA group is wider than tq.decode_step takes (72 query
    heads over one kv-head: more than MAX_FOLDED_ROWS) stores the pending token and runs
    tq.decode, not dense attention: the output and cache bytes of the eager step (which stores
    first too), and no dequantize in the graph."""
    caches = [TurboQuantKVCache(1, 1, S_MAX, D, window=8) for _ in range(2)]
    gen = torch.Generator().manual_seed(12)
    prompt = torch.randn(1, 1, 10, D, generator=gen).bfloat16()
    for cache in caches:
        cache.update(torch.arange(10), prompt, prompt)
    new_k, new_v = (torch.randn(1, 1, 1, D, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(1, 72, 1, D, generator=gen).bfloat16()

    def step(cache):
        keys, values = cache.update(torch.tensor([10]), new_k, new_v)
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)

    expected = step(caches[0])
    called, call = [], ops.call

    def recording(args):
        called.append(type(args).__name__)
        return call(args)

    torch._dynamo.reset()
    with mock.patch.object(ops, "call", recording):
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(caches[1])
    torch._dynamo.reset()
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    for (name, a), b in zip(caches[0].named_buffers(), caches[1].buffers(), strict=True):
        assert torch.equal(a, b), name
    assert sorted(set(called)) == ["DecodeArgs", "StoreWindowArgs"], called


def test_model_dtype_cast_converts_the_rings_only():
    """model.to(fp16) / .half() after setup converts the rings, which hold the model's tokens,
    as a dense cache's buffers would be; the meta records, rotation and codes keep their dtype
    and every cached value stays (bf16 values are exact in fp16). Keys of another dtype than
    the rings are refused before anything is written (issue 51, defect 4: on e30c341 the rings
    stayed bf16 and fp16 keys were cast into them silently; bfloat16 keys near 1e5 became inf
    in a float16 ring)."""
    cache, keys, _ = filled_tq_cache()
    before = keys.dequantize(torch.float32)
    cache.half()
    assert cache.meta.dtype == torch.bfloat16 and cache.rotation.dtype == torch.float32
    assert cache.k_window.dtype == cache.v_window.dtype == torch.float16
    assert cache.model_dtype == torch.float16
    buffers = [t.clone() for t in cache.buffers()]
    huge = torch.full((B, HK, 1, D), 1e5).bfloat16()
    with pytest.raises(TypeError, match="key must have the rings' dtype torch.float16"):
        cache.update(torch.tensor([37]), huge, huge)
    assert all(torch.equal(a, b) for a, b in zip(buffers, cache.buffers(), strict=True))
    new = [torch.randn(B, HK, 1, D).half()] * 2
    keys_after, _ = cache.update(torch.tensor([37]), *new)
    after = keys_after.dequantize(torch.float32)
    kept = torch.arange(37) != 37 - WINDOW  # position 21 left the window: quantized now
    torch.testing.assert_close(after[:, :, :37][:, :, kept], before[:, :, :37][:, :, kept])


PROMPT_LEN, NEW_TOKENS, BATCH, MAX_SEQ = 64, 32, 2, 128

# Largest relative error of the decode logits (TQ cache vs bf16 cache, teacher-forced on the
# bf16 tokens) over 32 steps of the tiny model, 3 seeds, times 1.3. The random-weight model's
# attention is diffuse, so a window of 16 recent bf16 tokens changes this little (<5%); the
# trained model of benchmarks/quality.py is where the window shows.
LOGIT_ERROR = {
    "k8v4": 0.15,
    "4bit_nc": 0.15,
    "k3v4_nc": 0.15,
    "3bit_nc": 0.3,
    "int8": 0.013,
    "fp8": 0.036,
    "tq4_nc": 0.14,
    "k2v2_nc": 0.64,
    "k2v4_nc": 0.15,
    "tq3_nc": 0.26,
    "tq2_nc": 0.42,
    "tqk4v2_nc": 0.43,
}
# Lowest next-token agreement (TQ cache vs bf16 cache, teacher-forced, 2 x 32 predictions) the
# test's model and prompt (seed 0) must reach. Measured over seeds 0-5 (model and prompt seed)
# and windows 0 and 16, lowest / test's seed 0 (window 0, window 16): k8v4 0.766 / 0.922,
# 0.953; 4bit_nc 0.766 / 0.938, 0.953; k3v4_nc 0.766 / 0.906, 0.938; 3bit_nc 0.562 / 0.562,
# 0.562; int8 0.953 / 1.0, 1.0; fp8 0.953 / 0.984, 0.984; tq4_nc 0.719 / 0.953, 0.969; k2v2_nc
# 0.234 / 0.625, 0.906; k2v4_nc 0.781 / 0.922, 0.953; tq3_nc 0.594 / 0.656, 0.594; tq2_nc
# 0.344 / 0.734, 0.766; tqk4v2_nc 0.359 / 0.719, 0.828. The random-weight model's logits are
# flat (near-ties flip), so each floor is that lowest agreement minus 0.1, and at least 0.45: an
# all-zero attention output agrees on 0.234 at seed 0 (0.0-0.08 at the other seeds), a random
# one on at most 0.08.
AGREEMENT_FLOOR = {
    "k8v4": 0.67,
    "4bit_nc": 0.67,
    "k3v4_nc": 0.67,
    "3bit_nc": 0.46,
    "int8": 0.85,
    "fp8": 0.85,
    "tq4_nc": 0.62,
    "k2v2_nc": 0.45,
    "k2v4_nc": 0.68,
    "tq3_nc": 0.49,
    "tq2_nc": 0.45,
    "tqk4v2_nc": 0.45,
}
MODEL_WINDOW = 16  # the windowed runs keep the last 16 of the 64..96 tokens in bf16


def _model(
    fmt, seed=0, device="cpu", max_seq=MAX_SEQ, dtype=torch.bfloat16, window=0, center=False
) -> Transformer:
    model = init_weights(Transformer(ModelArgs.from_name("tiny")), seed)
    model = model.to(device=device, dtype=dtype)
    factory = None
    if fmt is not None:
        factory = functools.partial(
            TurboQuantKVCache, preset=fmt, window=window, center_keys=center
        )
    model.setup_caches(BATCH, max_seq, cache_factory=factory)
    return model


def _prompt(seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    vocab = ModelArgs.from_name("tiny").vocab_size
    return torch.randint(0, vocab, (BATCH, PROMPT_LEN), generator=gen).to(device)


LONG_PROMPT, LONG_SEQ = 200, 256  # longer than the default window of 128


@pytest.mark.parametrize("window", [0, 128])
@torch.no_grad()
def test_single_forward_prefill_equals_the_bf16_cache(window):
    """gpt-fast's prefill (the prompt in one forward, its causal mask over the whole cache):
    the prompt attends over its own keys and values, not over their codes, so for every format
    the logits are the bf16 cache's to bf16 rounding (closer than the bf16 model is to float32;
    measured 0.07% against 1.25%). Attending over the stored codes put them 2% (int8) to 22%
    (4bit_nc) away."""
    prompt = torch.randint(
        0,
        ModelArgs.from_name("tiny").vocab_size,
        (BATCH, LONG_PROMPT),
        generator=torch.Generator().manual_seed(7),
    )
    positions = torch.arange(LONG_PROMPT)
    dense = _model(None, max_seq=LONG_SEQ)(prompt, positions)
    exact = _model(None, max_seq=LONG_SEQ, dtype=torch.float32)(prompt, positions)
    bound = rel_error(dense, exact)
    for fmt in sorted(FORMATS):
        got = _model(fmt, max_seq=LONG_SEQ, window=window)(prompt, positions)
        assert rel_error(got, dense) < bound, fmt


@torch.no_grad()
def test_compiled_chunked_prefill_matches_eager():
    """torch.compile(model, fullgraph=True) over a prompt in three chunks of 32 tokens: one
    graph for the three (positions are tensors) with one tq.prefill per layer (no break, no
    dequantize), the eager chunks' logits; later chunks read the compressed prefix."""
    prompt = torch.randint(
        0,
        ModelArgs.from_name("tiny").vocab_size,
        (BATCH, 96),
        generator=torch.Generator().manual_seed(3),
    )
    eager, compiled = _model("4bit_nc", window=8), _model("4bit_nc", window=8)
    torch._dynamo.reset()
    graphs = []

    def forward_compiler(gm, _):
        graphs.append(gm)
        return gm

    step = torch.compile(
        compiled, backend=aot_autograd(fw_compiler=forward_compiler), fullgraph=True
    )
    for start in (0, 32, 64):
        positions = torch.arange(start, start + 32)
        expected = eager(prompt[:, start : start + 32], positions)
        got = step(prompt[:, start : start + 32], positions)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert len(graphs) == 1
    assert _attention_ops(graphs[0]) == "\n".join(
        ["auto_functionalized_v2(tq.store_window.default)", "tq.prefill.default"] * 2
        + ["dense sdpa / dequantize calls: 0"]
    )
    torch._dynamo.reset()


@pytest.mark.parametrize("window", [0, MODEL_WINDOW])
@pytest.mark.parametrize("fmt", sorted(LOGIT_ERROR))
@torch.no_grad()
def test_eager_decode_against_bf16_cache(fmt, window):
    """Prefill 64 tokens and decode 32 greedily (teacher-forced on the bf16 model's tokens),
    without and with a recent window: the TQ cache's logits stay within the format's bound of
    the bf16 cache's, and its next tokens agree with the bf16 cache's at least as often as the
    format's floor."""
    ref, tq = _model(None), _model(fmt, window=window)
    prompt = _prompt(0)
    tok, ref_logits = prefill(ref, prompt, torch.arange(PROMPT_LEN))
    _, tq_logits = prefill(tq, prompt, torch.arange(PROMPT_LEN))
    errors, agree = [], []
    for step in range(NEW_TOKENS):
        pos = torch.tensor([PROMPT_LEN + step])
        next_ref, ref_logits = decode_one_token(ref, tok, pos)
        next_tq, tq_logits = decode_one_token(tq, tok, pos)
        errors.append((tq_logits.float() - ref_logits.float()).norm() / ref_logits.float().norm())
        agree.append((next_ref == next_tq).float().mean())
        tok = next_ref
    agreement = torch.stack(agree).mean().item()
    print(
        f"{fmt} window {window}: max logits error {max(errors):.4f}, next-token agreement "
        f"{agreement:.3f}"
    )
    assert max(errors) < LOGIT_ERROR[fmt]
    assert AGREEMENT_FLOOR[fmt] <= agreement <= 1, agreement


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_compiled_decode_no_graph_break_no_recompile(device, center):
    """torch.compile(decode_one_token, fullgraph=True) with inductor on the TQ model with a
    recent window: one graph, no break, no recompile over 32 steps, teacher forced on eager TQ
    decoding's tokens: logits within fp16 rounding of eager's (fp16 model: in bf16, inductor's
    fused rounding moves them 8x more) and the same token wherever eager's top two logits are
    apart by more than that, with and without key centering. On CUDA inductor launches the tq
    kernels itself (statically: see custom_ops.triton.traced) and eager decoding calls the ops.
    (Free-running greedy tokens are not compared: a near tie flips on any rounding.)"""
    eager, compiled = (
        _model("4bit_nc", device=device, dtype=torch.float16, window=MODEL_WINDOW, center=center),
        _model("4bit_nc", device=device, dtype=torch.float16, window=MODEL_WINDOW, center=center),
    )
    prompt = _prompt(1, device)
    positions = torch.arange(PROMPT_LEN, device=device)
    tok_eager, _ = prefill(eager, prompt, positions)
    tok_compiled, _ = prefill(compiled, prompt, positions)
    assert torch.equal(tok_eager, tok_compiled)

    # explain() runs the step (it writes a token): on a third model, so the two compared above
    # stay untouched
    probe = _model(
        "4bit_nc", device=device, dtype=torch.float16, window=MODEL_WINDOW, center=center
    )
    prefill(probe, prompt, positions)
    explained = torch._dynamo.explain(decode_one_token)(
        probe, tok_compiled, torch.tensor([PROMPT_LEN], device=device)
    )
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    step = torch.compile(decode_one_token, backend=counter, fullgraph=True)
    previous = torch._dynamo.config.error_on_recompile
    try:
        for i in range(NEW_TOKENS):
            pos = torch.tensor([PROMPT_LEN + i], device=device)
            tok_compiled, logits_compiled = step(compiled, tok_eager, pos)
            tok_eager, logits_eager = decode_one_token(eager, tok_eager, pos)
            torch._dynamo.config.error_on_recompile = True
            scale = logits_eager.float().abs().amax()
            tolerance = 16 * torch.finfo(torch.float16).eps * scale  # a few fp16 roundings
            diff = (logits_compiled.float() - logits_eager.float()).abs().amax()
            assert diff <= tolerance, f"step {i}: logits {diff} apart, bound {tolerance}"
            top2 = logits_eager.float().topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance
            assert torch.equal(tok_compiled[clear], tok_eager[clear]), f"step {i}"
    finally:
        torch._dynamo.config.error_on_recompile = previous
        torch._dynamo.reset()
    assert counter.frame_count == 1


# A write back into a buffer in inductor's code: aten.copy_ (in a fused kernel's name, or a
# call); `_to_copy` (a dtype conversion) is not one.
_COPY_BACK = re.compile(r"(?<!_to_)copy_")


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_compiled_step_copies_no_cache_buffer(device, center):
    """Inductor's code for one decode step (window 16, so the meta record and both rings are
    written every step) mutates the cache buffers in place: no copy of a cache plane or ring
    back into its buffer (a buffer held as a view of another dtype made functionalization copy
    it back every step, a dozen copy kernels per step), the keys' centres included. On the
    CPU the step calls the tq ops; on CUDA inductor launches their kernels itself, and no tq
    op is left."""
    model = _model("4bit_nc", device=device, window=MODEL_WINDOW, center=center)
    tok, _ = prefill(model, _prompt(4, device), torch.arange(PROMPT_LEN, device=device))
    torch._dynamo.reset()
    step = torch.compile(decode_one_token, fullgraph=True)
    _, codes = run_and_get_code(step, model, tok, torch.tensor([PROMPT_LEN], device=device))
    torch._dynamo.reset()
    code = "\n".join(codes)
    if device == "cpu":  # uncentred keys: the decode token's step is one op
        ops_called = ("store_window", "decode") if center else ("decode_step",)
        assert all(name in code for name in ops_called)
    else:  # (the step: the split kernel appends, the merge fills the ring)
        kernels = ("store_window_kernel", "merge_kernel") if center else ("merge_fill_kernel",)
        assert all(name in code for name in ("split_kernel", *kernels))
        assert center or "store_window_kernel" not in code
        left = sorted(
            {line.strip()[:160] for line in code.splitlines() if "torch.ops.tq." in line}
        )
        assert not left, "\n".join(left)
    # the launches: each module's `call` (kernel sources above it may name a `copy_mask`)
    calls = "\n".join(c[c.index("def call(") :] for c in codes if "def call(" in c)
    copies = sorted({line.strip()[:120] for line in calls.splitlines() if _COPY_BACK.search(line)})
    assert not copies, "\n".join(copies)


@pytest.mark.gpu
@torch.no_grad()
def test_compiled_step_launches_the_kernels_statically():
    """On CUDA inductor launches every tq kernel of a plain-compiled step through its static
    launcher (a ``StaticTritonCompileResult``), which importing custom_ops turned on, not
    through Triton's Python launcher (custom_ops.triton.traced)."""
    from torch._inductor.codecache import PyCodeCache

    model = _model("4bit_nc", device="cuda", window=MODEL_WINDOW)
    tok, _ = prefill(model, _prompt(5, "cuda"), torch.arange(PROMPT_LEN, device="cuda"))
    loaded = len(PyCodeCache.modules)
    torch._dynamo.reset()
    torch.compile(decode_one_token, fullgraph=True)(
        model, tok, torch.tensor([PROMPT_LEN], device="cuda")
    )
    torch._dynamo.reset()
    launches = {
        name: sorted({type(result).__name__ for result in tuner.compile_results})
        for name, tuner in inductor_flat_kernels(PyCodeCache.modules[loaded:]).items()
    }
    assert any(name.startswith("split_kernel") for name in launches), launches
    assert all(kinds == ["StaticTritonCompileResult"] for kinds in launches.values()), launches


def _attention_ops(gm: torch.fx.GraphModule) -> str:
    """The cache and attention calls of a traced graph, in order, and dense leftovers."""
    lines, dense = [], 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        target = str(node.target)
        if target.startswith("auto_functionalized"):
            target = f"{target}({node.args[0]})"
        if "tq." in target:
            lines.append(target)
        dense += "scaled_dot_product" in target or "dequantize" in target
    return "\n".join([*lines, f"dense sdpa / dequantize calls: {dense}"])


class TestDecodeGraph(expecttest.TestCase):
    @torch.no_grad()
    def test_graph_of_one_decode_step(self):
        """The traced (AOT) graph of one decode step stores and decodes per layer (2 layers) on
        the compressed cache (through the window's store with a window) and never dequantizes
        it or runs dense SDPA."""
        traced = []
        for window in (0, MODEL_WINDOW):
            model = _model("4bit_nc", window=window)
            tok, _ = prefill(model, _prompt(2), torch.arange(PROMPT_LEN))
            graphs = []

            def forward_compiler(gm, example_inputs, graphs=graphs):
                graphs.append(gm)
                return gm

            torch._dynamo.reset()
            backend = aot_autograd(fw_compiler=forward_compiler)
            torch.compile(decode_one_token, backend=backend, fullgraph=True)(
                model, tok, torch.tensor([PROMPT_LEN])
            )
            torch._dynamo.reset()
            self.assertEqual(len(graphs), 1)
            traced.append(f"window {window}:\n{_attention_ops(graphs[0])}")
        self.assertExpectedInline(
            "\n".join(traced),
            """\
window 0:
auto_functionalized_v2(tq.store.default)
tq.decode.default
auto_functionalized_v2(tq.store.default)
tq.decode.default
dense sdpa / dequantize calls: 0
window 16:
auto_functionalized_v2(tq.decode_step.default)
auto_functionalized_v2(tq.decode_step.default)
dense sdpa / dequantize calls: 0""",
        )


@pytest.mark.gpu
@torch.no_grad()
def test_reduce_overhead_cuda_graphs_200_steps():
    """On CUDA, torch.compile(mode="reduce-overhead") runs the decode step in CUDA graphs (a
    recorded graph tree, no "skipping cudagraphs") and 200 steps, crossing the recent window's
    boundary (prompt 16, window 16), equal eager TQ decoding, both
    fed the same token: logits to fp16 rounding (2e-2) at every step, and the same next token
    wherever eager's top two logits are further apart than that (inductor's fused kernels
    round differently, so a near-tie may flip; seen: 1 of 200 steps)."""
    from torch._dynamo.utils import counters
    from torch._inductor.cudagraph_trees import get_manager

    prompt_len, steps, tol = 16, 200, 2e-2
    make = functools.partial(
        _model,
        "4bit_nc",
        device="cuda",
        max_seq=prompt_len + steps,
        dtype=torch.float16,
        window=MODEL_WINDOW,
    )
    eager, compiled = make(), make()
    prompt = _prompt(3, "cuda")[:, :prompt_len]
    tok, _ = prefill(eager, prompt, torch.arange(prompt_len, device="cuda"))
    prefill(compiled, prompt, torch.arange(prompt_len, device="cuda"))
    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    for i in range(steps):
        pos = torch.tensor([prompt_len + i], device="cuda")
        next_eager, logits_eager = decode_one_token(eager, tok, pos)
        next_compiled, logits_compiled = step(compiled, tok, pos)
        torch.testing.assert_close(logits_compiled, logits_eager, rtol=tol, atol=tol)
        top2 = logits_eager.float().topk(2, dim=-1).values
        decided = (top2[:, 0] - top2[:, 1]) > 2 * tol
        assert torch.equal(next_compiled[decided], next_eager[decided]), f"step {i}"
        tok = next_eager.clone()
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values()), "no CUDA graph was recorded"
    torch._dynamo.reset()


def test_kv_bytes_4bit_at_head_dim_128():
    """4bit_nc at D=128 takes <= 0.27x the bytes of the bf16 cache (134 / 512 per token-head);
    a window of 128 keeps its tokens in bf16 rings (and their int32 positions) instead of pages
    (+2.3% of the bf16 cache's bytes at 4096 tokens), and its default 4 sinks take 4 more ring
    slots (pages for them stay allocated). Every buffer counts: the rotation ([D, D] float32)
    and the block table ([B, pages] int32) too."""
    cache = TurboQuantKVCache(4, 8, 4096, 128, preset="4bit_nc", window=0)
    assert cache.nbytes() == 4 * 8 * 4096 * 134 + 128 * 128 * 4 + 4 * 256 * 4
    assert cache.nbytes() / cache.dense_nbytes() <= 0.27
    windowed = TurboQuantKVCache(4, 8, 4096, 128, preset="4bit_nc", window=128, sinks=0)
    fewer_pages = 4 * 8 * 4  # [B, 8 pages] of the block table: the window's 128 positions
    assert windowed.nbytes() - cache.nbytes() == 4 * 8 * 128 * (512 + 4 - 134) - fewer_pages
    with_sinks = TurboQuantKVCache(4, 8, 4096, 128, preset="4bit_nc", window=128)
    assert with_sinks.sinks == 4
    assert with_sinks.nbytes() - windowed.nbytes() == 4 * 8 * 4 * (512 + 4)
    cache = windowed
    new_kv = torch.randn(4, 8, 3, 128).bfloat16()
    assert isinstance(cache.update(torch.arange(3), new_kv, new_kv)[0], TurboQuantKVTensor)


def test_a_ring_that_covers_the_capacity_is_sized_down_and_warns():
    """Window and sinks that cover max_seq_length (the default 128 + 4 over 64 tokens: issue
    53's 1.147x bf16's bytes, silently) quantize nothing: the cache warns once, at the caller's
    line, naming the capacity, window, sinks, the bytes it holds and a dense cache's, and sizes
    the ring down to the capacity (no sink slot for a position the window holds anyway), which
    loses nothing: every token reads back exact. A cache that quantizes a token does not warn."""
    with pytest.warns(UserWarning) as record:
        cache = TurboQuantKVCache(1, 8, 64, 128)
    assert len(record) == 1 and record[0].filename == __file__
    message = str(record[0].message)
    for part in (
        "max_seq_length=64",
        "window (128)",
        "sinks (4)",
        "no token is ever quantized",
        f"{cache.nbytes():,} bytes",
        f"{cache.dense_nbytes():,} of a bf16",
        "keep window + sinks below max_seq_length",
    ):
        assert part in message, part
    assert (cache.window, cache.sinks, cache.k_window.shape[2]) == (64, 0, 64)
    with pytest.warns(UserWarning, match=r"sized to the capacity \(window 16, sinks 4\)"):
        sized = TurboQuantKVCache(1, 2, 20, 64, window=16, sinks=8)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 1, 2, 20, 64, generator=gen).bfloat16()
    for position in range(20):
        one = slice(position, position + 1)
        keys, values = sized.update(torch.tensor([position]), k[:, :, one], v[:, :, one])
    assert torch.equal(keys.dequantize(torch.bfloat16), k)
    assert torch.equal(values.dequantize(torch.bfloat16), v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TurboQuantKVCache(1, 8, 256, 128)  # positions 4 .. 127 reach the pages


@pytest.mark.parametrize(
    "options",
    [
        dict(window=0),
        dict(window=8, sinks=0),
        dict(window=8),
        dict(window=8, center_keys=True),
        dict(),
    ],
)
def test_nbytes_counts_everything_the_cache_holds(options):
    """nbytes() is the bytes of every tensor the module holds (pages, rings, positions, centres,
    block table, rotation): no cache reports fewer bytes than it holds."""
    cache = TurboQuantKVCache(2, 2, 48, 64, **options)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in vars(cache).values()
        if isinstance(t, torch.Tensor)
    }
    storages.update(
        (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in cache.buffers()
    )
    assert cache.nbytes() == sum(storages.values())


class TestUpdateBadInput(expecttest.TestCase):
    def test_errors_name_the_argument_and_leave_the_cache_untouched(self):
        """Positions, batch, token count and construction arguments that the cache cannot hold
        raise a clear error before anything is written (they wrapped around, raised raw
        IndexErrors or deferred the error to a later prefill); the buffers stay byte for byte
        the same."""
        for window in (0, 8):
            cache = TurboQuantKVCache(2, 2, 100, 64, window=window)
            new = torch.randn(2, 2, 1, 64).bfloat16()
            cache.update(torch.arange(20), *[torch.randn(2, 2, 20, 64).bfloat16()] * 2)
            before = [b.clone() for b in cache.buffers()]
            cases = {
                "negative position": (torch.tensor([-1]), new),
                "position = max_seq_length": (torch.tensor([100]), new),
                "inside the last page, past max_seq_length": (torch.tensor([103]), new),
                "no new token": (torch.tensor([], dtype=torch.int64), new[:, :, :0]),
                "batch larger than the cache": (torch.tensor([20]), new.repeat(2, 1, 1, 1)),
                "float positions": (torch.tensor([20.0]), new),
                "positions and tokens disagree": (torch.tensor([20, 21]), new),
            }
            if window:
                cases["a gap in the positions"] = (
                    torch.tensor([20, 22]),
                    torch.randn(2, 2, 2, 64).bfloat16(),
                )
            messages = []
            for case, (pos, kv) in cases.items():
                with self.assertRaises((ValueError, TypeError)) as ctx:
                    cache.update(pos, kv, kv)
                messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
                for expected, actual in zip(before, cache.buffers(), strict=True):
                    self.assertTrue(torch.equal(expected, actual), case)
            if window == 0:
                self.assertExpectedInline(
                    "\n".join(messages),
                    """\
negative position: ValueError: TurboQuantKVCache.update: input_pos holds position -1; expected positions in [0, 100) (max_seq_length)
position = max_seq_length: ValueError: TurboQuantKVCache.update: input_pos holds position 100; expected positions in [0, 100) (max_seq_length)
inside the last page, past max_seq_length: ValueError: TurboQuantKVCache.update: input_pos holds position 103; expected positions in [0, 100) (max_seq_length)
no new token: ValueError: TurboQuantKVCache.update: input_pos has 0 positions for 0 new tokens (k_val.shape[2]); expected T >= 1 of each
batch larger than the cache: ValueError: TurboQuantKVCache.update: batch 4 (k_val.shape[0]) must be in [1, 2] (the cache's max_batch_size)
float positions: TypeError: TurboQuantKVCache.update: input_pos must be a 1-D integer tensor [T], got torch.float32 of shape (1,)
positions and tokens disagree: ValueError: TurboQuantKVCache.update: input_pos has 2 positions for 1 new tokens (k_val.shape[2]); expected T >= 1 of each""",  # noqa: E501
                )
            else:
                gap = (
                    "a gap in the positions: ValueError: TurboQuantKVCache.update: with a "
                    "ring (window=8, sinks=4) new tokens take consecutive positions: "
                    "input_pos must be start .. start + T - 1, got [20, 22]"
                )
                self.assertEqual(messages[-1], gap)

    def test_construction_arguments(self):
        """Sizes, page size and split count are checked when the cache is built."""
        cases = {
            "page_size=0": dict(page_size=0),
            "num_splits=3": dict(num_splits=3),
            "window=-1": dict(window=-1),
            "sinks=-4": dict(sinks=-4),
            "max_seq_length=0": dict(max_seq_length=0),
            "center_keys without a ring": dict(window=0, center_keys=True),
            "center_keys=1": dict(center_keys=1),
        }
        messages = []
        for case, override in cases.items():
            args = dict(max_batch_size=1, n_heads=2, max_seq_length=32, head_dim=64) | override
            with self.assertRaises((ValueError, TypeError)) as ctx:
                TurboQuantKVCache(**args)
            messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
page_size=0: ValueError: page_size must be an integer >= 1, got 0
num_splits=3: ValueError: num_splits must be None (chosen per device) or a power of two in [1, 512], got 3
window=-1: ValueError: window must be an integer >= 0, got -1
sinks=-4: ValueError: sinks must be an integer >= 0, got -4
max_seq_length=0: ValueError: max_seq_length must be an integer >= 1, got 0
center_keys without a ring: ValueError: center_keys=True needs a window or sinks (window > 0 or sinks > 0): the centre is set from keys held in the ring before any is quantized
center_keys=1: TypeError: center_keys must be a bool, got 1""",  # noqa: E501
        )


def test_built_on_the_meta_device_then_materialized():
    """A cache built on the meta device and materialized with to_empty() (how large models are
    set up) rebuilds its constants: the rotation and the identity block table hold what a cache
    built in place holds (they held uninitialized memory), and attention over it matches."""
    with torch.device("meta"):
        lazy = TurboQuantKVCache(2, 2, 48, 64, window=8, seed=3)
    lazy.to_empty(device="cpu")
    eager = TurboQuantKVCache(2, 2, 48, 64, window=8, seed=3)
    assert torch.equal(lazy.rotation, eager.rotation)
    assert torch.equal(lazy.block_table, eager.block_table)
    k_new = torch.randn(2, 2, 30, 64).bfloat16()
    q = torch.randn(2, 8, 1, 64).bfloat16()
    outs = []
    for cache in (lazy, eager):
        k, v = cache.update(torch.arange(30), k_new, k_new)
        outs.append(F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
