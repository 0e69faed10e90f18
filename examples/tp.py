"""Tensor-parallel decode of the example model (gpt-fast's ``tp.py``), bf16 or TurboQuant caches.

Each rank holds a slice of every layer: ``wqkv``, ``w1`` and ``w3`` are split by output features
(column-parallel: rank ``r`` computes query heads ``r * Hq/N ...`` and kv-heads ``r * Hk/N
...``), ``wo`` and ``w2`` by input features (row-parallel: each rank's partial sums are added
by an all-reduce). The all-reduce goes through ``torch.distributed._functional_collectives``,
which ``torch.compile(fullgraph=True)`` traces and CUDA graphs capture. Embedding, norms and the
output layer are replicated, so every rank computes the same logits.

A rank's attention then has ``Hq/N`` query heads and ``Hk/N`` kv-heads, and its KV cache, set up
*after* sharding (``model.setup_caches`` reads the per-rank ``model.config``), holds only those
kv-heads: a bf16 ``KVCache`` or, after ``tq_compile.quantize_`` on the rank's model, a
``TurboQuantKVCache`` whose decode split count is chosen from that rank's share. Nothing in
the library knows about the other ranks. N must divide Hk (and the feed-forward width).

Two ways to shard, same result:

* :func:`apply_tp`: gpt-fast's module surgery (weights sliced in place, an all-reduce hook on
  each attention and feed-forward module).
* :func:`parallelize_dtensor`: DTensor's ``parallelize_module`` with ``ColwiseParallel`` /
  ``RowwiseParallel`` on the same five linears. Their outputs are turned back into local
  tensors (``use_local_output=True``, the default), so the caches only ever see plain per-rank
  tensors and work unchanged, eager and compiled. (A KV cache cannot itself be a DTensor: the
  ``torch.ops.tq`` ops have no DTensor sharding rules. Nothing needs it to be one.)

Launch one process per device (NCCL on CUDA, gloo on the CPU):

    torchrun --nproc-per-node 2 examples/tp.py                       # 4bit_nc, tiny on CPU
    torchrun --nproc-per-node 2 examples/tp.py --preset 8b-shape --compile   # 2 GPUs
    torchrun --nproc-per-node 2 examples/tp.py --cache bf16 --route dtensor

Shapes: B batch, Hq / Hk query / kv heads of the whole model, N ranks, D head dimension.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.arguments import (  # noqa: E402
    add_device_argument,
    check_arguments,
    format_names,
    model_sizes,
    resolve_device,
)

ROUTES = ("funcol", "dtensor")


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked arguments (torch is not imported: a bad one fails at once)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_argument(parser)
    parser.add_argument(
        "--preset",
        choices=model_sizes(),
        help="model size (default: tiny on CPU, 1b-shape on CUDA)",
    )
    parser.add_argument(
        "--cache",
        default="4bit_nc",
        choices=("bf16", *format_names()),
        help="bf16 or a TurboQuant format",
    )
    parser.add_argument("--window", type=int, default=16, help="TurboQuant recent window")
    parser.add_argument("--route", default="funcol", choices=ROUTES)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--compile", action="store_true", help="compile the decode step (reduce-overhead on CUDA)"
    )
    args = parser.parse_args(argv)
    check_arguments(parser, args, "batch", "prompt_len", "new_tokens")
    return parser, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # before the imports below, which take seconds

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed import _functional_collectives as funcol  # noqa: E402

from examples.generate import sync  # noqa: E402
from examples.model import (  # noqa: E402
    ModelArgs,
    Transformer,
    decode_one_token,
    generate,
    init_weights,
)
from tq_compile import TurboQuantKVConfig, kv_cache_nbytes, quantize_  # noqa: E402

__all__ = [
    "init_distributed",
    "process_group",
    "leave_process_group",
    "shard_config",
    "apply_tp",
    "parallelize_dtensor",
]

# DTensor plans for one TransformerBlock: the five linears gpt-fast shards.
COLWISE = ("attention.wqkv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """Join the process group that ``torchrun`` describes in the environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    Args:
        device: ``"cuda"`` (NCCL, one GPU per local rank) or ``"cpu"`` (gloo).

    Returns:
        ``(rank, world_size, this rank's device)``.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    missing = [k for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"{', '.join(missing)} not set: launch with torchrun, e.g. "
            "`torchrun --nproc-per-node 2 examples/tp.py`"
        )
    if device == "cuda":
        rank_device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(rank_device)
        dist.init_process_group("nccl", device_id=rank_device)
    else:
        rank_device = torch.device("cpu")
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), rank_device


@contextlib.contextmanager
def process_group(device: str):
    """:func:`init_distributed` for the ``with`` block (yields its result); the group is
    destroyed when the block ends normally. A rank whose block raises leaves the group as it is
    and exits with the error: NCCL's teardown would wait for peers still inside a collective
    (a two-GPU test hung there instead of reporting a failed rank)."""
    joined = init_distributed(device)
    yield joined
    leave_process_group()


def leave_process_group() -> None:
    """Destroy the default process group after releasing every CUDA graph that
    ``torch.compile`` recorded (``mode="reduce-overhead"``; this resets dynamo's compile caches).

    A recorded graph that captured NCCL collectives makes ``destroy_process_group`` wait forever
    (pytorch/pytorch#115388): a two-GPU run finished its 200 compiled steps and then hung there on
    both ranks. CUDA graphs a caller recorded itself (``torch.cuda.CUDAGraph``) must be deleted
    before this call for the same reason.
    """
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
        torch._dynamo.reset()  # frees the cudagraph trees' graphs with the compiled code
        gc.collect()
    dist.destroy_process_group()


def shard_config(config: ModelArgs, world_size: int) -> ModelArgs:
    """One rank's share of ``config``: ``n_head``, ``n_local_heads`` and ``intermediate_size``
    divided by ``world_size``; ``dim``, ``head_dim`` and the rest unchanged.

    Raises:
        ValueError: ``world_size`` does not divide the kv-heads (each rank must hold whole
            kv-heads, and with them whole GQA groups of query heads) or the feed-forward width.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if config.n_local_heads % world_size:
        divisors = [n for n in range(1, config.n_local_heads + 1) if config.n_local_heads % n == 0]
        raise ValueError(
            f"tensor-parallel degree {world_size} does not divide the model's "
            f"n_local_heads={config.n_local_heads} kv-heads: each rank must hold whole kv-heads; "
            f"use a degree in {divisors}"
        )
    if config.intermediate_size % world_size:
        raise ValueError(
            f"tensor-parallel degree {world_size} does not divide "
            f"intermediate_size={config.intermediate_size}"
        )
    return dataclasses.replace(
        config,
        n_head=config.n_head // world_size,
        n_local_heads=config.n_local_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


def _qkv_rank_major(weight: Tensor, sizes: tuple[int, int, int], world_size: int) -> Tensor:
    """``wqkv``'s rows ``[q | k | v]`` (``sizes`` = their counts ``Hq*D, Hk*D, Hk*D``) reordered
    to ``[q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...]``, so that the ``r``-th of ``world_size``
    equal chunks is rank ``r``'s query heads, then its kv-heads' keys and values."""
    parts = [part.chunk(world_size, dim=0) for part in weight.split(sizes, dim=0)]
    return torch.cat([chunk for rank_parts in zip(*parts, strict=True) for chunk in rank_parts])


def _check_no_caches(model: Transformer) -> None:
    if any(layer.attention.kv_cache is not None for layer in model.layers):
        raise ValueError(
            "the model's KV caches are already set up with all kv-heads: shard first, then call "
            "model.setup_caches(...) (and tq_compile.quantize_) so each rank's cache holds only "
            "its own kv-heads"
        )


def _attention_sizes(model: Transformer) -> tuple[int, int, int]:
    cfg = model.config
    q_size, kv_size = cfg.n_head * cfg.head_dim, cfg.n_local_heads * cfg.head_dim
    return q_size, kv_size, kv_size


def _use_rank_shapes(model: Transformer, rank_config: ModelArgs) -> None:
    """Point the attention modules and ``model.config`` (read by ``setup_caches``) at one
    rank's head counts."""
    for layer in model.layers:
        layer.attention.n_head = rank_config.n_head
        layer.attention.n_local_heads = rank_config.n_local_heads
    model.config = rank_config


def _shard_linear(linear: nn.Linear, dim: int, rank: int, world_size: int) -> None:
    """Keep rank ``rank``'s chunk of ``linear.weight`` along ``dim`` (0: output features,
    column-parallel; 1: input features, row-parallel), as a fresh tensor so the full weight is
    freed."""
    shard = linear.weight.detach().chunk(world_size, dim=dim)[rank].clone()
    linear.weight = nn.Parameter(shard, requires_grad=False)
    linear.out_features, linear.in_features = shard.shape


def _all_reduce_output(module: nn.Module, args, output: Tensor, group) -> Tensor:
    """Forward hook of a row-parallel block: the sum of every rank's partial output."""
    return funcol.all_reduce(output, "sum", group)


@torch.no_grad()
def apply_tp(model: Transformer, group: dist.ProcessGroup | None = None) -> Transformer:
    """Shard ``model`` in place for this rank of ``group`` (default: the whole world), gpt-fast
    style: column-parallel ``wqkv`` / ``w1`` / ``w3``, row-parallel ``wo`` / ``w2`` with an
    all-reduce of each attention and feed-forward output.

    Every rank must start from the same weights (same seed or checkpoint). Call before
    ``model.setup_caches``; ``model.config`` becomes the rank's share (:func:`shard_config`).

    Returns:
        ``model``.
    """
    _check_no_caches(model)
    group = dist.group.WORLD if group is None else group
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    rank_config = shard_config(model.config, world_size)
    sizes = _attention_sizes(model)
    hook = functools.partial(_all_reduce_output, group=group)
    for layer in model.layers:
        attention, feed_forward = layer.attention, layer.feed_forward
        attention.wqkv.weight.copy_(_qkv_rank_major(attention.wqkv.weight, sizes, world_size))
        for linear in (attention.wqkv, feed_forward.w1, feed_forward.w3):
            _shard_linear(linear, 0, rank, world_size)
        for linear in (attention.wo, feed_forward.w2):
            _shard_linear(linear, 1, rank, world_size)
        attention.register_forward_hook(hook)
        feed_forward.register_forward_hook(hook)
    _use_rank_shapes(model, rank_config)
    return model


@torch.no_grad()
def parallelize_dtensor(model: Transformer, mesh) -> Transformer:
    """Shard ``model`` in place with DTensor: ``parallelize_module`` of each block with
    ``ColwiseParallel`` on ``wqkv`` / ``w1`` / ``w3`` and ``RowwiseParallel`` on ``wo`` /
    ``w2`` over the 1-D device mesh ``mesh``. Weights become DTensors; activations between the
    linears stay local tensors, so each rank's KV cache (set up afterwards, as with
    :func:`apply_tp`) is a plain module holding its own kv-heads.

    ``wqkv``'s rows are first reordered rank-major (DTensor shards a fused weight in equal
    contiguous chunks, which would hand rank 0 all query heads).

    Args:
        mesh: a 1-D ``DeviceMesh`` (e.g. ``init_device_mesh("cuda", (world_size,))``).

    Returns:
        ``model``.
    """
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    _check_no_caches(model)
    if mesh.ndim != 1:
        raise ValueError(f"mesh must be 1-D (tensor parallel only), got {mesh.ndim} dims")
    world_size = mesh.size()
    rank_config = shard_config(model.config, world_size)
    sizes = _attention_sizes(model)
    plan = {name: ColwiseParallel() for name in COLWISE}
    plan |= {name: RowwiseParallel() for name in ROWWISE}
    for layer in model.layers:
        wqkv = layer.attention.wqkv.weight
        wqkv.copy_(_qkv_rank_major(wqkv, sizes, world_size))
        parallelize_module(layer, mesh, plan)
    _use_rank_shapes(model, rank_config)
    return model


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    resolve_device(parser, args)
    with process_group(args.device) as (rank, world_size, device):
        say = print if rank == 0 else (lambda *a, **k: None)
        preset = args.preset or ("1b-shape" if device.type == "cuda" else "tiny")
        cfg = ModelArgs.from_name(preset)
        say(
            f"{preset} model (Hq={cfg.n_head}, Hk={cfg.n_local_heads}, D={cfg.head_dim}) on "
            f"{world_size} {device.type} rank(s), sharded with {args.route}",
            flush=True,
        )
        with torch.device(device):
            model = init_weights(Transformer(cfg), seed=0).to(torch.bfloat16).eval()
        if args.route == "funcol":
            apply_tp(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh

            parallelize_dtensor(model, init_device_mesh(device.type, (world_size,)))
        max_seq = args.prompt_len + args.new_tokens
        model.setup_caches(args.batch, max_seq)
        if args.cache != "bf16":
            quantize_(model, TurboQuantKVConfig(args.cache, window=args.window))
        per_rank = model.config
        say(
            f"each rank: Hq={per_rank.n_head}, Hk={per_rank.n_local_heads}; {args.cache} cache "
            f"{kv_cache_nbytes(model) / 1e6:,.2f} MB per rank for B={args.batch} x {max_seq} "
            "tokens",
            flush=True,
        )
        step = decode_one_token
        if args.compile:
            mode = "reduce-overhead" if device.type == "cuda" else "default"
            step = torch.compile(decode_one_token, mode=mode, fullgraph=True)
        gen = torch.Generator().manual_seed(0)  # the same prompt on every rank
        prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=gen)
        # A short untimed pass first (compilation, CUDA-graph recording); a new prompt at
        # position 0 may reuse the caches, window or not.
        say(f"warm-up, then {args.new_tokens} tokens (compile: {args.compile})...", flush=True)
        generate(model, prompt.to(device), min(4, args.new_tokens), decode_fn=step)
        sync(device.type)
        start = time.perf_counter()
        tokens = generate(model, prompt.to(device), args.new_tokens, decode_fn=step)
        sync(device.type)
        elapsed = time.perf_counter() - start
        say(
            f"{args.batch * args.new_tokens / elapsed:,.0f} tokens/s (prefill included); first "
            f"sequence's new tokens: {tokens[0, args.prompt_len :].tolist()}"
        )


if __name__ == "__main__":
    main(PARSER, ARGS)
