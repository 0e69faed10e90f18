"""Speculative greedy decoding over a TurboQuant KV cache, gpt-fast style.

Each round proposes ``k`` draft tokens, runs the target model once over the current token and
the drafts (a *verify* step: ``k + 1`` query tokens, which the cache's ``TurboQuantKVTensor``
sends to the multi-token ``tq.decode``), keeps the drafts up to the first one the target
disagrees with plus the target's own next token, and continues from there: the cache positions
of the rejected drafts are simply written again by the next round (the recent window records
its slots' positions, so a rollback is exact). The output equals plain greedy decoding with
the same cache, token for token, except where two logits are so close that the rounding of a
different kernel path flips the choice.

Drafts come from
* ``--draft lookup`` (default): prompt lookup, the ``k`` tokens that followed the latest
  earlier occurrence of the context's last n-gram (no draft model; wins on repetitive text);
* ``--draft early-exit``: the target's first ``--draft-layers`` layers and its output head
  (LayerSkip-style self-speculation: a smaller example model that shares the target's
  weights, with its own TurboQuant caches);
* ``--draft replay``: the plain run's own tokens, each replaced by another with probability
  ``1 - --accept``: a stand-in for a draft model that agrees with the target that often, to
  time the verify steps and rollbacks at a chosen acceptance rate (the random-weight example
  model is no good at predicting itself: prompt lookup and early exit accept few drafts). The
  replay decides acceptance itself (the drafts up to the first replaced one) and continues
  with the plain run's tokens (a random model's top logits nearly tie so often that the verify
  path's other rounding would soon leave them, after which no replayed draft would match): the
  verify steps run and cost as in a real run, plus one small copy of the next token to the
  device per round. It reports how often the verify step's own choice was the replayed token.

The verify step (and the draft model's step) is compiled with ``mode="reduce-overhead"``
(CUDA graphs) on CUDA: captured once, replayed across rollbacks, positions in device tensors.
Prints the acceptance rate and tokens/s against plain greedy decoding with the same cache.

    python examples/speculative.py                          # CPU or CUDA, whichever is here
    python examples/speculative.py --draft early-exit --drafts 3 --new-tokens 200
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from examples.arguments import add_model_arguments, check_arguments, resolve_device  # noqa: E402


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser and the checked arguments (torch is not imported: a bad one fails at once;
    ``--draft-layers`` against the model's depth is checked once the model is known)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--draft", choices=("lookup", "early-exit", "replay"), default="lookup")
    parser.add_argument(
        "--accept",
        type=float,
        default=0.8,
        help="--draft replay: how often a draft is the target's",
    )
    parser.add_argument("--drafts", type=int, default=4, help="k, draft tokens per round (<= 15)")
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="default: 48 on CPU, 200 on CUDA"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true", help="eager steps")
    args = parser.parse_args(argv)
    check_arguments(parser, args, "prompt_len", "new_tokens", "draft_layers")
    if not 1 <= args.drafts <= 15:
        parser.error(
            f"--drafts must be in [1, 15] (a verify step reads at most 16 tokens), "
            f"got {args.drafts}"
        )
    if not 0 <= args.accept <= 1:
        parser.error(f"--accept must be in [0, 1], got {args.accept}")
    return parser, args


if __name__ == "__main__":
    PARSER, ARGS = parse_args()  # before the imports below, which take seconds

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from examples.generate import sync  # noqa: E402
from examples.model import (  # noqa: E402
    ModelArgs,
    Transformer,
    decode_one_token,
    init_weights,
    prefill,
)
from tq_compile import TurboQuantKVConfig, quantize_  # noqa: E402
from tq_compile.options import default_sinks  # noqa: E402


def verify(model: Transformer, tokens: Tensor, input_pos: Tensor) -> Tensor:
    """The target's greedy choice after each of ``tokens [1, k + 1]`` at ``input_pos [k + 1]``:
    ``[1, k + 1] int64`` (the step to compile)."""
    return model(tokens, input_pos).argmax(dim=-1)


def early_exit_draft(model: Transformer, n_layer: int) -> Transformer:
    """A draft model of the target's first ``n_layer`` layers, norm and output head: its
    parameters are the target's tensors (no copy); its caches are its own."""
    config = ModelArgs(**{**vars(model.config), "n_layer": n_layer})
    with torch.device("meta"):
        draft = Transformer(config)
    for name, part in (
        ("tok_embeddings", model.tok_embeddings),
        ("norm", model.norm),
        ("output", model.output),
    ):
        getattr(draft, name).load_state_dict(part.state_dict(), assign=True)
    for mine, theirs in zip(draft.layers, model.layers[:n_layer], strict=True):
        mine.load_state_dict(theirs.state_dict(), assign=True)
    draft.freqs_cis = model.freqs_cis
    return draft


def lookup_drafts(history: list[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt lookup: the ``k`` tokens after the latest earlier occurrence of the longest
    trailing n-gram (``n <= max_ngram``) of ``history``, padded by repeating the last one;
    without a match, the last token ``k`` times."""
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        tail = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == tail:
                follow = history[start + n : start + n + k]
                return follow + [follow[-1]] * (k - len(follow))
    return [history[-1]] * k


@dataclass
class Result:
    tokens: list[int]  # the generated tokens (the prefill's prediction first)
    seconds: float  # wall time after the first round (or step): compilation excluded
    timed_tokens: int  # tokens generated in that time
    proposed: int = 0  # drafts proposed
    accepted: int = 0  # drafts accepted
    checked: int = 0  # replay: positions taken from it (accepted drafts, the token after)
    matched: int = 0  # replay: of those, where the verify step chose the same token
    margins: list[float] | None = None  # plain decoding: each choice's top-2 logit gap


def _margin(logits: Tensor) -> float:
    top2 = logits.float().topk(2, dim=-1).values[0]
    return float(top2[0] - top2[1])


@torch.no_grad()
def plain_greedy(model, prompt: Tensor, n_new: int, step_fn, device: str) -> Result:
    """Greedy decoding of ``n_new`` tokens after ``prompt [1, P]`` with one-token steps."""
    prompt_len = prompt.shape[1]
    token, logits = prefill(model, prompt, torch.arange(prompt_len, device=device))
    tokens, margins, start = [int(token)], [_margin(logits)], None
    for i in range(n_new - 1):
        if i == 2:
            sync(device)
            start = time.perf_counter()
        token, logits = step_fn(model, token, torch.tensor([prompt_len + i], device=device))
        token = token.clone()
        tokens.append(int(token))  # the host reads each token, as a streaming server does
        margins.append(_margin(logits))
    sync(device)
    seconds = time.perf_counter() - start if start is not None else 0.0
    return Result(tokens, seconds, max(0, n_new - 3), margins=margins)


@torch.no_grad()
def speculative_greedy(
    model,
    prompt: Tensor,
    n_new: int,
    k: int,
    verify_fn,
    device: str,
    draft=None,
    draft_step=None,
    replay: list[int] | None = None,
    accept: float = 1.0,
    seed: int = 0,
) -> Result:
    """Greedy decoding of ``n_new`` tokens after ``prompt [1, P]``, ``k`` drafts per round from
    ``draft`` (a model with its own caches, stepped by ``draft_step``), from ``replay`` (the
    tokens to expect, each kept with probability ``accept``; the kept ones up to the first
    replaced one are accepted and the replayed token follows, whatever the verify step chose)
    or by prompt lookup."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    prompt_len = prompt.shape[1]
    positions = torch.arange(prompt_len, device=device)
    token, _ = prefill(model, prompt, positions)
    if draft is not None:
        prefill(draft, prompt, positions)
    history = prompt[0].tolist() + [int(token)]
    result = Result([int(token)], 0.0, 0)
    pos, draft_len, start = prompt_len, prompt_len, None  # draft_len: positions in its cache
    while len(result.tokens) < n_new:
        if replay is not None:
            expected = replay[len(result.tokens) : len(result.tokens) + k + 1]
            expected += [expected[-1] if expected else 0] * (k + 1 - len(expected))
            # a draft past the plain run's tokens cannot be accepted: the round's tokens stay
            # within them
            within = torch.arange(k) < len(replay) - len(result.tokens) - 1
            kept = (torch.rand(k, generator=gen) < accept) & within
            replayed = torch.tensor(expected[:k])
            other = (replayed + torch.randint(1, vocab, (k,), generator=gen)) % vocab
            drafts = torch.where(kept, replayed, other)[None].to(device)
        elif draft is None:
            drafts = torch.tensor([lookup_drafts(history, k)], device=device)
        else:
            if draft_len < pos:  # every draft was accepted: the last one is not in its cache
                draft_step(
                    draft,
                    torch.tensor([[history[-2]]], device=device),
                    torch.tensor([pos - 1], device=device),
                )
            proposed, current = [], token
            for i in range(k):
                current, _ = draft_step(draft, current, torch.tensor([pos + i], device=device))
                current = current.clone()
                proposed.append(current)
            drafts = torch.cat(proposed, dim=1)  # [1, k]
            draft_len = pos + k
        tokens = torch.cat([token, drafts], dim=1)  # [1, k + 1]
        chosen = verify_fn(model, tokens, torch.arange(pos, pos + k + 1, device=device))
        if replay is None:
            agree = (chosen[0, :k] == drafts[0]).int().cumprod(dim=0)
            n_accepted = int(agree.sum())  # the round's one host sync
            new = drafts[0, :n_accepted].tolist() + [int(chosen[0, n_accepted])]
            token = chosen[:, n_accepted : n_accepted + 1].clone()
        else:  # the replay decides; the verify step's choices are read all the same
            n_accepted = int(kept.int().cumprod(dim=0).sum())
            new = expected[: n_accepted + 1]
            same = chosen[0, : n_accepted + 1].cpu() == torch.tensor(new)  # the host sync
            result.checked += n_accepted + 1
            result.matched += int(same.sum())
            token = torch.tensor([new[-1:]], device=device)
        result.proposed += k
        result.accepted += n_accepted
        result.tokens += new
        history += new
        pos += n_accepted + 1
        draft_len = min(draft_len, pos)  # positions from pos on are rewritten next round
        if start is None:  # the first round compiles and captures: not timed
            sync(device)
            start, timed_from = time.perf_counter(), len(result.tokens)
    sync(device)
    result.seconds = time.perf_counter() - start
    result.timed_tokens = len(result.tokens) - timed_from
    result.tokens = result.tokens[:n_new]
    return result


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    device = resolve_device(parser, args)
    n_new = args.new_tokens or (200 if device == "cuda" else 48)
    cfg = ModelArgs.from_name(args.preset or ("1b-shape" if device == "cuda" else "tiny"))
    if not 1 <= args.draft_layers < cfg.n_layer:
        parser.error(f"--draft-layers must be in [1, {cfg.n_layer})")
    max_seq = args.prompt_len + n_new + args.drafts + 1
    with torch.device(device):
        model = init_weights(Transformer(cfg), args.seed).to(torch.bfloat16).eval()
    draft = early_exit_draft(model, args.draft_layers) if args.draft == "early-exit" else None
    gen = torch.Generator().manual_seed(args.seed)
    # a prompt with repeats, as the inputs prompt lookup serves (code, documents, chat history)
    motif = torch.randint(0, cfg.vocab_size, (args.prompt_len // 4,), generator=gen)
    prompt = motif.repeat(4)[None, : args.prompt_len].to(device)
    config = TurboQuantKVConfig(args.format, window=args.window)
    mode = "reduce-overhead" if device == "cuda" else "default"

    def compiled(fn):
        return fn if args.no_compile else torch.compile(fn, mode=mode, fullgraph=True)

    def fresh_caches():
        for m in (model, draft) if draft is not None else (model,):
            m.setup_caches(1, max_seq)
            quantize_(m, config)

    print(
        f"{cfg.n_layer}-layer model (Hq={cfg.n_head}, Hk={cfg.n_local_heads}, D="
        f"{cfg.head_dim}) on {device}, {args.format} cache (window {args.window}); "
        f"{n_new} tokens after a {args.prompt_len}-token prompt"
    )
    if max_seq <= args.window + default_sinks(args.window, None):
        # the ring and the sink slots hold every position: the pages are never read
        print(
            f"  (window and sinks hold all {max_seq} positions, so no token is quantized: "
            "--window 16 runs the compressed cache)"
        )
    step = compiled(decode_one_token)
    for label in ("warm-up", "plain"):  # the first run compiles and captures
        fresh_caches()
        plain = plain_greedy(model, prompt, n_new if label == "plain" else 8, step, device)
    verify_fn, draft_step = compiled(verify), compiled(decode_one_token)
    for label in ("warm-up", "speculative"):
        fresh_caches()
        replay = plain.tokens if args.draft == "replay" else None
        spec = speculative_greedy(
            model,
            prompt,
            n_new if label == "speculative" else 8,
            args.drafts,
            verify_fn,
            device,
            draft,
            draft_step,
            replay,
            args.accept,
            args.seed,
        )
    same = next(
        (i for i, (a, b) in enumerate(zip(plain.tokens, spec.tokens, strict=True)) if a != b),
        n_new,
    )
    plain_rate = plain.timed_tokens / plain.seconds
    spec_rate = spec.timed_tokens / spec.seconds
    rounds = spec.proposed // args.drafts
    print(
        f"drafts ({args.draft}, k={args.drafts}): {spec.accepted}/{spec.proposed} accepted "
        f"({spec.accepted / spec.proposed:.1%}), {(spec.accepted + rounds) / rounds:.2f} "
        "tokens per verify step"
    )
    print(
        f"tokens/s: plain {plain_rate:,.1f}, speculative {spec_rate:,.1f} "
        f"({spec_rate / plain_rate:.2f}x)"
    )
    if replay is not None:  # the replay's tokens are the plain run's by construction
        print(
            f"verify steps chose the replayed token at {spec.matched} of {spec.checked} "
            "accepted positions (and their next tokens)"
        )
        return
    print(f"output equal to plain greedy decoding: {same} of {n_new} tokens")
    if same < n_new:
        median = sorted(plain.margins)[len(plain.margins) // 2]
        print(
            f"  at token {same} plain decoding's top two logits differ by "
            f"{plain.margins[same]:.4f} (median over its tokens {median:.4f}): where they "
            "nearly tie, another kernel path's rounding can pick the other"
        )


if __name__ == "__main__":
    main(PARSER, ARGS)
