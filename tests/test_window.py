"""The recent window: tq.store_window, and tq.decode / tq.dequantize reading the ring."""

from __future__ import annotations

import expecttest
import pytest
import torch
from conftest import triton_kernels
from helpers import (
    assert_codes_match,
    assert_same_cache,
    clone_cache,
    poisoned_cache,
    random_kv,
    slot_rows,
)

from custom_ops import api, reference
from custom_ops.formats import FORMATS, get_format

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: exp2(-inf)

BATCH, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, WINDOW, PAGES_PER_SEQ = 2, 2, 64, 4, 8, 7
# A sequence holds its table's positions plus the window: only the oldest len - W need pages.
CAPACITY = PAGE_SIZE * PAGES_PER_SEQ + WINDOW

# (T, start of each sequence): a prefill longer than the window, a skipped sequence (-1), short
# chunks, single tokens, a chunk that crosses the window boundary of sequence 1, and one that
# takes sequence 0 past its block table's 28 positions (into the ring).
STEPS = [(11, (0, -1)), (3, (11, 0)), (1, (14, 3)), (6, (15, 4)), (1, (21, 10)), (2, (22, 11)),
         (9, (24, 13))]  # fmt: skip


class Sequences:
    """Two sequences in a paged cache with a shuffled block table, their rings and every token
    appended so far (bf16 ``[B, Hk, S, D]``)."""

    def __init__(self, fmt_name, gen, device="cpu", dtype=torch.bfloat16, window=WINDOW):
        self.fmt = get_format(fmt_name)
        self.window = window
        self.capacity = PAGE_SIZE * PAGES_PER_SEQ + window
        self.consts = api.make_constants(self.fmt, HEAD_DIM, seed=5)
        num_pages = BATCH * PAGES_PER_SEQ + 2
        self.cache = poisoned_cache(self.fmt, num_pages, NUM_KV_HEADS, PAGE_SIZE, HEAD_DIM, gen)
        pages = torch.randperm(num_pages, generator=gen)[: BATCH * PAGES_PER_SEQ]
        self.block_table = pages.to(torch.int32).reshape(BATCH, PAGES_PER_SEQ)
        shape = (BATCH, NUM_KV_HEADS, window, HEAD_DIM)
        self.k_window = torch.randn(shape, generator=gen).to(dtype)  # poison: never read
        self.v_window = torch.randn(shape, generator=gen).to(dtype)
        self.keys = torch.zeros(BATCH, NUM_KV_HEADS, self.capacity, HEAD_DIM, dtype=torch.bfloat16)
        self.values = torch.zeros_like(self.keys)
        self.lens = torch.zeros(BATCH, dtype=torch.int32)
        self.device = device
        self.to(device)

    def to(self, device):
        self.cache = clone_cache(self.cache, device)
        self.consts = api.KVConstants(*(c.to(device) for c in self.consts))
        for name in ("block_table", "k_window", "v_window"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = device
        return self

    def append(self, n_new, starts, gen, use_triton):
        """Append ``n_new`` random tokens at ``starts`` (a negative start skips the sequence)."""
        key, value = random_kv(BATCH * n_new, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
        key = key.reshape(BATCH, n_new, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)  # strided
        value = value.reshape(BATCH, n_new, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
        start_pos = torch.tensor(starts, dtype=torch.int32)
        for b, start in enumerate(starts):
            if start >= 0:
                self.keys[b, :, start : start + n_new] = key[b]
                self.values[b, :, start : start + n_new] = value[b]
                self.lens[b] = start + n_new
        d = self.device
        with triton_kernels(d) if use_triton else torch.no_grad():
            api.store_window(self.fmt, self.cache, key.to(d), value.to(d), self.k_window,
                             self.v_window, self.block_table, start_pos.to(d),
                             self.consts)  # fmt: skip

    def decode(self, q, num_splits, mask=None):
        """``tq.decode`` of ``q`` over the cache and the rings by the Triton kernels on this
        device (query and mask moved there), returned on the CPU."""
        d = self.device
        with triton_kernels(d):
            return api.decode(self.fmt, q.to(d), self.cache, self.block_table, self.lens.to(d),
                              self.consts, num_splits=num_splits,
                              mask=None if mask is None else mask.to(d), k_window=self.k_window,
                              v_window=self.v_window).cpu()  # fmt: skip

    def slots_of(self, b, positions):
        pages = self.block_table.cpu()[b, positions // PAGE_SIZE].to(torch.int64)
        return pages * PAGE_SIZE + positions % PAGE_SIZE


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_store_window_kernel_matches_reference(fmt_name, kernel_device, seeded):
    """After every append (prefill longer than the window, skipped sequences, chunks crossing
    the boundary, single tokens) the kernel's cache equals the reference's (codes up to a tie,
    meta up to a rounding) and its rings are bit-identical."""
    expected = Sequences(fmt_name, torch.Generator().manual_seed(7))
    actual = Sequences(fmt_name, torch.Generator().manual_seed(7), kernel_device)
    for n_new, starts in STEPS:
        expected.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=False)
        actual.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=True)
        assert_same_cache(expected.fmt, expected.cache, actual.cache)
        assert torch.equal(actual.k_window.cpu(), expected.k_window)
        assert torch.equal(actual.v_window.cpu(), expected.v_window)


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc", "k2v2_nc"])
def test_tokens_leaving_the_window_are_quantized_exactly_once(fmt_name, kernel_device, seeded):
    """Each append changes exactly the slots of the tokens that left the window in it; a slot
    never changes again; at the end every slot below ``len - W`` holds what a plain ``tq.store``
    of that token writes, the window's slots are untouched, and the ring holds the last W
    tokens."""
    seqs = Sequences(fmt_name, seeded, kernel_device)
    before = torch.cat(slot_rows(seqs.cache), dim=1)
    quantized = torch.zeros(before.shape[0], dtype=torch.bool)
    for n_new, starts in STEPS:
        old_lens = seqs.lens.clone()
        seqs.append(n_new, starts, seeded, use_triton=True)
        leaving = torch.zeros_like(quantized)
        for b in range(BATCH):
            first, last = max(0, int(old_lens[b]) - WINDOW), max(0, int(seqs.lens[b]) - WINDOW)
            leaving[seqs.slots_of(b, torch.arange(first, last))] = True
        after = torch.cat(slot_rows(seqs.cache), dim=1)
        changed = (after != before).any(dim=1)
        assert torch.equal(changed, leaving), "slots written other than the leaving tokens'"
        assert not (leaving & quantized).any(), "a token was quantized twice"
        quantized |= leaving
        before = after

    direct = poisoned_cache(seqs.fmt, *seqs.cache.k_codes.shape[:3], HEAD_DIM, seeded)
    consts = api.KVConstants(*(c.cpu() for c in seqs.consts))
    for b in range(BATCH):
        length = int(seqs.lens[b])
        old = torch.arange(length - WINDOW)
        rows = (seqs.keys[b, :, old].transpose(0, 1), seqs.values[b, :, old].transpose(0, 1))
        reference.store(seqs.fmt, *rows, direct, seqs.slots_of(b, old).to(torch.int32), *consts)
        recent = torch.arange(length - WINDOW, length)
        assert torch.equal(seqs.k_window.cpu()[b][:, recent % WINDOW], seqs.keys[b][:, recent])
        assert torch.equal(seqs.v_window.cpu()[b][:, recent % WINDOW], seqs.values[b][:, recent])

    # The quantized slots hold the tokens' codes, plane by plane ([slots, Hk, bytes]).
    def slot_major(plane):
        return plane.cpu().permute(0, 2, 1, 3).reshape(-1, plane.shape[1], plane.shape[3])

    planes = ((seqs.fmt.key, "k_codes"), (seqs.fmt.value, "value_rows"))
    for codec, name in planes:
        expected = slot_major(getattr(direct, name))[quantized]
        assert_codes_match(codec, expected, slot_major(getattr(seqs.cache, name))[quantized])


def _expected_attention(seqs, q, dtype=torch.float64, mask=None):
    """float64 attention over the dequantized cache for positions below ``len - W`` and the
    exact bf16 tokens for the last ``W``."""
    consts = api.KVConstants(*(c.cpu() for c in seqs.consts))
    cache = clone_cache(seqs.cache)
    k, v = reference.dequantize(seqs.fmt, cache, seqs.block_table.cpu(), seqs.lens, *consts,
                                seqs.capacity, dtype)  # fmt: skip
    positions = torch.arange(seqs.capacity)[None, :]
    recent = (positions >= seqs.lens[:, None] - seqs.window)[:, None, :, None]
    k = torch.where(recent, seqs.keys.to(dtype), k)
    v = torch.where(recent, seqs.values.to(dtype), v)
    return reference.attention(q, k, v, seqs.lens, HEAD_DIM**-0.5, mask)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_decode_window_contribution_is_exact(fmt_name, group, kernel_device, seeded):
    """Decode with the window equals float64 attention over the dequantized compressed tokens
    and the *unquantized* window tokens (1e-3: fp16 query and probabilities on the compressed
    side), at lengths below, at and beyond the window."""
    seqs = Sequences(fmt_name, seeded, kernel_device)
    for n_new, starts in STEPS:
        seqs.append(n_new, starts, seeded, use_triton=False)
        # fp16 query, so the output's rounding (2^-11) stays below the bound
        q = torch.randn(BATCH, NUM_KV_HEADS * group, HEAD_DIM, generator=seeded).half()
        expected = _expected_attention(seqs, q)
        actual = seqs.decode(q, num_splits=2)
        rel = (actual.double() - expected).norm() / expected.norm()
        assert rel < 1e-3, (n_new, starts, float(rel))


def test_decode_window_only_is_exact(kernel_device, seeded):
    """While a sequence is shorter than the window, decode reads only the ring: it equals
    float64 attention over the bf16 tokens to float32 rounding (tf32 products of bf16 inputs
    are exact), whatever the compressed pages and the ring's unwritten slots (NaN) hold."""
    seqs = Sequences("3bit_nc", seeded, kernel_device)
    seqs.append(6, (0, 0), seeded, use_triton=False)
    seqs.k_window[:, :, 6:] = float("nan")  # unwritten slots: never read
    seqs.v_window[:, :, 6:] = float("nan")
    q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).to(torch.bfloat16)
    expected = reference.attention(q, seqs.keys.double(), seqs.values.double(), seqs.lens,
                                   HEAD_DIM**-0.5)  # fmt: skip
    actual = seqs.decode(q, num_splits=2)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-2, atol=4e-3)


@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize(
    "fmt_name, dtype",
    [(name, torch.bfloat16) for name in ("4bit_nc", "3bit_nc", "k2v2_nc", "int8", "tq4_nc")]
    + [("k8v4", torch.float16), ("fp8", torch.float16)],
)
def test_decode_ring_of_several_tiles(fmt_name, dtype, num_splits, kernel_device, seeded):
    """A 40-token window (three ring tiles of the split kernel, the last one partial, dealt
    round robin over the splits; one partial window-kernel tile for rotated values),
    filled past its size so the ring's slots wrap, in bf16 or fp16 (with fp16 queries, whose
    dtype then matches the ring's): decode equals float64 attention within 1e-3."""
    seqs = Sequences(fmt_name, seeded, kernel_device, dtype=dtype, window=40)
    for n_new, starts in [(45, (0, 10)), (3, (45, 55)), (10, (48, 58))]:
        seqs.append(n_new, starts, seeded, use_triton=False)
        q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).half()
        expected = _expected_attention(seqs, q)
        actual = seqs.decode(q, num_splits=num_splits)
        rel = (actual.double() - expected).norm() / expected.norm()
        assert rel < 1e-3, (n_new, starts, float(rel))


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_decode_window_mask(kind, kernel_device, seeded):
    """A mask over positions applies to window tokens by their position (not their ring slot),
    including a query with every key masked out (zeros)."""
    seqs = Sequences("4bit_nc", seeded, kernel_device)
    for n_new, starts in STEPS[:4]:
        seqs.append(n_new, starts, seeded, use_triton=False)
    num_q_heads = NUM_KV_HEADS * 4
    allowed = torch.rand(BATCH, num_q_heads, CAPACITY - 3, generator=seeded) > 0.3
    allowed[1, 2] = False
    mask = allowed if kind == "bool" else torch.where(allowed, 0.25, float("-inf"))
    q = torch.randn(BATCH, num_q_heads, HEAD_DIM, generator=seeded).half()
    expected = _expected_attention(seqs, q, mask=mask)
    actual = seqs.decode(q, num_splits=4, mask=mask)
    assert bool((actual[1, 2] == 0).all())
    rel = (actual.double() - expected).norm() / expected.norm()
    assert rel < 1e-3


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "tq4_nc", "k2v4_nc"])
def test_dequantize_window_kernel_matches_reference(fmt_name, kernel_device, seeded):
    """Dequantize with the window: compressed positions decoded, the last W copied from the
    ring, zeros past each length; the kernel equals the reference."""
    seqs = Sequences(fmt_name, seeded, kernel_device)
    for n_new, starts in STEPS:
        seqs.append(n_new, starts, seeded, use_triton=False)
    consts = api.KVConstants(*(c.cpu() for c in seqs.consts))
    args = (seqs.fmt, clone_cache(seqs.cache), seqs.block_table.cpu(), seqs.lens, consts,
            CAPACITY, torch.float32, seqs.k_window.cpu(), seqs.v_window.cpu())  # fmt: skip
    expected = api.dequantize(*args)
    d = kernel_device
    with triton_kernels(d):
        actual = api.dequantize(seqs.fmt, seqs.cache, seqs.block_table, seqs.lens.to(d),
                                seqs.consts, CAPACITY, torch.float32, seqs.k_window,
                                seqs.v_window)  # fmt: skip
    for e, a, exact in zip(expected, actual, (seqs.keys, seqs.values), strict=True):
        torch.testing.assert_close(a.cpu(), e, rtol=1e-5, atol=1e-5)
        for b in range(BATCH):
            length = int(seqs.lens[b])
            recent = slice(max(0, length - WINDOW), length)
            assert torch.equal(e[b, :, recent], exact[b, :, recent].float())
            assert bool((e[b, :, length:] == 0).all())


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_opcheck_window_ops(impl, kernel_device, seeded):
    """opcheck (schema, fake tensors, aot dispatch) for store_window, and decode / dequantize
    with the rings."""
    device = "cpu" if impl == "reference" else kernel_device
    seqs = Sequences("4bit_nc", seeded, device)
    seqs.append(11, (0, 3), seeded, use_triton=impl == "triton")
    key, value = random_kv(BATCH * 2, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, seeded)
    key = key.reshape(BATCH, NUM_KV_HEADS, 2, HEAD_DIM).to(device)
    value = value.reshape(BATCH, NUM_KV_HEADS, 2, HEAD_DIM).to(device)
    start = seqs.lens.to(device)
    q = torch.randn(BATCH, NUM_KV_HEADS * 2, HEAD_DIM, generator=seeded).to(torch.bfloat16)
    rings = (seqs.k_window, seqs.v_window)
    context = triton_kernels(device) if impl == "triton" else torch.no_grad()
    with context:
        torch.library.opcheck(
            torch.ops.tq.store_window.default,
            (key, value, *seqs.cache, *rings, seqs.block_table, start, *seqs.consts, "4bit_nc"),
        )
        lens = seqs.lens.to(device)
        torch.library.opcheck(
            torch.ops.tq.decode.default,
            (q.to(device), *seqs.cache, seqs.block_table, lens, *seqs.consts, "4bit_nc", 2,
             0.125, None, *rings),
        )  # fmt: skip
        torch.library.opcheck(
            torch.ops.tq.dequantize.default,
            (*seqs.cache, seqs.block_table, lens, *seqs.consts, "4bit_nc", CAPACITY,
             torch.bfloat16, *rings),
        )  # fmt: skip


class TestStoreWindowBadInput(expecttest.TestCase):
    def test_errors_leave_cache_and_rings_untouched(self):
        """Bad input raises a clear error before any kernel runs; cache and rings unchanged."""
        gen = torch.Generator().manual_seed(3)
        seqs = Sequences("4bit_nc", gen)
        seqs.append(11, (0, 0), gen, use_triton=False)  # 3 tokens left the window
        key = torch.randn(BATCH, NUM_KV_HEADS, 2, HEAD_DIM).to(torch.bfloat16)
        start = seqs.lens.clone()
        rings = (seqs.k_window, seqs.v_window)
        snapshot = [t.clone() for t in (*seqs.cache, *rings)]

        def call(key=key, value=key, rings=rings, table=seqs.block_table, start=start):
            torch.ops.tq.store_window(key, value, *seqs.cache, *rings, table, start,
                                      *seqs.consts, "4bit_nc")  # fmt: skip

        cases = {
            "float32 tokens": dict(key=key.float(), value=key.float()),
            "3-D tokens": dict(key=key[:, :, 0], value=key[:, :, 0]),
            "ring of another head dim": dict(rings=(rings[0][..., :32], rings[1][..., :32])),
            "float32 ring": dict(rings=(rings[0].float(), rings[1].float())),
            "ring dtypes differ": dict(rings=(rings[0], rings[1].half())),
            "int64 start": dict(start=start.long()),
            "past capacity": dict(start=torch.tensor([CAPACITY - 1, 0], dtype=torch.int32)),
            "block table too short": dict(table=seqs.block_table[:1]),
            "page id out of range": dict(
                table=seqs.block_table.index_fill(1, torch.tensor([1]), 99)
            ),
        }
        messages = []
        for label, kwargs in cases.items():
            with self.assertRaises((TypeError, ValueError)) as ctx:
                call(**kwargs)
            messages.append(f"{label}: {type(ctx.exception).__name__}: {ctx.exception}")
            for before, after in zip(snapshot, (*seqs.cache, *rings), strict=True):
                assert torch.equal(before, after), label
        self.assertExpectedInline(
            "\n".join(messages),
            """\
float32 tokens: TypeError: tq.store_window: key must be bfloat16 or float16, got torch.float32
3-D tokens: ValueError: tq.store_window: key must be [B, Hk, T, D], got shape (2, 2, 64)
ring of another head dim: ValueError: tq.store_window: k_window and v_window must be [>= 2, 2, W >= 1, 64] (batch, kv-heads, window, head dim), got (2, 2, 8, 32) and (2, 2, 8, 32)
float32 ring: TypeError: tq.store_window: k_window and v_window must be bfloat16 or float16 of one dtype, got torch.float32 and torch.float32
ring dtypes differ: TypeError: tq.store_window: k_window and v_window must be bfloat16 or float16 of one dtype, got torch.bfloat16 and torch.float16
int64 start: TypeError: tq.store_window: start_pos must be int32, got torch.int64
past capacity: ValueError: tq.store_window: tokens up to position 36 do not fit a sequence's capacity of 36 positions (block_table pages * page_size + window)
block table too short: ValueError: tq.store_window: block_table must be int32 [>= 2, max_pages], got torch.int32 (1, 7)
page id out of range: ValueError: tq.store_window: block_table holds page ids outside [0, 16) for positions below 5""",  # noqa: E501
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k2v4_nc"])
def test_cuda_graph_loop_crossing_the_window(fmt_name, seeded):
    """Capture store_window-one-token + decode in a CUDA graph; replay 100 steps with new tokens
    and positions advanced in place, from lengths below the window (32) to past it; every step
    equals the eager ops on a twin cache bitwise, and no host sync happens."""
    fmt = get_format(fmt_name)
    batch, num_kv_heads, group, head_dim, page_size, window, max_pages = 3, 4, 4, 128, 16, 32, 8
    consts = api.make_constants(fmt, head_dim, device="cuda")
    num_pages = batch * max_pages
    table = torch.randperm(num_pages, generator=seeded).to(torch.int32)
    table = table.reshape(batch, max_pages).cuda()

    def state():
        cache = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim, "cuda")
        ring = (batch, num_kv_heads, window, head_dim)
        rings = [torch.zeros(ring, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        return cache, rings

    start = torch.tensor([0, 5, 20], dtype=torch.int32, device="cuda")  # lengths before a step
    seq_lens = start + 1
    token = torch.empty(batch, num_kv_heads, 2, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    q = torch.empty(batch, num_kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
    num_splits = api.num_splits_for(batch, num_kv_heads, max_pages * page_size, "cuda")

    def step(cache, rings):
        api.store_window(fmt, cache, token[:, :, 0], token[:, :, 1], *rings, table, start, consts)
        return api.decode(fmt, q, cache, table, seq_lens, consts, num_splits, k_window=rings[0],
                          v_window=rings[1])  # fmt: skip

    token.normal_(), q.normal_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels on a throwaway state
        step(*state())
    torch.cuda.current_stream().wait_stream(side)
    graph_state, eager_state = state(), state()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records only: the states stay equal (zeros)
        graph_out = step(*graph_state)
    for _ in range(100):
        token.normal_(), q.normal_()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            expected = step(*eager_state)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(graph_out, expected, rtol=0, atol=0)
        start.add_(1)
        seq_lens.add_(1)
    (graph_cache, graph_rings), (eager_cache, eager_rings) = graph_state, eager_state
    graph_tensors, eager_tensors = (*graph_cache, *graph_rings), (*eager_cache, *eager_rings)
    for graph_t, eager_t in zip(graph_tensors, eager_tensors, strict=True):
        assert torch.equal(graph_t, eager_t)
    assert start.tolist() == [100, 105, 120]
