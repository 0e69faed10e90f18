"""A decode step with its own token (``custom_ops.triton.decode.decode_step``): attention over the
cache as it was and the token itself, exact, then the token appended in the split kernel's last
program per sequence-head, byte for byte as ``tq.store_window`` appends it."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import triton_kernels
from helpers import rel_error
from window_sequences import BATCH, HEAD_DIM, NUM_KV_HEADS, REWRITE_STEPS, STEPS, Sequences

from custom_ops import reference
from custom_ops.formats import FORMATS
from custom_ops.triton import decode as triton_decode
from custom_ops.triton.decode.plan import step_supported

GROUP = 4
STEP_FORMATS = sorted(name for name, fmt in FORMATS.items() if not fmt.value.rotated)


def _own_tokens(gen):
    """The next step's keys and values ``[B, Hk, 1, D]`` as ``Sequences.append`` draws them
    from ``gen`` (the same generator state gives the same tokens)."""
    from helpers import random_kv

    key, value = random_kv(BATCH, NUM_KV_HEADS, HEAD_DIM, torch.bfloat16, gen)
    key = key.reshape(BATCH, 1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
    value = value.reshape(BATCH, 1, NUM_KV_HEADS, HEAD_DIM).transpose(1, 2)
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
    return reference.attention(q.double(), k, v, lens, HEAD_DIM**-0.5)


@pytest.mark.parametrize("steps", ["appends", "rewrites"])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("fmt_name", STEP_FORMATS)
def test_decode_step_attends_then_appends(fmt_name, sinks, steps, kernel_device, seeded):
    """After chunks and single tokens (appends, or rewrites from below the length), each
    one-token step equals float64 attention over the cache as it was and its own token; its
    cache afterwards equals the window store's, byte for byte; the arrival counts are zero
    again and the new lengths are the store's."""
    seqs = Sequences(fmt_name, seeded, kernel_device, sinks=sinks)
    schedule = STEPS if steps == "appends" else REWRITE_STEPS
    for n_new, starts in schedule[:5]:
        seqs.append(n_new, starts, seeded, use_triton=False)
        starts = tuple(int(x) for x in seqs.lens) if n_new > 1 else (int(seqs.lens[0]), -1)
        q = torch.randn(BATCH, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=seeded).half()
        state = seeded.get_state()
        key, value = _own_tokens(seeded)
        expected = _expected(seqs, q, key, value, starts)
        stored = copy.deepcopy(seqs)
        seeded.set_state(state)
        stored.append(1, starts, seeded, use_triton=False)
        d = seqs.device
        counts = torch.zeros(BATCH * NUM_KV_HEADS, dtype=torch.int32, device=d)
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
                4,
                HEAD_DIM**-0.5,
                counts,
                seqs.recent,
            )
        live = torch.tensor([s >= 0 for s in starts])
        assert rel_error(out.cpu()[live], expected.float()[live]) < 1e-3
        assert torch.equal(lens.cpu(), torch.where(live, stored.lens, 0))
        assert not counts.any()
        for mine, theirs in zip(
            (*seqs.cache, *seqs.rings), (*stored.cache, *stored.rings), strict=True
        ):
            assert torch.equal(mine.cpu(), theirs.cpu())
        seqs = stored  # the same bytes; its bookkeeping knows the step's token


def test_step_needs_a_window_one_token_and_unrotated_values():
    fmt = FORMATS["4bit_nc"]
    assert step_supported(fmt, 8, 1)
    assert not step_supported(fmt, 0, 1)
    assert not step_supported(fmt, 8, 2)
    assert not step_supported(FORMATS["tq4_nc"], 8, 1)


def _op_case(fmt_name, sinks, device, gen):
    """Two sequences after an 11-token prefill and a few single tokens (the ring full), the
    step's query, tokens (last head dim contiguous), start positions (one skipped) and zero
    counts on ``device``."""
    seqs = Sequences(fmt_name, gen, device, sinks=sinks)
    seqs.append(11, (0, 0), gen, use_triton=False)
    seqs.append(1, (11, 11), gen, use_triton=False)
    q = torch.randn(BATCH, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(torch.bfloat16)
    key, value = (t.contiguous() for t in _own_tokens(gen))
    starts = torch.tensor([12, -1], dtype=torch.int32)
    counts = torch.zeros(BATCH * NUM_KV_HEADS, dtype=torch.int32)
    return seqs, [t.to(device) for t in (q, key, value, starts, counts)]


def _op_args(seqs, q, key, value, starts, counts, fmt_name, sinks, mask=None):
    return (
        q,
        key,
        value,
        *seqs.cache,
        seqs.block_table,
        starts,
        *seqs.consts,
        counts,
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
    the store) and by the kernels: outputs within 1e-3 (an additive mask too), the same new
    lengths and the same cache bytes; the skipped sequence's row is zeros."""
    state = seeded.get_state()
    for mask_kind in (None, "additive"):
        outs, caches, lens = [], [], []
        for impl in ("reference", "triton"):  # (Triton's interpreter off a GPU)
            device = "cpu" if impl == "reference" else kernel_device
            seeded.set_state(state)
            seqs, (q, key, value, starts, counts) = _op_case(fmt_name, sinks, device, seeded)
            mask = None
            if mask_kind:
                mask = torch.randn(1, 1, seqs.capacity, generator=seeded).to(device)
            with triton_kernels(device) if impl == "triton" else torch.no_grad():
                out, new_lens = torch.ops.tq.decode_step(
                    *_op_args(seqs, q, key, value, starts, counts, fmt_name, sinks, mask)
                )
            outs.append(out.cpu().float())
            lens.append(new_lens.cpu())
            caches.append([t.cpu() for t in (*seqs.cache, *seqs.rings)])
            assert not counts.any()
        assert rel_error(outs[1][:1], outs[0][:1]) < 1e-3
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
    """A format with rotated values, a head dim that is not contiguous and counts that are not
    zero each raise a ValueError naming the op and the argument; the cache is unchanged."""
    seqs, (q, key, value, starts, counts) = _op_case("4bit_nc", 0, "cpu", seeded)
    before = [t.clone() for t in (*seqs.cache, *seqs.rings)]
    strided = torch.randn(BATCH, NUM_KV_HEADS, 1, 2 * HEAD_DIM).to(torch.bfloat16)[..., ::2]
    cases = [
        (dict(key=strided, value=strided), "key must have a contiguous head dim"),
        (dict(counts=counts + 1), "counts must be zero"),
    ]
    for change, message in cases:
        args = dict(q=q, key=key, value=value, starts=starts, counts=counts) | change
        with pytest.raises(ValueError, match=f"decode_step: {message}"):
            torch.ops.tq.decode_step(
                *_op_args(seqs, *args.values(), "4bit_nc", 0),
            )
    rotated, (q, key, value, starts, counts) = _op_case("tq4_nc", 0, "cpu", seeded)
    with pytest.raises(ValueError, match="decode_step: a fused decode step needs"):
        torch.ops.tq.decode_step(*_op_args(rotated, q, key, value, starts, counts, "tq4_nc", 0))
    for now, then in zip((*seqs.cache, *seqs.rings), before, strict=True):
        assert torch.equal(now, then)
