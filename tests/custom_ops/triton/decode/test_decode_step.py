"""A decode step with its own token (``custom_ops.triton.decode.decode_step``): attention over the
cache as it was and the token itself, exact, then the token appended (the token leaving the ring
by the split kernel's eviction, the step's own into the ring by the merge), byte for
byte as ``tq.store_window`` appends it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import triton_kernels
from helpers import random_kv, rel_error
from window_sequences import BATCH, HEAD_DIM, NUM_KV_HEADS, REWRITE_STEPS, STEPS, Sequences

from custom_ops import api, reference
from custom_ops.formats import FORMATS
from custom_ops.triton import decode as triton_decode
from custom_ops.triton.decode.codes import int8_keys
from custom_ops.triton.decode.plan import QueryMode, StepMode, step_supported

GROUP = 4
STEP_FORMATS = sorted(name for name, fmt in FORMATS.items() if not fmt.value.rotated)


def _own_tokens(gen, head_dim):
    """The next step's keys and values ``[B, Hk, 1, head_dim]`` as ``Sequences.append`` draws
    them from ``gen`` (the same generator state gives the same tokens)."""
    key, value = random_kv(BATCH, NUM_KV_HEADS, head_dim, torch.bfloat16, gen)
    key = key.reshape(BATCH, 1, NUM_KV_HEADS, head_dim).transpose(1, 2)
    value = value.reshape(BATCH, 1, NUM_KV_HEADS, head_dim).transpose(1, 2)
    return key, value


def _expected(seqs, q, key, value, starts):
    """float64 attention of ``q`` over the cache as it is (its ring run and sinks exact, the
    rest dequantized) and each sequence's own token at ``starts``, exact."""
    consts = [c.cpu() for c in seqs.consts]
    cache = type(seqs.cache)(*(p.cpu() for p in seqs.cache))
    lens = torch.tensor([max(s, 0) + 1 for s in starts], dtype=torch.int32)
    window = seqs.recent
    window = type(window)(*(t.cpu() if torch.is_tensor(t) else t for t in window))
    k, v = reference.dequantize(
        seqs.fmt,
        cache,
        seqs.block_table.cpu(),
        lens,
        *consts,
        seqs.capacity,
        torch.float64,
        window,
    )
    for b, start in enumerate(starts):
        k[b, :, max(start, 0)] = key[b, :, 0].double()
        v[b, :, max(start, 0)] = value[b, :, 0].double()
    return reference.attention(q.double(), k, v, lens, seqs.head_dim**-0.5)


def _checked_step(seqs, starts, gen, num_splits, split_config=None, merge_config=None):
    """One step through the Triton kernels on ``seqs``' device at ``starts``, checked: within
    1e-3 of float64 attention over the cache as it was and the step's token, the cache
    afterwards byte-equal to the window store's and the new lengths the store's. Returns the
    sequences after the step (the store's bookkeeping)."""
    q = torch.randn(BATCH, NUM_KV_HEADS * GROUP, seqs.head_dim, generator=gen).half()
    state = gen.get_state()
    key, value = _own_tokens(gen, seqs.head_dim)
    expected = _expected(seqs, q, key, value, starts)
    stored = copy.deepcopy(seqs)
    gen.set_state(state)
    stored.append(1, starts, gen, use_triton=False)
    d = seqs.device
    with triton_kernels(d):
        out, lens = triton_decode.decode_step(
            seqs.fmt,
            q.to(d),
            key.to(d),
            value.to(d),
            seqs.cache,
            seqs.block_table,
            torch.tensor(starts, dtype=torch.int32, device=d),
            seqs.consts.rotation,
            num_splits,
            seqs.head_dim**-0.5,
            seqs.recent,
            split_config=split_config,
            merge_config=merge_config,
        )
    live = torch.tensor([s >= 0 for s in starts])
    assert rel_error(out.cpu()[live], expected.float()[live]) < 1e-3, starts
    assert torch.equal(lens.cpu(), torch.where(live, stored.lens, 0))
    for mine, theirs in zip(
        (*seqs.cache, *seqs.rings), (*stored.cache, *stored.rings), strict=True
    ):
        assert torch.equal(mine.cpu(), theirs.cpu()), starts
    return stored  # the same bytes; its bookkeeping knows the step's token


@pytest.mark.parametrize("steps", ["appends", "rewrites"])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("fmt_name", STEP_FORMATS)
def test_decode_step_attends_then_appends(fmt_name, sinks, steps, kernel_device, seeded):
    """After chunks and single tokens (appends, or rewrites from below the length), each
    one-token step (the last one rolled back 3 positions under "rewrites") equals float64
    attention over the cache as it was and its own token; its cache afterwards equals the
    window store's, byte for byte, and the new lengths are the store's."""
    seqs = Sequences(fmt_name, seeded, kernel_device, sinks=sinks)
    schedule = STEPS if steps == "appends" else REWRITE_STEPS
    for i, (n_new, starts) in enumerate(schedule[:5]):
        seqs.append(n_new, starts, seeded, use_triton=False)
        lens = [int(x) for x in seqs.lens]
        if steps == "rewrites" and i == 4:  # sequence 0 rolls back 3 positions (stale ring)
            starts = (max(lens[0] - 3, 0), lens[1])
        else:  # sequence 1 skipped after single tokens
            starts = tuple(lens) if n_new > 1 else (lens[0], -1)
        seqs = _checked_step(seqs, starts, seeded, num_splits=4)


@pytest.mark.parametrize("steps", ["appends", "rewrites"])
def test_decode_step_evicts_in_the_last_split(steps, kernel_device, seeded):
    """With the eviction done first by the last split's program (the grid of a step whose own
    eviction programs would not fit one wave) instead of a program of its own, each step
    attends and appends as above, a rollback's stale ring included."""
    seqs = Sequences("4bit_nc", seeded, kernel_device, sinks=3)
    schedule = STEPS if steps == "appends" else REWRITE_STEPS
    config = triton_decode.SplitConfig(evict_in_split=True)
    for i, (n_new, starts) in enumerate(schedule[:5]):
        seqs.append(n_new, starts, seeded, use_triton=False)
        lens = [int(x) for x in seqs.lens]
        if steps == "rewrites" and i == 4:
            starts = (max(lens[0] - 3, 0), lens[1])
        else:
            starts = tuple(lens) if n_new > 1 else (lens[0], -1)
        seqs = _checked_step(seqs, starts, seeded, num_splits=4, split_config=config)


@pytest.mark.parametrize("block_m", [1, 2])
def test_decode_step_merges_in_column_blocks(block_m, kernel_device, seeded):
    """A step whose merge takes blocks of 32 of a row's 64 columns (so two programs per row:
    only the first block's fills the ring) attends and appends as the whole-row merge does."""
    seqs = Sequences("4bit_nc", seeded, kernel_device, sinks=3)
    for n_new, starts in STEPS[:4]:
        seqs.append(n_new, starts, seeded, use_triton=False)
        lens = [int(x) for x in seqs.lens]
        starts = tuple(lens) if n_new > 1 else (lens[0], -1)
        merge_config = triton_decode.MergeConfig(block_m, 2, 1, 32)
        seqs = _checked_step(seqs, starts, seeded, num_splits=4, merge_config=merge_config)


def test_step_rotates_its_query_in_a_streaming_split(kernel_device, seeded):
    """A step whose one split holds 256 tokens of capacity (8 tiles of 32) rotates its query in
    the split kernel, where a plain decode has it prepared (the plan's choice,
    ``STEP_ROTATE_HERE_MAX_TOKENS``): after a 150-token chunk (5 tiles of compressed tokens
    streamed past the 8-slot window), three steps, each checked as above."""
    seqs = Sequences("4bit_nc", seeded, kernel_device, pages_per_seq=64)
    q = torch.zeros(BATCH, NUM_KV_HEADS * GROUP, HEAD_DIM, dtype=torch.float16)
    args = (seqs.fmt, q.to(kernel_device), seqs.cache, seqs.block_table, 1, None, seqs.recent)
    plain = triton_decode.plan_for(*args)
    step = triton_decode.plan_for(*args, step=StepMode.APPEND)
    assert (plain.query, step.query, step.one_tile) == (
        QueryMode.PREPARED,
        QueryMode.ROTATED_HERE,
        False,
    )
    seqs.append(150, (0, 0), seeded, use_triton=False)
    for _ in range(3):
        seqs = _checked_step(seqs, tuple(int(x) for x in seqs.lens), seeded, num_splits=1)


@pytest.mark.parametrize("fmt_name", ["3bit_nc", "k3v4_nc"])
def test_step_at_head_dim_128_over_16_token_pages(fmt_name, kernel_device, seeded):
    """The shape real models decode at: D 128, 16-token pages, a 16-slot window and 4 sinks,
    where the split kernel takes 32-token tiles of two pages, each page's value codes as a tile
    of its own (3- and 4-bit values), and the 3-bit keys as int8 with one sign tile (plain
    Triton on the CPU): after a 40-token prefill, steps from two lengths (one sequence skipped
    once), each checked as above (attention within 1e-3 of float64, the cache afterwards the
    window store's, byte for byte)."""
    seqs = Sequences(
        fmt_name,
        seeded,
        kernel_device,
        window=16,
        sinks=4,
        head_dim=128,
        page_size=16,
        pages_per_seq=8,
    )
    q = torch.zeros(BATCH, NUM_KV_HEADS * GROUP, 128, dtype=torch.float16)
    args = (seqs.fmt, q.to(kernel_device), seqs.cache, seqs.block_table, 2, None, seqs.recent)
    launch = triton_decode.plan_for(*args, step=StepMode.APPEND).split.kwargs
    keys = launch["K"]
    assert launch["VALUE_PAGES"] and keys.LANE_SIGNS, launch
    assert int8_keys(keys.INT8_UNIT, keys.PC_PAD, launch["ONE_TILE"]), launch
    seqs.append(40, (0, 0), seeded, use_triton=False)
    seqs.append(3, (40, 40), seeded, use_triton=False)
    for starts in ((43, 43), (44, -1), (45, 44)):
        seqs = _checked_step(seqs, starts, seeded, num_splits=2)


@pytest.mark.gpu
@pytest.mark.parametrize("evict_in_split", [False, True])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4"])
def test_many_steps_interleave_the_eviction_and_the_splits(fmt_name, evict_in_split, seeded):
    """On a GPU, where the eviction runs beside the splits (in programs of its own, or first in
    the last split) and the merge may start before the split kernel ends (programmatic
    dependent launch): 55 one-token steps (one sequence skipping every fifth) through a ring of
    40 slots and 4 sinks read by both splits, several ring tiles each, past the point where
    every step sends a token to its page; each step checked as above."""
    seqs = Sequences(fmt_name, seeded, "cuda", window=40, sinks=4)
    seqs.append(11, (0, 0), seeded, use_triton=False)
    config = triton_decode.SplitConfig(evict_in_split=evict_in_split)
    for step in range(55):
        lens = [int(x) for x in seqs.lens]
        starts = (lens[0], -1 if step % 5 == 4 else lens[1])
        seqs = _checked_step(seqs, starts, seeded, num_splits=2, split_config=config)


@pytest.mark.gpu
def test_compiled_step_equals_the_eager_one(seeded):
    """Under torch.compile inductor launches the same two kernels itself (no programmatic
    dependent launch; the mutation analysis of each launch tells it what the kernel writes).
    Its output equals the eager op's within 1e-3 and its cache bytes are the same."""
    state = seeded.get_state()
    runs = []
    for compiled in (False, True):
        seeded.set_state(state)
        seqs, (q, key, value, starts) = _op_case("4bit_nc", 3, "cuda", seeded)
        step = torch.ops.tq.decode_step
        if compiled:
            torch._dynamo.reset()
            step = torch.compile(lambda *args: torch.ops.tq.decode_step(*args), fullgraph=True)
        with torch.no_grad():
            out, lens = step(*_op_args(seqs, q, key, value, starts, "4bit_nc", 3))
        runs.append((out.float().cpu(), lens.cpu(), [t.cpu() for t in (*seqs.cache, *seqs.rings)]))
    torch._dynamo.reset()
    (eager_out, eager_lens, eager_cache), (out, lens, cache) = runs
    assert rel_error(out[:1], eager_out[:1]) < 1e-3 and torch.equal(lens, eager_lens)
    for mine, theirs in zip(cache, eager_cache, strict=True):
        assert torch.equal(mine, theirs)


def test_step_needs_a_window_one_token_and_unrotated_values():
    fmt = FORMATS["4bit_nc"]
    assert step_supported(fmt, 8, 1)
    assert not step_supported(fmt, 0, 1)
    assert not step_supported(fmt, 8, 2)
    assert not step_supported(FORMATS["tq4_nc"], 8, 1)


def _op_case(fmt_name, sinks, device, gen):
    """Two sequences after an 11-token prefill and a few single tokens (the ring full), the
    step's query, tokens (last head dim contiguous) and start positions (one skipped) on
    ``device``."""
    seqs = Sequences(fmt_name, gen, device, sinks=sinks)
    seqs.append(11, (0, 0), gen, use_triton=False)
    seqs.append(1, (11, 11), gen, use_triton=False)
    q = torch.randn(BATCH, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(torch.bfloat16)
    key, value = (t.contiguous() for t in _own_tokens(gen, HEAD_DIM))
    starts = torch.tensor([12, -1], dtype=torch.int32)
    return seqs, [t.to(device) for t in (q, key, value, starts)]


def _op_args(seqs, q, key, value, starts, fmt_name, sinks, mask=None):
    return (
        q,
        key,
        value,
        *seqs.cache,
        seqs.block_table,
        starts,
        *seqs.consts,
        fmt_name,
        2,
        HEAD_DIM**-0.5,
        *seqs.rings,
        sinks,
        mask,
    )


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4"])
def test_op_reference_and_kernels_agree(fmt_name, sinks, kernel_device, seeded):
    """``tq.decode_step`` on the CPU (the reference: a one-token prefill before the store, then
    the store) and by the kernels: outputs within 2**-9 (an additive mask too), the same new
    lengths and the same cache bytes; the skipped sequence's row is zeros."""
    state = seeded.get_state()
    for mask_kind in (None, "additive"):
        outs, caches, lens = [], [], []
        for impl in ("reference", "triton"):  # (Triton's interpreter off a GPU)
            device = "cpu" if impl == "reference" else kernel_device
            seeded.set_state(state)
            seqs, (q, key, value, starts) = _op_case(fmt_name, sinks, device, seeded)
            mask = None
            if mask_kind:
                mask = torch.randn(1, 1, seqs.capacity, generator=seeded).to(device)
            with triton_kernels(device) if impl == "triton" else torch.no_grad():
                out, new_lens = torch.ops.tq.decode_step(
                    *_op_args(seqs, q, key, value, starts, fmt_name, sinks, mask)
                )
            outs.append(out.cpu().float())
            lens.append(new_lens.cpu())
            caches.append([t.cpu() for t in (*seqs.cache, *seqs.rings)])
        # bf16 outputs (a relative spacing of 2**-8 to 2**-7): values that the kernels' fp16
        # query and probabilities move across a rounding boundary differ by a whole ulp, a few
        # percent of the elements (1.2e-3 with the int8-grid levels' codes, 5e-4 before);
        # a 0.4% error in the scores gives 4e-3 to 6.5e-3 here without sinks
        assert rel_error(outs[1][:1], outs[0][:1]) < 2**-9
        assert not outs[0][1].any() and not outs[1][1].any()
        assert torch.equal(lens[0], torch.tensor([13, 0], dtype=torch.int32))
        assert torch.equal(lens[1], lens[0])
        for mine, theirs in zip(*caches, strict=True):
            assert torch.equal(mine, theirs)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_opcheck_decode_step(impl, kernel_device, seeded):
    device = "cpu" if impl == "reference" else kernel_device
    seqs, tensors = _op_case("4bit_nc", 3, device, seeded)
    with triton_kernels(device) if impl == "triton" else torch.no_grad():
        torch.library.opcheck(
            torch.ops.tq.decode_step.default, _op_args(seqs, *tensors, "4bit_nc", 3)
        )


def test_bad_input_is_refused_before_anything_is_written(seeded):
    """Each bad argument raises a ValueError or TypeError naming the op, the argument and what
    is allowed, and the cache stays byte for byte unchanged: a head dim that is not contiguous,
    a key of two tokens, a batch that q and
    key disagree on, a page id past the cache below the step's start (after a rollback: the
    pages the attention reads), a format with rotated values and rings without a window; the
    API refuses a window whose keys are stored centred."""
    seqs, (q, key, value, starts) = _op_case("4bit_nc", 0, "cpu", seeded)
    before = [t.clone() for t in (*seqs.cache, *seqs.rings, seqs.block_table)]
    strided = torch.randn(BATCH, NUM_KV_HEADS, 1, 2 * HEAD_DIM).to(torch.bfloat16)[..., ::2]
    two = torch.randn(BATCH, NUM_KV_HEADS, 2, HEAD_DIM).to(torch.bfloat16)
    cases = [
        (dict(key=strided, value=strided), ValueError, "key must have a contiguous head dim"),
        (dict(key=two, value=two), ValueError, "key must be \\[B, Hk, 1, D\\]"),
        (dict(q=q[:1]), ValueError, "q has 1 sequences but key has 2"),
    ]
    for change, error, message in cases:
        args = dict(q=q, key=key, value=value, starts=starts) | change
        with pytest.raises(error, match=f"decode_step: {message}"):
            torch.ops.tq.decode_step(*_op_args(seqs, *args.values(), "4bit_nc", 0))
    # a rollback to position 4: the attention reads the pages below it, whose first id is bad
    seqs.block_table[0, 0] = 10**6
    with pytest.raises(ValueError, match="decode_step: block_table\\[0, 0\\] = 1000000"):
        torch.ops.tq.decode_step(
            *_op_args(seqs, q, key, value, torch.tensor([4, -1], dtype=torch.int32), "4bit_nc", 0)
        )
    seqs.block_table[0, 0] = before[-1][0, 0]
    rotated, (q, key, value, starts) = _op_case("tq4_nc", 0, "cpu", seeded)
    with pytest.raises(ValueError, match="decode_step: .* tq4_nc's values are rotated"):
        torch.ops.tq.decode_step(*_op_args(rotated, q, key, value, starts, "tq4_nc", 0))
    sinks_only = Sequences("4bit_nc", seeded, "cpu", window=0, sinks=3)
    with pytest.raises(ValueError, match="decode_step: .* no recent window \\(window 0"):
        torch.ops.tq.decode_step(*_op_args(sinks_only, q, key, value, starts, "4bit_nc", 3))
    centred = Sequences("4bit_nc", seeded, "cpu", center=True)
    with pytest.raises(ValueError, match="decode_step: window.key_center is set"):
        api.decode_step(
            "4bit_nc",
            q,
            key,
            value,
            centred.cache,
            centred.recent,
            centred.block_table,
            starts,
            centred.consts,
        )
    for now, then in zip((*seqs.cache, *seqs.rings, seqs.block_table), before, strict=True):
        assert torch.equal(now, then)
