"""Trace a decode step of a ``TurboQuantKVCache`` for inductor without a GPU, and build every
kernel the graph launches the way inductor's generated code does (run without TRITON_INTERPRET,
in a subprocess of tests/custom_ops/triton/test_traced.py).

A CPU-only torch cannot trace views of fake CUDA tensors, so the step is traced on fake CPU
tensors with the ops' CUDA path forced: the ops trace through (``inductor_launches``), run
their Triton implementation, and plan the decode with the inline-PTX decoding of a GPU (no
programmatic dependent launch: that needs a CUDA device).

Prints the graph's operator calls, then per traced kernel the arguments its launch counts as
written and whether it built (``ok`` or ``FAILED``); exits 1 if a kernel fails to build."""

from __future__ import annotations

import importlib.util
import re
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F
import triton
from sm90_compile import report
from torch._functorch.aot_autograd import aot_export_module
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._inductor.codegen.wrapper import (
    user_defined_triton_kernel_transitive_closure_source_code as inductor_kernel_source,
)
from torch._inductor.runtime.triton_heuristics import (
    CachingAutotuner,
    config_from_dict,
    config_to_dict,
)
from torch._subclasses.fake_tensor import FakeTensorMode
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from custom_ops import ops
from custom_ops.triton import decode
from custom_ops.triton.offline import offline_target
from tq_compile import TurboQuantKVCache

HQ, HK, D, CONTEXT = 8, 2, 128, 256
_BUILD_DIR = tempfile.TemporaryDirectory()  # the modules built, removed at exit
_TRITON_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}


class Step(torch.nn.Module):
    """One layer's cache write and attention, as the example model runs them."""

    def __init__(self, cache: TurboQuantKVCache):
        super().__init__()
        self.cache = cache

    def forward(self, q, k_new, v_new, input_pos, mask):
        k, v = self.cache.update(input_pos, k_new, v_new)
        return (F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True),)


def trace(fmt: str, window: int, batch: int, tokens: int):
    """The functional graph of one step (fake CPU tensors, the CUDA path forced)."""
    cache = TurboQuantKVCache(batch, HK, CONTEXT, D, preset=fmt, window=window, num_splits=4)
    with FakeTensorMode() as fake:
        step = Step(cache)
        for name, buffer in list(cache.named_buffers()):
            cache._buffers[name] = fake.from_tensor(buffer)
        q = torch.empty(batch, HQ, tokens, D, dtype=torch.bfloat16)
        k_new = torch.empty(batch, HK, tokens, D, dtype=torch.bfloat16)
        pos = torch.arange(tokens) + 100
        mask = torch.ones(1, 1, tokens, CONTEXT, dtype=torch.bool).tril(100)
        graph, _ = aot_export_module(step, (q, k_new, k_new, pos, mask), trace_joint=False)
    return graph


def build(node, label: str) -> None:
    """Build the kernel of a ``triton_kernel_wrapper_functional`` node as inductor does: the
    source of its transitive closure in a fresh module, its constexprs through their repr,
    compiled for sm_90 with the options inductor makes of its config; print ``<label> maxnreg:
    <the register cap in its PTX, or None>``."""
    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    constants = kernel_side_table.get_constant_args(node.kwargs["constant_args_idx"])
    # the constexprs by repr, then the kernel, undecorated (inductor writes its decorators,
    # which hold the constexprs, above it); inductor embeds all of it in a string literal of
    # its generated code, which processes the escapes once
    source = (
        f"import triton\nimport triton.language as tl\n\nCONSTANTS = {constants!r}\n\n"
        f"@triton.jit\n{inductor_kernel_source(kernel.fn)}"
    )
    embedded = "'''" + source + "'''"
    path = Path(_BUILD_DIR.name) / f"{node.name}.py"
    path.write_text(eval(embedded))  # noqa: S307
    spec = importlib.util.spec_from_file_location(f"inductor_{node.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    built = getattr(module, kernel.fn.__name__)
    constants = module.CONSTANTS  # the launch's arguments that are not plain numbers
    # inductor's signature: a pointer of each tensor's dtype, i32 integers and fp64 floats
    signature, constexprs = {}, {}
    for param in built.params:
        value = node.kwargs["kwargs"].get(param.name, constants.get(param.name))
        if param.is_constexpr:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, torch.fx.Node):
            signature[param.name] = "*" + _TRITON_DTYPES[value.meta["val"].dtype]
        else:
            signature[param.name] = "fp64" if isinstance(value, float) else "i32"
    # the config as inductor writes it into its code and reads it back (the register cap
    # rides in its keyword arguments), and the compile options inductor makes of it
    (config,) = kernel.configs
    config = config_from_dict(config_to_dict(config))
    compile_meta = {"num_warps": config.num_warps, "num_stages": config.num_stages, "debug": False}
    cuda = SimpleNamespace(device_props=SimpleNamespace(type="cuda"))
    options = CachingAutotuner._create_compile_options(cuda, config, compile_meta)
    with offline_target():
        compiled = triton.compile(
            ASTSource(built, signature, constexprs),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
    cap = re.search(r"^\.maxnreg (\d+)", compiled.asm["ptx"], re.MULTILINE)
    print(f"{label} maxnreg: {cap and cap.group(1)}", flush=True)


def main(cases: list[str]) -> int:
    results = []
    plan_for = decode.plan_for
    with (
        mock.patch.object(ops, "inductor_launches", lambda op_args: True),
        mock.patch.object(ops, "_use_triton", lambda device: True),
        mock.patch.object(decode, "plan_for", lambda *a: plan_for(*a[:7], True, *a[8:])),
        offline_target(),
    ):  # the mutation analysis of traced launches reads sm_90's TTIR
        for case in cases:
            fmt, window, batch, tokens = case.split(":")
            graph = trace(fmt, int(window), int(batch), int(tokens))
            calls = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
            print(f"{case} calls: {' '.join(calls)}", flush=True)
            for node in graph.graph.nodes:
                if "triton_kernel_wrapper" in str(node.target):
                    name = kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__
                    written = " ".join(node.kwargs["tensors_to_clone"])
                    print(f"{case} {name} writes: {written}", flush=True)
                    label = f"{case} {name}"
                    results.append(
                        report(label, lambda node=node, label=label: build(node, label))
                    )
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
