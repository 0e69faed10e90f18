"""Seeded random configurations of every op against the float64 oracle.

Each run draws new configurations (format, head dim, page size, kv-heads, GQA group, batch,
window, ragged lengths at 0 / 1 / page and window boundaries / capacity, mask kind, query dtype,
split count), writes random tokens in random chunks through the Triton kernels (on the kernel
device: CUDA, or the CPU through the interpreter) and through the CPU reference, and checks:

* the kernels' cache dequantizes to what the reference's does (codes may sit one level apart
  where float32 summation order tips a value over a decision boundary: a small error bound),
  every written token-head row's quantization error is the reference's for that row, its meta
  record the reference's up to one rounding step, the rings the reference's bit for bit;
  slots and ring rows that hold no position keep their (poisoned) bytes on both paths;
* ``tq.dequantize`` by the kernels equals the reference's dequantization of the same cache;
* ``tq.decode`` by the kernels equals float64 attention over the same cache, per query within
  1e-3 (fp16 queries; 4e-3 bf16) of ``||sum_i p_i |v_i| ||``, the scale of the tensor cores'
  fp16 rounding; fully masked queries give zeros.

The seed is printed on failure; ``TQ_TEST_SEED=<seed>`` replays a run. The CPU draws a few
small configurations (the interpreter is slow), CUDA many.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import pytest
import torch
from conftest import CUDA, triton_kernels
from helpers import (
    by_slot,
    clone_cache,
    poisoned_cache,
    random_kv,
    rel_error,
    slot_rows,
    window_on,
)

from custom_ops import api, reference
from custom_ops.formats import FORMATS, SUPPORTED_HEAD_DIMS, RecentWindow, get_format

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: exp2(-inf)

CONFIGS = 8 if CUDA else 12


@dataclass(frozen=True)
class Config:
    """One drawn configuration (its repr is the failure message's context)."""

    fmt: str
    head_dim: int
    page_size: int
    num_kv_heads: int
    group: int
    window: int
    pages_per_seq: int
    lens: tuple[int, ...]
    mask: str
    q_dtype: torch.dtype
    num_splits: int

    @property
    def capacity(self) -> int:
        return self.pages_per_seq * self.page_size + self.window


def _pick(options, gen: torch.Generator):
    return options[int(torch.randint(len(options), (1,), generator=gen))]


def draw(gen: torch.Generator, small: bool) -> Config:
    """A random configuration; ``small`` keeps it cheap for the interpreter."""
    head_dim = _pick((64, 128) if small else SUPPORTED_HEAD_DIMS, gen)
    page_size = _pick((4, 8) if small else (1, 4, 8, 16, 32), gen)
    window = _pick((0, 4, 8) if small else (0, 1, 8, 16, 64, 128), gen)
    pages_per_seq = _pick((2, 3) if small else (1, 2, 5, 12), gen)
    capacity = pages_per_seq * page_size + window
    # lengths at the edges: empty, one token, around a page and the window, full
    edges = [
        0,
        1,
        page_size - 1,
        page_size,
        page_size + 1,
        window,
        window + 1,
        capacity - 1,
        capacity,
        int(torch.randint(capacity + 1, (1,), generator=gen)),
    ]
    edges = [n for n in edges if 0 <= n <= capacity]
    batch = _pick((1, 2) if small else (1, 2, 3), gen)
    lens = tuple(_pick(edges, gen) for _ in range(batch))
    return Config(
        fmt=_pick(sorted(FORMATS), gen),
        head_dim=head_dim,
        page_size=page_size,
        num_kv_heads=_pick((1, 2) if small else (1, 2, 4), gen),
        group=_pick((1, 4) if small else (1, 2, 4, 5, 8), gen),
        window=window,
        pages_per_seq=pages_per_seq,
        lens=lens,
        mask=_pick(("none", "bool", "additive"), gen),
        q_dtype=_pick((torch.float16, torch.bfloat16), gen),
        num_splits=_pick((1, 2, 4) if small else (1, 2, 8, 32), gen),
    )


class Case:
    """A configuration's caches, written the same way on two paths: ``"kernel"`` (the Triton
    kernels on ``device``) and ``"reference"`` (the CPU reference)."""

    def __init__(self, cfg: Config, gen: torch.Generator, device: str):
        self.cfg, self.device = cfg, device
        self.fmt = get_format(cfg.fmt)
        batch = len(cfg.lens)
        self.rotation = api.make_constants(self.fmt, cfg.head_dim, seed=7).rotation
        num_pages = batch * cfg.pages_per_seq + 1
        cache = poisoned_cache(
            self.fmt, num_pages, cfg.num_kv_heads, cfg.page_size, cfg.head_dim, gen
        )
        pages = torch.randperm(num_pages, generator=gen)[: batch * cfg.pages_per_seq]
        self.block_table = pages.to(torch.int32).reshape(batch, cfg.pages_per_seq)
        ring_shape = (batch, cfg.num_kv_heads, max(cfg.window, 1), cfg.head_dim)
        rings = (
            torch.randn(ring_shape, generator=gen).to(torch.bfloat16),
            torch.randn(ring_shape, generator=gen).to(torch.bfloat16),
            torch.full(ring_shape[:3], -1, dtype=torch.int32),
        )
        self.initial_cache, self.initial_rings = cache, rings  # the poison, kept to compare
        self.caches = {"kernel": clone_cache(cache, device), "reference": clone_cache(cache)}
        self.rings = {
            "kernel": tuple(r.clone().to(device) for r in rings),
            "reference": tuple(r.clone() for r in rings),
        }
        self.keys = torch.zeros(
            batch, cfg.num_kv_heads, cfg.capacity, cfg.head_dim, dtype=torch.bfloat16
        )
        self.values = torch.zeros_like(self.keys)
        self._write(gen)

    @property
    def lens(self) -> torch.Tensor:
        return torch.tensor(self.cfg.lens, dtype=torch.int32)

    def _write(self, gen: torch.Generator) -> None:
        """Every sequence's tokens in random chunks (sequences whose turn it is not skipped)."""
        cfg, batch = self.cfg, len(self.cfg.lens)
        written = [0] * batch
        while written != list(cfg.lens):
            chunk = int(torch.randint(1, 2 * cfg.page_size + 3, (1,), generator=gen))
            n_new = min(chunk, max(n - w for n, w in zip(cfg.lens, written, strict=True)))
            key, value = random_kv(
                batch * n_new, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, gen
            )
            key = key.reshape(batch, n_new, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            value = value.reshape(batch, n_new, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
            starts = [w if w + n_new <= n else -1 for n, w in zip(cfg.lens, written, strict=True)]
            if all(s < 0 for s in starts):  # the remaining sequences need shorter chunks
                continue
            for b, start in enumerate(starts):
                if start >= 0:
                    self.keys[b, :, start : start + n_new] = key[b]
                    self.values[b, :, start : start + n_new] = value[b]
                    written[b] += n_new
            for path in ("kernel", "reference"):
                self._store(path, key, value, torch.tensor(starts, dtype=torch.int32))

    def _store(self, path: str, key, value, starts: torch.Tensor) -> None:
        device = self.device if path == "kernel" else "cpu"
        cache, table = self.caches[path], self.block_table.to(device)
        rotation = self.rotation.to(device)
        with triton_kernels(device) if path == "kernel" else torch.no_grad():
            if self.cfg.window:
                torch.ops.tq.store_window(
                    key.to(device),
                    value.to(device),
                    *cache,
                    *self.rings[path],
                    table,
                    starts.to(device),
                    rotation,
                    self.cfg.fmt,
                )
                return
            # no window: slots of positions start .. start + T - 1 of the live sequences
            n_new, page = key.shape[2], self.cfg.page_size
            positions = starts[:, None].long() + torch.arange(n_new)
            slots = self.block_table.long().gather(1, (positions // page).clamp(0)) * page
            slots = torch.where(starts[:, None] >= 0, slots + positions % page, -1)
            rows = key.transpose(1, 2).reshape(-1, *key.shape[1::2])
            value_rows = value.transpose(1, 2).reshape(-1, *value.shape[1::2])
            torch.ops.tq.store(
                rows.to(device),
                value_rows.to(device),
                *cache,
                slots.reshape(-1).to(torch.int32).to(device),
                rotation,
                self.cfg.fmt,
            )

    def unwritten_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(page_slots, ring_rows)``: bool ``[num_pages * page_size]`` over the pages' slots
        that hold no position (past ``len - window`` in a sequence's pages, or a page outside
        the block table), and ``[B, W]`` over ring slots of positions never written."""
        cfg = self.cfg
        num_pages = self.initial_cache.k_codes.shape[0]
        page_slots = torch.ones(num_pages * cfg.page_size, dtype=torch.bool)
        for b, n in enumerate(cfg.lens):
            positions = torch.arange(max(0, n - cfg.window))
            pages = self.block_table[b].long()[positions // cfg.page_size]
            page_slots[pages * cfg.page_size + positions % cfg.page_size] = False
        ring_rows = torch.arange(max(cfg.window, 1))[None, :] >= self.lens[:, None]
        return page_slots, ring_rows if cfg.window else torch.ones_like(ring_rows)

    def reference_dequantized(self, path: str) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 ``(K, V) [B, Hk, capacity, D]`` of ``path``'s cache by the reference."""
        window = RecentWindow(*self.rings[path]) if self.cfg.window else None
        return reference.dequantize(
            self.fmt,
            clone_cache(self.caches[path]),
            self.block_table,
            self.lens,
            self.rotation,
            self.cfg.capacity,
            torch.float64,
            window_on(window, "cpu"),
        )


def _seed() -> int:
    return int(os.environ.get("TQ_TEST_SEED", time.time_ns() % 2**31))


def _mask(cfg: Config, num_q_heads: int, gen: torch.Generator) -> torch.Tensor | None:
    """``[B or 1, Hq or 1, M]`` over the first ``M`` positions (the rest masked out)."""
    if cfg.mask == "none":
        return None
    batch = len(cfg.lens)
    shape = (
        _pick((1, batch), gen),
        _pick((1, num_q_heads), gen),
        int(torch.randint(1, cfg.capacity + 1, (1,), generator=gen)),
    )
    if cfg.mask == "bool":
        return torch.rand(shape, generator=gen) > 0.3
    return torch.randn(shape, generator=gen) * 2


def _decode_budget(q, k, v, expected, lens, scale, mask, q_dtype) -> torch.Tensor:
    """Per query ``[B, Hq]``, the error the kernels' rounding may cause in the output
    ``expected`` (float64 attention of ``q`` over the dequantized ``k, v [B, Hk, S, D]``):

    * probabilities and value products rounded to fp16 on the tensor cores (2^-11 each), and
      the output to the query's dtype (bf16: 2^-9 of each element): 1e-3 (fp16) or 4e-3 (bf16)
      of ``||sum_i p_i |v_i| ||`` (not of the output, which cancellation can make small);
    * the query and the decoded keys rounded to fp16 before their product: each score moves by
      about 2^-11 ``scale ||q|| ||k_i|| / sqrt(D)`` (D roundings of random sign), which moves
      the output by ``sum_i p_i ds_i (v_i - o)``: bounded with twice that step.
    """
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    mass = reference.attention(q, k, v.abs(), lens, scale, mask).norm(dim=-1)
    # sum_i p_i ||k_i|| |v_i - o| per query: each query a sequence of one head of its own
    rows = batch * num_q_heads
    k_rows = k.repeat_interleave(group, 1).reshape(rows, 1, *k.shape[2:])
    spread = (v.repeat_interleave(group, 1) - expected[:, :, None]).abs()
    spread = spread.reshape(rows, 1, *k.shape[2:]) * k_rows.norm(dim=-1, keepdim=True)
    row_mask = None if mask is None else mask.expand(batch, num_q_heads, -1).reshape(rows, 1, -1)
    weighted = reference.attention(
        q.reshape(rows, 1, head_dim),
        k_rows,
        spread,
        lens.repeat_interleave(num_q_heads),
        scale,
        row_mask,
    )
    score_step = 2.0**-10 * scale * q.double().norm(dim=-1) / head_dim**0.5
    weighted = score_step * weighted.reshape(q.shape).norm(dim=-1)
    tolerance = 1e-3 if q_dtype == torch.float16 else 4e-3
    return tolerance * mass + weighted


def _check(cfg: Config, gen: torch.Generator, device: str) -> None:
    case = Case(cfg, gen, device)
    ref_k, ref_v = case.reference_dequantized("reference")
    kernel_k, kernel_v = case.reference_dequantized("kernel")
    written = torch.arange(cfg.capacity)[None, :] < case.lens[:, None]  # [B, capacity]
    written = written[:, None].expand(-1, cfg.num_kv_heads, -1)  # [B, Hk, capacity]
    meta_step = torch.finfo(case.fmt.meta_dtype).eps
    for side, ref, kernel, original in (
        ("keys", ref_k, kernel_k, case.keys),
        ("values", ref_v, kernel_v, case.values),
    ):
        if not written.any():
            break
        ref, kernel, original = ref[written], kernel[written], original.double()[written]
        # the same codes up to one level for a few elements: far below a format step
        assert rel_error(kernel, ref) < 2e-2, f"{side}: the kernels' store"
        # per token-head row, so that one wrong row among many fails: a code tipped across a
        # decision boundary costs about nothing, a meta record one rounding step apart (float32
        # summation order) at most that step of the row
        row_norm = original.norm(dim=-1)
        kernel_err = (kernel - original).norm(dim=-1) / row_norm
        ref_err = (ref - original).norm(dim=-1) / row_norm
        worst = int((kernel_err - ref_err * 1.05).argmax())
        assert kernel_err[worst] <= ref_err[worst] * 1.05 + meta_step, (
            f"{side}: written row {worst} has error {float(kernel_err[worst]):.3g} through the "
            f"kernels, {float(ref_err[worst]):.3g} through the reference"
        )
    page_slots, ring_rows = case.unwritten_slots()
    # Written slots: the same meta record up to one rounding step (a row error 5% above the
    # reference's is a low-bit format's noise; a scale 3% off is not), the same ring rows.
    kernel_meta, ref_meta = (by_slot(case.caches[path].meta) for path in ("kernel", "reference"))
    torch.testing.assert_close(
        kernel_meta[~page_slots],
        ref_meta[~page_slots],
        rtol=meta_step,
        atol=0,
        msg=lambda m: f"written meta records: {m}",
    )
    for kernel_ring, ref_ring in zip(case.rings["kernel"], case.rings["reference"], strict=True):
        assert torch.equal(kernel_ring.cpu(), ref_ring), "ring rows"
    for path in ("kernel", "reference"):
        for name, now, before in zip(
            ("k_codes", "value codes", "meta"),
            slot_rows(case.caches[path]),
            slot_rows(case.initial_cache),
            strict=True,
        ):
            assert torch.equal(now[page_slots], before[page_slots]), f"{path}: unwritten {name}"
        for now, before in zip(case.rings[path], case.initial_rings, strict=True):
            unwritten = ring_rows[:, None, :].expand(now.shape[:3])
            assert torch.equal(now.cpu()[unwritten], before[unwritten]), f"{path}: ring slot"

    rings = case.rings["kernel"] if cfg.window else (None, None, None)
    table, lens = case.block_table.to(device), case.lens.to(device)
    rotation = case.rotation.to(device)
    with triton_kernels(device):
        k_deq, v_deq = torch.ops.tq.dequantize(
            *case.caches["kernel"],
            table,
            lens,
            rotation,
            cfg.fmt,
            cfg.capacity,
            torch.float32,
            *rings,
        )
    unread = ~written[..., None]
    torch.testing.assert_close(
        k_deq.cpu().double(), kernel_k.masked_fill(unread, 0), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        v_deq.cpu().double(), kernel_v.masked_fill(unread, 0), rtol=1e-5, atol=1e-5
    )

    num_q_heads = cfg.num_kv_heads * cfg.group
    q = torch.randn(len(cfg.lens), num_q_heads, cfg.head_dim, generator=gen).to(cfg.q_dtype)
    mask = _mask(cfg, num_q_heads, gen)
    scale = cfg.head_dim**-0.5
    # float64 attention over the kernels' cache, and the scales of the kernels' fp16 rounding
    expected = reference.attention(q, kernel_k, kernel_v, case.lens, scale, mask)
    budget = _decode_budget(q, kernel_k, kernel_v, expected, case.lens, scale, mask, cfg.q_dtype)
    with triton_kernels(device):
        actual = torch.ops.tq.decode(
            q.to(device),
            *case.caches["kernel"],
            table,
            lens,
            rotation,
            cfg.fmt,
            cfg.num_splits,
            scale,
            None if mask is None else mask.to(device),
            *rings,
        ).cpu()
    assert not actual.isnan().any()
    seen = budget > 0  # queries with at least one visible key
    assert bool((actual[~seen] == 0).all()), "a query that sees nothing gets zeros"
    error = (actual.double() - expected).norm(dim=-1)
    b, h = divmod(int((error / budget.clamp_min(1e-300)).argmax()), error.shape[1])
    assert error[b, h] <= budget[b, h], (
        f"decode: query ({b}, {h}) error {float(error[b, h]):.3g}, "
        f"budget {float(budget[b, h]):.3g}"
    )


def test_random_configurations(kernel_device):
    """:data:`CONFIGS` random configurations per run, every op against the oracle."""
    seed = _seed()
    gen = torch.Generator().manual_seed(seed)
    for i in range(CONFIGS):
        cfg = draw(gen, small=kernel_device == "cpu")
        try:
            _check(cfg, gen, kernel_device)
        except AssertionError as err:
            raise AssertionError(
                f"configuration {i} of seed {seed} (TQ_TEST_SEED={seed} replays it): {cfg}: {err}"
            ) from err
