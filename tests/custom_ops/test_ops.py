"""The ``torch.ops.tq`` operators together (``custom_ops/ops.py``): a compiled function that
stores and dequantizes, and CUDA-graph loops of store (or store_window) and decode. Each op's
own tests (kernel, opcheck, bad input) are in the test module of its kernel under
``tests/custom_ops/triton/``."""

from __future__ import annotations

import pytest
import torch
from conftest import triton_kernels
from helpers import decode_case, random_kv
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from custom_ops import api, ops
from custom_ops.formats import RecentWindow, get_format
from custom_ops.schema import DecodeArgs


class _SeenOps(TorchDispatchMode):
    """Records the operators dispatched under it."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_is_eager_only_outside_compilation_and_dispatch_modes():
    """``ops.is_eager``: true op by op; false under a dispatch mode (fake tensors,
    functionalization, a recorder), under ``make_fx`` (pre-dispatch too), inside ``vmap`` and
    ``functionalize`` and inside a graph dynamo compiles (folded to a constant, no graph
    break)."""
    assert ops.is_eager()
    with _SeenOps():
        assert not ops.is_eager()
    seen = []

    def record(x):
        seen.append(ops.is_eager())
        return x + 1

    for pre_dispatch in (False, True):
        make_fx(record, pre_dispatch=pre_dispatch)(torch.zeros(2))
    torch.vmap(record)(torch.zeros(2, 1))
    torch.func.functionalize(record)(torch.zeros(2))
    assert seen == [False] * 4
    compiled = torch.compile(lambda x: x + int(ops.is_eager()), backend="eager", fullgraph=True)
    assert compiled(torch.zeros(2)).tolist() == [0.0, 0.0]


@pytest.mark.gpu
def test_call_skips_the_dispatcher_only_when_eager(seeded):
    """``ops.call`` of plain CUDA arguments runs the implementation without a dispatcher round
    trip (no ``tq::decode`` in a profile) and gives the operator's result; a dispatch mode
    still sees the operator."""
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, seeded)
    args = DecodeArgs(
        q.cuda(),
        *(p.cuda() for p in cache),
        table.cuda(),
        lens.cuda(),
        consts.rotation.cuda(),
        fmt.name,
        2,
        0.125,
    )
    expected = torch.ops.tq.decode(*args)
    with profile(activities=[ProfilerActivity.CPU]) as direct_profile:
        direct = ops.call(args)
    torch.testing.assert_close(direct, expected, rtol=0, atol=0)
    assert not any(e.name == "tq::decode" for e in direct_profile.events())
    with profile(activities=[ProfilerActivity.CPU]) as op_profile:
        torch.ops.tq.decode(*args)
    assert any(e.name == "tq::decode" for e in op_profile.events())
    with _SeenOps() as mode:
        torch.testing.assert_close(ops.call(args), expected, rtol=0, atol=0)
    assert torch.ops.tq.decode.default in mode.seen
    with profile(activities=[ProfilerActivity.CPU]) as grad_profile:  # autograd must see it
        ops.call(args._replace(q=args.q.clone().requires_grad_()))
    assert any(e.name == "tq::decode" for e in grad_profile.events())


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_store_then_dequantize(backend, seeded):
    """A compiled function that stores new tokens and dequantizes the cache (fullgraph) gives
    the eager result and mutates the cache like eager."""
    fmt = get_format("3bit_nc")
    consts = api.make_constants(fmt, 64)
    key, value = random_kv(6, 2, 64, torch.bfloat16, seeded)
    slots = torch.tensor([0, 1, 2, 5, 6, 7], dtype=torch.int32)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    lens = torch.tensor([8], dtype=torch.int32)

    def step(cache, k, v):
        api.store(fmt, cache, k, v, slots, consts)
        return api.dequantize(fmt, cache, table, lens, consts, 8, torch.float32)

    eager_cache = fmt.allocate(2, 2, 4, 64)
    compiled_cache = fmt.allocate(2, 2, 4, 64)
    expected = step(eager_cache, key, value)
    actual = torch.compile(step, backend=backend, fullgraph=True)(compiled_cache, key, value)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    for e, a in zip(eager_cache, compiled_cache, strict=True):
        assert torch.equal(e, a)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc", "tq4_nc"])
def test_cuda_graph_store_and_decode(fmt_name, seeded):
    """Capture store-one-token + decode in a CUDA graph; replay 100 steps with new tokens and
    growing lengths written in place; every step equals the eager ops on a twin cache, and no
    host sync happens (sync debug mode "error"). Rotated keys take three launches (query
    preparation, split, merge), fp8 keys two; on Hopper the launches after the first use
    programmatic dependent launch."""
    fmt = get_format(fmt_name)
    batch, num_kv_heads, group, head_dim, page_size = 3, 4, 4, 128, 16
    max_pages = 16
    consts = api.make_constants(fmt, head_dim, device="cuda")
    num_pages = batch * max_pages
    block_table = torch.randperm(num_pages, generator=seeded).to(torch.int32)
    block_table = block_table.reshape(batch, max_pages).cuda()
    graph_cache = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim, "cuda")
    eager_cache = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim, "cuda")
    start = torch.tensor([30, 0, 111], dtype=torch.int32)
    seq_lens = (start + 1).cuda()
    pos = start.cuda()
    static_k = torch.empty(batch, num_kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    static_v = torch.empty_like(static_k)
    static_q = torch.empty(
        batch, num_kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda"
    )
    num_splits = api.default_num_splits(batch, num_kv_heads, max_pages, page_size, 0, "cuda")

    def step(cache):
        page = block_table.gather(1, (pos // page_size)[:, None].long())[:, 0]
        slots = page * page_size + pos % page_size
        api.store(fmt, cache, static_k, static_v, slots, consts)
        return api.decode(fmt, static_q, cache, block_table, seq_lens, consts, num_splits)

    static_k.normal_(), static_v.normal_(), static_q.normal_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles the kernels) off the capture stream
        for _ in range(3):
            step(graph_cache)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step(graph_cache)
    for eager_plane, graph_plane in zip(eager_cache, graph_cache, strict=True):
        eager_plane.copy_(graph_plane)  # both start from the warmed-up state
    for _ in range(100):
        static_k.normal_(), static_v.normal_(), static_q.normal_()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
            expected = step(eager_cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.testing.assert_close(graph_out, expected, rtol=0, atol=0)
        pos.add_(1)
        seq_lens.add_(1)
    for eager_plane, graph_plane in zip(eager_cache, graph_cache, strict=True):
        assert torch.equal(eager_plane, graph_plane)
    assert int(seq_lens.max()) == 212


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k2v4_nc"])
def test_cuda_graph_loop_crossing_the_window(fmt_name, seeded):
    """Capture store_window-one-token + decode in a CUDA graph; replay 100 steps with new tokens
    and positions advanced in place, from lengths below the window (32) to past it, rolled back
    by 10 positions at step 60; every step equals the eager ops on a twin cache bitwise, and no
    host sync happens."""
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
        rings.append(torch.full(ring[:3], -1, dtype=torch.int32, device="cuda"))
        return cache, rings

    start = torch.tensor([0, 5, 20], dtype=torch.int32, device="cuda")  # lengths before a step
    seq_lens = start + 1
    token = torch.empty(batch, num_kv_heads, 2, 1, head_dim, dtype=torch.bfloat16, device="cuda")
    q = torch.empty(batch, num_kv_heads * group, head_dim, dtype=torch.bfloat16, device="cuda")
    num_splits = api.default_num_splits(batch, num_kv_heads, max_pages, page_size, 0, "cuda")

    def step(cache, rings):
        window = RecentWindow(*rings)
        api.store_window(fmt, cache, token[:, :, 0], token[:, :, 1], window, table, start, consts)
        return api.decode(fmt, q, cache, table, seq_lens, consts, num_splits, window=window)

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
    for step_index in range(100):
        if step_index == 60:  # roll back 10 positions (rejected drafts): the same graph replays
            start.sub_(10)
            seq_lens.sub_(10)
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
    assert start.tolist() == [90, 95, 110]


def test_empty_inputs_agree_on_every_path(kernel_device):
    """Empty inputs give empty (or zero) outputs on the reference path and through the Triton
    kernels alike, as dense SDPA does: a batch of 0 sequences (decode, dequantize), a
    dequantize of 0 positions, a block table of 0 pages (sequences of length 0); a cache of 0
    kv heads is refused with a message on both (issue 51, defect 5: on e30c341 the reference
    path raised "cannot reshape tensor of 0 elements" and the check ZeroDivisionError)."""
    fmt, head_dim = get_format("4bit_nc"), 64
    consts = api.make_constants(fmt, head_dim)
    q = torch.randn(1, 4, head_dim).bfloat16()

    def cases(device: str, num_kv_heads: int = 2) -> dict:
        cache = type(fmt.allocate(4, num_kv_heads, 16, head_dim))(
            *(p.to(device) for p in fmt.allocate(4, num_kv_heads, 16, head_dim))
        )
        c = api.KVConstants(consts.rotation.to(device))
        lens, table = (
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(1, 2, dtype=torch.int32, device=device),
        )
        no_batch, no_pages = (table[:0], lens[:0]), (table[:, :0], lens)
        return {
            "decode, no sequence": lambda: api.decode(fmt, q[:0].to(device), cache, *no_batch, c),
            "dequantize, no sequence": lambda: api.dequantize(
                fmt, cache, *no_batch, c, max_seq_len=16
            ),
            "dequantize, no position": lambda: api.dequantize(
                fmt, cache, table, lens, c, max_seq_len=0
            ),
            "decode, no page": lambda: api.decode(fmt, q.to(device), cache, *no_pages, c),
            "dequantize, no page": lambda: api.dequantize(fmt, cache, *no_pages, c, max_seq_len=0),
            "decode, no kv head": lambda: api.decode(
                fmt, q[:, :0].to(device), cache, table, lens, c
            ),
        }

    reference = cases("cpu")
    with triton_kernels(kernel_device):
        kernels = cases(kernel_device)
        for name in reference:
            if name.endswith("no kv head"):
                continue
            want, got = reference[name](), kernels[name]()
            want, got = (o if isinstance(o, tuple) else (o,) for o in (want, got))
            for w, g in zip(want, got, strict=True):
                assert g.shape == w.shape and not w.any() and not g.cpu().any(), name
    with pytest.raises(ValueError, match="at least one kv head"):
        cases("cpu", 0)["decode, no kv head"]()
    with triton_kernels(kernel_device), pytest.raises(ValueError, match="at least one kv head"):
        cases(kernel_device, 0)["decode, no kv head"]()
