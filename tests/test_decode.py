"""tq.decode: split-KV attention over the compressed cache."""

from __future__ import annotations

import expecttest
import pytest
import torch
from conftest import CUDA, triton_kernels
from helpers import clone_cache, filled_cache, random_kv

from custom_ops import api, reference
from custom_ops.formats import FORMATS, get_format
from custom_ops.triton import decode as triton_decode

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: exp2(-inf)


def _case(fmt_name, head_dim, group, gen, num_kv_heads=2, page_size=4, num_pages=14):
    """A filled cache, a shuffled non-contiguous block table, ragged lengths (0, 1, full)."""
    fmt = get_format(fmt_name)
    consts = api.make_constants(fmt, head_dim, seed=3)
    cache = filled_cache(fmt, num_pages, num_kv_heads, page_size, head_dim, consts, gen)
    pages = torch.randperm(num_pages, generator=gen)[:12].to(torch.int32)
    block_table = pages.reshape(4, 3).T  # [3, 4], non-contiguous
    seq_lens = torch.tensor([13, 0, 1], dtype=torch.int32)
    q = torch.randn(3, num_kv_heads * group, head_dim, generator=gen).to(torch.float16)
    return fmt, consts, cache, block_table, seq_lens, q


def _kernel_decode(fmt, q, cache, block_table, seq_lens, consts, device, num_splits=2):
    dev = api.KVConstants(*(c.to(device) for c in consts))
    with triton_kernels(device):
        out = api.decode(
            fmt,
            q.to(device),
            clone_cache(cache, device),
            block_table.to(device),
            seq_lens.to(device),
            dev,
            num_splits=num_splits,
        )
    return out.cpu()


def _rel(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_kernel_matches_float64_attention(fmt_name, group, kernel_device, seeded):
    """The kernel equals float64 attention over the dequantized cache within 1e-3 (fp16 query
    and probabilities on the tensor cores: 2^-11 each), for every format and GQA group sizes 1
    (MHA), 4 and 8, ragged lengths 0 / 1 / 13, a shuffled non-contiguous block table and more
    splits than some sequences have tiles."""
    fmt, consts, cache, table, lens, q = _case(fmt_name, 64, group, seeded)
    assert not table.is_contiguous()
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device, num_splits=4)
    assert bool((actual[1] == 0).all()), "a sequence of length 0 attends to nothing"
    assert _rel(actual, expected) < 1e-3


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k8v4", "tq4_nc", "k2v2_nc"])
def test_kernel_head_dims(fmt_name, head_dim, kernel_device, seeded):
    """Head dims 80, 96 (padded tiles), 128 and 256 against float64 attention."""
    fmt, consts, cache, table, lens, q = _case(fmt_name, head_dim, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, head_dim**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device)
    assert _rel(actual, expected) < 1e-3


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq4_nc"])
def test_many_splits(fmt_name, kernel_device, seeded):
    """64 splits, most of them empty: the merge reads them in chunks and rotates rotated values
    back, against float64 attention."""
    fmt, consts, cache, table, lens, q = _case(fmt_name, 64, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device, num_splits=64)
    assert _rel(actual, expected) < 1e-3


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k2v4_nc", "tq4_nc"])
def test_query_rotated_in_split_or_prepared(fmt_name, kernel_device, seeded):
    """Rotated keys get their queries rotated inside the split kernel (short splits: the
    Walsh-Hadamard structure of R) or by the preparation kernel (long splits: a block table with
    more capacity per split); both agree with float64 attention."""
    fmt, consts, cache, table, lens, q = _case(fmt_name, 64, 4, seeded)
    long_table = torch.cat([table, table[:, :1].expand(-1, 80)], dim=1)
    modes = [triton_decode._query_mode(fmt, 64, t.shape[1] * 4, 2) for t in (table, long_table)]
    assert modes == [triton_decode._QUERY_ROTATED_HERE.value, triton_decode._QUERY_PREPARED.value]
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    for block_table in (table, long_table):
        actual = _kernel_decode(fmt, q, cache, block_table, lens, consts, kernel_device)
        assert _rel(actual, expected) < 1e-3


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "int8", "fp8", "tq4_nc"])
def test_block_table_past_the_length_is_not_followed(fmt_name, kernel_device, seeded):
    """Block-table entries past a sequence's pages may hold anything (here a page id far beyond
    the cache). Splits of one tile read them before they know the length and must not follow
    them; longer splits do not read them. Both against float64 attention (int8, fp8, and k8v4 in
    the longer splits: two 16-token tiles per step; fp8, tq4_nc: the longer splits' kernel is
    register-capped)."""
    fmt, consts, cache, table, lens, q = _case(fmt_name, 64, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    stale = table.clone()
    stale[torch.arange(4)[None, :] >= ((lens + 3) // 4)[:, None]] = 2**30
    long_stale = torch.cat([stale, torch.full((3, 80), 2**30, dtype=torch.int32)], dim=1)
    block_n, subtiles = triton_decode.tile_config(fmt)
    one_tile = [triton_decode._one_tile(t.shape[1] * 4, 2, block_n * subtiles)
                for t in (stale, long_stale)]  # fmt: skip
    assert one_tile == [True, False]
    for block_table in (stale, long_stale):
        actual = _kernel_decode(fmt, q, cache, block_table, lens, consts, kernel_device)
        assert _rel(actual, expected) < 1e-3


def test_bf16_query(kernel_device, seeded):
    """bf16 queries: the output's own rounding (2^-9) dominates."""
    fmt, consts, cache, table, lens, q = _case("4bit_nc", 128, 4, seeded)
    q = q.to(torch.bfloat16)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 128**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device)
    assert actual.dtype == torch.bfloat16
    assert _rel(actual, expected) < 4e-3


# Relative error of decode over the quantized cache vs attention over the unquantized K/V on
# random_kv data (64 tokens, D=128; keys with per-token scales and an 8x outlier channel, so the
# softmax is peaked and amplifies key error): the largest of 8 seeds, times 1.25.
QUANTIZATION_ERROR = {
    "k8v4": 0.14,
    "4bit_nc": 0.27,
    "k3v4_nc": 0.5,
    "3bit_nc": 0.56,
    "int8": 0.085,
    "fp8": 0.075,
    "tq4_nc": 0.26,
    "k2v2_nc": 1.17,
    "k2v4_nc": 0.95,
}


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_error_against_unquantized_attention(fmt_name, seeded):
    """Decode over the compressed cache vs attention over the original K/V: a per-format bound."""
    fmt = get_format(fmt_name)
    consts = api.make_constants(fmt, 128)
    key, value = random_kv(64, 2, 128, torch.bfloat16, seeded)
    cache = fmt.allocate(16, 2, 4, 128)
    api.store(fmt, cache, key, value, torch.arange(64, dtype=torch.int32), consts)
    q = torch.randn(1, 8, 128, generator=seeded).to(torch.bfloat16)
    table = torch.arange(16, dtype=torch.int32)[None]
    lens = torch.tensor([64], dtype=torch.int32)
    out = api.decode(fmt, q, cache, table, lens, consts)
    k = key.double().transpose(0, 1)[None]
    v = value.double().transpose(0, 1)[None]
    exact = reference.attention(q, k, v, lens, 128**-0.5)
    assert _rel(out, exact) < QUANTIZATION_ERROR[fmt_name]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc", "int8", "tq4_nc", "k2v4_nc"])
def test_opcheck_decode(fmt_name, impl, kernel_device, seeded):
    """opcheck (schema, fake tensor, aot dispatch) for tq.decode."""
    device = "cpu" if impl == "reference" else kernel_device
    fmt, consts, cache, table, lens, q = _case(fmt_name, 64, 4, seeded)
    args = tuple(t.to(device) for t in (q, *cache, table, lens, *consts))
    args = args + (fmt_name, 2, 0.125)
    context = triton_kernels(device) if impl == "triton" else torch.no_grad()
    with context:
        torch.library.opcheck(torch.ops.tq.decode.default, args)


class TestDecodeBadInput(expecttest.TestCase):
    def test_rejects_bad_input(self):
        gen = torch.Generator().manual_seed(0)
        fmt, consts, cache, table, lens, q = _case("4bit_nc", 64, 4, gen)
        cases = {
            "float32 query": dict(q=q.float()),
            "heads not a multiple": dict(q=q[:, :7]),
            "splits not a power of two": dict(num_splits=3),
            "batch mismatch": dict(q=q[:2]),
            "prefill-shaped query": dict(q=q[:, :, None]),
        }
        messages = []
        for case, override in cases.items():
            args = dict(q=q, num_splits=2) | override
            with self.assertRaises((ValueError, TypeError)) as ctx:
                api.decode(
                    fmt, args["q"], cache, table, lens, consts, num_splits=args["num_splits"]
                )
            messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
float32 query: TypeError: tq.decode: q must be bfloat16 or float16, got torch.float32
heads not a multiple: ValueError: tq.decode: q has 7 heads, not a multiple of the cache's 2 kv-heads
splits not a power of two: ValueError: tq.decode: num_splits must be a power of two in [1, 512], got 3
batch mismatch: ValueError: tq.decode: block_table has 3 rows for a batch of 2 queries
prefill-shaped query: ValueError: tq.decode: q must be [B, Hq, D] (one query token per sequence), got shape (3, 8, 1, 64)""",  # noqa: E501
        )


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
    num_splits = api.num_splits_for(batch, num_kv_heads, max_pages * page_size, "cuda")

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


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fast_and_portable_paths_agree(seeded):
    """On the GPU, the inline-PTX decoding of the codes (4, 3, 2 bits, int8) equals the
    plain-Triton decoding."""
    for fmt_name in ("4bit_nc", "tq4_nc", "k8v4", "3bit_nc", "k2v2_nc", "k2v4_nc", "int8"):
        fmt, consts, cache, table, lens, q = _case(fmt_name, 128, 4, seeded)
        cuda_cache = clone_cache(cache, "cuda")
        args = (fmt, q.cuda(), cuda_cache, table.cuda(), lens.cuda(), *(c.cuda() for c in consts))
        fast = triton_decode.decode(*args, num_splits=2, scale=0.1)
        portable = triton_decode.decode(*args, num_splits=2, scale=0.1, fast=False)
        torch.testing.assert_close(fast, portable, rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "tq4_nc", "int8"])
def test_warp_counts(fmt_name, seeded, monkeypatch):
    """Grids of at most two programs per SM get two-warp split programs, larger ones one warp;
    merges of one row whose partials fit one warp get one warp, the others four warps and
    chunks of splits. Every combination agrees with float64 attention (head dim 128, 32
    splits; tq4_nc rotates its values back in the merge)."""
    device = torch.device("cuda")
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    split_warps = [triton_decode._split_warps(n, device) for n in (2 * sm_count, 2 * sm_count + 1)]
    assert split_warps == [2, 1]
    one_row = [triton_decode._merge_block(32, n, 128, False, device) for n in (32, 64)]
    assert one_row == [(1, 32, 1), (1, 64, 4)]
    fmt, consts, cache, table, lens, q = _case(fmt_name, 128, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 128**-0.5, torch.float64)
    args = (fmt, q.cuda(), clone_cache(cache, "cuda"), table.cuda(), lens.cuda())
    args += tuple(c.cuda() for c in consts)
    merges = {"one warp": (1, 32, 1), "four warps, chunks of 8": (1, 8, 4)}
    for merge_label, merge_block in merges.items():
        monkeypatch.setattr(triton_decode, "_merge_block", lambda *_, m=merge_block: m)
        for num_warps in (1, 2):
            actual = triton_decode.decode(*args, num_splits=32, scale=128**-0.5,
                                          num_warps=num_warps)  # fmt: skip
            error = _rel(actual.cpu(), expected)
            assert error < 1e-3, f"{num_warps} split warps, merge of {merge_label}: {error}"


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc"])
def test_kernel_mask(fmt_name, kind, kernel_device, seeded):
    """A boolean or additive mask [B, Hq or 1, M] (M shorter than the cache: the rest masked),
    including a query whose keys are all masked out (zeros), against float64 attention."""
    fmt, consts, cache, table, lens, q = _case(fmt_name, 64, 4, seeded)
    num_q_heads = q.shape[1]
    if kind == "bool":
        mask = torch.rand(3, num_q_heads, 12, generator=seeded) > 0.4
        mask[0, 1] = False
    else:
        mask = torch.randn(3, 1, 12, generator=seeded) * 2
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 0.125, torch.float64, mask)
    dev = api.KVConstants(*(c.to(kernel_device) for c in consts))
    with triton_kernels(kernel_device):
        actual = api.decode(
            fmt,
            q.to(kernel_device),
            clone_cache(cache, kernel_device),
            table.to(kernel_device),
            lens.to(kernel_device),
            dev,
            num_splits=4,
            scale=0.125,
            mask=mask.to(kernel_device),
        ).cpu()
    assert not actual.isnan().any()
    if kind == "bool":
        assert bool((actual[0, 1] == 0).all())
    assert _rel(actual, expected) < 1e-3
