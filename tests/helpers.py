"""Helpers shared by the tests: random inputs, poisoned caches, code comparisons, the op tests'
implementations, a decode case, running the examples, a tiny transformers decoder's config."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from conftest import ROOT, triton_kernels

from custom_ops import api, reference
from custom_ops.formats import Codec, Kind, KVFormat, PagedKVCache, RecentWindow, get_format

# A tiny transformers decoder (random weights): 2 layers, 4 query / 2 kv heads of dim 64; the
# fields every architecture's config takes.
TINY_DECODER = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=256,
    attn_implementation="sdpa",
)


def window_on(window: RecentWindow | None, device) -> RecentWindow | None:
    """``window`` with its tensors on ``device`` (a copy where they move; None stays None)."""
    if window is None:
        return None
    return RecentWindow(*(t.to(device) if isinstance(t, torch.Tensor) else t for t in window))


def random_kv(n_tokens: int, num_kv_heads: int, head_dim: int, dtype=torch.bfloat16, gen=None):
    """Random keys and values ``[N, Hk, D]`` with per-row scales and a few outliers."""
    scale = torch.rand(n_tokens, num_kv_heads, 1, generator=gen) * 4 + 0.1
    key = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen) * scale
    key[..., 3] *= 8  # an outlier channel, as real post-RoPE keys have
    value = torch.randn(n_tokens, num_kv_heads, head_dim, generator=gen) * scale + 0.5
    return key.to(dtype), value.to(dtype)


def poisoned_cache(
    fmt: KVFormat, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, gen=None
) -> PagedKVCache:
    """A cache whose planes hold random bytes (so unwritten bytes are detectable)."""
    cache = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim)
    for plane in cache:
        raw = plane.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))
    # Meta records must stay finite floats for the kernels' arithmetic; use random scales.
    cache.meta.copy_(torch.rand(cache.meta.shape, generator=gen) + 0.5)
    return cache


def clone_cache(cache: PagedKVCache, device="cpu") -> PagedKVCache:
    return PagedKVCache(*(p.clone().to(device) for p in cache))


def by_slot(plane: torch.Tensor) -> torch.Tensor:
    """A plane ``[num_pages, Hk, page_size, C]`` on the CPU as ``[num_pages * page_size, Hk,
    C]``, one row per slot (slot = page * page_size + offset)."""
    plane = plane.cpu()
    return plane.transpose(1, 2).reshape(-1, plane.shape[1], plane.shape[3])


def slot_rows(cache: PagedKVCache) -> list[torch.Tensor]:
    """Each plane's raw bytes on the CPU as ``[num_pages * page_size, Hk * bytes] uint8``, one
    row per slot (value codes through :attr:`PagedKVCache.value_rows`)."""
    planes = (cache.k_codes, cache.value_rows, cache.meta)
    return [by_slot(plane.view(torch.uint8)).flatten(1) for plane in planes]


def _rank(codec: Codec, codes: torch.Tensor) -> torch.Tensor:
    """Position of each code's level in ascending value order (sign-magnitude -> rank)."""
    if codec.kind != Kind.LLOYD_MAX:
        return codes
    half = 1 << (codec.bits - 1)
    sign, mag = codes >> (codec.bits - 1), codes & (half - 1)
    return torch.where(sign == 1, half - 1 - mag, half + mag)


def assert_codes_match(codec: Codec, expected: torch.Tensor, actual: torch.Tensor) -> None:
    """Packed code rows ``[..., bytes]`` equal, except a code may be one level off where the
    float32 summation order of a norm or rotation lands a value on the other side of a decision
    boundary (Lloyd-Max and uniform codes only; then for at most 0.1% of the elements)."""
    expected = expected.reshape(-1, expected.shape[-1]).cpu()
    actual = actual.reshape(-1, actual.shape[-1]).cpu()
    if codec.kind in (Kind.FP8_ABSMAX, Kind.INT8_ABSMAX):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        return
    diff = (
        _rank(codec, reference.unpack_codes(codec, actual))
        - _rank(codec, reference.unpack_codes(codec, expected))
    ).abs()
    assert int(diff.max()) <= 1, f"a code differs by {int(diff.max())} levels"
    assert float((diff > 0).float().mean()) <= 1e-3, "too many codes one level off"


def assert_same_cache(fmt: KVFormat, expected: PagedKVCache, actual: PagedKVCache) -> None:
    """Two caches hold the same codes (up to :func:`assert_codes_match`) and meta records."""
    assert_codes_match(fmt.key, expected.k_codes, actual.k_codes)
    assert_codes_match(fmt.value, expected.value_rows, actual.value_rows)
    # one rounding step of the meta dtype (a norm's float32 summation order may differ)
    step = torch.finfo(fmt.meta_dtype).eps
    torch.testing.assert_close(actual.meta.cpu(), expected.meta.cpu(), rtol=step, atol=0)


def filled_cache(
    fmt: KVFormat, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int, consts, gen
) -> PagedKVCache:
    """A cache with every slot holding a stored random token (reference store)."""
    cache = fmt.allocate(num_pages, num_kv_heads, page_size, head_dim)
    n_tokens = num_pages * page_size
    key, value = random_kv(n_tokens, num_kv_heads, head_dim, torch.bfloat16, gen)
    slots = torch.arange(n_tokens, dtype=torch.int32)
    reference.store(fmt, key, value, cache, slots, *consts)
    return cache


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64."""
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


# The op tests run each op's CPU implementation (the reference) and its Triton kernels (on the
# kernel device: CUDA, or the CPU through the interpreter).
IMPLS = ["reference", "triton"]


def impl_device(impl: str, kernel_device: str) -> str:
    return "cpu" if impl == "reference" else kernel_device


def impl_context(impl: str, device: str):
    return triton_kernels(device) if impl == "triton" else torch.no_grad()


def decode_case(fmt_name, head_dim, group, gen, num_kv_heads=2, page_size=4, num_pages=14):
    """A filled cache, a shuffled non-contiguous block table, ragged lengths (0, 1, full)."""
    fmt = get_format(fmt_name)
    consts = api.make_constants(fmt, head_dim, seed=3)
    cache = filled_cache(fmt, num_pages, num_kv_heads, page_size, head_dim, consts, gen)
    pages = torch.randperm(num_pages, generator=gen)[:12].to(torch.int32)
    block_table = pages.reshape(4, 3).T  # [3, 4], non-contiguous
    seq_lens = torch.tensor([13, 0, 1], dtype=torch.int32)
    q = torch.randn(3, num_kv_heads * group, head_dim, generator=gen).to(torch.float16)
    return fmt, consts, cache, block_table, seq_lens, q


def longer_table(table: torch.Tensor) -> torch.Tensor:
    """A decode case's block table with 80 more columns (copies of its first): more capacity per
    split, so splits are longer than one tile (and rotated keys get a prepared query)."""
    return torch.cat([table, table[:, :1].expand(-1, 80)], dim=1)


def stale_table(table: torch.Tensor, lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """``table [B, pages]`` with the entries past each sequence's pages (``lens [B]`` tokens in
    pages of ``page_size``) set to 2**30, a page id far beyond any cache."""
    stale = table.clone()
    pages_used = (lens + page_size - 1) // page_size
    stale[torch.arange(table.shape[1])[None, :] >= pages_used[:, None]] = 2**30
    return stale


def stale_tables(table: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode case's ``[3, 4]`` block table with the entries past each sequence's pages set to
    a page id far beyond the cache, and the same with 80 more such columns (longer splits)."""
    stale = stale_table(table, lens, 4)
    long_stale = torch.cat([stale, torch.full((3, 80), 2**30, dtype=torch.int32)], dim=1)
    return stale, long_stale


def inductor_flat_kernels(modules) -> dict:
    """The compiled kernels of our traced launches (their flat entries,
    ``custom_ops.triton.traced``) in inductor's generated ``modules`` (``PyCodeCache.modules``):
    ``{name: CachingAutotuner}``."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    return {
        name: tuner
        for module in modules
        for name, tuner in vars(module).items()
        if isinstance(tuner, CachingAutotuner) and "_flat_" in name
    }


def run_python(
    argv: list[str],
    timeout: int = 300,
    drop: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python *argv`` in the repository with it on ``PYTHONPATH``, the environment
    variables ``drop`` unset and ``env`` set; its result, unchecked."""
    environment = {**{k: v for k, v in os.environ.items() if k not in drop}, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_example(*argv: str, timeout: int = 300) -> str:
    """Run a script of the repository (``examples/...``) with it on ``PYTHONPATH``; it must
    succeed. Returns its stdout."""
    result = run_python(list(argv), timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def run_compiler_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run ``tests/<script>`` (it compiles kernels for sm_90) without ``TRITON_INTERPRET`` (the
    interpreter has no compiler), the repository on ``PYTHONPATH``; its result, unchecked."""
    return run_python([str(ROOT / "tests" / script), *args], 600, drop=("TRITON_INTERPRET",))
