"""Agreement with the training run: held-out loss in MLX and MTP acceptance in our engine.

The embedded default model carries ``heldout.safetensors`` (token sequences from files the training never
saw), ``training_report.json`` (what PyTorch measured in training) and ``heldout_pytorch.json`` (PyTorch's
loss on each held-out sequence, written by ``training/train_small.py``, so that a subset compares like with
like: MLX's CPU backend takes about 25 s per 512-token sequence). ``mlx-streaming evaluate`` measures the
same figures here, side by side with the recorded ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, Sequence

import mlx.core as mx
import mlx.nn as nn
from tqdm import tqdm

from ..errors import CheckpointError

HELDOUT_FILE = "heldout.safetensors"
REPORT_FILE = "training_report.json"
PYTORCH_LOSSES_FILE = "heldout_pytorch.json"


def _recorded(model_dir: Path, name: str) -> dict:
    path = Path(model_dir) / name
    if not path.exists():
        raise CheckpointError(f"{path}: missing (only a model trained by training/train_small.py carries one)")
    return json.loads(path.read_text())


def training_report(model_dir: Path) -> dict:
    return _recorded(model_dir, REPORT_FILE)


def pytorch_losses(model_dir: Path) -> list:
    """PyTorch's held-out loss of each sequence of ``heldout.safetensors`` (bf16 original checkpoint)."""
    return _recorded(model_dir, PYTORCH_LOSSES_FILE)["loss_per_sequence"]


def heldout_sequences(model_dir: Path) -> mx.array:
    path = Path(model_dir) / HELDOUT_FILE
    if not path.exists():
        raise CheckpointError(f"{path}: missing (only a model trained by training/train_small.py carries one)")
    return mx.load(str(path))["tokens"]


def heldout_loss(model, sequences: mx.array, batch: int = 8) -> float:
    """Mean next-token cross-entropy (nats) over every predicted position, as the training script counts it."""
    total, count = 0.0, 0
    for i in tqdm(range(0, sequences.shape[0], batch), desc="held-out loss", unit="batch", disable=None):
        ids = sequences[i:i + batch]
        logits = model(ids[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, ids[:, 1:], reduction="sum")
        total += loss.item()
        count += ids[:, 1:].size
    return total / count


def mtp_acceptance(streaming_model, prompts: Sequence[Sequence[int]], new_tokens: int, ks=(2, 3, 4)) -> Dict[str, float]:
    """Accepted drafts per verify step of real speculative decoding, pooled over ``prompts``, per K."""
    from ..mtp.drafter import MTPDrafter
    from ..mtp.speculative import mtp_generate

    result = {}
    for k in ks:
        steps = accepted = 0
        for prompt in tqdm(prompts, desc=f"MTP acceptance K={k}", unit="prompt", disable=None):
            _, stats = mtp_generate(streaming_model.model, MTPDrafter(streaming_model.mtp, streaming_model.model),
                                    list(prompt), new_tokens, k)
            steps += stats["steps"]
            accepted += stats["accepted_drafts"]
        result[str(k)] = accepted / steps
    return result


def evaluate(model_dir: Path, config, loss_sequences: int = 8, prompts: int = 16, prompt_len: int = 64,
             new_tokens: int = 96) -> dict:
    """Held-out loss of the first ``loss_sequences`` sequences (mlx-lm's in-memory model) against PyTorch's
    on the same sequences, and MTP acceptance (our engine) next to the training report's."""
    from mlx_lm import load

    from ..model import build_streaming_model

    report = training_report(model_dir)
    sequences = heldout_sequences(model_dir)
    model, _ = load(str(model_dir))
    loss = heldout_loss(model, sequences[:loss_sequences])
    del model
    torch_losses = pytorch_losses(model_dir)[:loss_sequences]
    torch_loss = sum(torch_losses) / len(torch_losses)
    chosen = sequences[:prompts, :prompt_len].tolist()
    with build_streaming_model(model_dir, config.replace(mtp=True)) as sm:
        accept = mtp_acceptance(sm, chosen, new_tokens)
    return {
        "model": str(model_dir),
        "heldout": {"sequences": loss_sequences, "seq_len": int(sequences.shape[1]), "loss_mlx": loss,
                    "loss_pytorch_bf16": torch_loss, "relative_gap": (loss - torch_loss) / torch_loss,
                    "loss_pytorch_all_sequences": report["heldout"]["loss_bf16"]},
        "mtp_accept": {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
                       "engine": accept, "pytorch": report["mtp_accept_bf16"]["avg_accepted_drafts"]},
    }
