"""custom_ops/triton/traced.py: the kernels launched by inductor's generated code (flat entries,
constexprs written as their repr), and the ops traced through for it (custom_ops/ops.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from conftest import CUDA, triton_kernels
from helpers import inductor_flat_kernels, run_compiler_script, run_python
from torch._inductor import config as inductor_config
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from triton import knobs

from custom_ops import api, ops
from custom_ops.formats import RecentWindow, get_format
from custom_ops.triton import traced
from custom_ops.triton.decode.codes import part_params
from custom_ops.triton.store import side_params
from tq_compile import TurboQuantKVCache


def test_namedtuple_constexprs_print_as_themselves():
    """Inductor writes constexprs into its generated module by repr: the codec parameters'
    repr evaluates, with no name of ours in scope, to an equal tuple of the same class."""
    fmt = get_format("tq3_nc")
    params = [
        *side_params(fmt, fmt.allocate(1, 1, 16, 128), 128),
        part_params(fmt, "k", 128, True),
        part_params(fmt, "v", 128, False),
    ]
    for value in params:
        rebuilt = eval(repr(value), {})  # noqa: S307
        assert type(rebuilt) is type(value) and rebuilt == value


def _step(cache, gen, head_dim, q_heads, tokens):
    """Prefill 40 tokens, append ``tokens`` more and attend with them: the attention output and
    every cache buffer afterwards."""
    heads = cache.k_codes.shape[1]

    def kv(n):
        return (torch.randn(1, heads, n, head_dim, generator=gen).to(torch.bfloat16) for _ in "kv")

    cache.update(torch.arange(40), *kv(40))
    k, v = cache.update(torch.arange(40, 40 + tokens), *kv(tokens))
    q = torch.randn(1, q_heads, tokens, head_dim, generator=gen).to(torch.bfloat16)
    mask = torch.ones(1, 1, tokens, cache.max_seq_length, dtype=torch.bool).tril(40)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return [out, *(b.clone() for b in cache.buffers())]


@pytest.mark.skipif(CUDA, reason="the flat entries launched eagerly: the interpreter's test")
@pytest.mark.parametrize(
    ("fmt", "window", "head_dim", "tokens", "kernels"),
    [
        # the prefill of 40 tokens passes the window's 8 on to the plain store
        ("4bit_nc", 8, 64, 1, {"store_window", "store", "split", "merge"}),
        ("4bit_nc", 0, 64, 1, {"store", "split", "merge"}),
        ("tq3_nc", 8, 64, 2, {"store_window", "store", "split", "ring_partials", "merge"}),
        ("4bit_nc", 8, 96, 1, {"store_window", "store", "prep_query", "split", "merge"}),
    ],
)
def test_flat_entries_compute_what_the_kernels_compute(fmt, window, head_dim, tokens, kernels):
    """Launched through their flat entries (tuples spread into parameters, rebuilt inside),
    the kernels of a step leave the same bytes in the cache and the same attention output as
    launched directly; every kernel of the step went through an entry."""
    results, launched = [], set()
    real_launch = traced.launch_traced

    def spy(kernel, *args):
        launched.add(kernel.__name__.removesuffix("_kernel"))
        real_launch(kernel, *args)

    for flat in (False, True):
        cache = TurboQuantKVCache(1, 1, 64, head_dim, preset=fmt, window=window, num_splits=2)
        gen = torch.Generator().manual_seed(7)
        with triton_kernels("cpu"), mock.patch.object(traced, "launch_traced", spy):
            if flat:  # under the interpreter wrap_triton hands back the kernel: launched here
                with traced.traced_launches():
                    results.append(_step(cache, gen, head_dim, 2, tokens))
            else:
                results.append(_step(cache, gen, head_dim, 2, tokens))
    assert launched == kernels
    for direct, through_entry in zip(*results, strict=True):
        assert torch.equal(direct, through_entry)


def test_inductor_builds_every_traced_kernel():
    """A decode step traced for inductor (fake tensors, the CUDA path forced) has no tq op
    left, only the kernels' launches, and each kernel builds from the source inductor writes
    for it (its transitive closure, constexprs by repr, the config as inductor reads it back),
    for sm_90: appends with and without a window, a ring kernel, fp8 keys, a 4-token verify
    step; a decode token's step (window, unrotated values: 4-bit and fp8) in the split kernel and
    the merge. From PyTorch 2.13 on, whose mutation analysis sees through pure inline PTX, each
    launch counts as written exactly what its kernel writes (2.11 counts every argument): the
    step's split kernel the planes too (its eviction), its merge the rings and the
    lengths (the fill)."""
    cases = ["4bit_nc:16:2:1", "4bit_nc:0:1:1", "tq3_nc:16:2:1", "fp8:16:1:1", "k8v4:16:1:4"]
    result = run_compiler_script("inductor_trace.py", *cases)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, "\n".join(lines[-20:]) + result.stderr[-3000:]
    calls = [line for line in lines if " calls: " in line]
    built = [line for line in lines if line.endswith(": ok")]
    assert len(calls) == len(cases) and not [c for c in calls if "tq." in c], "\n".join(calls)
    # store or store_window, split, merge (a decode step: the split kernel, merge_fill); and
    # the ring kernel of tq3_nc's rotated values
    assert len(built) == 3 * len(cases) + 1 - 2, result.stdout
    # the plan's register caps reach the compile through inductor's options: the long split's
    # 128, a 4-token verify step's 192 (16 rows); no other kernel has one
    caps = {line.split("_flat_")[0]: line.split(": ")[1] for line in lines if " maxnreg: " in line}
    assert caps["4bit_nc:16:2:1 split_kernel"] == "128", caps
    assert caps["k8v4:16:1:4 split_kernel"] == "192", caps
    assert {cap for name, cap in caps.items() if "split_kernel" not in name} == {"None"}, caps
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13):
        written = {
            (line.split()[0], line.split(" writes: ")[0].split()[1].split("_flat_")[0]): (
                line.split(": ")[1]
            )
            for line in lines
            if " writes: " in line
        }
        plain = "part_out_ptr part_lse_ptr"
        window_store = "rings_0 rings_1 rings_2 planes_0 planes_1 planes_2 seq_lens_ptr"
        step = {
            "split_kernel": f"planes_0 planes_1 planes_2 {plain}",
            "merge_fill_kernel": "out_ptr rings_0 rings_1 rings_2 new_lens_ptr",
        }
        assert written == {
            **{("4bit_nc:16:2:1", kernel): writes for kernel, writes in step.items()},
            ("4bit_nc:0:1:1", "store_kernel"): "planes_0 planes_1 planes_2",
            ("4bit_nc:0:1:1", "split_kernel"): plain,
            ("4bit_nc:0:1:1", "merge_kernel"): "out_ptr",
            ("tq3_nc:16:2:1", "store_window_kernel"): window_store,
            ("tq3_nc:16:2:1", "split_kernel"): plain,
            ("tq3_nc:16:2:1", "ring_partials_kernel"): plain,
            ("tq3_nc:16:2:1", "merge_kernel"): "out_ptr",
            **{("fp8:16:1:1", kernel): writes for kernel, writes in step.items()},
            ("k8v4:16:1:4", "store_window_kernel"): window_store,
            ("k8v4:16:1:4", "split_kernel"): plain,
            ("k8v4:16:1:4", "merge_kernel"): "out_ptr",
        }, written


# A fresh process: the compile options inductor makes of a config with and without a register
# cap, before and after it evaluates one of our constexprs as its generated code does.
_REGISTER_CAP_PROBE = """
from types import SimpleNamespace
import triton
from torch._inductor.runtime.triton_heuristics import CachingAutotuner
from custom_ops.formats import get_format
from custom_ops.triton.decode.codes import part_params

def cap(config):
    cuda = SimpleNamespace(device_props=SimpleNamespace(type="cuda"))
    meta = {"num_warps": 1, "num_stages": 2, "debug": False}
    return CachingAutotuner._create_compile_options(cuda, config, meta).get("maxnreg")

capped, plain = triton.Config({}, num_warps=1, maxnreg=128), triton.Config({}, num_warps=1)
before = cap(capped)
eval(repr(part_params(get_format("4bit_nc"), "k", 128, True)), {})
print(before, cap(capped), cap(plain))
"""


def test_inductor_keeps_a_register_cap_once_it_loads_our_constexprs():
    """Inductor's compile options drop a config's ``maxnreg`` until the process evaluates one
    of our NamedTuple constexprs, as it does loading one of our kernels to compile it (a
    compile worker, or the parent): then a capped config keeps its cap and an uncapped one
    gets none."""
    result = run_python(["-c", _REGISTER_CAP_PROBE])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == "None 128 None"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="inductor compiles the kernels for a GPU")
def test_inductor_compiles_the_long_split_under_its_register_cap():
    """A plain-compiled decode with a window over splits of several tiles, in fresh inductor
    caches: inductor builds the split kernel under the plan's cap of 128 registers, which it
    would otherwise drop (157-166 on an H200 for this kernel, 16-35% slower:
    traced.honour_register_caps), and the output equals the eager decode's."""
    from torch._inductor.codecache import PyCodeCache
    from torch._inductor.utils import fresh_cache

    fmt, heads, head_dim, seq, window = get_format("4bit_nc"), 2, 128, 2048, 128
    consts = api.make_constants(fmt, head_dim, device="cuda")
    cache = fmt.allocate(seq // 16, heads, 16, head_dim, "cuda")
    key, value = (
        torch.randn(seq, heads, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv"
    )
    api.store(fmt, cache, key, value, torch.arange(seq, device="cuda", dtype=torch.int32), consts)
    table = torch.arange(seq // 16, device="cuda", dtype=torch.int32)[None]
    lens = torch.tensor([seq - 5], device="cuda", dtype=torch.int32)
    rings = [
        torch.randn(1, heads, window, head_dim, device="cuda", dtype=torch.bfloat16) for _ in "kv"
    ]
    positions = api.appended_window_positions(lens, heads, window, 0)
    q = torch.randn(1, 4 * heads, head_dim, device="cuda", dtype=torch.bfloat16)

    def attend(q):  # 4 splits of 512 tokens: 16 tiles each
        return api.decode(
            fmt,
            q,
            cache,
            table,
            lens,
            consts,
            num_splits=4,
            window=RecentWindow(*rings, positions),
        )

    torch._dynamo.reset()
    with fresh_cache():  # empties PyCodeCache.modules on entry and on exit: read inside
        out = torch.compile(attend, fullgraph=True)(q)
        registers = [
            launcher.n_regs
            for name, tuner in inductor_flat_kernels(PyCodeCache.modules).items()
            if name.startswith("split_kernel")
            for launcher in tuner.launchers
        ]
    torch._dynamo.reset()
    assert registers and all(0 < n <= 128 for n in registers), registers
    torch.testing.assert_close(out, attend(q), atol=0, rtol=0)


def test_traced_launch_has_no_programmatic_dependent_launch():
    """A traced launch drops ``launch_pdl`` and turns the kernel's ``PDL`` constexpr off
    (inductor launches without it; its waits would hide the kernel's writes from the mutation
    analysis); the launch options travel in the one config, the register cap in its kwargs;
    integer arguments become constexprs of the flat entry."""
    calls = []

    class Recorded:  # what wrap_triton(kernel)[grid](*args, **kwargs) would trace
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((self.kernel, grid, args, kwargs))

    fmt = get_format("4bit_nc")
    launcher_kwargs = dict(
        D=128,
        D_PAD=128,
        INV_SQRT_D=0.088,
        BLOCK_R=16,
        K=fmt,
        V=fmt,
        PDL=True,
        num_warps=2,
        maxnreg=128,
        launch_pdl=True,
    )
    with mock.patch.object(torch.library, "wrap_triton", Recorded):
        traced.launch_traced(_kernel_with_pdl, launcher_kwargs, (3,), ((torch.empty(1), 5), 1.5))
    ((tuned, grid, args, kwargs),) = calls
    # the tuple's int is compiled in (a constexpr of the flat entry), the tensor and the float
    # are passed
    assert grid == (3,) and len(args) == 2 and kwargs["pair_1"] == 5 and kwargs["PDL"] is False
    assert "launch_pdl" not in kwargs and "num_warps" not in kwargs and "maxnreg" not in kwargs
    (config,) = tuned.configs
    assert (config.num_warps, config.kwargs) == (2, {"maxnreg": 128})


@triton.jit
def _kernel_with_pdl(
    pair,
    scale,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    INV_SQRT_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    PDL: tl.constexpr,
):
    pass


def test_only_inductor_launches_the_kernels():
    """The ops are traced through only while inductor traces (not aot_eager, not export), on
    CUDA, without CUDA graphs, with static shapes (a dynamic dimension keeps the op: the launch
    plan needs concrete shapes)."""
    shape_env = ShapeEnv()
    # (mock.patch of a Triton knob does not restore it; the knobs' own scope does)
    with FakeTensorMode(shape_env=shape_env) as fake, knobs.runtime.scope():
        knobs.runtime.interpret = False
        static = (torch.empty(2, 4, device="cuda"), 3)
        dynamic = (torch.empty(shape_env.create_unbacked_symint(), 4, device="cuda"), 3)
        on_cpu = (torch.empty(2, 4), 3)
        assert not ops.inductor_launches(static)  # no inductor compile under way
        with V.set_fake_mode(fake):
            assert ops.inductor_launches(static)
            assert not ops.inductor_launches(dynamic)
            assert not ops.inductor_launches(on_cpu)
            with inductor_config.patch({"triton.cudagraphs": True}):
                assert not ops.inductor_launches(static)


# A fresh process: import inductor's config and custom_ops in the given order, print the
# config's switch and the environment variable.
_STATIC_LAUNCH_PROBE = """
import importlib, os, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from torch._inductor import config
print(config.static_launch_user_defined_triton_kernels, os.environ.get({env!r}))
"""


@pytest.mark.parametrize(
    ("preset", "first", "expected"),
    [
        (None, "torch._inductor.config", "True 1"),  # config read before the variable was set
        (None, "custom_ops", "True 1"),
        ("0", "torch._inductor.config", "False 0"),  # the user's choice stays
    ],
)
def test_inductor_launches_user_kernels_statically_unless_told_not_to(preset, first, expected):
    """Importing custom_ops turns on inductor's static launch of user-defined Triton kernels
    (the tq kernels it launches itself), for this process and its compile workers (the
    environment variable), whichever was imported first; a preset variable is respected."""
    probe = _STATIC_LAUNCH_PROBE.format(env=traced.STATIC_LAUNCH_ENV)
    others = ["custom_ops", "torch._inductor.config"]
    others.remove(first)
    env = {} if preset is None else {traced.STATIC_LAUNCH_ENV: preset}
    result = run_python(["-c", probe, first, *others], env=env, drop=(traced.STATIC_LAUNCH_ENV,))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == expected
