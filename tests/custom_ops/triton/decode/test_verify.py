"""The verify kernel (``custom_ops/triton/decode/verify.py``, Gluon): which decodes the plan
gives it, and its decodes against float64 attention. Gluon kernels do not run under Triton's
interpreter, so these tests need a Hopper GPU; its sm_90 build is checked on the CPU by
``test_offline.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA
from helpers import poisoned_cache, random_kv, rel_error, window_on

from custom_ops import api, reference
from custom_ops.formats import RecentWindow, get_format
from custom_ops.triton import decode as triton_decode
from custom_ops.triton.decode import SplitConfig
from custom_ops.triton.decode.plan import plan_decode

HOPPER = CUDA and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (Gluon, no interpreter)")

HEAD_DIM, NUM_KV_HEADS, GROUP, TOKENS, PAGE_SIZE = 128, 2, 4, 8, 16
LENS = (13, 300, 1000)  # one tile, a split's worth, several splits; pages partly filled


def _plan(fmt_name="4bit_nc", tokens=TOKENS, group=GROUP, head_dim=HEAD_DIM, **kwargs):
    fmt = get_format(fmt_name)
    return plan_decode(
        fmt,
        2,
        NUM_KV_HEADS * group * tokens,
        NUM_KV_HEADS,
        head_dim,
        PAGE_SIZE,
        64,
        0,
        torch.float16,
        None,
        0,
        8,
        torch.device("cuda"),
        True,
        q_tokens=tokens,
        **kwargs,
    )


def test_plan_takes_the_verify_kernel_for_32_rows_of_4bit_nc():
    """32 query rows per kv-head of 4bit_nc at D = 128 (T = 8 at GQA 4, T = 4 at GQA 8) take the
    verify kernel, which reads rings of the query's dtype itself; other row counts, formats,
    head dims and ring dtypes, a configured split kernel and inductor's traced launches take
    the split kernel."""
    plan = _plan()
    assert plan.verify and plan.split.launcher.kernel.__name__ == "verify_kernel"
    assert _plan(tokens=4, group=8).verify
    assert not _plan(tokens=4).verify  # 16 rows
    assert not _plan("k8v4").verify and not _plan("tq4_nc").verify
    assert not _plan(head_dim=64).verify
    assert not _plan(split_config=SplitConfig(block_n=32)).verify
    assert not _plan(traced=True).verify
    fmt = get_format("4bit_nc")
    ringed = plan_decode(
        fmt,
        2,
        64,
        NUM_KV_HEADS,
        HEAD_DIM,
        PAGE_SIZE,
        64,
        16,
        torch.bfloat16,
        torch.bfloat16,
        1,
        8,
        torch.device("cuda"),
        True,
        q_tokens=TOKENS,
        sinks=4,
    )
    assert ringed.verify and ringed.ring_in_split and ringed.ring is None
    fp32_rings = plan_decode(
        fmt,
        2,
        64,
        NUM_KV_HEADS,
        HEAD_DIM,
        PAGE_SIZE,
        64,
        16,
        torch.float16,
        torch.float32,
        0,
        8,
        torch.device("cuda"),
        True,
        q_tokens=TOKENS,
    )
    assert not fp32_rings.verify


def _case(
    window,
    sinks,
    mask_kind,
    gen,
    dtype=torch.float16,
    page_size=PAGE_SIZE,
    tokens=TOKENS,
    group=GROUP,
):
    """Three sequences (``LENS``) in a poisoned cache of ``page_size``-token pages, shuffled,
    with table entries past each length that point nowhere; rings holding each sequence's first
    ``sinks`` positions (slot ``window + p``) and its last ``window`` after them (slot ``p %
    window``, as the window's store leaves them); verify queries ``[3, Hk * group, tokens, D]``
    and a mask (None, boolean per token and shorter than the longest length, or additive and
    shared); queries and rings in ``dtype``. The page slots of the sinks' positions, which the
    store never writes and no reader uses, hold NaN scalars."""
    fmt = get_format("4bit_nc")
    consts = api.make_constants(fmt, HEAD_DIM, seed=7)
    pages_per_seq = -(-max(LENS) // page_size)
    num_pages = len(LENS) * pages_per_seq + 3
    cache = poisoned_cache(fmt, num_pages, NUM_KV_HEADS, page_size, HEAD_DIM, gen)
    table = torch.full((len(LENS), pages_per_seq + 4), 2**30, dtype=torch.int32)
    pages = torch.randperm(num_pages, generator=gen)
    shape = (len(LENS), NUM_KV_HEADS, window + sinks, HEAD_DIM)
    k_window = torch.randn(shape, generator=gen).to(dtype)
    v_window = torch.randn(shape, generator=gen).to(dtype)
    window_pos = torch.full(shape[:3], -1, dtype=torch.int32)
    sink_slots = []
    for b, length in enumerate(LENS):
        used = pages[b * pages_per_seq : b * pages_per_seq + -(-length // page_size)]
        table[b, : len(used)] = used.to(torch.int32)
        key, value = random_kv(length, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
        positions = torch.arange(length)
        slots = table[b, positions // page_size].long() * page_size + positions % page_size
        reference.store(fmt, key, value, cache, slots.to(torch.int32), consts.rotation)
        sink_slots.append(slots[: min(sinks, length)])
        for p in range(max(sinks, length - window), length):  # the sinks are not in the window
            window_pos[b, :, p % window] = p
        for p in range(min(sinks, length)):
            window_pos[b, :, window + p] = p
    recent = RecentWindow(k_window, v_window, window_pos, sinks) if window + sinks else None
    num_q_heads = NUM_KV_HEADS * group
    q = torch.randn(len(LENS), num_q_heads, tokens, HEAD_DIM, generator=gen).to(dtype)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(len(LENS), num_q_heads, tokens, 900, generator=gen) > 0.3
        mask[..., 0] = True  # every query keeps a key
    elif mask_kind == "additive":
        mask = torch.randn(1, 1, 1100, generator=gen)
    sink_slots = torch.cat(sink_slots)
    cache.meta[sink_slots // page_size, :, sink_slots % page_size] = float("nan")
    lens = torch.tensor(LENS, dtype=torch.int32)
    return fmt, consts, cache, table, lens, q, mask, recent


def _on_cuda(case):
    """``_case``'s tensors moved to the GPU (strides kept: a column-major table stays so)."""
    fmt, consts, cache, table, lens, q, mask, recent = case

    def move(x):
        return None if x is None else x.cuda()

    return (
        fmt,
        api.KVConstants(*map(move, consts)),
        type(cache)(*map(move, cache)),
        move(table),
        move(lens),
        move(q),
        move(mask),
        window_on(recent, "cuda"),
    )


@pytest.mark.parametrize(
    "window, sinks, mask_kind, dtype, num_splits, page_size, transposed, tokens, group",
    [
        (w, s, m, torch.float16, None, 16, False, TOKENS, GROUP)
        for w, s in [(0, 0), (16, 0), (128, 4), (16, 20)]
        for m in (None, "bool", "additive")
    ]
    + [
        (128, 4, "bool", torch.bfloat16, None, 16, False, TOKENS, GROUP),
        (128, 4, None, torch.float16, 2, 16, False, TOKENS, GROUP),
        (16, 4, "bool", torch.float16, None, 32, True, TOKENS, GROUP),
        (16, 4, "bool", torch.float16, None, 16, False, 4, 8),
        (0, 0, None, torch.float16, None, 16, False, 1, 32),
    ],
)
def test_verify_kernel_matches_float64_attention(
    window, sinks, mask_kind, dtype, num_splits, page_size, transposed, tokens, group, seeded
):
    """A verify step of 8 tokens at GQA 4 (token t sees the positions below len - 7 + t, and
    the mask), or any 32 query rows per kv-head (4 tokens at GQA 8, one at GQA 32), through the
    verify kernel equals float64 attention over the dequantized pages and
    the exact rings (within 1e-3; 5e-3 for bf16 outputs), and the split kernel's decode of the
    same step (within 2e-3; 5e-3), at one, several and many tiles, with the window's ring and
    sinks (a ring tile per split, round robin: several in a split at 2 splits; NaN scalars in
    their page slots), either mask, 32-token pages and a block table with strided entries;
    each sequence within the bound."""
    fmt, consts, cache, table, lens, q, mask, recent = _case(
        window, sinks, mask_kind, seeded, dtype, page_size, tokens, group
    )
    if transposed:  # the same entries, column-major
        table = table.t().contiguous().t()
    expected = reference.decode(
        fmt, q, cache, table, lens, consts.rotation, HEAD_DIM**-0.5, torch.float64, mask, recent
    )
    _, consts_cuda, cache_cuda, table_cuda, lens_cuda, q_cuda, mask_cuda, recent_cuda = _on_cuda(
        (fmt, consts, cache, table, lens, q, mask, recent)
    )
    num_splits = num_splits or api.default_num_splits(
        len(LENS), NUM_KV_HEADS, table.shape[1], page_size, window, torch.device("cuda")
    )
    outputs = {}
    for name, split_config in (("verify", None), ("split", SplitConfig(block_n=32))):
        plan = triton_decode.plan_for(
            fmt,
            q_cuda,
            cache_cuda,
            table_cuda,
            num_splits,
            mask_cuda,
            recent_cuda,
            split_config=split_config,
        )
        assert plan.verify == (name == "verify")
        outputs[name] = triton_decode.decode(
            fmt,
            q_cuda,
            cache_cuda,
            table_cuda,
            lens_cuda,
            consts_cuda.rotation,
            num_splits,
            HEAD_DIM**-0.5,
            mask_cuda,
            recent_cuda,
            split_config=split_config,
        ).cpu()
    actual = outputs["verify"]
    assert actual.shape == q.shape and actual.isfinite().all()
    bound = 5e-3 if dtype == torch.bfloat16 else 1e-3
    for b in range(len(LENS)):
        assert rel_error(actual[b], expected[b]) < bound, (b, rel_error(actual[b], expected[b]))
        assert rel_error(actual[b], outputs["split"][b]) < 2 * bound


def test_op_calls_launch_the_compiled_verify_kernel(seeded):
    """``tq.decode`` through the op (keyed launches: after the first, the launcher calls the
    compiled kernel's own launch) gives the plain launch's output, call after call, with rings,
    sinks and a mask."""
    fmt, consts_cuda, cache_cuda, table_cuda, lens_cuda, q_cuda, mask_cuda, recent_cuda = _on_cuda(
        _case(128, 4, "bool", seeded)
    )
    plan = triton_decode.plan_for(fmt, q_cuda, cache_cuda, table_cuda, 8, mask_cuda, recent_cuda)
    assert plan.verify
    plain = triton_decode.decode(
        fmt,
        q_cuda,
        cache_cuda,
        table_cuda,
        lens_cuda,
        consts_cuda.rotation,
        8,
        HEAD_DIM**-0.5,
        mask_cuda,
        recent_cuda,
    )
    for _ in range(3):
        out = api.decode(
            fmt,
            q_cuda,
            cache_cuda,
            table_cuda,
            lens_cuda,
            consts_cuda,
            8,
            HEAD_DIM**-0.5,
            mask_cuda,
            recent_cuda,
        )
        assert torch.equal(out, plain)


def test_padded_query_rows_with_a_ring(seeded):
    """Query rows padded to 136 elements (a view whose strides Triton cannot tell 16-byte
    aligned, which the ring pass's ``cp.async`` of the query needs) give the contiguous
    query's output exactly: ``verify_arguments`` passes the kernel a contiguous copy (without
    it the kernel does not compile; ``test_offline.py`` builds that case on the CPU)."""
    fmt, consts_cuda, cache_cuda, table_cuda, lens_cuda, q_cuda, mask_cuda, recent_cuda = _on_cuda(
        _case(128, 4, "bool", seeded)
    )
    padded = torch.full(
        (*q_cuda.shape[:-1], HEAD_DIM + 8), float("nan"), dtype=q_cuda.dtype, device="cuda"
    )
    padded[..., :HEAD_DIM] = q_cuda
    q_view = padded[..., :HEAD_DIM]
    plan = triton_decode.plan_for(fmt, q_view, cache_cuda, table_cuda, 8, mask_cuda, recent_cuda)
    assert plan.verify
    out = {}
    for name, query in (("contiguous", q_cuda), ("padded", q_view)):
        out[name] = triton_decode.decode(
            fmt,
            query,
            cache_cuda,
            table_cuda,
            lens_cuda,
            consts_cuda.rotation,
            8,
            HEAD_DIM**-0.5,
            mask_cuda,
            recent_cuda,
        )
    assert torch.equal(out["padded"], out["contiguous"])
