"""Command-line arguments the examples share, built without importing torch or the kernels.

An example parses its arguments before its heavy imports (torch, Triton, the ops: seconds on a
busy machine), so that a bad argument fails at once, naming it. The choices come from their one
source, read as text: the presets from ``custom_ops/formats.py``'s ``FORMATS`` and the model
sizes from ``examples/model.py``'s ``transformer_configs``; ``tests/examples/test_arguments.py``
checks that they equal the imported ones. What needs torch (whether a CUDA device is there) is
checked after the imports, still before any work.
"""

from __future__ import annotations

import argparse
import ast
import functools
from pathlib import Path

__all__ = [
    "format_names",
    "head_dims",
    "model_sizes",
    "add_device_argument",
    "add_format_argument",
    "add_model_arguments",
    "check_arguments",
    "check_device",
    "GPU_DRIVER_FILES",
    "resolve_device",
]

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def format_names() -> tuple[str, ...]:
    """The KV-cache presets, sorted: the names of the ``KVFormat(...)`` entries of
    ``custom_ops/formats.py``'s ``FORMATS``, read from its source."""
    tree = ast.parse((ROOT / "custom_ops" / "formats.py").read_text())
    names = [
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "KVFormat"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ]
    return tuple(sorted(names))


@functools.cache
def head_dims() -> tuple[int, ...]:
    """The head dims the kernels support: ``custom_ops/formats.py``'s ``SUPPORTED_HEAD_DIMS``,
    read from its source."""
    tree = ast.parse((ROOT / "custom_ops" / "formats.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == (
            "SUPPORTED_HEAD_DIMS"
        ):
            return tuple(ast.literal_eval(node.value))
    raise LookupError("custom_ops/formats.py defines no SUPPORTED_HEAD_DIMS")


@functools.cache
def model_sizes() -> tuple[str, ...]:
    """The example model's sizes, sorted: the keys of ``examples/model.py``'s
    ``transformer_configs``, read from its source."""
    tree = ast.parse((ROOT / "examples" / "model.py").read_text())
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if getattr(target, "id", None) == "transformer_configs":
            return tuple(sorted(key.value for key in node.value.keys))
    raise LookupError("examples/model.py defines no transformer_configs")


# A GPU's driver leaves these (NVIDIA's, and ROCm's, whose devices torch also calls cuda): without
# any of them torch sees no CUDA device, which can be said before torch is imported.
GPU_DRIVER_FILES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    """``--device cpu|cuda`` (default: CUDA where torch sees a device, :func:`resolve_device`)."""
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], help="default: cuda where torch sees one, else cpu"
    )


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse ``--device cuda`` on a machine without a GPU driver, before torch is imported
    (where a driver is there, :func:`resolve_device` asks torch)."""
    if args.device == "cuda" and not any(Path(f).exists() for f in GPU_DRIVER_FILES):
        parser.error("--device cuda: this machine has no GPU driver (no /dev/nvidiactl)")


def add_format_argument(parser: argparse.ArgumentParser, flag: str = "--format") -> None:
    """``--format``: the KV cache's preset (default 4bit_nc)."""
    parser.add_argument(flag, default="4bit_nc", choices=format_names(), help="the KV format")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device``, ``--preset`` (the example model's size) and ``--format`` (the KV cache's
    preset), each refused by the parser unless it is one it knows."""
    add_device_argument(parser)
    parser.add_argument(
        "--preset",
        choices=model_sizes(),
        help="model size (default: tiny on CPU, 1b-shape on CUDA)",
    )
    add_format_argument(parser)


def check_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str
) -> None:
    """The checks every example makes before its imports: ``--device cuda`` without a GPU
    driver (:func:`check_device`) and any of the integer arguments ``names`` below 1 are refused
    (``parser.error``, exit 2)."""
    check_device(parser, args)
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def resolve_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``args.device``, or CUDA where torch sees a device; ``--device cuda`` without one is
    refused (``parser.error``). Imports torch: call it after the arguments are parsed."""
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    return args.device
