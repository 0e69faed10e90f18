"""tq.store_window (``custom_ops/triton/store_window.py`` on CUDA): the kernel against the
reference, tokens quantized exactly once as they leave the window, opcheck, bad input."""

from __future__ import annotations

import expecttest
import pytest
import torch
from conftest import triton_kernels
from helpers import (
    IMPLS,
    assert_codes_match,
    assert_same_cache,
    clone_cache,
    impl_context,
    impl_device,
    poisoned_cache,
    random_kv,
    rel_error,
    slot_rows,
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
from custom_ops.formats import FORMATS, RecentWindow, get_format
from custom_ops.triton import store_window as triton_store_window

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: exp2(-inf)


@pytest.mark.parametrize("steps", ["appends", "rewrites"])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_store_window_kernel_matches_reference(fmt_name, steps, kernel_device, seeded):
    """After every append (prefill longer than the window, skipped sequences, chunks crossing
    the boundary, single tokens) and every rewrite from below the length, the kernel's cache
    equals the reference's (codes up to a tie, meta up to a rounding) and its rings and their
    positions are bit-identical."""
    expected = Sequences(fmt_name, torch.Generator().manual_seed(7))
    actual = Sequences(fmt_name, torch.Generator().manual_seed(7), kernel_device)
    for n_new, starts in STEPS if steps == "appends" else REWRITE_STEPS:
        expected.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=False)
        actual.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=True)
        _assert_same_window_state(expected, actual)


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


@pytest.mark.parametrize("window, sinks", [(WINDOW, 3), (2, 5), (0, 3)])
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "tq4_nc"])
def test_sinks_stay_exact_and_out_of_the_pages(fmt_name, window, sinks, kernel_device, seeded):
    """With sinks (beside the window, more of them than window slots, without a window): after
    every rewrite step the kernel's cache and rings equal the reference's, the sink slots ``W +
    p`` hold the first ``min(len, sinks)`` tokens bit for bit with their positions, and no
    position below ``sinks`` ever reaches a page (its slots keep their poison)."""
    expected = Sequences(fmt_name, torch.Generator().manual_seed(7), window=window, sinks=sinks)
    actual = Sequences(
        fmt_name, torch.Generator().manual_seed(7), kernel_device, window=window, sinks=sinks
    )
    poison = torch.cat(slot_rows(expected.cache), dim=1)
    sink_slots = torch.cat([expected.slots_of(b, torch.arange(sinks)) for b in range(BATCH)])
    for n_new, starts in REWRITE_STEPS:
        expected.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=False)
        actual.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=True)
        assert_same_cache(expected.fmt, expected.cache, actual.cache)
        for a, e in zip(actual.rings, expected.rings, strict=True):
            assert torch.equal(a.cpu(), e), (n_new, starts)
        for b in range(BATCH):
            first = torch.arange(min(sinks, int(expected.lens[b])))
            held = expected.k_window[b][:, window + first]
            assert torch.equal(held, expected.keys[b][:, first]), (b, n_new, starts)
            assert bool((expected.window_pos[b][:, window + first] == first).all())
        rows = torch.cat(slot_rows(actual.cache), dim=1)[sink_slots]
        assert torch.equal(rows, poison[sink_slots]), "a sink was quantized into its page"


def _centred_ring_matches(actual, expected):
    """Rings of centred keys agree to one bf16 rounding step (the kernel's mean sums in
    another order, so ``key - mu`` may round the other way)."""
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-8, atol=1e-6)


def _assert_same_window_state(expected, actual):
    """The kernels' ``actual`` :class:`Sequences` hold what the reference's ``expected`` do:
    the centres to float32 rounding (when centred), codes up to a tie and meta up to a rounding,
    ring keys bit for bit (centred: to one bf16 step), ring values and slot positions bit for
    bit."""
    if expected.key_center is not None:
        torch.testing.assert_close(
            actual.key_center.cpu(), expected.key_center, rtol=1e-6, atol=1e-6
        )
    assert_same_cache(expected.fmt, expected.cache, actual.cache)
    if expected.key_center is None:
        assert torch.equal(actual.k_window.cpu(), expected.k_window)
    else:
        _centred_ring_matches(actual.k_window.cpu(), expected.k_window)
    assert torch.equal(actual.v_window.cpu(), expected.v_window)
    assert torch.equal(actual.window_pos.cpu(), expected.window_pos)


# One token at a time (a decode loop: the window store sets the centres itself): a prefill of
# 5, appends to 16 (the centres set on the way), sequence 0 rolled back to position 2 (below the
# sinks of the tests: its centre is set again) and appended to again, sequence 1 skipped.
TOKEN_STEPS = (
    [(5, (0, 0))] + [(1, (p, p)) for p in range(5, 16)] + [(1, (p, -1)) for p in range(2, 14)]
)
_CENTRED_STEPS = {"rewrites": REWRITE_STEPS, "appends": STEPS, "tokens": TOKEN_STEPS}


# fp8 keys without centring and Lloyd-Max keys with it: the launch shape is the same code for
# every format (4bit_nc's two cases took 90 of the 180 s these took in CI's interpreter)
@pytest.mark.parametrize("fmt_name, center", [("k8v4", False), ("tq3_nc", True)])
def test_append_launch_matches_reference(fmt_name, center, kernel_device, seeded):
    """The GPU's launch shape of appends (``APPEND_LAUNCH``: one row per one-warp program; the
    interpreter's default is 16 rows on 4 warps) over the appends and rewrites, with and
    without centring (single tokens set the centres inline): the reference's cache, rings and
    centres."""
    sinks = 3 if center else 0
    expected = Sequences(fmt_name, torch.Generator().manual_seed(7), sinks=sinks, center=center)
    actual = Sequences(
        fmt_name, torch.Generator().manual_seed(7), kernel_device, sinks=sinks, center=center
    )
    for n_new, starts in REWRITE_STEPS + _CENTRED_STEPS["tokens"]:
        expected.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=False)
        actual.append(
            n_new,
            starts,
            torch.Generator().manual_seed(n_new),
            use_triton=True,
            launch=triton_store_window.APPEND_LAUNCH,
        )
        _assert_same_window_state(expected, actual)


@pytest.mark.parametrize(
    "window, sinks, steps",
    [
        (WINDOW, 3, "rewrites"),
        (WINDOW, 3, "appends"),
        (WINDOW, 3, "tokens"),
        (WINDOW, 0, "appends"),
        (WINDOW, 0, "tokens"),
        (2, 5, "rewrites"),
        (2, 5, "tokens"),
        (0, 3, "rewrites"),
        (0, 3, "tokens"),
    ],
)
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq3_nc", "k8v4"])
def test_centred_store_matches_reference(fmt_name, window, sinks, steps, kernel_device, seeded):
    """With key centering, after every step of appends, rewrites (a restart at 0 included) and
    single tokens (centres set by the window store itself, and set again after a rollback
    below the sinks), the kernels' centres, cache and rings equal the reference's: centres to
    float32 rounding, codes up to a tie, ring keys to one bf16 step, ring values and positions
    bit for bit."""
    expected = Sequences(
        fmt_name, torch.Generator().manual_seed(7), window=window, sinks=sinks, center=True
    )
    actual = Sequences(
        fmt_name,
        torch.Generator().manual_seed(7),
        kernel_device,
        window=window,
        sinks=sinks,
        center=True,
    )
    for n_new, starts in _CENTRED_STEPS[steps]:
        expected.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=False)
        actual.append(n_new, starts, torch.Generator().manual_seed(n_new), use_triton=True)
        _assert_same_window_state(expected, actual)
    assert bool((expected.key_center != 0).any()), "no centre was set"


@pytest.mark.parametrize("use_triton", [False, True])
def test_centre_is_the_mean_of_the_first_window(use_triton, kernel_device, seeded):
    """The centre of a sequence-head is 0 until its first position leaves the ring, then the
    mean of the keys of positions ``[sinks, sinks + W)`` for good (later appends keep it); the
    ring holds every key minus it (one bf16 rounding) and ``tq.dequantize`` gives the keys back
    (exact ones from the ring to that rounding). A restart at position 0 resets it to 0."""
    sinks = 3
    seqs = Sequences("4bit_nc", seeded, kernel_device, sinks=sinks, center=True)
    for n_new, starts in STEPS:
        seqs.append(n_new, starts, seeded, use_triton=use_triton)
        center = seqs.key_center.cpu()
        for b in range(BATCH):
            length = int(seqs.lens[b])
            sample = seqs.keys[b, :, sinks : sinks + WINDOW].float().mean(dim=1)
            want = sample if length > sinks + WINDOW else torch.zeros_like(sample)
            torch.testing.assert_close(center[b], want, rtol=1e-6, atol=1e-6)
            held = torch.arange(min(max(sinks, length - WINDOW), length), length)
            first = torch.arange(min(sinks, length))
            slots = torch.cat([WINDOW + first, held % WINDOW])
            ring = seqs.k_window.cpu()[b][:, slots].float()
            exact = seqs.keys[b][:, torch.cat([first, held])].float()
            centred = (exact - center[b][:, None]).bfloat16().float()
            torch.testing.assert_close(ring, centred, rtol=2**-8, atol=1e-6)
    assert bool((center != 0).all()), "both sequences passed sinks + W: centred"
    consts = api.KVConstants(*(c.cpu() for c in seqs.consts))
    k, _ = reference.dequantize(
        seqs.fmt,
        clone_cache(seqs.cache),
        seqs.block_table.cpu(),
        seqs.lens,
        *consts,
        seqs.capacity,
        torch.float32,
        window_on(seqs.recent, "cpu"),
    )
    exact = seqs.exact(torch.arange(seqs.capacity))[:, None, :, None]
    ring_error = torch.where(exact, k - seqs.keys.float(), 0).abs()
    assert float(ring_error.max()) <= 2**-7 * float(seqs.keys.float().abs().max())
    paged = ~exact & (torch.arange(seqs.capacity) < seqs.lens[:, None])[:, None, :, None]
    assert rel_error(k[paged.expand_as(k)], seqs.keys.float()[paged.expand_as(k)]) < 0.15
    seqs.append(2, (0, -1), seeded, use_triton=use_triton)  # sequence 0 restarts
    assert bool((seqs.key_center.cpu()[0] == 0).all()) and torch.equal(
        seqs.key_center.cpu()[1], center[1]
    )


@pytest.mark.parametrize("use_triton", [False, True])
def test_nan_key_in_the_centre_lasts_until_a_restart(use_triton, kernel_device, seeded):
    """A NaN key among the positions that set a centre makes the centre, and so every key the
    sequence-head stores after, NaN, on the CPU and in the kernels alike; a write from position 0
    resets it, and the new sequence's keys are finite again."""
    seqs = Sequences("4bit_nc", seeded, kernel_device, sinks=3, center=True)
    seqs.append(5, (0, 0), seeded, use_triton=use_triton)
    seqs.k_window[0, 1, 4] = float("nan")  # position 4 (a sample position) of sequence 0, head 1
    seqs.append(8, (5, 5), seeded, use_triton=use_triton)  # length 13 > sinks + W: centres set
    center = seqs.key_center.cpu()
    assert bool(center[0, 1].isnan().all()) and bool(center.isfinite()[[0, 1, 1], [0, 0, 1]].all())
    assert bool(seqs.k_window.cpu()[0, 1, :WINDOW].isnan().all())
    seqs.append(2, (0, -1), seeded, use_triton=use_triton)
    assert bool((seqs.key_center.cpu()[0] == 0).all())
    assert bool(seqs.k_window.cpu()[0, :, WINDOW : WINDOW + 2].isfinite().all())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("center", [False, True])
def test_opcheck_store_window(impl, center, kernel_device, seeded):
    """opcheck (schema, fake tensors, aot dispatch) for store_window; with key centering, a
    write that sets the centres (the first positions leave the ring)."""
    device = impl_device(impl, kernel_device)
    seqs = Sequences("4bit_nc", seeded, device, center=center)
    seqs.append(5 if center else 11, (0, 0), seeded, use_triton=impl == "triton")
    n_new = 6 if center else 2
    key, value = random_kv(BATCH * n_new, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, seeded)
    key = key.reshape(BATCH, NUM_KV_HEADS, n_new, HEAD_DIM).to(device)
    value = value.reshape(BATCH, NUM_KV_HEADS, n_new, HEAD_DIM).to(device)
    start = seqs.lens.to(device)
    rings = (seqs.k_window, seqs.v_window, seqs.window_pos)
    centring = (0, seqs.key_center) if center else ()
    with impl_context(impl, device):
        torch.library.opcheck(
            torch.ops.tq.store_window.default,
            (
                key,
                value,
                *seqs.cache,
                *rings,
                seqs.block_table,
                start,
                *seqs.consts,
                "4bit_nc",
                *centring,
            ),
        )


class TestStoreWindowBadInput(expecttest.TestCase):
    def test_errors_leave_cache_and_rings_untouched(self):
        """Bad input raises a clear error before any kernel runs; cache and rings unchanged."""
        gen = torch.Generator().manual_seed(3)
        seqs = Sequences("4bit_nc", gen)
        seqs.append(11, (0, 0), gen, use_triton=False)  # 3 tokens left the window
        key = torch.randn(BATCH, NUM_KV_HEADS, 2, HEAD_DIM).to(torch.bfloat16)
        start = seqs.lens.clone()
        rings = (seqs.k_window, seqs.v_window, seqs.window_pos)
        snapshot = [t.clone() for t in (*seqs.cache, *rings)]

        center = torch.zeros(BATCH, NUM_KV_HEADS, HEAD_DIM)

        def call(
            key=key,
            value=key,
            rings=rings,
            table=seqs.block_table,
            start=start,
            sinks=0,
            center=None,
        ):
            torch.ops.tq.store_window(
                key,
                value,
                *seqs.cache,
                *rings,
                table,
                start,
                *seqs.consts,
                "4bit_nc",
                sinks,
                center,
            )

        cases = {
            "float32 tokens": dict(key=key.float(), value=key.float()),
            "3-D tokens": dict(key=key[:, :, 0], value=key[:, :, 0]),
            "ring of another head dim": dict(
                rings=(rings[0][..., :32], rings[1][..., :32], rings[2])
            ),
            "float32 ring": dict(rings=(rings[0].float(), rings[1].float(), rings[2])),
            "ring dtypes differ": dict(rings=(rings[0], rings[1].half(), rings[2])),
            "int64 ring positions": dict(rings=(*rings[:2], rings[2].long())),
            "ring positions of another window": dict(rings=(*rings[:2], rings[2][..., :4])),
            "float start": dict(start=start.float()),
            "start of one sequence": dict(start=start[:1]),
            "past capacity": dict(start=torch.tensor([CAPACITY - 1, 0], dtype=torch.int32)),
            "block table too short": dict(table=seqs.block_table[:1]),
            "negative sinks": dict(sinks=-1),
            "more sinks than ring slots": dict(sinks=9),
            "sinks the ring was not written with": dict(sinks=3),
            "page id out of range": dict(
                table=seqs.block_table.index_fill(1, torch.tensor([1]), 99)
            ),
            "bf16 key centres": dict(center=center.bfloat16()),
            "key centres of one sequence": dict(center=center[:1]),
            "key centres of another head dim": dict(center=center[..., :32]),
            "strided key centres": dict(
                center=torch.zeros(NUM_KV_HEADS, BATCH, HEAD_DIM).transpose(0, 1)
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
ring of another head dim: ValueError: tq.store_window: k_window and v_window must be [>= 2, 2, W + sinks >= 1, 64] (batch, kv-heads, window slots + sinks=0, head dim), got (2, 2, 8, 32) and (2, 2, 8, 32)
float32 ring: TypeError: tq.store_window: k_window and v_window must be bfloat16 or float16 of one dtype, got torch.float32 and torch.float32
ring dtypes differ: TypeError: tq.store_window: k_window and v_window must be bfloat16 or float16 of one dtype, got torch.bfloat16 and torch.float16
int64 ring positions: TypeError: tq.store_window: window_pos must be int32, got torch.int64
ring positions of another window: ValueError: tq.store_window: window_pos must be a contiguous [2, 2, 8] (the rings' batch, kv-heads and slots), got (2, 2, 4) with strides (16, 8, 1)
float start: TypeError: tq.store_window: start_pos must be int32 or int64, got torch.float32
start of one sequence: ValueError: tq.store_window: start_pos must have shape [2], got (1,)
past capacity: ValueError: tq.store_window: tokens up to position 36 do not fit a sequence's capacity of 36 positions (block_table pages * page_size + window)
block table too short: ValueError: tq.store_window: block_table must be int32 [>= 2, max_pages], got torch.int32 (1, 7)
negative sinks: ValueError: tq.store_window: sinks must be an integer >= 0, got -1
more sinks than ring slots: ValueError: tq.store_window: k_window and v_window must be [>= 2, 2, W + sinks >= 9, 64] (batch, kv-heads, window slots + sinks=9, head dim), got (2, 2, 8, 64) and (2, 2, 8, 64)
sinks the ring was not written with: ValueError: tq.store_window: window_pos[0, 0, 0] = 8 is not a position that slot 0 of a ring of 5 window slots and sinks=3 holds (-1, a position p >= sinks with p % window == slot, or a sink slot's own p = slot - window)
page id out of range: ValueError: tq.store_window: block_table[0, 1] = 99 is not a page id in [0, 16), but sequence 0 keeps its positions below start_pos + T - window = 5 in pages
bf16 key centres: TypeError: tq.store_window: key_center must be float32, got torch.bfloat16
key centres of one sequence: ValueError: tq.store_window: key_center must be a contiguous [2, 2, 64] (the rings' batch, kv-heads and head dim), got (1, 2, 64)
key centres of another head dim: ValueError: tq.store_window: key_center must be a contiguous [2, 2, 64] (the rings' batch, kv-heads and head dim), got (2, 2, 32) with strides (128, 64, 1)
strided key centres: ValueError: tq.store_window: key_center must be a contiguous [2, 2, 64] (the rings' batch, kv-heads and head dim), got (2, 2, 64) with strides (64, 128, 1)""",  # noqa: E501
        )


@pytest.mark.parametrize("n_new", [3, 6])  # within the window of 4, and past it
def test_start_read_from_a_model_input_pos(n_new, kernel_device, seeded):
    """A model's positions ``input_pos [T] int64`` pass as ``input_pos[:1].expand(B)`` (int64,
    stride 0, no copy): the same cache, rings and returned lengths as a contiguous int32
    start. A negative int64 start skips its sequence whatever its low 32 bits (-2**32)."""
    fmt = get_format("k8v4")
    rotation = api.make_constants(fmt, HEAD_DIM).rotation.to(kernel_device)
    key, value = random_kv(BATCH * n_new, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, seeded)
    key = key.reshape(BATCH, NUM_KV_HEADS, n_new, HEAD_DIM).to(kernel_device)
    value = value.reshape(BATCH, NUM_KV_HEADS, n_new, HEAD_DIM).to(kernel_device)
    input_pos = torch.arange(7, 7 + n_new, device=kernel_device)
    table = torch.arange(BATCH * 4, dtype=torch.int32, device=kernel_device).reshape(BATCH, 4)
    skip_first = torch.tensor([-(2**32)] + [7] * (BATCH - 1))
    starts = {
        "view": (input_pos[:1].expand(BATCH), [7 + n_new] * BATCH),
        "int32": (torch.full((BATCH,), 7, dtype=torch.int32), [7 + n_new] * BATCH),
        "int64 skip": (skip_first, [0] + [7 + n_new] * (BATCH - 1)),
        "int32 skip": (skip_first.clamp_min(-1).to(torch.int32), [0] + [7 + n_new] * (BATCH - 1)),
    }
    results = {}
    for label, (start, lengths) in starts.items():
        cache = fmt.allocate(BATCH * 4, NUM_KV_HEADS, 4, HEAD_DIM, kernel_device)
        rings = [
            torch.zeros(
                BATCH, NUM_KV_HEADS, 4, HEAD_DIM, dtype=torch.bfloat16, device=kernel_device
            )
            for _ in range(2)
        ]
        rings.append(
            torch.full((BATCH, NUM_KV_HEADS, 4), -1, dtype=torch.int32, device=kernel_device)
        )
        for first, n in ((0, 4), (4, 3)):  # positions 0..6 first: position 7 onwards evicts
            with triton_kernels(kernel_device):
                api.store_window(
                    fmt,
                    cache,
                    key[:, :, :1].expand(-1, -1, n, -1),
                    value[:, :, :1].expand(-1, -1, n, -1),
                    RecentWindow(*rings),
                    table,
                    torch.full((BATCH,), first, dtype=torch.int32, device=kernel_device),
                    api.KVConstants(rotation),
                )
        with triton_kernels(kernel_device):
            lens = api.store_window(
                fmt,
                cache,
                key,
                value,
                RecentWindow(*rings),
                table,
                start.to(kernel_device),
                api.KVConstants(rotation),
            )
        assert lens.dtype == torch.int32 and lens.tolist() == lengths, label
        results[label] = [p.cpu() for p in (*cache, *rings)]
    for a, b in (("view", "int32"), ("int64 skip", "int32 skip")):
        for x, y in zip(results[a], results[b], strict=True):
            assert torch.equal(x, y), (a, b)


def test_short_sequence_table_may_end_in_padding(kernel_device, seeded):
    """Each sequence's block table needs pages only up to its own last position that leaves the
    ring (window 4, page 4, 12 new tokens): sequence 0 (positions 0..11) needs 2 pages and its
    row ends in -1 padding, sequence 1 (positions 1..12) needs 3. That is valid (the page check
    once applied the longest sequence's end to every row), and the append equals the same one
    through a table without padding."""
    fmt = get_format("4bit_nc")
    rotation = api.make_constants(fmt, 64).rotation.to(kernel_device)
    window, page, n_new = 4, 4, 12
    key, value = random_kv(2 * n_new, 2, 64, torch.bfloat16, seeded)
    key = key.reshape(2, n_new, 2, 64).transpose(1, 2).to(kernel_device)
    value = value.reshape(2, n_new, 2, 64).transpose(1, 2).to(kernel_device)
    starts = torch.tensor([0, 1], dtype=torch.int32, device=kernel_device)
    padded = torch.tensor([[0, 1, -1, -1], [2, 3, 4, -1]], dtype=torch.int32)
    full = torch.tensor([[0, 1, 5, 6], [2, 3, 4, 7]], dtype=torch.int32)
    results = []
    for block_table in (padded, full):
        cache = fmt.allocate(8, 2, page, 64, kernel_device)
        rings = [
            torch.zeros(2, 2, window, 64, dtype=torch.bfloat16, device=kernel_device)
            for _ in range(2)
        ]
        rings.append(torch.full((2, 2, window), -1, dtype=torch.int32, device=kernel_device))
        with triton_kernels(kernel_device):
            api.store_window(
                fmt,
                cache,
                key,
                value,
                RecentWindow(*rings),
                block_table.to(kernel_device),
                starts,
                api.KVConstants(rotation),
            )
        results.append([p.cpu() for p in (*cache, *rings)])
    for with_padding, without in zip(*results, strict=True):
        assert torch.equal(with_padding, without)
