"""benchmarks/fixed_cost.py: the line fitted through the decode times, and the floors' kernels
(run by Triton's interpreter on a CPU, by the GPU where there is one)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import fixed_cost  # noqa: E402

from custom_ops.formats import get_format  # noqa: E402
from custom_ops.triton import decode  # noqa: E402
from custom_ops.triton.decode import QueryMode  # noqa: E402


def test_the_fit_takes_the_streaming_points_only():
    """``fit_line``: the intercept and slope of the points from ``fit_from`` tiles on, exactly
    for points on a line; the short ones (another plan) left out."""
    rows = [dict(tiles=t, us=11.5 + 2.75 * t) for t in (8, 16, 32, 64)]
    rows += [dict(tiles=1, us=40.0), dict(tiles=4, us=3.0)]
    a, b = fixed_cost.fit_line(rows, 8)
    assert a == pytest.approx(11.5, abs=1e-9) and b == pytest.approx(2.75, abs=1e-9)
    a_all, _ = fixed_cost.fit_line(rows, 1)
    assert abs(a_all - 11.5) > 1.0


def test_the_streaming_share_counts_one_tile_per_program():
    """``streaming_share``: 2,048 programs' 32-token tiles of the format's bytes per token-head
    over the slope, against the copy bandwidth (4bit_nc at 2.63 us per tile-step and 4.28 TB/s:
    session 47's 78%)."""
    share = fixed_cost.streaming_share("4bit_nc", 2.63, 4.28e12)
    step_bytes = 2048 * 32 * get_format("4bit_nc").bytes_per_token_head(128)
    assert share == pytest.approx(step_bytes / 2.63e-6 / 4.28e12, rel=1e-12)
    assert 0.77 < share < 0.79


@pytest.mark.parametrize("name", ["4bit_nc", "k8v4"])
def test_the_decode_shape_is_2048_programs_of_the_given_tiles(name):
    """B = 16 x 16 splits x Hk 8 at ``tiles`` x 32 tokens per split: the plan keeps the 16
    splits (2,048 programs), one tile is the one-tile path and from 8 tiles on (where the fit
    starts) the splits stream with the query prepared by its own launch (rotated keys) or
    scaled in the split kernel (8-bit keys), the same plan at every count the fit takes."""
    fmt = get_format(name)
    plans = {}
    for tiles in (1, 4, 8, 16, 64):
        seq = fixed_cost.SPLITS * tiles * fixed_cost.BLOCK_N
        pages = fixed_cost.BATCH * seq // 16
        cache = fmt.allocate(pages, 8, 16, 128, "meta")
        q = torch.empty(fixed_cost.BATCH, 32, 128, dtype=torch.bfloat16, device="meta")
        table = torch.empty(fixed_cost.BATCH, seq // 16, dtype=torch.int32, device="meta")
        plan = decode.plan_for(fmt, q, cache, table, fixed_cost.SPLITS, fast=True)
        assert plan.num_splits == fixed_cost.SPLITS
        plans[tiles] = (plan.one_tile, plan.query)
    assert fixed_cost.PROGRAMS == 2048
    streaming = QueryMode.PREPARED if fmt.key.rotated else QueryMode.SCALED
    assert plans[1][0]
    assert plans[8] == plans[16] == plans[64] == (False, streaming)


def test_a_fit_of_fewer_than_two_counts_is_refused_before_any_work():
    """``--fit-from`` past all but one of ``--tiles``: an argument error naming both, before the
    script asks for a GPU."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fixed_cost.py"), "--tiles", "1", "64"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 2
    assert "--fit-from 8 leaves fewer than 2 of --tiles [1, 64]" in result.stderr


def test_the_floor_kernels_store_what_they_read(kernel_device):
    """``_store_one`` writes each program's index (on a GPU also with the dependent-launch
    wait, which the interpreter does not run); ``_load_chain`` sums the row that the length's
    table entry names, for each program."""
    device = kernel_device
    programs, pages, row = 8, 4, 64
    for pdl in (False, True) if device == "cuda" else (False,):
        out = torch.full((programs,), -1, dtype=torch.int32, device=device)
        fixed_cost._store_one[(programs,)](out, PDL=pdl, num_warps=1, launch_pdl=pdl)
        assert out.tolist() == list(range(programs))
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 1000, (programs,), generator=gen, dtype=torch.int32)
    table = torch.randint(0, programs, (programs, pages), generator=gen, dtype=torch.int32)
    data = torch.randint(-1000, 1000, (programs, row // 4), generator=gen, dtype=torch.int32)
    fixed_cost._load_chain[(programs,)](
        lens.to(device), table.to(device), data.to(device), out, PAGES=pages, ROW=row, num_warps=1
    )
    pids = torch.arange(programs)
    expected = data[table[pids, lens.long() % pages].long()].sum(dim=1)
    assert out.cpu().tolist() == expected.tolist()


def test_both_merges_sum_each_groups_partials(kernel_device):
    """The merge floor's two ways give the same sums: ``_write_partial`` then
    ``_merge_partials`` (on a GPU also under programmatic dependent launch), and
    ``_write_partial_counted``, whose last program of each group merges and sets the group's
    count back to 0, so that a second call merges again. Partials and outputs are poisoned
    before every launch; two chunks of 4 partials per group. A launch one program short leaves
    the first group unmerged and its count at 7 (the interpreter runs programs in order, so
    this is what catches a wrong group or an early merge on a CPU; the barrier and the
    acquire-release order only a GPU run can show)."""
    device = kernel_device
    splits, partial, groups = 8, 8, 3
    programs = splits * groups
    pids = torch.arange(programs, dtype=torch.float32)[:, None]
    written = pids + torch.arange(partial, dtype=torch.float32)[None, :]
    expected = written.view(groups, splits, partial).sum(dim=1)
    partials = torch.empty(programs, partial, device=device)

    def poisoned():
        partials.fill_(float("nan"))
        return torch.full((groups, partial), float("nan"), device=device)

    for pdl in (False, True) if device == "cuda" else (False,):
        out = poisoned()
        fixed_cost._write_partial[(programs,)](partials, PARTIAL=partial, PDL=pdl, num_warps=1)
        fixed_cost._merge_partials[(groups,)](
            partials, out, SPLITS=splits, PARTIAL=partial, PDL=pdl, num_warps=1, launch_pdl=pdl
        )
        assert torch.equal(out.cpu(), expected)
    counts = torch.zeros(groups, dtype=torch.int32, device=device)
    for _ in range(2):
        out = poisoned()
        fixed_cost._write_partial_counted[(programs,)](
            partials, counts, out, SPLITS=splits, PARTIAL=partial, num_warps=1
        )
        assert torch.equal(out.cpu(), expected)
        assert counts.tolist() == [0] * groups
    out = poisoned()
    fixed_cost._write_partial_counted[(splits - 1,)](
        partials, counts, out, SPLITS=splits, PARTIAL=partial, num_warps=1
    )
    assert out.isnan().all()
    assert counts.tolist() == [splits - 1] + [0] * (groups - 1)
