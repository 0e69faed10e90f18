"""The decode launch plan (``custom_ops/triton/decode/plan.py``): where the query is rotated,
splits of one tile, the split kernel's warps and the merge's configuration. The decode tests
run the kernels on these same cases (``tests/custom_ops/triton/decode/test_decode.py``)."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA
from helpers import clone_cache, decode_case, filled_cache, longer_table, rel_error, stale_tables

from custom_ops import api, reference
from custom_ops.formats import RecentWindow, get_format
from custom_ops.splits import (
    LONG_SPLIT_TOKENS,
    MANY_PROGRAMS_PER_SM,
    choose_num_splits,
    splits_in_one_wave,
)
from custom_ops.triton import decode as triton_decode
from custom_ops.triton.decode import MergeConfig, QueryMode
from custom_ops.triton.decode import plan as plan_module
from custom_ops.triton.decode.plan import TOKENS_PER_STEP, StepMode, evicts_in_last_split
from custom_ops.tuning import decode_tuning

HOPPER = CUDA and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "k2v4_nc", "tq4_nc"])
def test_query_rotated_in_split_or_prepared(fmt_name, kernel_device, seeded):
    """Rotated keys get their queries rotated inside the split kernel with short splits and by
    the preparation kernel with a block table of more capacity per split."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    long_table = longer_table(table)
    modes = [
        triton_decode.plan_for(fmt, q.to(kernel_device), cache, t, 2).query
        for t in (table, long_table)
    ]
    assert modes == [QueryMode.ROTATED_HERE, QueryMode.PREPARED]


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "int8", "fp8", "tq4_nc"])
def test_one_tile_splits(fmt_name, kernel_device, seeded):
    """The decode case's table gives splits of one tile (which read their block-table entries
    before they know the length); 80 more columns give longer splits."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    stale, long_stale = stale_tables(table, lens)
    one_tile = [
        triton_decode.plan_for(fmt, q.to(kernel_device), cache, t, 2).one_tile
        for t in (stale, long_stale)
    ]
    assert one_tile == [True, False]


@pytest.mark.parametrize("fmt_name, streaming_stages", [("4bit_nc", 3), ("k8v4", 2)])
def test_pipeline_stages_from_the_format_tuning(fmt_name, streaming_stages, kernel_device, seeded):
    """Streaming splits of one query token take the format's tuned pipeline stages
    (``DecodeTuning.stages``); splits of one tile and a verify step's many rows keep the
    default of 2, and a split config's stages override them."""
    assert decode_tuning(get_format(fmt_name)).stages == streaming_stages
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    q = q.to(kernel_device)
    stale, long_stale = stale_tables(table, lens)
    verify_q = q[:, :, None].expand(-1, -1, 8, -1)

    def stages(query, block_table, **config):
        split_config = triton_decode.SplitConfig(**config)
        plan = triton_decode.plan_for(fmt, query, cache, block_table, 2, split_config=split_config)
        return plan.split.kwargs["num_stages"]

    cases = [(q, long_stale), (q, stale), (verify_q, long_stale)]
    assert [stages(query, block_table) for query, block_table in cases] == [
        streaming_stages,
        plan_module.DEFAULT_STAGES,
        plan_module.DEFAULT_STAGES,
    ]
    overridden = [stages(query, block_table, num_stages=4) for query, block_table in cases]
    assert overridden == [4, 4, 4]


# the caches of the stage tests: 512 pages of 16 positions per sequence
_PAGES, _PAGE = 512, 16


def _stages(fmt, batch, num_splits, device, split_config=None):
    """The split kernel's stages for B x 8,192 paged positions (Hq 32, Hk 8, D 128, page 16)."""
    plan = plan_module.plan_decode(
        fmt,
        batch,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        page_size=_PAGE,
        max_pages=_PAGES,
        window=0,
        q_dtype=torch.bfloat16,
        ring_dtype=None,
        mask_kind=0,
        num_splits=num_splits,
        device=torch.device(device),
        fast=device == "cuda",
        split_config=split_config,
    )
    return plan.split.kwargs["num_stages"]


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="long splits take their stages on Hopper only")
@pytest.mark.parametrize(
    "fmt_name, long_split_stages",
    [("tqk5v3_nc", 5), ("k3v4_nc", 5), ("4bit_nc", 5), ("tqk4v2_nc", 3)],
)
def test_long_splits_of_several_waves_take_their_stages(fmt_name, long_split_stages):
    """Splits of at least LONG_SPLIT_TOKENS positions in a grid of at least
    MANY_PROGRAMS_PER_SM programs per SM (``splits.many_long_splits``) take the format's
    ``long_split_stages`` (0: its ``stages``); the same cache at a batch of 16, with its own
    split count (splits of 512 positions), keeps ``stages``, and a split config's stages
    override both."""
    fmt = get_format(fmt_name)
    tuning = decode_tuning(fmt)
    assert (tuning.long_split_stages or tuning.stages) == long_split_stages
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    # splits of exactly LONG_SPLIT_TOKENS positions
    num_splits = _PAGES * _PAGE // LONG_SPLIT_TOKENS
    batch = -(-MANY_PROGRAMS_PER_SM * sm_count // (8 * num_splits))  # the fewest programs
    assert [
        _stages(fmt, batch, num_splits, "cuda"),
        _stages(fmt, batch - 1, num_splits, "cuda"),
        _stages(fmt, 16, choose_num_splits(16, 8, _PAGES * _PAGE, sm_count), "cuda"),
        _stages(fmt, batch, num_splits, "cuda", triton_decode.SplitConfig(num_stages=2)),
    ] == [long_split_stages, tuning.stages, tuning.stages, 2]


def test_long_split_stages_not_under_the_interpreter():
    """The interpreter (and any device but a Hopper GPU) keeps a format's ``stages`` at any
    batch: ``long_split_stages`` were measured on an H200 only."""
    fmt = get_format("tqk5v3_nc")
    assert decode_tuning(fmt).long_split_stages == 5
    assert _stages(fmt, 1024, 4, "cpu") == decode_tuning(fmt).stages


@pytest.mark.parametrize(
    "fmt_name, page_size, value_pages",
    [("4bit_nc", 16, True), ("4bit_nc", 8, False), ("4bit_nc", 32, False), ("k8v4", 8, False)],
)
def test_value_pages_only_for_two_pages_of_16_tokens(
    fmt_name, page_size, value_pages, kernel_device, seeded
):
    """Each page's value codes are a tile of their own only where a 32-token tile is two pages:
    not one page of 32, nor pages of 8 (four per tile; k8v4's 16-token tiles, two per tile,
    would multiply with K = 8, below the tensor cores' 16)."""
    fmt = get_format(fmt_name)
    cache = fmt.allocate(2 * 1024 // page_size, 2, page_size, 128)
    table = torch.arange(2 * 1024 // page_size, dtype=torch.int32).reshape(2, -1)
    q = torch.randn(2, 8, 128, generator=seeded).half().to(kernel_device)
    plan = triton_decode.plan_for(fmt, q, cache, table.to(kernel_device), 2)
    assert not plan.one_tile
    assert plan.split.kwargs["VALUE_PAGES"] == value_pages


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "3bit_nc", "tq4_nc", "int8"])
def test_split_warps_and_merge_configs(fmt_name, seeded):
    """Grids of at most two programs per SM get two-warp split programs, larger ones one warp;
    merges of one row whose partials fit one warp get one warp, the others four warps and
    chunks of splits; a few rows of values that are not rotated are merged in blocks of
    columns."""
    sm_count = torch.cuda.get_device_properties("cuda").multi_processor_count
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 128, 4, seeded)
    args = (fmt, q.cuda(), clone_cache(cache, "cuda"), table.cuda(), lens.cuda())
    # B = 3 sequences x Hk = 2 kv-heads x splits: two programs per SM, then one more
    plans = [triton_decode.plan_for(*args[:4], n) for n in (sm_count // 3, sm_count // 3 + 1)]
    assert [plan.split.kwargs["num_warps"] for plan in plans] == [2, 1]
    one_row = [
        triton_decode.plan_for(fmt, q[:1].cuda(), *args[2:4], n).merge_config for n in (32, 64)
    ]
    if fmt.value.rotated:
        assert one_row == [MergeConfig(1, 32, 1), MergeConfig(1, 64, 4)]
    else:  # 8 rows, far fewer than the SMs: columns in blocks of 32, which one warp holds
        assert one_row == [MergeConfig(1, 32, 1, 32), MergeConfig(1, 64, 1, 32)]


@pytest.mark.parametrize("tokens", [4, 8, 16])
def test_verify_step_warps_and_register_caps(tokens, kernel_device, seeded):
    """A verify step's query rows (GQA 4 x T tokens, padded) choose the split kernel's warps and
    register cap, whatever the grid, for splits of one tile and longer ones alike: one warp at
    192 registers for 16 rows (no spills), one at 255 for 32, eight for 64 with the usual cap
    (128 for long splits, none for one tile); an override of either is kept."""
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, seeded)
    q = q[:, :, None].expand(-1, -1, tokens, -1).to(kernel_device)
    warps, cap = {4: (1, 192), 8: (1, 255), 16: (8, None)}[tokens]
    for block_table, usual_cap in ((table, None), (longer_table(table), 128)):
        plan = triton_decode.plan_for(fmt, q, cache, block_table, 2)
        launch = plan.split.kwargs
        assert plan.one_tile == (usual_cap is None)
        assert (launch["num_warps"], launch.get("maxnreg"), launch["SUBTILES"]) == (
            warps,
            cap or usual_cap,
            1,
        )
    overridden = triton_decode.plan_for(
        fmt,
        q,
        cache,
        longer_table(table),
        2,
        split_config=(triton_decode.SplitConfig(num_warps=4, max_registers=96)),
    ).split.kwargs
    assert (overridden["num_warps"], overridden["maxnreg"]) == (4, 96)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [4, 8])
def test_verify_step_takes_one_wave_of_splits(tokens, seeded):
    """A verify step's programs (16 or 32 query rows: 192 or 255 registers, 8 per SM) take at
    most the splits resident on the GPU at once, fewer than the count asked for, in every
    kernel of the plan (the split grid and constexprs, the merge, the partials); and over
    sequences longer than that many one-tile splits (so that a split kernel still dividing the
    positions by the count asked for would leave some unread) attention equals float64's
    (1e-3)."""
    sm_count = torch.cuda.get_device_properties("cuda").multi_processor_count
    fmt = get_format("4bit_nc")
    consts = api.make_constants(fmt, 64, seed=3)
    requested, page_size, pages = 512, 16, 512  # 8192 positions per sequence
    cache = filled_cache(fmt, 3 * pages, 2, page_size, 64, consts, seeded)
    table = torch.randperm(3 * pages, generator=seeded).to(torch.int32).reshape(3, pages)
    q = torch.randn(3, 8, tokens, 64, generator=seeded).half()
    gpu_cache = clone_cache(cache, "cuda")
    plan = triton_decode.plan_for(fmt, q.cuda(), gpu_cache, table.cuda(), requested)
    launch = plan.split.kwargs
    # 3 sequences x 2 kv-heads per split
    fitting = splits_in_one_wave(requested, 6, launch["num_warps"], launch["maxnreg"], sm_count)
    assert plan.num_splits == plan.split.grid[0] == launch["NUM_SPLITS"] == fitting < requested
    assert plan.merge.kwargs["NUM_SPLITS"] == plan.num_partials == plan.num_splits
    one_tile_each = fitting * TOKENS_PER_STEP
    assert one_tile_each < pages * page_size, (fitting, sm_count)
    lens = torch.tensor(
        [pages * page_size, one_tile_each + 37, one_tile_each // 2], dtype=torch.int32
    )
    expected = reference.decode(fmt, q, cache, table, lens, *consts, 64**-0.5, torch.float64)
    gpu_consts = api.KVConstants(*(c.cuda() for c in consts))
    actual = api.decode(
        fmt, q.cuda(), gpu_cache, table.cuda(), lens.cuda(), gpu_consts, num_splits=requested
    )
    assert rel_error(actual.cpu(), expected) < 1e-3


@pytest.mark.parametrize(
    "fmt_name, block_d", [("tq4_nc", 32), ("4bit_nc", 48), ("4bit_nc", 128), ("4bit_nc", -32)]
)
def test_merge_columns_are_checked(fmt_name, block_d, kernel_device, seeded):
    """A merge configuration's column block must be a positive divisor of the padded head dim
    (64 here), and rotated values (a butterfly over each whole row) take none."""
    fmt, consts, cache, table, lens, q = decode_case(fmt_name, 64, 4, seeded)
    with pytest.raises(ValueError) as error:
        triton_decode.plan_for(
            fmt, q.to(kernel_device), cache, table, 2, merge_config=MergeConfig(1, 2, 1, block_d)
        )
    assert str(error.value) == (
        "merge_config.block_d must be None or a positive divisor of the padded head dim 64, and "
        f"None for rotated values ({fmt_name}: {fmt.value.rotated}), got {block_d}"
    )


def test_merge_chunk_must_divide_the_split_count(kernel_device, seeded):
    """A merge configuration whose chunk of partials does not divide the plan's split count
    (it would read the ring's partials or the next row's) is refused by the plan."""
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, seeded)
    with pytest.raises(ValueError) as error:
        triton_decode.plan_for(
            fmt, q.to(kernel_device), cache, table, 2, merge_config=MergeConfig(1, 4, 1)
        )
    assert str(error.value) == (
        "merge_config.split_chunk must divide the plan's split count 2, got 4"
    )


@pytest.mark.parametrize(
    "num_splits, sequence_heads, expected",
    [
        (16, 128, True),  # 16 x 4096 at Hk 8: 2,176 programs with the evictions' > 2,112
        (32, 64, False),  # 8 x 4096: 2,112, exactly one wave
        (64, 32, False),  # 4 x 4096: 2,080
        (128, 8, False),  # one sequence: 1,032
    ],
)
def test_step_evicts_in_the_last_split_past_one_wave(num_splits, sequence_heads, expected):
    """On 132 SMs (an H200) at one warp of 128 registers (16 programs per SM, 2,112 at once) a
    step's eviction has programs of its own unless they take the grid past one wave."""
    assert evicts_in_last_split(num_splits, sequence_heads, 1, 128, 132) == expected


def _step_case(device, seeded):
    """A decode case (2 splits, 3 sequences x 2 kv-heads) with rings on ``device``: its step's
    plan arguments."""
    fmt, consts, cache, table, lens, q = decode_case("4bit_nc", 64, 4, seeded)
    rings = torch.zeros(3, 2, 8, 64, dtype=torch.float16, device=device)
    positions = torch.full((3, 2, 8), -1, dtype=torch.int32, device=device)
    return fmt, q.to(device), cache, table, 2, None, RecentWindow(rings, rings, positions)


@pytest.mark.parametrize(
    "columns, step_query", [(128, QueryMode.ROTATED_HERE), (129, QueryMode.PREPARED)]
)
def test_step_rotates_its_query_in_longer_splits(columns, step_query, kernel_device, seeded):
    """A decode step rotates its query in the split kernel up to 256 tokens of capacity per
    split (its chain then has no preparation launch), a plain decode only up to 128: at 2
    splits of 4-token pages, 128 block-table columns are 256 tokens per split, 129 more."""
    fmt, q, cache, table, splits, mask, window = _step_case(kernel_device, seeded)
    args = (fmt, q, cache, table[:, :1].expand(-1, columns).contiguous(), splits, mask, window)
    plain = triton_decode.plan_for(*args).query
    step = triton_decode.plan_for(*args, step=StepMode.APPEND).query
    assert (plain, step) == (QueryMode.PREPARED, step_query)


@pytest.mark.gpu
@pytest.mark.parametrize("resident, in_split", [(17, True), (18, False)])
def test_step_plan_evicts_in_the_last_split_past_the_resident_programs(
    resident, in_split, monkeypatch, seeded
):
    """On a GPU the plan decides by the resident programs it counts: (2 + 1) x 6 = 18 programs
    fit 18, not 17, so there the eviction moves into the last split (the GPU's count patched:
    this small grid fits any GPU)."""
    monkeypatch.setattr(plan_module, "resident_programs", lambda *args: resident)
    plan_module.plan_decode.cache_clear()
    try:
        plan = triton_decode.plan_for(*_step_case("cuda", seeded), step=StepMode.APPEND)
    finally:
        plan_module.plan_decode.cache_clear()
    assert plan.split.grid == (2 + (not in_split), 2, 3)
    assert plan.split.kwargs["EVICT_SPLIT"] == 2 - in_split


@pytest.mark.parametrize("evict_in_split", [None, False, True])
def test_step_grid_has_the_eviction_programs_or_not(evict_in_split, kernel_device, seeded):
    """A decode step's split grid has one more program per sequence-head for the eviction
    (``EVICT_SPLIT`` past the splits) or, in the last split, none more; off a GPU and on one
    at this small grid the plan's choice is programs of their own. A plain decode refuses the
    override."""
    case = _step_case(kernel_device, seeded)
    config = triton_decode.SplitConfig(evict_in_split=evict_in_split)
    plan = triton_decode.plan_for(*case, split_config=config, step=StepMode.APPEND)
    in_split = bool(evict_in_split)
    assert plan.split.grid == (2 + (not in_split), 2, 3)
    assert plan.split.kwargs["EVICT_SPLIT"] == 2 - in_split
    if evict_in_split is not None:
        with pytest.raises(ValueError) as error:
            triton_decode.plan_for(*case, split_config=config)
        assert str(error.value) == (
            "split_config.evict_in_split is for decode steps (tq.decode_step) only, got "
            f"{evict_in_split} for a decode without a step"
        )
