"""Split-KV decode attention over a compressed paged cache: ``torch.ops.tq.decode`` (and
``tq.decode_step``, :func:`decode_step`) on CUDA.

Up to four launches, shapes fixed by the inputs (CUDA-graph safe, no host sync), chosen by the
cached launch plan (:mod:`~custom_ops.triton.decode.plan`):

1. query preparation (:mod:`~custom_ops.triton.decode.prep`; rotated keys with long splits):
   rotates the query into the keys' code space and scales it by ``scale * log2(e)`` so the
   softmax can use ``exp2``;
2. the split kernel (:mod:`~custom_ops.triton.decode.split`): one program per (sequence,
   kv-head, split) streams its compressed tokens (and, for values in the original space, its
   share of the recent window's ring) into a partial softmax state; a verify step's 32 query
   rows per kv-head of ``4bit_nc`` on a Hopper GPU take the verify kernel instead
   (:mod:`~custom_ops.triton.decode.verify`, Gluon, which reads the rings too);
3. the ring kernel (:mod:`~custom_ops.triton.decode.ring`; rotated values with a window): the
   ring's partials in the original space;
4. the merge (:mod:`~custom_ops.triton.decode.merge`): log-sum-exp of the partials, rotated
   values back to the original space, the query's dtype.

On Hopper each kernel after the first uses programmatic dependent launch. Jit pieces shared by
the kernels: :mod:`~custom_ops.triton.decode.codes` (code rows -> fp16 operands, inline PTX from
:mod:`~custom_ops.triton.decode.ptx`), :mod:`~custom_ops.triton.decode.query`,
:mod:`~custom_ops.triton.decode.tiles` and :mod:`~custom_ops.triton.decode.softmax`.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from custom_ops.formats import KVFormat, PagedKVCache, RecentWindow, sequence_capacity, window_size
from custom_ops.triton.decode.merge import MergeConfig, launch_merge
from custom_ops.triton.decode.merge_fill import merge_fill_arguments
from custom_ops.triton.decode.plan import (
    DecodePlan,
    QueryMode,
    SplitConfig,
    StepMode,
    plan_decode,
)
from custom_ops.triton.decode.prep import launch_prep
from custom_ops.triton.decode.ring import launch_ring
from custom_ops.triton.decode.softmax import LOG2E
from custom_ops.triton.decode.split import (
    DecodeStep,
    compile_split,
    launch_split,
    split_arguments,
)
from custom_ops.triton.decode.verify import verify_arguments
from custom_ops.triton.launch import KeyedMemo
from custom_ops.triton.paged import mask_arguments
from custom_ops.triton.store import side_params
from custom_ops.triton.store_window import store_window
from custom_ops.triton.traced import tracing, unread

__all__ = [
    "DecodePlan",
    "MergeConfig",
    "QueryMode",
    "SplitConfig",
    "decode",
    "decode_step",
    "plan_for",
    "compile_split_kernel",
]


def plan_for(
    fmt: KVFormat,
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    num_splits: int,
    mask: torch.Tensor | None = None,
    window: RecentWindow | None = None,
    fast: bool | None = None,
    split_config: SplitConfig | None = None,
    merge_config: MergeConfig | None = None,
    softcap: float = 0.0,
    step: StepMode = StepMode.NONE,
) -> DecodePlan:
    """The :class:`DecodePlan` of a decode with these inputs (``q [B, Hq, D]`` or ``[B, Hq, T,
    D]``; ``fast`` default: on CUDA; ``step``: :func:`plan_decode`'s)."""
    batch, num_q_heads, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    q_tokens = 1 if q.dim() == 3 else q.shape[2]
    _, num_kv_heads, page_size, _ = cache.k_codes.shape
    fast = q.device.type == "cuda" if fast is None else fast
    mask_kind = 0 if mask is None else (1 if mask.dtype == torch.bool else 2)
    ring_dtype = None if window is None else window.k_window.dtype
    sinks = 0 if window is None else window.sinks
    return plan_decode(
        fmt,
        batch,
        num_q_heads * q_tokens,
        num_kv_heads,
        head_dim,
        page_size,
        block_table.shape[1],
        window_size(window),
        q.dtype,
        ring_dtype,
        mask_kind,
        num_splits,
        q.device,
        fast,
        split_config,
        merge_config,
        q_tokens,
        sinks,
        tracing(),
        softcap,
        step,
        side_params(fmt, cache, head_dim) if step == StepMode.APPEND else None,
    )


# Plans of op calls by their arguments' metadata key (plan_decode's own cache is keyed by the
# plan's inputs, which take longer to gather than the key).
_PLANS = KeyedMemo()


def _buffers(plan: DecodePlan, q: torch.Tensor):
    """``(q_code, part_out, part_lse)`` of query rows ``q [B, Hq * T, D]``: the prepared query
    ``[B, Hq * T, q_code_columns] fp16`` (without preparation never read: ``q``, see
    :func:`~custom_ops.triton.traced.unread`) and the partials ``[B, Hq * T, num_partials, D]``
    and their lse ``[B, Hq * T, num_partials]``, float32."""
    batch, num_q_heads, head_dim = q.shape
    q_code = unread(q)
    if plan.prep is not None:
        q_code = torch.empty(
            batch, num_q_heads, plan.q_code_columns, dtype=torch.float16, device=q.device
        )
    part_out = torch.empty(
        batch, num_q_heads, plan.num_partials, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(
        batch, num_q_heads, plan.num_partials, dtype=torch.float32, device=q.device
    )
    return q_code, part_out, part_lse


def decode(
    fmt: KVFormat,
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    num_splits: int,
    scale: float,
    mask: torch.Tensor | None = None,
    window: RecentWindow | None = None,
    softcap: float = 0.0,
    fast: bool | None = None,
    split_config: SplitConfig | None = None,
    merge_config: MergeConfig | None = None,
    launch_key: Hashable | None = None,
    step: DecodeStep | None = None,
) -> torch.Tensor:
    """Launch the decode kernels (inputs validated; see ``torch.ops.tq.decode``).

    ``q [B, Hq, D]``, or ``[B, Hq, T, D]``: the kernels see its ``Hq * T`` query rows as the
    heads of one query token, row ``h * T + t`` with the causal limit of token ``t`` (without a
    mask; a mask alone orders the tokens), so the ``T`` tokens of a GQA group share each cache
    byte read. Returns q's shape in q's dtype. ``window``: the recent window, if any (its
    ``key_center`` is not read: softmax ignores the shift the stored keys' scores share).
    ``softcap`` > 0 caps each score ``s`` at ``softcap * tanh(s / softcap)`` before the mask
    (the verify kernel does not serve it).
    ``fast`` selects the inline-PTX decoding and programmatic dependent launch (default: on
    CUDA; the interpreter cannot run them); ``split_config`` and ``merge_config`` override the
    plan's kernel configurations (sweeps, tests). ``launch_key``: the op arguments' metadata key
    (:func:`custom_ops.validate.launch_key`), which determines the plan and the kernels'
    specializations: both are then looked up by it. ``step``: a decode step's own tokens
    (:func:`decode_step`), attended beside the cache as it was and appended by the split kernel
    and the merge.
    """
    batch, head_dim = q.shape[0], q.shape[-1]
    if batch == 0:
        return q.new_empty(q.shape)
    overridden = fast is not None or split_config is not None or merge_config is not None
    # (a graph traced for inductor gets Triton kernels only: see plan_decode's ``traced``)
    step_mode = StepMode.NONE if step is None else StepMode.APPEND
    key = None if overridden or launch_key is None else (launch_key, tracing(), step_mode)
    plan = _PLANS.get(
        key,
        lambda: plan_for(
            fmt,
            q,
            cache,
            block_table,
            num_splits,
            mask,
            window,
            fast,
            split_config,
            merge_config,
            softcap,
            step_mode,
        ),
    )
    mask_args = mask_arguments(mask, seq_lens)
    q_scale = scale * LOG2E
    rows = q.reshape(batch, -1, head_dim)  # [B, Hq * T, D]: a view, or a copy of a few rows
    # contiguous whatever q's strides: the merge writes row b * Hq * T + r
    out = rows.new_empty(rows.shape)
    q_code, part_out, part_lse = _buffers(plan, rows)
    # The first kernel is launched normally, after everything before it; the ones after it
    # with programmatic dependent launch where the plan says so.
    if plan.prep is not None:
        launch_prep(plan.prep, rows, rotation, q_code, q_scale, key)
    if plan.verify:
        plan.split(
            *verify_arguments(
                rows,
                q_code,
                q_scale,
                cache,
                block_table,
                seq_lens,
                window,
                mask_args,
                part_out,
                part_lse,
            ),
            key=key,
        )
    else:
        launch_split(
            plan.split,
            split_arguments(
                rows,
                q_code,
                q_scale,
                rotation,
                cache,
                block_table,
                seq_lens,
                mask_args,
                window,
                part_out,
                part_lse,
                step,
            ),
            key,
        )
    if plan.ring is not None:  # (a ring plan only with a window)
        capacity = sequence_capacity(block_table.shape[1], cache.k_codes.shape[2], window.size)
        launch_ring(
            plan.ring,
            rows,
            q_scale,
            window,
            seq_lens,
            capacity,
            mask_args,
            part_out,
            part_lse,
            key,
        )
    if step_mode == StepMode.APPEND:  # the merge also writes the step's token into the ring
        arguments = merge_fill_arguments(
            part_out, part_lse, rotation, out, step, window, block_table
        )
        plan.merge(*arguments, key=key)
    else:
        launch_merge(plan.merge, part_out, part_lse, rotation, out, key)
    return out.view(q.shape)


def decode_step(
    fmt: KVFormat,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    start_pos: torch.Tensor,
    rotation: torch.Tensor,
    num_splits: int,
    scale: float,
    window: RecentWindow,
    mask: torch.Tensor | None = None,
    softcap: float = 0.0,
    launch_key: Hashable | None = None,
    split_config: SplitConfig | None = None,
    merge_config: MergeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch a decode step with its own token (inputs validated; see
    ``torch.ops.tq.decode_step``): ``q [B, Hq, D]`` attends the cache as it was before the step,
    its positions below ``start_pos``, and the step's ``key``/``value [B, Hk, 1, D]``
    exactly; then the token is appended as ``tq.store_window`` appends it. Returns the output
    (q's shape and dtype) and the new lengths ``[B] int32``.

    Two launches, the split kernel and the merge (three with the query preparation: rotated
    keys at long splits). One more program per sequence-head in the split grid (or, where
    those would take it past one wave of resident programs, the last split first) quantizes
    the token leaving the ring into its page while the splits attend (no split attends that
    page slot). The merge, which runs once every split has read the ring, writes
    the step's token into it. In a graph traced for inductor the same two kernels run
    (programmatic dependent launch off: :mod:`custom_ops.triton.traced`); PyTorch's mutation
    analysis of their launches finds what each writes (the split kernel: the partials and the
    planes; the merge: the output, the new lengths and the rings).

    Args:
        fmt, q, key, value, cache, block_table, start_pos, rotation, num_splits, scale,
            window, mask, softcap: as ``torch.ops.tq.decode_step`` takes them (``cache`` the
            planes, ``window`` the rings), validated.
        launch_key: the op arguments' metadata key (see :func:`decode`).
        split_config, merge_config: overrides of the split kernel's and the merge's
            configurations (tests).

    Returns:
        ``(out, new_lens)``: q's shape and dtype, and ``[B] int32``.
    """
    batch = q.shape[0]
    new_lens = torch.empty(batch, dtype=torch.int32, device=q.device)
    step = DecodeStep(key, value, start_pos, new_lens)
    # the kernels read the lengths from start_pos; seq_lens' place takes the new lengths
    out = decode(
        fmt,
        q,
        cache,
        block_table,
        new_lens,
        rotation,
        num_splits,
        scale,
        mask,
        window,
        softcap,
        split_config=split_config,
        merge_config=merge_config,
        launch_key=launch_key,
        step=step,
    )
    if batch == 0:
        new_lens = store_window(
            fmt, key, value, cache, window, block_table, start_pos, rotation, launch_key=None
        )
    return out, new_lens


def compile_split_kernel(
    fmt: KVFormat,
    q: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    rotation: torch.Tensor,
    num_splits: int,
    compile_fn,
    fast: bool = True,
    split_config: SplitConfig | None = None,
    window: RecentWindow | None = None,
    softcap: float = 0.0,
):
    """Compile (not launch) the split kernel of this decode (``q [B, Hq, D]`` or ``[B, Hq, T,
    D]``) through ``compile_fn(kernel, grid, *args, **kwargs)``; ``benchmarks/sass_report.py``
    compiles it for sm_90 without a GPU (``split_config`` overrides the plan's launch, register
    cap included)."""
    plan = plan_for(
        fmt, q, cache, block_table, num_splits, None, window, fast, split_config, softcap=softcap
    )
    if plan.verify:
        raise ValueError(
            "compile_split_kernel: this decode's plan takes the verify kernel, not the split "
            "kernel (pass a split_config to compile the split kernel)"
        )
    mask_args = mask_arguments(None, seq_lens)
    rows = q.reshape(q.shape[0], -1, q.shape[-1])  # [B, Hq * T, D]
    q_code, part_out, part_lse = _buffers(plan, rows)
    arguments = split_arguments(
        rows,
        q_code,
        LOG2E,
        rotation,
        cache,
        block_table,
        seq_lens,
        mask_args,
        window,
        part_out,
        part_lse,
    )
    return compile_split(plan.split, arguments, compile_fn)
