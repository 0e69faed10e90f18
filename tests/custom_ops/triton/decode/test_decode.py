"""tq.decode (``custom_ops/triton/decode/`` on CUDA): the launcher end to end, split-KV
attention over the compressed cache and the recent window's rings against float64 attention;
opcheck; bad input."""

from __future__ import annotations

import math

import expecttest
import pytest
import torch
import triton
from conftest import CUDA, triton_kernels
from helpers import (
    IMPLS,
    clone_cache,
    decode_case,
    filled_cache,
    impl_context,
    impl_device,
    longer_table,
    random_kv,
    rel_error,
    stale_table,
    stale_tables,
    window_on,
)
from window_sequences import (
    BATCH,
    CAPACITY,
    HEAD_DIM,
    NUM_KV_HEADS,
    REWRITE_STEPS,
    STEPS,
    WINDOW,
    Sequences,
)

from custom_ops import api, reference
from custom_ops.formats import FORMATS, SUPPORTED_HEAD_DIMS, Kind, RecentWindow, get_format
from custom_ops.triton import decode as triton_decode
from custom_ops.triton.decode import MergeConfig, SplitConfig
from custom_ops.triton.decode.codes import int8_keys, part_params
from custom_ops.triton.decode.softmax import LOG2E

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: exp2(-inf)


def _kernel_decode(
    fmt,
    q,
    cache,
    block_table,
    seq_lens,
    consts,
    device,
    num_splits=2,
    scale=None,
    mask=None,
    softcap=0.0,
):
    """``api.decode`` by the Triton kernels on ``device`` (inputs moved there), on the CPU."""
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
            scale=scale,
            mask=None if mask is None else mask.to(device),
            softcap=softcap,
        )
    return out.cpu()


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_kernel_matches_float64_attention(fmt_name, group, kernel_device, seeded):
    """The kernel equals float64 attention over the dequantized cache within 1e-3 (fp16 query
    and probabilities on the tensor cores: 2^-11 each), for every format and GQA group sizes 1
    (MHA), 4 and 8, ragged lengths 0 / 1 / 13, a shuffled non-contiguous block table and more
    splits than some sequences have tiles."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, group, seeded)
    assert not table.is_contiguous()
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device, num_splits=4)
    assert bool((actual[1] == 0).all()), "a sequence of length 0 attends to nothing"
    assert rel_error(actual, expected) < 1e-3


@pytest.mark.parametrize(
    "fmt_name, tokens, value_scale, head_dim",
    [
        ("4bit_nc", 1, 1.0, 64),
        ("4bit_nc", 3, 1.0, 64),
        ("k8v4", 1, 1.0, 64),
        ("k8v4", 3, 1.0, 64),
        ("tq4_nc", 1, 1.0, 64),
        ("tq4_nc", 1, 2.0**10, 64),
        ("4bit_nc", 8, 1.0, 128),
        ("4bit_nc", 8, 2.0**13, 128),
        ("tqk5v3_nc", 1, 2.0**13, 128),
        ("4bit_nc", 1, 2.0**13, 128),
        ("tqk4v2_nc", 1, 2.0**13, 64),
    ],
)
def test_scores_rising_along_the_sequence(
    fmt_name, tokens, value_scale, head_dim, kernel_device, seeded
):
    """One split streams ten 32-token tiles whose scores rise and fall along the sequence: some
    tiles raise a query row's maximum by less than the split kernel's rescale slack (then its
    probabilities exceed 1, up to 2**3.5, against the maximum it keeps), some by more (the
    accumulators rescaled), some not at all; half the rows see the scores fall instead. Each
    of T query tokens (causal among them in the last tile) equals float64 attention; with
    value norms near 2**13 (tq4_nc: rotated values, one norm per token; tqk5v3_nc: 3-bit
    values as the grid's integers, the zero term in absolute units), where such probabilities
    times the norms overflow fp16, through the pass in units of the largest. At
    T = 8 and D = 128 (32 query rows per kv-head of 4bit_nc) a Hopper GPU runs the verify
    kernel (the same slack, and its own second pass: uniform value scales there, the values'
    range / 15, pass 2**11). At T = 1, 4bit_nc (D 128) and tqk4v2_nc load each tile's scalars
    a tile ahead, and the value pages (4bit_nc and tq4_nc at D 64 in byte halves, tqk5v3_nc's
    integer values at D 128 too), through both passes."""
    fmt = get_format(fmt_name)
    num_kv_heads, group, page_size = 2, 4, 16
    n_tokens = 10 * 32 - 5
    consts = api.make_constants(fmt, head_dim, seed=3)
    key, value = random_kv(n_tokens, num_kv_heads, head_dim, torch.float32, seeded)
    key, value = key * 0.05, torch.randn(value.shape, generator=seeded) * value_scale
    # A query 2 * u (plus a little noise) gets about 2 * c / sqrt(D) * log2(e) (log2 units) from
    # a key's component c * u: offsets per tile, rising by 3.5 (under the slack of 4), 5.5 or 6
    # (over it), 1.5 or not at all; queries -2 * u see them fall.
    offsets = torch.tensor([0.0, 3.5, 9, 0, 9, 15, 3, 18.5, 20, 20]).repeat_interleave(32)
    u = torch.nn.functional.normalize(torch.randn(head_dim, generator=seeded), dim=0)
    key = key + (offsets[:n_tokens] / (2 * head_dim**-0.5 * LOG2E))[:, None, None] * u
    num_pages = triton.cdiv(n_tokens, page_size)
    cache = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim)
    reference.store(
        fmt,
        key.to(torch.bfloat16),
        value.to(torch.bfloat16),
        cache,
        torch.arange(n_tokens, dtype=torch.int32),
        *consts,
    )
    table = torch.arange(num_pages, dtype=torch.int32)[None]
    lens = torch.tensor([n_tokens], dtype=torch.int32)
    noise = torch.randn(1, num_kv_heads * group, tokens, head_dim, generator=seeded)
    sign = 1 - 2 * (torch.arange(num_kv_heads * group) % 2)  # +u, -u, ... per query head
    q = (2 * sign[None, :, None, None] * u + 0.1 * noise).to(torch.float16)
    expected = torch.stack(
        [
            reference.decode(
                fmt,
                q[:, :, t],
                cache,
                table,
                lens - (tokens - 1 - t),
                *consts,
                head_dim**-0.5,
                torch.float64,
            )
            for t in range(tokens)
        ],
        2,
    )
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device, num_splits=1)
    assert rel_error(actual, expected) < 1e-3


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
@pytest.mark.parametrize(
    "fmt_name", ["4bit_nc", "3bit_nc", "k8v4", "tq4_nc", "k2v2_nc", "tqk5v3_nc"]
)
def test_kernel_head_dims(fmt_name, head_dim, kernel_device, seeded):
    """Head dims 80, 96 (padded tiles), 128 and 256 against float64 attention (5-bit keys: the
    sign halves' boundary D/8 inside a 4-byte group at D = 80)."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, head_dim, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, head_dim**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device)
    assert rel_error(actual, expected) < 1e-3


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq4_nc"])
def test_many_splits(fmt_name, kernel_device, seeded):
    """64 splits, most of them empty: the merge reads them in chunks and rotates rotated values
    back, against float64 attention."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device, num_splits=64)
    assert rel_error(actual, expected) < 1e-3


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k2v4_nc", "tq4_nc"])
def test_query_rotated_in_split_or_prepared(fmt_name, kernel_device, seeded):
    """Rotated keys get their queries rotated inside the split kernel (short splits: the
    Walsh-Hadamard structure of R) or by the preparation kernel (long splits: a block table with
    more capacity per split; test_plan.py checks that these two tables take the two paths); both
    agree with float64 attention."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    long_table = longer_table(table)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    for block_table in (table, long_table):
        actual = _kernel_decode(fmt, q, cache, block_table, lens, consts, kernel_device)
        assert rel_error(actual, expected) < 1e-3


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_int8_keys_at_every_head_dim(head_dim, kernel_device, seeded):
    """3-, 4- and 5-bit keys in streaming splits (a longer table) at every head dim (80 and 96
    pad their parts), multiplied as int8 (the query in two int8 terms; 3- and 5-bit keys at D
    64, quarters of 16, as fp16), the query prepared (2 splits) or, at powers of two, rotated
    in the kernel (4 splits), against float64 attention."""
    for fmt_name in ("4bit_nc", "tqk5v3_nc", "3bit_nc"):
        fmt, consts, cache, table, lens, q = decode_case(fmt_name, head_dim, 4, seeded)
        expected = reference.decode(
            fmt, q, cache, table, lens, *consts, head_dim**-0.5, torch.float64
        )
        for num_splits in (2, 4):
            actual = _kernel_decode(
                fmt,
                q,
                cache,
                longer_table(table),
                lens,
                consts,
                kernel_device,
                num_splits=num_splits,
            )
            assert rel_error(actual, expected) < 1e-3, (fmt_name, num_splits)


def test_which_codes_are_decoded_to_integers():
    """The split kernel's gate (``int8_keys``, the same function on the host): 3-, 4- and 5-bit
    Lloyd-Max keys in streaming splits at every head dim but D 64 for 3 and 5 bits (quarters of
    16, below the int8 MMA's k 32); never in one-tile splits or other codecs. Its values as the
    grid's integers: 3-bit Lloyd-Max ones at every head dim, in units of a power of two ``S``
    with ``S * unit`` in [1, 1.75] (the value multipliers' factor, which the split kernel's
    fp16 products allow); keys never. 3- and 5-bit int8 keys read their sign plane as one
    tile at D 128 only, with the inline PTX or without."""
    for name, fmt in FORMATS.items():
        for head_dim in SUPPORTED_HEAD_DIMS:
            keys = part_params(fmt, "k", head_dim, True)
            lloyd_max = fmt.key.kind == Kind.LLOYD_MAX and fmt.key.bits in (3, 4, 5)
            expected = lloyd_max and not (fmt.key.bits != 4 and head_dim == 64)
            assert int8_keys(keys.INT8_UNIT, keys.PC_PAD, False) == expected, (name, head_dim)
            assert not int8_keys(keys.INT8_UNIT, keys.PC_PAD, True)
            assert (len(keys.ASM_INT8) > 0) == lloyd_max
            # one sign tile, told apart by lane, where a plane tile is one 32-byte operand row
            lanes = lloyd_max and fmt.key.bits != 4 and head_dim == 128
            assert keys.LANE_SIGNS == part_params(fmt, "k", head_dim, False).LANE_SIGNS == lanes
            assert keys.INTEGER_SCALE == 0.0 and keys.ASM_INTEGERS == ""
            values = part_params(fmt, "v", head_dim, True)
            integers = fmt.value.kind == Kind.LLOYD_MAX and fmt.value.bits == 3
            assert (values.INTEGER_SCALE > 0) == integers, (name, head_dim)
            assert (values.ASM_INTEGERS != "") == integers
            assert part_params(fmt, "v", head_dim, False).ASM_INTEGERS == ""
            if integers:
                scale = values.INTEGER_SCALE
                assert scale == 2.0 ** round(math.log2(scale))
                assert 1.0 <= scale * values.INT8_UNIT <= 1.75, (name, head_dim)


@pytest.mark.parametrize(
    "fmt_name, element", [("4bit_nc", 7), ("4bit_nc", 100), ("3bit_nc", 40), ("tqk5v3_nc", 104)]
)
def test_int8_keys_keep_a_nan_query(fmt_name, element, kernel_device, seeded):
    """A query row holding a NaN gives NaN outputs through the int8 keys too (its int8 terms
    are finite garbage, its ``half_sum`` NaN), and only that row: in either part of 4-bit keys,
    and in the second pair of quarters (1 and 3) of 3- and 5-bit ones."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 128, 4, seeded)
    q[0, 1, element] = float("nan")
    actual = _kernel_decode(fmt, q, cache, longer_table(table), lens, consts, kernel_device)
    assert actual[0, 1].isnan().all()
    actual[0, 1] = 0.0
    assert not actual.isnan().any()


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "int8", "fp8", "tq4_nc"])
def test_block_table_past_the_length_is_not_followed(fmt_name, kernel_device, seeded):
    """Block-table entries past a sequence's pages may hold anything (here a page id far beyond
    the cache). Splits of one tile read them before they know the length and must not follow
    them; longer splits do not read them. Both against float64 attention (int8, fp8, and k8v4 in
    the longer splits: two 16-token tiles per step; fp8, tq4_nc: the longer splits' kernel is
    register-capped; test_plan.py checks that the two tables give splits of one tile and
    longer ones)."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    stale, long_stale = stale_tables(table, lens)
    for block_table in (stale, long_stale):
        actual = _kernel_decode(fmt, q, cache, block_table, lens, consts, kernel_device)
        assert rel_error(actual, expected) < 1e-3


def test_bf16_query(kernel_device, seeded):
    """bf16 queries: the output's own rounding (2^-9) dominates."""
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 128, 4, seeded)
    q = q.to(torch.bfloat16)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 128**-0.5, torch.float64)
    actual = _kernel_decode(fmt, q, cache, table, lens, consts, kernel_device)
    assert actual.dtype == torch.bfloat16
    assert rel_error(actual, expected) < 4e-3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc", "int8", "tq4_nc", "k2v4_nc"])
def test_opcheck_decode(fmt_name, impl, kernel_device, seeded):
    """opcheck (schema, fake tensor, aot dispatch) for tq.decode."""
    device = impl_device(impl, kernel_device)
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    args = tuple(t.to(device) for t in (q, *cache, table, lens, *consts))
    args = args + (fmt_name, 2, 0.125)
    with impl_context(impl, device):
        torch.library.opcheck(torch.ops.tq.decode.default, args)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_query(impl, kernel_device, seeded):
    """A query that is a view (batch and heads permuted, rows padded: what a model's transposes
    and slices hand over) gives the contiguous query's output, bit for bit, in a contiguous
    ``[B, Hq, D]`` tensor (the merge writes rows in that order), and opcheck agrees (the fake
    gives the same strides)."""
    device = impl_device(impl, kernel_device)
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, seeded)
    batch, num_q_heads, head_dim = q.shape
    views = {
        "batch and heads permuted": q.transpose(0, 1).contiguous().transpose(0, 1),
        "padded rows": torch.nn.functional.pad(q, (0, 8))[..., :head_dim],
    }
    args = tuple(t.to(device) for t in (*cache, table, lens, *consts))
    with impl_context(impl, device):
        expected = torch.ops.tq.decode(q.to(device), *args, "4bit_nc", 2, 0.125)
        for name, view in views.items():
            assert not view.is_contiguous()
            actual = torch.ops.tq.decode(view.to(device), *args, "4bit_nc", 2, 0.125)
            assert actual.is_contiguous(), name
            assert torch.equal(actual, expected), name
            torch.library.opcheck(
                torch.ops.tq.decode.default, (view.to(device), *args, "4bit_nc", 2, 0.125)
            )


class TestDecodeBadInput(expecttest.TestCase):
    def test_rejects_bad_input(self):
        gen = torch.Generator().manual_seed(0)
        fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, gen)
        cases = {
            "float32 query": dict(q=q.float()),
            "heads not a multiple": dict(q=q[:, :7]),
            "splits not a power of two": dict(num_splits=3),
            "batch mismatch": dict(q=q[:2]),
            "a prefill's worth of query tokens": dict(q=q[:, :, None].expand(-1, -1, 17, -1)),
            "sinks without rings": dict(sinks=4),
            "a negative softcap": dict(softcap=-1.0),
            "an infinite softcap": dict(softcap=float("inf")),
        }
        messages = []
        for case, override in cases.items():
            args = dict(q=q, num_splits=2, sinks=0, softcap=0.0) | override
            with self.assertRaises((ValueError, TypeError)) as ctx:  # (a window has rings: the op)
                torch.ops.tq.decode(
                    args["q"],
                    *cache,
                    table,
                    lens,
                    *consts,
                    fmt.name,
                    args["num_splits"],
                    0.125,
                    sinks=args["sinks"],
                    softcap=args["softcap"],
                )
            messages.append(f"{case}: {type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
float32 query: TypeError: tq.decode: q must be bfloat16 or float16, got torch.float32
heads not a multiple: ValueError: tq.decode: q has 7 heads, not a multiple of the cache's 2 kv-heads
splits not a power of two: ValueError: tq.decode: num_splits must be a power of two in [1, 512], got 3
batch mismatch: ValueError: tq.decode: block_table has 3 rows for a batch of 2 queries
a prefill's worth of query tokens: ValueError: tq.decode: q must be [B, Hq, D] (one query token per sequence) or [B, Hq, T, D] with 1 <= T <= 16 (each sequence's last T tokens), got shape (3, 8, 17, 64)
sinks without rings: ValueError: tq.decode: sinks=4 needs the rings (k_window, v_window, window_pos) that hold them
a negative softcap: ValueError: tq.decode: softcap must be 0 (no cap) or a positive finite float, got -1.0
an infinite softcap: ValueError: tq.decode: softcap must be 0 (no cap) or a positive finite float, got inf""",  # noqa: E501
        )


# (format, head dim, streaming splits: a longer table, split counts) of
# test_fast_and_portable_paths_agree
_FAST_PORTABLE_CASES = [
    (name, 128, False, (2,))
    for name in (
        "4bit_nc",
        "tq4_nc",
        "tq3_nc",
        "tq2_nc",
        "tqk5v3_nc",
        "k8v4",
        "3bit_nc",
        "k2v2_nc",
        "k2v4_nc",
        "int8",
    )
]
_FAST_PORTABLE_CASES += [
    (name, d, False, (2,)) for name in ("tqk5v3_nc", "tq3_nc") for d in (64, 80)
]
_FAST_PORTABLE_CASES += [
    (name, d, True, (2, 4))
    for name in ("4bit_nc", "tqk5v3_nc", "3bit_nc")
    for d in SUPPORTED_HEAD_DIMS
]
_FAST_PORTABLE_CASES += [(name, 128, True, (2, 4)) for name in ("tq4_nc", "tqk4v2_nc", "tq3_nc")]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# one test per format: each case compiles its kernels twice, and the workers share them out
@pytest.mark.parametrize("fmt_name", sorted({case[0] for case in _FAST_PORTABLE_CASES}))
def test_fast_and_portable_paths_agree(fmt_name, seeded):
    """On the GPU, the inline-PTX decoding of the codes (5, 4, 3, 2 bits, int8) equals the
    plain-Triton decoding; sign planes also at D = 80 (a key's 4-byte group straddles D/8, the
    sign halves' boundary) and D = 64. 3-, 4- and 5-bit keys in streaming splits (longer
    tables) at every head dim (D 80 and 96 pad their parts), the query prepared (2 splits) or
    rotated in the kernel (4 splits), multiplied as int8 (3- and 5-bit keys at D 64 as fp16):
    the PTX's interleaved nibbles against a permuted query; there, 3-bit Lloyd-Max values as
    the grid's integers (tqk5v3_nc, tq3_nc)."""
    for name, head_dim, streaming, split_counts in _FAST_PORTABLE_CASES:
        if name != fmt_name:
            continue
        fmt, consts, cache, table, lens, q = decode_case(name, head_dim, 4, seeded)
        if streaming:
            table = longer_table(table)
        cuda_cache = clone_cache(cache, "cuda")
        args = (fmt, q.cuda(), cuda_cache, table.cuda(), lens.cuda(), *(c.cuda() for c in consts))
        for num_splits in split_counts:
            fast = triton_decode.decode(*args, num_splits=num_splits, scale=0.1)
            portable = triton_decode.decode(*args, num_splits=num_splits, scale=0.1, fast=False)
            torch.testing.assert_close(fast, portable, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "tq4_nc", "int8"])
def test_warp_counts(fmt_name, seeded):
    """One- and two-warp split programs, and merges of one warp or of four warps and chunks of
    splits (the configurations test_plan.py checks the plan picks): every combination agrees
    with float64 attention (head dim 128, 32 splits; tq4_nc rotates its values back in the
    merge)."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 128, 4, seeded)
    args = (fmt, q.cuda(), clone_cache(cache, "cuda"), table.cuda(), lens.cuda())
    args += tuple(c.cuda() for c in consts)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 128**-0.5, torch.float64)
    merges = {"one warp": MergeConfig(1, 32, 1), "four warps, chunks of 8": MergeConfig(1, 8, 4)}
    if not fmt.value.rotated:
        merges["four warps, columns in blocks of 32"] = MergeConfig(1, 32, 4, 32)
    for merge_label, merge_config in merges.items():
        for num_warps in (1, 2):
            actual = triton_decode.decode(
                *args,
                num_splits=32,
                scale=128**-0.5,
                split_config=SplitConfig(num_warps=num_warps),
                merge_config=merge_config,
            )
            error = rel_error(actual.cpu(), expected)
            assert error < 1e-3, f"{num_warps} split warps, merge of {merge_label}: {error}"


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc"])
def test_kernel_mask(fmt_name, kind, kernel_device, seeded):
    """A boolean or additive mask [B, Hq or 1, M] (M shorter than the cache: the rest masked),
    including a query whose keys are all masked out (zeros), against float64 attention."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    num_q_heads = q.shape[1]
    if kind == "bool":
        mask = torch.rand(3, num_q_heads, 12, generator=seeded) > 0.4
        mask[0, 1] = False
    else:
        mask = torch.randn(3, 1, 12, generator=seeded) * 2
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 0.125, torch.float64, mask)
    actual = _kernel_decode(
        fmt, q, cache, table, lens, consts, kernel_device, num_splits=4, scale=0.125, mask=mask
    )
    assert not actual.isnan().any()
    if kind == "bool":
        assert bool((actual[0, 1] == 0).all())
    assert rel_error(actual, expected) < 1e-3


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc", "tq4_nc", "int8"])
def test_kernel_softcap(fmt_name, mask_kind, tokens, kernel_device, seeded):
    """Scores capped at ``softcap * tanh(s / softcap)`` before the mask (Gemma 2), one query
    token or a verify step's three (each with its mask row): the kernel equals float64 attention
    with the same cap within 1e-3, where the cap changes the answer by far more (queries scaled
    so that scores reach several times the cap)."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    if tokens > 1:
        q = torch.randn(*q.shape[:2], tokens, q.shape[-1], generator=seeded).to(q.dtype)
    q = q * 8
    rows = (3, 1, tokens, 12) if tokens > 1 else (3, 1, 12)
    mask = {
        "none": None,
        "bool": torch.rand(*rows, generator=seeded) > 0.3,
        "additive": torch.randn(*rows, generator=seeded) * 2,
    }[mask_kind]
    softcap = 5.0
    expected = reference.decode(
        fmt, q, cache, table, lens, *consts, 0.125, torch.float64, mask, softcap=softcap
    )
    uncapped = reference.decode(fmt, q, cache, table, lens, *consts, 0.125, torch.float64, mask)
    assert rel_error(uncapped, expected) > 0.1
    actual = _kernel_decode(
        fmt,
        q,
        cache,
        table,
        lens,
        consts,
        kernel_device,
        num_splits=4,
        scale=0.125,
        mask=mask,
        softcap=softcap,
    )
    assert rel_error(actual, expected) < 1e-3


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq4_nc"])
def test_decode_window_softcap(fmt_name, kernel_device, seeded):
    """The cap applies to the ring's tokens and the sinks as to the compressed ones: in the
    split kernel (values in the original space) and in the ring kernel (rotated values)."""
    seqs = Sequences(fmt_name, seeded, kernel_device, sinks=3)
    for n_new, starts in STEPS[:4]:
        seqs.append(n_new, starts, seeded, use_triton=False)
    q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).half() * 6
    expected = _expected_attention(seqs, q, softcap=3.0)
    assert rel_error(_expected_attention(seqs, q), expected) > 0.1
    actual = seqs.decode(q, num_splits=4, softcap=3.0)
    assert rel_error(actual, expected) < 1e-3


def _expected_kv(seqs, dtype=torch.float64):
    """``(K, V)``: the dequantized cache for positions below each sequence's ring run and the
    exact bf16 tokens in it and in its sinks."""
    consts = api.KVConstants(*(c.cpu() for c in seqs.consts))
    cache = clone_cache(seqs.cache)
    k, v = reference.dequantize(
        seqs.fmt, cache, seqs.block_table.cpu(), seqs.lens, *consts, seqs.capacity, dtype
    )
    exact = seqs.exact(torch.arange(seqs.capacity))[:, None, :, None]
    k = torch.where(exact, seqs.keys.to(dtype), k)
    return k, torch.where(exact, seqs.values.to(dtype), v)


def _expected_attention(seqs, q, dtype=torch.float64, mask=None, softcap=0.0):
    """float64 attention of ``q [B, Hq, D]`` over :func:`_expected_kv`."""
    return reference.attention(
        q, *_expected_kv(seqs, dtype), seqs.lens, HEAD_DIM**-0.5, mask, softcap
    )


def _expected_verify(q, k, v, lens):
    """float64 attention of a verify step's ``q [B, Hq, T, D]`` over ``k``, ``v``: token ``t``
    sees the positions below ``lens - T + t + 1``."""
    tokens = q.shape[2]
    return torch.stack(
        [
            reference.attention(q[:, :, t], k, v, lens - (tokens - 1 - t), HEAD_DIM**-0.5)
            for t in range(tokens)
        ],
        dim=2,
    )


@pytest.mark.parametrize("steps", ["appends", "rewrites"])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_decode_window_contribution_is_exact(fmt_name, group, steps, kernel_device, seeded):
    """Decode with the window equals float64 attention over the dequantized compressed tokens
    and the *unquantized* window tokens (1e-3: fp16 query and probabilities on the compressed
    side), at lengths below, at and beyond the window, and after rewrites from below the length
    (rollbacks within and past the ring run, a restart)."""
    seqs = Sequences(fmt_name, seeded, kernel_device)
    for n_new, starts in STEPS if steps == "appends" else REWRITE_STEPS:
        seqs.append(n_new, starts, seeded, use_triton=False)
        # fp16 query, so the output's rounding (2^-11) stays below the bound
        q = torch.randn(BATCH, NUM_KV_HEADS * group, HEAD_DIM, generator=seeded).half()
        expected = _expected_attention(seqs, q)
        actual = seqs.decode(q, num_splits=2)
        rel = (actual.double() - expected).norm() / expected.norm()
        assert rel < 1e-3, (n_new, starts, float(rel))


@pytest.mark.parametrize("window, sinks", [(WINDOW, 3), (2, 5), (0, 3)])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq4_nc", "k8v4"])
def test_decode_reads_sinks_exactly(fmt_name, window, sinks, kernel_device, seeded):
    """With sinks (beside the window, more sinks than window slots, sinks alone) decode equals
    float64 attention over the exact tokens of the sinks and the ring run and the dequantized
    others (1e-3), after every write of the rewrite steps (a restart rewrites the sinks), one
    token (group 4) and a verify step of 3 tokens; the sinks' pages (poison) are never read."""
    seqs = Sequences(fmt_name, seeded, kernel_device, window=window, sinks=sinks)
    for n_new, starts in REWRITE_STEPS:
        seqs.append(n_new, starts, seeded, use_triton=False)
        q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).half()
        rel = rel_error(seqs.decode(q, num_splits=2), _expected_attention(seqs, q))
        assert rel < 1e-3, (n_new, starts, float(rel))
        tokens = min(3, int(seqs.lens.min()))
        q, _ = _multi_token_case(seqs, tokens, 2, seeded, None)
        expected = _expected_verify(q, *_expected_kv(seqs), seqs.lens)
        rel = rel_error(seqs.decode(q, num_splits=4), expected)
        assert rel < 1e-3, (n_new, starts, tokens, float(rel))


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc"])
def test_merge_in_column_blocks(fmt_name, kernel_device, seeded):
    """Merges whose programs take a block of 32 of a row's 64 columns (values not rotated: one
    program per row and block, or two rows per program, chunks of one split or of all; and the
    plan's own choice, blocks on a GPU) equal float64 attention (1e-3) over a cache with a
    window and sinks, and a whole-row merge to an fp16 rounding (the sums over splits go in
    another order); rotated values' rows stay whole (``test_plan.py``)."""
    seqs = Sequences(fmt_name, seeded, kernel_device, window=WINDOW, sinks=3)
    for n_new, starts in REWRITE_STEPS[:4]:
        seqs.append(n_new, starts, seeded, use_triton=False)
    q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).half()
    expected = _expected_attention(seqs, q)
    d = seqs.device
    outputs = []
    whole_rows = MergeConfig(1, 4, 1)
    for merge_config in (whole_rows, MergeConfig(1, 1, 1, 32), MergeConfig(2, 4, 4, 32), None):
        with triton_kernels(d):
            out = triton_decode.decode(
                seqs.fmt,
                q.to(d),
                seqs.cache,
                seqs.block_table,
                seqs.lens.to(d),
                seqs.consts.rotation,
                4,
                HEAD_DIM**-0.5,
                window=seqs.recent,
                merge_config=merge_config,
            ).cpu()
        assert rel_error(out, expected) < 1e-3, merge_config
        outputs.append(out.float())
    for out in outputs[1:]:
        torch.testing.assert_close(out, outputs[0], rtol=2**-10, atol=2**-14)


@pytest.mark.parametrize("fmt_name", ["k8v4", "3bit_nc"])
def test_merge_in_column_blocks_of_a_padded_head_dim(fmt_name, kernel_device, seeded):
    """At head dim 96 (padded to 128) a merge in blocks of 32 columns takes three blocks, the
    last one ending at the head dim, and equals float64 attention (1e-3)."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 96, 4, seeded)
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 96**-0.5, torch.float64)
    plan = triton_decode.plan_for(fmt, q, cache, table, 2, merge_config=MergeConfig(1, 2, 1, 32))
    assert plan.merge.grid[1] == 3
    d = kernel_device
    with triton_kernels(d):
        out = triton_decode.decode(
            fmt,
            q.to(d),
            clone_cache(cache, d),
            table.to(d),
            lens.to(d),
            consts.rotation.to(d),
            2,
            96**-0.5,
            merge_config=MergeConfig(1, 2, 1, 32),
        )
    assert rel_error(out.cpu(), expected) < 1e-3


def _stored_pages(fmt, lens, pages_per_seq, page, head_dim, window, sinks, consts, device, gen):
    """``len(lens)`` sequences of ``pages_per_seq`` shuffled pages filled through ``tq.store``
    with random tokens, and rings of ``window + sinks`` slots (random bf16, positions as
    appended up to ``lens``; None without slots): ``(cache, table, recent, k, v)``, ``k, v`` the
    float64 keys and values decode attends (the dequantized pages, the exact ring)."""
    batch = len(lens)
    num_pages = batch * pages_per_seq
    key, value = (
        torch.randn(num_pages * page, NUM_KV_HEADS, head_dim, generator=gen) for _ in range(2)
    )
    table = torch.randperm(num_pages, generator=gen).to(torch.int32).reshape(batch, -1)
    shape = (batch, NUM_KV_HEADS, window + sinks, head_dim)
    rings = [torch.randn(shape, generator=gen).bfloat16().to(device) for _ in range(2)]
    recent = None
    if window + sinks:
        window_pos = api.appended_window_positions(lens.to(device), NUM_KV_HEADS, window, sinks)
        recent = RecentWindow(*rings, window_pos, sinks)
    with triton_kernels(device):
        cache = fmt.allocate(num_pages, NUM_KV_HEADS, page, head_dim, device)
        slots = torch.arange(num_pages * page, dtype=torch.int32, device=device)
        api.store(
            fmt, cache, key.bfloat16().to(device), value.bfloat16().to(device), slots, consts
        )
    k, v = reference.dequantize(
        fmt,
        clone_cache(cache),
        table,
        lens,
        *(c.cpu() for c in consts),
        page * pages_per_seq,
        torch.float64,
        None if recent is None else window_on(recent, "cpu"),
    )
    return cache, table, recent, k, v


def _sixteen_pages_each(fmt_name, head_dim, window, sinks, device, gen):
    """Four sequences of 16 shuffled 16-token pages (:func:`_stored_pages`), of lengths at the
    capacity (256), inside a 32-token tile's second page, inside its first and below one page,
    4 query rows per kv-head: ``(fmt, q, cache, table, lens, consts, recent, expected)``,
    ``expected`` float64 attention over the dequantized pages and the exact ring."""
    fmt = get_format(fmt_name)
    page, pages_per_seq = 16, 16
    capacity = page * pages_per_seq
    lens = torch.tensor([capacity, capacity - 5, capacity - 23, 11], dtype=torch.int32)
    consts = api.make_constants(fmt, head_dim, seed=3, device=device)
    cache, table, recent, k, v = _stored_pages(
        fmt, lens, pages_per_seq, page, head_dim, window, sinks, consts, device, gen
    )
    q = torch.randn(len(lens), NUM_KV_HEADS * 4, head_dim, generator=gen).half()
    expected = reference.attention(q, k, v, lens, head_dim**-0.5)
    return fmt, q, cache, table, lens, consts, recent, expected


# (VALUE_PAGES, SCALARS_AHEAD) of the split kernel in streaming and in one-tile splits of
# 32-token tiles over 16-token pages, per format and head dim
TWO_PAGE_TILES = {
    ("4bit_nc", 128): ((True, True), (True, False)),
    ("4bit_nc", 64): ((True, True), (True, False)),  # rows of 32 bytes: two halves
    ("tq4_nc", 96): ((True, True), (True, False)),  # rows of 48 bytes, padded to 64
    ("tqk4v2_nc", 64): ((False, True), (False, False)),  # four parts of 16 bytes
    ("3bit_nc", 128): ((True, True), (True, False)),  # four parts of 32: halves, signs
    ("tqk4v2_nc", 128): ((True, True), (True, False)),  # 2-bit parts of 32 bytes
    ("tq2_nc", 128): ((False, False), (False, False)),  # its tuning
    ("tq3_nc", 96): ((False, True), (False, False)),  # parts of 24 bytes, padded to 32
    ("k8v4", 80): ((True, True), (True, False)),
}


@pytest.mark.parametrize("fmt_name, head_dim", list(TWO_PAGE_TILES))
@pytest.mark.parametrize("window, sinks", [(0, 0), (16, 4)])
def test_two_page_tiles_and_scalars_ahead(
    fmt_name, head_dim, window, sinks, kernel_device, seeded
):
    """32-token tiles over 16-token pages (docs/design/decode.md#tiles-tokens-on-m-one-warp-per-
    program): values read each page's codes as a tile of their own (parts of 32 bytes as a
    [2, 16, 16] tile: 4-bit values at D 64, 3- and 2-bit values' quarters and the signs at D
    128), and every format but tq2_nc and k2v2_nc (their tuning) loads each tile's scalars
    during the tile before, in streaming splits (2 splits of 4 tiles; one-tile splits, 8, never
    load ahead); parts of 16 bytes, or padded to 32, and tq2_nc keep two-page tiles. Over a
    shuffled block table, lengths at the capacity, inside a tile's second page, inside its first
    and below one page, with and without a 16-slot window and 4 sinks (read from the ring, their
    page slots masked), decode equals float64 attention over the dequantized pages and the exact
    ring (1e-3)."""
    device = kernel_device
    fmt, q, cache, table, lens, consts, recent, expected = _sixteen_pages_each(
        fmt_name, head_dim, window, sinks, device, seeded
    )
    with triton_kernels(device):
        for splits, flags in zip((2, 8), TWO_PAGE_TILES[fmt_name, head_dim], strict=True):
            args = (fmt, q.to(device), cache, table.to(device))
            plan = triton_decode.plan_for(*args, splits, None, recent)
            launch = plan.split.kwargs
            assert (launch["VALUE_PAGES"], launch["SCALARS_AHEAD"]) == flags, splits
            assert plan.one_tile == (splits == 8)
            actual = api.decode(*args, lens.to(device), consts, num_splits=splits, window=recent)
            assert rel_error(actual.cpu(), expected) < 1e-3, splits


@pytest.mark.parametrize("fmt_name", ["int8", "fp8", "k3v4_nc", "4bit_nc", "tq3_nc"])
def test_two_16_token_tiles(fmt_name, kernel_device, seeded):
    """Two 16-token tiles per softmax step (``SplitConfig(16, 2)``: no format's tuning takes
    them since one 32-token tile needs fewer instructions, docs/design/decode.md#ring-tiles-and-
    16-token-tiles; kept for sweeps) in streaming splits (2 splits of 4 steps) and one-tile
    splits (8), over 16-token pages, lengths at the capacity, inside a step's second tile, its
    first and below one page, a 16-slot window and 4 sinks: decode equals float64 attention over
    the dequantized pages and the exact ring (1e-3)."""
    device, head_dim = kernel_device, 128
    fmt, q, cache, table, lens, consts, recent, expected = _sixteen_pages_each(
        fmt_name, head_dim, 16, 4, device, seeded
    )
    split_config = SplitConfig(16, 2)
    with triton_kernels(device):
        for splits in (2, 8):
            args = (fmt, q.to(device), cache, table.to(device))
            plan = triton_decode.plan_for(*args, splits, None, recent, split_config=split_config)
            assert plan.split.kwargs["SUBTILES"] == 2 and plan.one_tile == (splits == 8)
            actual = triton_decode.decode(
                *args,
                lens.to(device),
                consts.rotation,
                splits,
                head_dim**-0.5,
                window=recent,
                split_config=split_config,
            )
            assert rel_error(actual.cpu(), expected) < 1e-3, splits


# (format, page size, split config) -> whether streaming tiles read their page ids as scalars:
# tiles within one page or of two whole pages, not four pages (64-token tiles of 16-token
# pages) nor a quarter of one
SCALAR_PAGE_CASES = {
    ("4bit_nc", 8, None): False,  # 32-token tiles, four pages
    ("4bit_nc", 16, None): True,
    ("4bit_nc", 32, None): True,  # one page
    ("4bit_nc", 64, None): True,  # half a page
    ("4bit_nc", 16, (64, 1)): False,
    ("k8v4", 8, None): False,  # 32-token tiles, four pages
    ("k8v4", 8, (16, 2)): True,  # two 16-token tiles per step, each two whole pages
    ("k8v4", 16, None): True,
    ("k8v4", 16, (32, 2)): True,
    ("k8v4", 64, (64, 1)): True,
    ("fp8", 16, None): True,  # finite values past the end
    ("fp8", 16, (16, 2)): True,  # 16-token tiles within one page
}


@pytest.mark.parametrize("fmt_name, page, config", list(SCALAR_PAGE_CASES))
def test_scalar_pages_read_only_the_sequence(fmt_name, page, config, kernel_device, seeded):
    """Streaming tiles that read their page ids as scalars (docs/design/decode.md#tiles-tokens-
    on-m-one-warp-per-program) over lengths at, inside and just past page boundaries, with a
    16-slot window and 4 sinks, a block table whose entries past each sequence's pages point
    far outside the cache, and 0xFF bytes in every slot decode must not weigh (past the ring
    start, the sinks): decode equals float64 attention over the intact cache (1e-3)."""
    fmt = get_format(fmt_name)
    split_config = SplitConfig(*config) if config else None
    head_dim, window, sinks, pages_per_seq = 64, 16, 4, 320 // page
    capacity = page * pages_per_seq
    lens = torch.tensor([capacity, 1, page - 1, page, page + 1, 2 * page + 3, capacity - 5])
    lens = lens.to(torch.int32)
    batch, num_pages = len(lens), len(lens) * pages_per_seq
    consts = api.make_constants(fmt, head_dim, seed=3)
    cache = filled_cache(fmt, num_pages, NUM_KV_HEADS, page, head_dim, consts, seeded)
    table = torch.randperm(num_pages, generator=seeded).to(torch.int32).reshape(batch, -1)
    positions = api.appended_window_positions(lens, NUM_KV_HEADS, window, sinks)
    shape = (batch, NUM_KV_HEADS, window + sinks, head_dim)
    recent = RecentWindow(
        *(torch.randn(shape, generator=seeded).bfloat16() for _ in "kv"), positions, sinks
    )
    q = torch.randn(batch, NUM_KV_HEADS * 4, head_dim, generator=seeded).half()
    expected = reference.decode(
        fmt, q, cache, table, lens, consts.rotation, head_dim**-0.5, torch.float64, window=recent
    )
    poisoned = clone_cache(cache)
    for b, length in enumerate(lens.tolist()):
        ring_start = max(0, length - window)
        for position in [*range(sinks), *range(ring_start, capacity)]:
            page_id, slot = int(table[b, position // page]), position % page
            poisoned.k_codes[page_id, :, slot] = 0xFF
            poisoned.v_codes[page_id, :, :, slot] = 0xFF
            poisoned.meta[page_id, :, slot] = 0xFF
    stale = stale_table(table, lens, page)
    device = kernel_device
    args = (fmt, q.to(device), clone_cache(poisoned, device), stale.to(device))
    recent = window_on(recent, device)
    plan = triton_decode.plan_for(*args, 2, None, recent, split_config=split_config)
    assert plan.split.kwargs["SCALAR_PAGES"] == SCALAR_PAGE_CASES[fmt_name, page, config]
    with triton_kernels(device):
        actual = triton_decode.decode(
            *args,
            lens.to(device),
            consts.rotation.to(device),
            2,
            head_dim**-0.5,
            window=recent,
            split_config=split_config,
        )
    assert rel_error(actual.cpu(), expected) < 1e-3


@pytest.mark.parametrize("window, sinks", [(72, 3), (48, 70)])
def test_ring_kernel_parts_and_sink_tiles(window, sinks, kernel_device, seeded):
    """Rotated values (tq4_nc) read the ring in a kernel of its own, in parts of whole 64-place
    tiles of the window's run, the last part also reading the sinks in 16-place tiles: a
    72-slot window (two parts, the second of up to 8 places, then 3 sinks) and 70 sinks (five
    sink tiles, the last of 6). Decode, one token (group 4) and a verify step of 3 tokens,
    equals float64 attention over the exact ring run and sinks and the dequantized pages
    (1e-3) after a prefill, a rewrite, appends and a rollback."""
    seqs = Sequences("tq4_nc", seeded, kernel_device, window=window, sinks=sinks)
    for n_new, starts in [(50, (0, 0)), (20, (50, 30)), (3, (70, 50)), (1, (10, 53))]:
        seqs.append(n_new, starts, seeded, use_triton=False)
        q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).half()
        rel = rel_error(seqs.decode(q, num_splits=2), _expected_attention(seqs, q))
        assert rel < 1e-3, (n_new, starts, float(rel))
        q, _ = _multi_token_case(seqs, 3, 2, seeded, None)
        expected = _expected_verify(q, *_expected_kv(seqs), seqs.lens)
        rel = rel_error(seqs.decode(q, num_splits=4), expected)
        assert rel < 1e-3, (n_new, starts, float(rel))


@pytest.mark.parametrize("sinks", [3, 20])
def test_sinks_in_a_ring_part_of_their_own_or_the_last(sinks, kernel_device, seeded):
    """The ring kernel reads the sinks in a part of their own where one part more still leaves
    every SM of a GPU at most one program (one sequence), and in the window's last part
    otherwise (as many sequences as SMs; always off a GPU): both equal float64 attention over
    the exact window run and sinks and the dequantized pages (1e-3; tq4_nc, a 72-slot window in
    two parts; 3 sinks in one tile, 20 in two), one token (group 4) and a verify step of 3, at
    lengths from below the sinks and the window to the capacity."""
    device = kernel_device
    # as many sequences as a GPU has SMs (3 off a GPU, whose plans never give the sinks a part)
    full_batch = torch.cuda.get_device_properties(device).multi_processor_count if CUDA else 3
    fmt = get_format("tq4_nc")
    window, page, pages_per_seq = 72, 16, 8
    capacity = page * pages_per_seq
    consts = api.make_constants(fmt, HEAD_DIM, seed=3, device=device)
    for batch, own_part in ((1, CUDA), (full_batch, False)):
        lens = torch.randint(3, capacity + 1, (batch,), generator=seeded, dtype=torch.int32)
        lens[:2] = torch.tensor([capacity, 3])[:batch]
        cache, table, recent, k, v = _stored_pages(
            fmt, lens, pages_per_seq, page, HEAD_DIM, window, sinks, consts, device, seeded
        )
        with triton_kernels(device):
            for q in (
                torch.randn(batch, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).half(),
                torch.randn(batch, NUM_KV_HEADS * 4, 3, HEAD_DIM, generator=seeded).half(),
            ):
                plan = triton_decode.plan_for(
                    fmt, q.to(device), cache, table.to(device), 4, None, recent
                )
                assert plan.ring.grid[0] == 2 + own_part, (batch, plan.ring.grid)
                actual = api.decode(
                    fmt,
                    q.to(device),
                    cache,
                    table.to(device),
                    lens.to(device),
                    consts,
                    num_splits=4,
                    window=recent,
                )
                expected = (
                    reference.attention(q, k, v, lens, HEAD_DIM**-0.5)
                    if q.dim() == 3
                    else _expected_verify(q, k, v, lens)
                )
                assert rel_error(actual.cpu(), expected) < 1e-3, (batch, q.dim())


@pytest.mark.parametrize("window, sinks", [(WINDOW, 3), (0, 3)])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq2_nc", "tqk4v2_nc", "k8v4"])
def test_decode_of_centred_keys_is_attention_over_the_keys(
    fmt_name, window, sinks, kernel_device, seeded
):
    """With keys stored centred decode reads them as they are, and that is attention over the
    written keys where the cache holds them exactly (ring run and sinks) and the pages with
    their centres back (``tq.dequantize`` with ``key_center``) elsewhere (float64; 8e-3: the
    ring holds ``key - centre`` rounded to bf16, twice after a rollback into the sinks), since
    softmax ignores the shift every score of a query shares: one token (group 4) and a verify
    step of 3 tokens after every rewrite step (centres set, reset by the restart, set again).
    The keys share a per-head offset, so a key stored with another centre shows."""
    seqs = Sequences(fmt_name, seeded, kernel_device, window=window, sinks=sinks, center=True)
    consts = api.KVConstants(*(c.cpu() for c in seqs.consts))
    for n_new, starts in REWRITE_STEPS:
        seqs.append(n_new, starts, seeded, use_triton=False)
        k, v = reference.dequantize(
            seqs.fmt,
            clone_cache(seqs.cache),
            seqs.block_table.cpu(),
            seqs.lens,
            *consts,
            seqs.capacity,
            torch.float64,
            window_on(seqs.recent, "cpu"),
        )
        exact = seqs.exact(torch.arange(seqs.capacity))[:, None, :, None]
        k = torch.where(exact, seqs.keys.double(), k)
        q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).half()
        expected = reference.attention(q, k, v, seqs.lens, HEAD_DIM**-0.5)
        rel = rel_error(seqs.decode(q, num_splits=2), expected)
        assert rel < 8e-3, (n_new, starts, float(rel))
        tokens = min(3, int(seqs.lens.min()))
        q, _ = _multi_token_case(seqs, tokens, 2, seeded, None)
        rel = rel_error(seqs.decode(q, num_splits=4), _expected_verify(q, k, v, seqs.lens))
        assert rel < 8e-3, (n_new, starts, tokens, float(rel))
    assert bool((seqs.key_center != 0).any()), "no centre was set"


def test_decode_window_only_is_exact(kernel_device, seeded):
    """While a sequence is shorter than the window, decode reads only the ring: it equals
    float64 attention over the bf16 tokens to float32 rounding (tf32 products of bf16 inputs
    are exact), whatever the compressed pages and the ring's unwritten slots (NaN) hold."""
    seqs = Sequences("3bit_nc", seeded, kernel_device)
    seqs.append(6, (0, 0), seeded, use_triton=False)
    seqs.k_window[:, :, 6:] = float("nan")  # unwritten slots: never read
    seqs.v_window[:, :, 6:] = float("nan")
    q = torch.randn(BATCH, NUM_KV_HEADS * 4, HEAD_DIM, generator=seeded).to(torch.bfloat16)
    expected = reference.attention(
        q, seqs.keys.double(), seqs.values.double(), seqs.lens, HEAD_DIM**-0.5
    )
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
    for n_new, starts in [(45, (0, 0)), (10, (-1, 45)), (3, (45, 55)), (10, (48, 58))]:
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


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_decode_with_rings(impl, sinks, kernel_device, seeded):
    """opcheck for tq.decode with the recent window's rings (and sinks)."""
    device = impl_device(impl, kernel_device)
    seqs = Sequences("4bit_nc", seeded, device, sinks=sinks)
    seqs.append(11, (0, 0), seeded, use_triton=impl == "triton")
    q = torch.randn(BATCH, NUM_KV_HEADS * 2, HEAD_DIM, generator=seeded).to(torch.bfloat16)
    with impl_context(impl, device):
        lens = seqs.lens.to(device)
        torch.library.opcheck(
            torch.ops.tq.decode.default,
            (
                q.to(device),
                *seqs.cache,
                seqs.block_table,
                lens,
                *seqs.consts,
                "4bit_nc",
                2,
                0.125,
                None,
                *seqs.rings,
                sinks,
            ),
        )


def _multi_token_case(seqs, tokens, group, gen, mask_kind):
    """Queries ``[B, Hk * group, T, D]`` (fp16) of each sequence's last ``T`` tokens and a mask
    (None, a bool one per token, or an additive one shared by the tokens)."""
    num_q_heads = NUM_KV_HEADS * group
    q = torch.randn(BATCH, num_q_heads, tokens, HEAD_DIM, generator=gen).half()
    if mask_kind == "bool":
        mask = torch.rand(BATCH, num_q_heads, tokens, CAPACITY - 2, generator=gen) > 0.3
        mask[:, :, :, 0] = True  # every query keeps one key
    elif mask_kind == "additive":
        mask = torch.randn(1, 1, CAPACITY, generator=gen)
    else:
        mask = None
    return q, mask


@pytest.mark.parametrize(
    "fmt_name, tokens, group, mask_kind",
    [(name, 2, 4, None) for name in sorted(FORMATS)]
    + [(name, 16, 1, "bool") for name in ("4bit_nc", "k8v4", "tq4_nc", "3bit_nc")]
    + [("4bit_nc", 4, 8, "additive"), ("k2v2_nc", 8, 4, "bool"), ("int8", 8, 1, None)],
)
def test_multi_token_decode(fmt_name, tokens, group, mask_kind, kernel_device, seeded):
    """Attention of each sequence's last T tokens (a speculative-decoding verify step) in one
    decode: equals float64 attention (within 1e-3) and the T one-token decodes of the same cache
    (within 2e-3) with token t seeing the positions below len - T + t + 1 without a mask, and
    below len where its mask allows with one (the mask alone decides, as for dense SDPA: a
    random mask per token is not made causal), at lengths whose last T tokens span pages and
    the window's ring (or lie in it), after appends and after rewrites."""
    seqs = Sequences(fmt_name, seeded, kernel_device)
    for n_new, starts in REWRITE_STEPS:
        seqs.append(n_new, starts, seeded, use_triton=False)
        lens = seqs.lens
        if int(lens.min()) < tokens:
            continue
        q, mask = _multi_token_case(seqs, tokens, group, seeded, mask_kind)
        k, v = _expected_kv(seqs)
        expected, one_token = [], []
        for t in range(tokens):
            visible = lens - (tokens - 1 - t) if mask is None else lens
            token_mask = mask if mask is None or mask.dim() == 3 else mask[:, :, t]
            expected.append(
                reference.attention(q[:, :, t], k, v, visible, HEAD_DIM**-0.5, token_mask)
            )
            one_token.append(seqs.decode(q[:, :, t], 2, token_mask, lens=visible))
        expected, one_token = torch.stack(expected, 2), torch.stack(one_token, 2)
        actual = seqs.decode(q, num_splits=2, mask=mask)
        assert actual.shape == q.shape and not actual.isnan().any()
        where = (n_new, starts)
        assert rel_error(actual, expected) < 1e-3, (where, rel_error(actual, expected))
        assert rel_error(actual, one_token) < 2e-3, (where, rel_error(actual, one_token))
