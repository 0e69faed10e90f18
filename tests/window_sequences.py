"""The recent window's test fixture: two sequences appended to a paged cache and its rings,
step by step, through ``tq.store_window`` (shared by the store_window, dequantize and decode
tests)."""

from __future__ import annotations

import torch
from conftest import triton_kernels
from helpers import clone_cache, poisoned_cache, random_kv

from custom_ops import api
from custom_ops.formats import RecentWindow, get_format
from custom_ops.triton import store_window as triton_store_window

BATCH, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, WINDOW, PAGES_PER_SEQ = 2, 2, 64, 4, 8, 7
# A sequence holds its table's positions plus the window: only the oldest len - W need pages.
CAPACITY = PAGE_SIZE * PAGES_PER_SEQ + WINDOW

# (T, start of each sequence): a prefill longer than the window, a skipped sequence (-1), short
# chunks, single tokens, a chunk that crosses the window boundary of sequence 1, and one that
# takes sequence 0 past its block table's 28 positions (into the ring).
STEPS = [
    (11, (0, -1)),
    (3, (11, 0)),
    (1, (14, 3)),
    (6, (15, 4)),
    (1, (21, 10)),
    (2, (22, 11)),
    (9, (24, 13)),
]

# Writes that start below the length (speculative decoding, rollback, a new sequence): a rewrite
# inside the ring (sequence 1 at 5 of 11), a rollback of 10 > W positions that crosses where the
# ring run starts (sequence 0 from 14 to 4), a chunk longer than the window after a rollback
# (its first tokens go straight to the pages), a restart at 0 and appends in between.
REWRITE_STEPS = [
    (11, (0, 0)),
    (3, (11, 5)),
    (2, (4, 8)),
    (1, (6, 10)),
    (12, (3, 2)),
    (1, (0, 14)),
    (5, (1, -1)),
    (9, (6, 14)),
]


class Sequences:
    """Two sequences in a paged cache with a shuffled block table, their rings (``window``
    slots and ``sinks``), with ``center`` their keys' centres (``key_center [B, Hk, D]``,
    stored centred), and every token appended so far (bf16 ``[B, Hk, S, D]``); each sequence
    has ``pages_per_seq`` pages of ``page_size`` slots and ``head_dim`` elements per token-head
    (the module's ``CAPACITY`` assumes the defaults)."""

    def __init__(
        self,
        fmt_name,
        gen,
        device="cpu",
        dtype=torch.bfloat16,
        window=WINDOW,
        sinks=0,
        center=False,
        pages_per_seq=PAGES_PER_SEQ,
        head_dim=HEAD_DIM,
        page_size=PAGE_SIZE,
    ):
        self.fmt = get_format(fmt_name)
        self.window, self.sinks = window, sinks
        self.head_dim, self.page_size = head_dim, page_size
        self.capacity = page_size * pages_per_seq + window
        self.consts = api.make_constants(self.fmt, head_dim, seed=5)
        num_pages = BATCH * pages_per_seq + 2
        self.cache = poisoned_cache(self.fmt, num_pages, NUM_KV_HEADS, page_size, head_dim, gen)
        pages = torch.randperm(num_pages, generator=gen)[: BATCH * pages_per_seq]
        self.block_table = pages.to(torch.int32).reshape(BATCH, pages_per_seq)
        shape = (BATCH, NUM_KV_HEADS, window + sinks, head_dim)
        self.k_window = torch.randn(shape, generator=gen).to(dtype)  # poison: never read
        self.v_window = torch.randn(shape, generator=gen).to(dtype)
        self.window_pos = torch.full(shape[:3], -1, dtype=torch.int32)  # no slot holds one yet
        self.key_center = torch.zeros(BATCH, NUM_KV_HEADS, head_dim) if center else None
        # with centring, keys share a per-head offset (real models' keys do): a key stored
        # with another centre than the others then shows
        self.key_offset = 3 * torch.randn(NUM_KV_HEADS, 1, head_dim, generator=gen) * center
        self.keys = torch.zeros(BATCH, NUM_KV_HEADS, self.capacity, head_dim, dtype=torch.bfloat16)
        self.values = torch.zeros_like(self.keys)
        self.lens = torch.zeros(BATCH, dtype=torch.int32)
        # where each sequence's ring run starts: positions below it are quantized (sinks aside)
        self.ring_from = torch.zeros(BATCH, dtype=torch.int64)
        self.device = device
        self.to(device)

    def to(self, device):
        self.cache = clone_cache(self.cache, device)
        self.consts = api.KVConstants(*(c.to(device) for c in self.consts))
        for name in ("block_table", "k_window", "v_window", "window_pos", "key_center"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name).to(device))
        self.device = device
        return self

    def append(self, n_new, starts, gen, use_triton, launch=None):
        """Write ``n_new`` random tokens at ``starts`` (a negative start skips the sequence; a
        start below the length rewrites from there on); ``launch``: the window store's ``(rows
        per program, warps)`` instead of its default (the Triton launcher called directly)."""
        head_dim = self.head_dim
        key, value = random_kv(BATCH * n_new, NUM_KV_HEADS, head_dim, torch.bfloat16, gen)
        key = key.reshape(BATCH, n_new, NUM_KV_HEADS, head_dim).transpose(1, 2)  # strided
        if self.key_center is not None:
            key = (key + self.key_offset).to(key.dtype)
        value = value.reshape(BATCH, n_new, NUM_KV_HEADS, head_dim).transpose(1, 2)
        if self.k_window is not None:  # the model's dtype: the rings' (store_window checks it)
            key, value = key.to(self.k_window.dtype), value.to(self.k_window.dtype)
        start_pos = torch.tensor(starts, dtype=torch.int32)
        for b, start in enumerate(starts):
            if start >= 0:
                assert start <= self.lens[b], "a write continues from at most the length"
                self.keys[b, :, start : start + n_new] = key[b]
                self.values[b, :, start : start + n_new] = value[b]
                self.lens[b] = start + n_new
                # everything from start on is new; the ring keeps at most W positions
                from_start = min(int(self.ring_from[b]), start)
                self.ring_from[b] = max(from_start, start + n_new - self.window)
        d = self.device
        if launch is not None:
            assert use_triton, "a launch shape is the Triton kernels'"
            with triton_kernels(d):
                lens = triton_store_window.store_window(
                    self.fmt,
                    key.to(d),
                    value.to(d),
                    self.cache,
                    self.recent,
                    self.block_table,
                    start_pos.to(d),
                    self.consts.rotation,
                    block_rows=launch[0],
                    num_warps=launch[1],
                )
        else:
            with triton_kernels(d) if use_triton else torch.no_grad():
                lens = api.store_window(
                    self.fmt,
                    self.cache,
                    key.to(d),
                    value.to(d),
                    self.recent,
                    self.block_table,
                    start_pos.to(d),
                    self.consts,
                )
        # the op returns the written sequences' lengths, 0 for the skipped ones
        assert torch.equal(lens.cpu(), torch.where(start_pos >= 0, self.lens, 0)), lens

    def decode(self, q, num_splits, mask=None, lens=None, softcap=0.0):
        """``tq.decode`` of ``q`` over the cache and the rings by the Triton kernels on this
        device (query and mask moved there) at the sequences' lengths (or ``lens``), scores
        capped by ``softcap``, returned on the CPU."""
        d = self.device
        lens = self.lens if lens is None else lens
        with triton_kernels(d):
            return api.decode(
                self.fmt,
                q.to(d),
                self.cache,
                self.block_table,
                lens.to(d),
                self.consts,
                num_splits=num_splits,
                mask=None if mask is None else mask.to(d),
                window=self.recent,
                softcap=softcap,
            ).cpu()

    @property
    def rings(self):
        """``(k_window, v_window, window_pos)``."""
        return self.k_window, self.v_window, self.window_pos

    @property
    def recent(self) -> RecentWindow:
        """The rings, sinks and (with ``center``) the keys' centres, as the ops take them."""
        return RecentWindow(*self.rings, self.sinks, self.key_center)

    def exact(self, positions):
        """``[B, n] bool``: which of ``positions [n]`` each sequence holds in full precision
        (its ring run and its sinks)."""
        return (positions[None, :] >= self.ring_from[:, None]) | (positions[None, :] < self.sinks)

    def slots_of(self, b, positions):
        pages = self.block_table.cpu()[b, positions // self.page_size].to(torch.int64)
        return pages * self.page_size + positions % self.page_size
