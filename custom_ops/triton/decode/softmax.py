"""The online-softmax state shared by the decode kernels (log2 domain), the logit softcap, the
attention mask and the causal order of several query tokens."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "LOG2E",
    "RESCALE_SLACK",
    "causal_ends",
    "mask_scores",
    "softcap_scores",
    "needs_rescale",
    "softmax_rescale",
    "LANE_ROWS",
    "lane_row_sums",
    "partial_normalizer",
]

LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
# How far (log2 units) a tile's scores may rise above the maximum the split kernel's
# probabilities are taken against before it moves that maximum and rescales its accumulators:
# probabilities then reach 2**RESCALE_SLACK, and after the first tiles a rescale is rare
# instead of a multiply of every accumulator per tile (docs/design/decode.md#rescale-past-a-slack).
RESCALE_SLACK = tl.constexpr(4)


@triton.jit
def causal_ends(seq_len, q_head, Q_TOKENS: tl.constexpr, MASK: tl.constexpr):
    """Where the positions each query row sees end (``q_head``'s shape): query row ``q_head`` is
    token ``t = q_head % Q_TOKENS`` of the sequence's last ``Q_TOKENS``, which sees the
    positions below ``seq_len - Q_TOKENS + 1 + t`` without a mask; with a mask (``MASK != 0``)
    every row sees below ``seq_len`` and the mask alone orders the tokens, as dense SDPA under
    that mask does (a bidirectional prefix, or a head group under a per-head mask, must not
    become causal)."""
    if MASK == 0:
        ends = seq_len - (Q_TOKENS - 1 - q_head % Q_TOKENS)
    else:
        ends = seq_len + 0 * q_head
    return ends


@triton.jit
def softcap_scores(scores, SOFTCAP: tl.constexpr):
    """``SOFTCAP * tanh(scores / SOFTCAP)`` (Gemma 2's attention logit softcapping) of scores in
    log2 units, ``SOFTCAP`` the cap times log2(e) (a cap of natural-log scores caps the same
    scores times log2(e) at that bound); 0: the scores as they are. ``tanh`` from ``exp2`` of
    ``-2|x|``, which stays in ``(0, 1]`` (no overflow), to a few float32 ulps."""
    if SOFTCAP != 0:
        x = scores * (1.0 / SOFTCAP)
        e = tl.math.exp2(tl.abs(x) * (-2.0 * _LOG2E))
        magnitude = (1.0 - e) / (1.0 + e)
        scores = tl.where(x < 0, -magnitude, magnitude) * SOFTCAP
    return scores


@triton.jit
def mask_scores(
    scores,
    positions,
    masking,
    b,
    q_head,
    row_ok,
    MASK: tl.constexpr,
    Q_TOKENS: tl.constexpr,
    SOFTCAP: tl.constexpr = 0.0,
):
    """Cap (:func:`softcap_scores`), then apply the attention mask at key ``positions [N]`` to
    ``scores [N, G_PAD]`` (log2 units) of the query rows ``q_head [G_PAD]`` (head ``q_head //
    Q_TOKENS``, token ``q_head % Q_TOKENS``): ``MASK`` 0 none, 1 boolean (False masks out), 2
    additive (natural-log units); with several query tokens and no mask, also the causal order
    among them. ``masking`` is ``(mask_args, row_ends)``: ``mask_args = (mask_ptr, stride_b,
    stride_h, stride_t, mask_len)`` and ``row_ends`` from :func:`causal_ends`. The cap comes
    first, as in Gemma 2's attention: an additive mask is not capped."""
    scores = softcap_scores(scores, SOFTCAP)
    mask_args, row_ends = masking
    if Q_TOKENS > 1:
        scores = tl.where(positions[:, None] < row_ends[None, :], scores, float("-inf"))
    if MASK != 0:
        mask_ptr, stride_mask_b, stride_mask_h, stride_mask_t, mask_len = mask_args
        rows = (q_head // Q_TOKENS) * stride_mask_h + (q_head % Q_TOKENS) * stride_mask_t
        mask_ptrs = mask_ptr + b * stride_mask_b + rows[None, :] + positions[:, None]
        in_mask = row_ok[None, :] & (positions < mask_len)[:, None]
        if MASK == 1:
            allowed = tl.load(mask_ptrs, mask=in_mask, other=0) != 0
            scores = tl.where(allowed, scores, float("-inf"))
        else:
            bias = tl.load(mask_ptrs, mask=in_mask, other=float("-inf")).to(tl.float32)
            scores = scores + bias * _LOG2E
    return scores


@triton.jit
def needs_rescale(tile_max, m_i):
    """Whether some query row's tile maximum ``tile_max [G_PAD]`` exceeds the maximum ``m_i``
    its probabilities are taken against by more than :data:`RESCALE_SLACK` (a scalar; a row
    that saw no key so far, ``m = -inf``, counts once it sees one)."""
    # the difference, not tile_max > m_i + SLACK: at |m| >= 2**26 the sum would round by 8
    # (a row still masked gives -inf - -inf = NaN: no rescale)
    return tl.max((tile_max - m_i > RESCALE_SLACK).to(tl.int32), axis=0) > 0


@triton.jit
def softmax_rescale(tile_max, m_i):
    """Online-softmax step in the log2 domain for a tile whose per-query max is ``tile_max
    [G_PAD]``: ``(m_new, m_sub, alpha)``, with ``p = exp2(scores - m_sub)`` and the running sums
    rescaled by ``alpha``. A query masked out so far keeps ``m = -inf``, so 0 is subtracted
    instead."""
    m_new = tl.maximum(m_i, tile_max)
    m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)
    return m_new, m_sub, tl.math.exp2(m_i - m_sub)


# Rows of a tile one lane's share of a column sum gathers: a tensor-core accumulator of tokens
# on M gives each lane rows r, r + 8, r + 16, ... (an m16 tile's halves, then its tiles).
LANE_ROWS = tl.constexpr(8)


@triton.jit
def lane_row_sums(x):
    """``x [N, G]`` summed over its rows ``r + 8 i``: ``[8, G]``, whose column sums are
    ``x``'s. The split kernel keeps its running sums in this shape and sums the 8 rows once
    per split: in the tensor cores' accumulator layout of one warp on M each lane holds rows
    ``r + 8 i``, so these adds stay within a lane, where a column sum per tile took three
    cross-lane shuffles per column (sm_90 SASS, these sums alone: 3bit_nc's streaming loop 755
    -> 732 instructions, 4bit_nc 701 -> 677;
    docs/design/decode.md#tiles-tokens-on-m-one-warp-per-program). The sum is the same in any
    layout; only its cost depends on it (with warps on M it still crosses warps)."""
    N: tl.constexpr = x.shape[0]
    tl.static_assert(N % LANE_ROWS == 0, "lane_row_sums: rows in groups of 8")
    return tl.sum(tl.reshape(x, [N // LANE_ROWS, LANE_ROWS, x.shape[1]]), axis=0)


@triton.jit
def partial_normalizer(m_i, l_i):
    """``(lse, 1 / l)`` of a finished partial; ``lse = -inf`` (and ``1 / l = 1``) if it saw no
    key."""
    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.math.log2(safe_l), float("-inf"))
    return lse, 1.0 / safe_l
