"""tq.prefill (``custom_ops/triton/prefill/`` on CUDA): a chunk's attention over its own exact
keys and values and its sequence's compressed prefix, against the float64 oracle
(``reference.prefill``); every kind of visibility (causal, masks the chunk check accepts and
rejects, truncated views), rings holding prefix positions, head dims, GQA groups; opcheck; bad
input.

Each case runs both ways of reading the prefix (the ``prefix_path`` fixture): the dense one
(dequantized, then the dense kernel; the default) and the fused kernel (what CUDA-graph capture
runs). Tolerances, of the output's norm against the float64 oracle: the fused kernel rounds the
output to bf16 once (2^-9 relative at most per element) after the chunk's SDPA rows were
rounded to bf16 too; its compressed tiles' fp16 operands add 2^-11: it lands at 1.2e-3 to
2.2e-3, 4e-3 is the bound. The dense path computes in the dense kernel's bf16 arithmetic, as
the bf16 model attends over its own cache: the dequantized keys and values, the probabilities
and each half's output are rounded to bf16 (2^-9 each, where the fused kernel's operands have
2^-11): it lands at 3.5e-3 to 7.4e-3, 1e-2 is the bound. A prefix position left out, a key
centre missing, a mask row misapplied or a chunk read quantized moves the output by 8% or more.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import expecttest
import pytest
import torch
from conftest import CUDA, triton_kernels
from helpers import IMPLS, impl_context, impl_device, random_kv, rel_error, window_on

from custom_ops import api, reference, sdpa_lse
from custom_ops.formats import FORMATS, RecentWindow, get_format
from custom_ops.triton import prefill as triton_prefill

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: exp2(-inf)

TOLERANCE = 4e-3  # the fused kernel
DENSE_TOLERANCE = 1e-2  # the dense kernel over a dequantized prefix


class PrefixPath(NamedTuple):
    """How the prefix is read: the context that selects it and the tolerance."""

    context: type[contextlib.AbstractContextManager]
    tolerance: float


PREFIX_PATHS = {
    "dense": PrefixPath(contextlib.nullcontext, DENSE_TOLERANCE),
    "fused": PrefixPath(triton_prefill.fused_prefix, TOLERANCE),
}


@pytest.fixture(params=sorted(PREFIX_PATHS))
def prefix_path(request) -> PrefixPath:
    return PREFIX_PATHS[request.param]


class Case:
    """Sequences whose caches hold ``prefix`` positions (written by the window store, in two
    appends) and then a chunk of ``tokens`` positions (from ``start``, default the prefix's
    end: a rollback when smaller; a tuple gives each sequence its own), with the chunk's exact
    keys and values and its queries."""

    def __init__(
        self,
        fmt_name,
        gen,
        *,
        head_dim=64,
        group=4,
        window=16,
        sinks=2,
        center=True,
        prefix=90,
        tokens=24,
        start=None,
        batch=2,
        num_kv_heads=2,
        page_size=16,
        dtype=torch.bfloat16,
    ):
        self.fmt = get_format(fmt_name)
        self.consts = api.make_constants(self.fmt, head_dim, seed=7)
        start = prefix if start is None else start
        starts = start if isinstance(start, tuple) else (start,) * batch
        pages_per_seq = (prefix + tokens) // page_size + 2
        num_pages = batch * pages_per_seq + 3
        self.cache = self.fmt.allocate(num_pages, num_kv_heads, page_size, head_dim)
        pages = torch.randperm(num_pages, generator=gen)[: batch * pages_per_seq]
        self.block_table = pages.to(torch.int32).reshape(batch, pages_per_seq)
        self.recent = None  # the recent window: rings, sinks, keys' centres
        if window + sinks:
            shape = (batch, num_kv_heads, window + sinks, head_dim)
            centres = torch.zeros(batch, num_kv_heads, head_dim) if center else None
            self.recent = RecentWindow(
                torch.zeros(shape, dtype=dtype),
                torch.zeros(shape, dtype=dtype),
                torch.full(shape[:3], -1, dtype=torch.int32),
                sinks,
                centres,
            )
        offset = 4 * torch.randn(num_kv_heads, 1, head_dim, generator=gen)  # a shared component
        lens = torch.zeros(batch, dtype=torch.int64)

        def write(begins, n):
            if n == 0:
                return None, None
            key, value = random_kv(batch * n, num_kv_heads, head_dim, dtype, gen)
            key = key.reshape(batch, n, num_kv_heads, head_dim).transpose(1, 2) + offset
            value = value.reshape(batch, n, num_kv_heads, head_dim).transpose(1, 2)
            key, value = key.to(dtype).contiguous(), value.contiguous()
            begins = torch.tensor(begins, dtype=torch.int64)
            if self.recent is not None:
                api.store_window(
                    self.fmt,
                    self.cache,
                    key,
                    value,
                    self.recent,
                    self.block_table,
                    begins.to(torch.int32),
                    self.consts,
                )
            else:
                positions = begins[:, None] + torch.arange(n)  # [B, n]
                pages = self.block_table.to(torch.int64).gather(1, positions // page_size)
                slots = pages * page_size + positions % page_size
                api.store(
                    self.fmt,
                    self.cache,
                    key.transpose(1, 2).reshape(-1, num_kv_heads, head_dim),
                    value.transpose(1, 2).reshape(-1, num_kv_heads, head_dim),
                    slots.reshape(-1).to(torch.int32),
                    self.consts,
                )
            lens.copy_(begins + n)
            return key, value

        with torch.no_grad():  # the reference store
            write([0] * batch, prefix // 2)
            write([prefix // 2] * batch, prefix - prefix // 2)
            self.key, self.value = write(starts, tokens)
        self.seq_lens = lens.to(torch.int32)
        self.q = torch.randn(batch, num_kv_heads * group, tokens, head_dim, generator=gen)
        self.q = (self.q * 2).to(dtype)

    def causal_mask(self, capacity=None) -> torch.Tensor:
        """gpt-fast's ``causal_mask[None, None, input_pos]``: ``[1, 1, T, S]`` bool (``[B, 1,
        T, S]`` when the sequences' chunks start at different positions)."""
        starts = self.seq_lens.to(torch.int64) - self.q.shape[2]
        capacity = capacity or int(self.seq_lens.max()) + 8
        rows = starts[:, None] + torch.arange(self.q.shape[2])  # [B, T]
        mask = (torch.arange(capacity)[None, None, :] <= rows[..., None])[:, None]
        return mask[:1] if bool((starts == starts[0]).all()) else mask

    def run(self, device, dtype=None, path=PREFIX_PATHS["dense"], **kwargs):
        """``tq.prefill`` by the Triton kernels on ``device`` (CPU: the interpreter), the prefix
        read by ``path``, or with ``dtype`` the float64 oracle; returned on the CPU."""
        kwargs = dict(is_causal=False, mask=None, max_seq_len=None, softcap=0.0) | kwargs
        args = (
            self.fmt,
            self.q,
            self.key,
            self.value,
            self.cache,
            self.block_table,
            self.seq_lens,
            self.consts.rotation,
        )
        if dtype is not None:
            capacity = self.block_table.shape[1] * self.cache.k_codes.shape[2] + 10**6
            max_seq_len = kwargs["max_seq_len"] or capacity
            return reference.prefill(
                *args,
                self.q.shape[-1] ** -0.5,
                kwargs["is_causal"],
                max_seq_len,
                dtype,
                kwargs["mask"],
                self.recent,
                kwargs["softcap"],
            )

        def moved(t):
            return None if t is None else t.to(device)

        with triton_kernels(device), path.context():
            out = api.prefill(
                self.fmt,
                *(moved(t) for t in args[1:4]),
                type(self.cache)(*(p.to(device) for p in self.cache)),
                moved(self.block_table),
                moved(self.seq_lens),
                api.KVConstants(self.consts.rotation.to(device)),
                is_causal=kwargs["is_causal"],
                mask=moved(kwargs["mask"]),
                max_seq_len=kwargs["max_seq_len"],
                window=window_on(self.recent, device),
                softcap=kwargs["softcap"],
            )
        return out.cpu()

    def check(self, device, path, **kwargs) -> float:
        expected = self.run(device, torch.float64, **kwargs)
        actual = self.run(device, path=path, **kwargs)
        assert actual.dtype == self.q.dtype
        assert actual.stride() == torch.empty_like(self.q).stride()  # q's layout
        error = rel_error(actual, expected)
        assert error < path.tolerance, error
        return error


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_kernel_matches_float64_oracle(fmt_name, kernel_device, prefix_path, seeded):
    """Every format: a 24-token chunk after a 90-token prefix (two 64-token tiles of pages, 2
    sinks, keys centred, a shuffled block table), under gpt-fast's causal mask: the mask rows
    are checked causal, the chunk is SDPA's and the prefix the kernel's, merged."""
    case = Case(fmt_name, seeded)
    case.check(kernel_device, prefix_path, mask=case.causal_mask())


def _masks(case: Case) -> dict:
    """Every kind of visibility ``tq.prefill`` takes, as keyword arguments (``case``'s
    sequences of one length)."""
    causal = case.causal_mask()
    batch, heads, tokens = case.q.shape[:3]
    start = int(case.seq_lens[0]) - tokens
    padded = causal.repeat(batch, 1, 1, 1)
    padded[1, :, :, :5] = False  # sequence 1 left-padded: no row causal over the chunk... yet
    padded[0, :, :, start + 3 : start + 6] = False  # a hole in sequence 0's chunk
    additive = torch.zeros(causal.shape).masked_fill(~causal, float("-inf"))
    biased = additive.clone()
    biased[..., :start] += torch.linspace(-2, 2, start)  # an ALiBi-like bias on the prefix
    per_head = causal.repeat(1, heads, 1, 1)
    per_head[:, 1::2, :, start // 2 : start] = False  # odd heads do not see half the prefix
    bidirectional = torch.ones_like(causal)  # a prefix-LM chunk: sees all of itself
    lowest = torch.finfo(case.q.dtype).min  # Hugging Face's additive "minus infinity"
    return {
        "is_causal over a prefix (top-left: the chunk mostly hidden)": dict(is_causal=True),
        "no mask, not causal": {},
        "gpt-fast causal mask": dict(mask=causal),
        "additive causal mask": dict(mask=additive.to(case.q.dtype)),
        "additive causal mask of finfo.min": dict(
            mask=torch.zeros(causal.shape, dtype=case.q.dtype).masked_fill(~causal, lowest)
        ),
        "float32 additive mask with a bias": dict(mask=biased),
        "padding and a hole": dict(mask=padded),
        "mask per head": dict(mask=per_head),
        "bidirectional chunk": dict(mask=bidirectional),
        "bidirectional mask and is_causal (both apply)": dict(mask=bidirectional, is_causal=True),
        "mask shorter than the sequence": dict(mask=causal[..., : start + tokens // 2]),
        "view truncated inside the chunk": dict(max_seq_len=start + 5),
        "view truncated inside the chunk, masked": dict(mask=causal, max_seq_len=start + 5),
    }


def test_causal_rows(kernel_device, seeded):
    """The mask check: rows that show exactly chunk positions 0 .. t (bool True, additive 0,
    hidden by -inf or finfo.min) are causal (flag bit 1), each sequence at its own chunk start;
    a hole, a bias or padding makes the rows that meet it not causal. Rows that show every
    prefix position get bit 2: not where the prefix has a hole or a bias, nor unchecked."""
    from custom_ops.triton.prefill.causal_rows import causal_rows

    case = Case("int8", seeded, prefix=30, tokens=20, start=(30, 21), window=0, sinks=0)
    mask = case.causal_mask()  # [2, 1, 20, S]: each sequence's own rows
    holed = mask.clone()
    holed[0, :, :, 30 + 7] = False  # chunk position 7 hidden: rows 7.. of sequence 0
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    biased = additive.clone()
    biased[1, :, 12, 21 + 3] = 0.5  # one biased visible position in row 12 of sequence 1
    prefix_hole = mask.clone()
    prefix_hole[0, :, 4:9, 17] = False  # rows 4-8 of sequence 0 miss prefix position 17
    prefix_bias = additive.clone()
    prefix_bias[1, :, :, 3] = 0.25  # every row of sequence 1 biases prefix position 3
    t = torch.arange(20)
    ones = torch.ones(20)
    expected = {  # 1: causal over the chunk, 2: shows the prefix
        "causal": 3 * torch.ones(2, 1, 20),
        "a hole": torch.stack([(t < 7) + 2, 3 * ones])[:, None],
        "additive, finfo.min": 3 * torch.ones(2, 1, 20),
        "a bias": torch.stack([3 * ones, (t != 12) + 2])[:, None],
        "a hole in the prefix": torch.stack([3 - 2 * ((t >= 4) & (t < 9)), 3 * ones])[:, None],
        "a bias in the prefix": torch.stack([3 * ones, ones])[:, None],
    }
    masks = (mask, holed, additive, biased, prefix_hole, prefix_bias)
    for name, m in zip(expected, masks, strict=True):
        args = (m.to(kernel_device), m.stride(0), m.stride(1), m.stride(2), m.shape[-1])
        with triton_kernels(kernel_device):
            flags = causal_rows(
                args, 1, 20, case.seq_lens.to(kernel_device), m.dtype != torch.bool
            ).cpu()
            unchecked = causal_rows(
                args,
                1,
                20,
                case.seq_lens.to(kernel_device),
                m.dtype != torch.bool,
                check_prefix=False,
            ).cpu()
        assert torch.equal(flags.float(), expected[name].float()), name
        assert torch.equal(unchecked, flags & 1), name  # no prefix is known to be shown


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tq4_nc"])
def test_visibility(fmt_name, kernel_device, prefix_path, seeded):
    """Each mask kind, causal order and view length: the rows the chunk check accepts take
    SDPA's result, the others the kernel's own pass over the chunk, both equal to the oracle
    (uniform and rotated values)."""
    case = Case(fmt_name, seeded, window=8, sinks=2)
    for name, kwargs in _masks(case).items():
        try:
            case.check(kernel_device, prefix_path, **kwargs)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None


def test_sequences_of_their_own_lengths(kernel_device, prefix_path, seeded):
    """Each sequence's chunk at its own start (sequence 1 rewrote from 10 positions back), under
    each sequence's own causal rows and under is_causal."""
    case = Case("4bit_nc", seeded, prefix=80, tokens=20, start=(80, 70), window=8, sinks=2)
    assert case.seq_lens.tolist() == [100, 90]
    case.check(kernel_device, prefix_path, mask=case.causal_mask())
    case.check(kernel_device, prefix_path, is_causal=True)


def test_is_causal_over_a_short_prefix(kernel_device, prefix_path, seeded):
    """is_causal with a prefix shorter than the chunk: SDPA's top-left order lets token t see
    positions 0 .. t, the prefix and the chunk's first t - start + 1 positions (the chunk
    recomputed by the kernel)."""
    case = Case("3bit_nc", seeded, prefix=10, tokens=40, window=0, sinks=0)
    case.check(kernel_device, prefix_path, is_causal=True)


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4"])
def test_first_chunk_is_sdpa(fmt_name, kernel_device, prefix_path, seeded):
    """A first chunk (no prefix) under a causal mask or is_causal is the dense kernel's causal
    attention over the chunk, bit for bit: the prefill kernel writes nothing."""
    case = Case(fmt_name, seeded, prefix=0, tokens=40)
    dense = sdpa_lse.attention_lse(
        case.q.to(kernel_device),
        case.key.to(kernel_device),
        case.value.to(kernel_device),
        True,
        case.q.shape[-1] ** -0.5,
    )[0].cpu()
    for kwargs in (
        dict(is_causal=True),
        dict(mask=case.causal_mask()),
        dict(is_causal=True, max_seq_len=40),
        dict(mask=case.causal_mask(), max_seq_len=40),
    ):
        assert torch.equal(case.run(kernel_device, path=prefix_path, **kwargs), dense)
    case.check(kernel_device, prefix_path, is_causal=True)


@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4"])
def test_softcap(fmt_name, kernel_device, seeded):
    """Scores capped before the mask (Gemma 2), over the chunk and the compressed prefix with
    its ring, sinks and centred keys, a causal mask or is_causal: the float64 oracle within the
    dense path's tolerance (capped prefills take the reference's arithmetic on every device,
    float32), where the cap moves the answer by far more."""
    case = Case(fmt_name, seeded)
    case.q = case.q * 4  # scores past the cap
    for kwargs in (dict(mask=case.causal_mask()), dict(is_causal=True)):
        expected = case.run(kernel_device, torch.float64, softcap=2.0, **kwargs)
        assert rel_error(case.run(kernel_device, torch.float64, **kwargs), expected) > 0.1
        actual = case.run(kernel_device, softcap=2.0, **kwargs)
        assert rel_error(actual, expected) < PREFIX_PATHS["dense"].tolerance


def test_dense_prefix_where_every_row_sees_it(kernel_device, seeded, monkeypatch):
    """The dense prefix runs where every sequence has the same prefix and every row sees all
    of it (no mask and not causal; gpt-fast's mask; an additive causal mask); the fused kernel
    everywhere else (is_causal's top-left order, padding, a bias on the prefix, sequences of
    their own lengths, a view cutting the chunk, inside ``fused_prefix``)."""
    calls = []
    dequantize = triton_prefill.dequantize
    monkeypatch.setattr(
        triton_prefill, "dequantize", lambda *a: calls.append("dense") or dequantize(*a)
    )
    case = Case("4bit_nc", seeded, window=8, sinks=2)
    masks = _masks(case)
    dense = [
        "no mask, not causal",
        "gpt-fast causal mask",
        "additive causal mask",
        "additive causal mask of finfo.min",
    ]
    fused = [
        "is_causal over a prefix (top-left: the chunk mostly hidden)",
        "padding and a hole",
        "float32 additive mask with a bias",
        "mask per head",
        "view truncated inside the chunk",
    ]
    for name in dense + fused:
        calls.clear()
        case.run(kernel_device, **masks[name])
        assert calls == (["dense"] if name in dense else []), name
    calls.clear()
    case.run(kernel_device, path=PREFIX_PATHS["fused"], mask=case.causal_mask())
    own_lengths = Case("4bit_nc", seeded, prefix=80, tokens=20, start=(80, 70))
    own_lengths.run(kernel_device, mask=own_lengths.causal_mask())
    assert calls == []
    # a view no longer than the chunk (the trim before a first prefill) reads nothing to the
    # host: the fused kernel finds no prefix to read on the device
    facts = triton_prefill._prefix_facts
    monkeypatch.setattr(
        triton_prefill, "_prefix_facts", lambda *a: calls.append("facts") or facts(*a)
    )
    first = Case("4bit_nc", seeded, prefix=0, tokens=40)
    first.run(kernel_device, is_causal=True, max_seq_len=40)
    assert calls == []
    first.run(kernel_device, is_causal=True)
    assert calls == ["facts"]


def test_output_in_the_query_layout(kernel_device, prefix_path, seeded):
    """The output has q's layout (a model's ``q.transpose(1, 2)`` of ``[B, T, Hq, D]``: the
    output's ``transpose(1, 2)`` is contiguous, as SDPA's), on every path, as the fake says."""
    case = Case("k8v4", seeded, prefix=30, tokens=12)
    case.q = case.q.transpose(1, 2).contiguous().transpose(1, 2)
    for kwargs in (dict(mask=case.causal_mask()), {}, dict(is_causal=True)):
        out = case.run(kernel_device, path=prefix_path, **kwargs)
        assert out.transpose(1, 2).is_contiguous(), kwargs
    error = case.check(kernel_device, prefix_path, mask=case.causal_mask())
    assert error < prefix_path.tolerance


@pytest.mark.parametrize(
    "window, sinks, prefix, tokens, start",
    [(32, 0, 40, 8, None), (32, 4, 40, 8, None), (16, 2, 40, 6, 30), (0, 0, 70, 20, None)],
    ids=["ring run in the prefix", "and sinks", "rollback into the ring", "no ring"],
)
def test_rings(window, sinks, prefix, tokens, start, kernel_device, prefix_path, seeded):
    """A chunk shorter than the window leaves prefix positions in the ring (read in full
    precision, sinks too); a chunk that rewrites from inside the ring leaves stale positions past
    the length there (never read); without rings the prefix is all pages."""
    case = Case(
        "3bit_nc", seeded, window=window, sinks=sinks, prefix=prefix, tokens=tokens, start=start
    )
    case.check(kernel_device, prefix_path, mask=case.causal_mask())
    case.check(kernel_device, prefix_path, is_causal=True)


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
@pytest.mark.parametrize("fmt_name", ["3bit_nc", "tq4_nc", "tqk5v3_nc"])
def test_head_dims(fmt_name, head_dim, kernel_device, prefix_path, seeded):
    """Head dims 80 and 96 (padded parts), 128 and 256, four parts of 3-bit codes and of 5-bit
    keys, two of rotated 4-bit values."""
    case = Case(fmt_name, seeded, head_dim=head_dim, prefix=40, tokens=12, batch=1)
    case.check(kernel_device, prefix_path, mask=case.causal_mask())


@pytest.mark.parametrize("group", [1, 3, 8])
def test_gqa_groups(group, kernel_device, prefix_path, seeded):
    """Query rows are token x group: groups 1, 3 (tiles of 64 rows split a token's group) and
    8; 37 tokens give a last tile partly empty."""
    case = Case("k8v4", seeded, group=group, prefix=50, tokens=37, batch=1)
    case.check(kernel_device, prefix_path, mask=case.causal_mask())


def test_float16_model(kernel_device, prefix_path, seeded):
    """An fp16 model: fp16 queries, chunk and rings."""
    case = Case("tq3_nc", seeded, dtype=torch.float16, prefix=40, tokens=12)
    case.check(kernel_device, prefix_path, mask=case.causal_mask())


@pytest.mark.parametrize("impl", IMPLS)
def test_opcheck_prefill(impl, kernel_device, seeded):
    """opcheck (schema, fake tensor, aot dispatch) for tq.prefill, with rings and a mask, q
    contiguous and as a model's transposed view (the output's layout follows it)."""
    device = impl_device(impl, kernel_device)
    case = Case("4bit_nc", seeded, prefix=20, tokens=9, batch=1)
    for q in (case.q, case.q.transpose(1, 2).contiguous().transpose(1, 2)):
        _opcheck_prefill(case, q, impl, device)


def _opcheck_prefill(case: Case, q: torch.Tensor, impl: str, device: str) -> None:
    # the window's fields are the op's last arguments, in their order
    args = (
        q,
        case.key,
        case.value,
        *case.cache,
        case.block_table,
        case.seq_lens,
        case.consts.rotation,
        "4bit_nc",
        0.125,
        False,
        64,
        case.causal_mask(),
        *case.recent,
    )
    with impl_context(impl, device):
        torch.library.opcheck(
            torch.ops.tq.prefill.default,
            tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args),
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "k8v4", "3bit_nc", "tq4_nc", "tqk5v3_nc"])
def test_long_chunk_on_the_gpu(fmt_name, prefix_path, seeded):
    """A GPU-sized case: 300 tokens after a 1000-token prefix, D = 128, group 4, window 128 and
    4 sinks, inline-PTX decoding of the codes, cuDNN's rows; also with padding (the fused
    kernel's own pass over the chunk on either path)."""
    case = Case(fmt_name, seeded, head_dim=128, prefix=1000, tokens=300, window=128, sinks=4)
    case.check("cuda", prefix_path, mask=case.causal_mask())
    case.check("cuda", prefix_path)
    mask = case.causal_mask().repeat(2, 1, 1, 1)
    mask[1, :, :, :7] = False
    case.check("cuda", prefix_path, mask=mask)


class TestPrefillBadInput(expecttest.TestCase):
    def test_rejects_bad_input(self):
        gen = torch.Generator().manual_seed(0)
        case = Case("4bit_nc", gen, prefix=20, tokens=6, batch=1)
        mask = case.causal_mask()
        cases = {
            "float32 query": dict(q=case.q.float()),
            "key of another dtype": dict(key=case.key.half(), value=case.value.half()),
            "chunk length mismatch": dict(key=case.key[:, :, :5], value=case.value[:, :, :5]),
            "no query token": dict(
                q=case.q[:, :, :0], key=case.key[:, :, :0], value=case.value[:, :, :0]
            ),
            "rings of another dtype": dict(
                q=case.q.half(), key=case.key.half(), value=case.value.half()
            ),
            "mask rows": dict(mask=mask[:, :, :2]),
            "mask of int": dict(mask=mask.to(torch.int32)),
            "length below the chunk": dict(seq_lens=torch.tensor([4], dtype=torch.int32)),
        }
        messages = []
        for name, override in cases.items():
            args = (
                dict(
                    q=case.q,
                    key=case.key,
                    value=case.value,
                    seq_lens=case.seq_lens,
                    mask=None,
                    is_causal=False,
                )
                | override
            )
            with self.assertRaises((ValueError, TypeError)) as ctx:
                api.prefill(
                    case.fmt,
                    args["q"],
                    args["key"],
                    args["value"],
                    case.cache,
                    case.block_table,
                    args["seq_lens"],
                    case.consts,
                    is_causal=args["is_causal"],
                    mask=args["mask"],
                    window=case.recent,
                )
            messages.append(f"{name}: {type(ctx.exception).__name__}: {ctx.exception}")
        self.assertExpectedInline(
            "\n".join(messages),
            """\
float32 query: TypeError: tq.prefill: q must be bfloat16 or float16, got torch.float32
key of another dtype: TypeError: tq.prefill: key must have q's dtype torch.bfloat16, got torch.float16
chunk length mismatch: ValueError: tq.prefill: key must be [B, Hk, T, D] = [1, Hk, 6, 64] (q's batch, tokens and head dim), got (1, 2, 5, 64)
no query token: ValueError: tq.prefill: q must hold at least one query token (T >= 1), got shape (1, 8, 0, 64)
rings of another dtype: TypeError: tq.prefill: k_window and v_window must have q's dtype torch.float16 (the model's), got torch.bfloat16
mask rows: ValueError: tq.prefill: mask must be [B or 1, Hq or 1, T, M] = [1 or 1, 8 or 1, 6, M], got shape (1, 1, 2, 34)
mask of int: TypeError: tq.prefill: mask must be bool or floating point, got torch.int32
length below the chunk: ValueError: tq.prefill: seq_lens must be at least T = 6 (the chunk is each sequence's last T positions, stored before), got a length of 4""",  # noqa: E501
        )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
# one test per format: each compiles the kernel twice (about 15 s each), and the workers share
# them out
@pytest.mark.parametrize("fmt_name", ["4bit_nc", "tqk5v3_nc", "3bit_nc", "k8v4", "int8"])
def test_fast_and_portable_paths_agree(fmt_name, seeded):
    """On the GPU, the prefill kernel with the inline-PTX decoding of the codes and with the
    plain-Triton decoding both equal the oracle (rotated keys and values, sign planes, fp8 and
    int8 codes)."""
    case = Case(fmt_name, seeded, head_dim=128, prefix=200, tokens=70)
    mask = case.causal_mask()
    expected = case.run("cuda", torch.float64, mask=mask)
    args = (
        case.fmt,
        case.q.cuda(),
        case.key.cuda(),
        case.value.cuda(),
        type(case.cache)(*(p.cuda() for p in case.cache)),
        case.block_table.cuda(),
        case.seq_lens.cuda(),
        case.consts.rotation.cuda(),
        case.q.shape[-1] ** -0.5,
        False,
        10**6,
        mask.cuda(),
        window_on(case.recent, "cuda"),
    )
    for fast in (True, False):
        with triton_prefill.fused_prefix():
            actual = triton_prefill.prefill(*args, fast=fast).cpu()
        assert rel_error(actual, expected) < TOLERANCE, (fmt_name, fast)
