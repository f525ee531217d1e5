"""Per-sequence held-out loss of the original (bf16, PyTorch) checkpoint, for comparisons on a subset.

``train_small.py`` reports the mean over all held-out sequences; MLX on a CPU evaluates only a few of them in
test time, so the comparison needs PyTorch's loss sequence by sequence. Runs on any machine with PyTorch and
transformers (CPU is enough):

    python3 training/pytorch_heldout.py --hf OUT/hf --model-dir engine/mlx_streaming/models/qwen3-next-code-28m

writes ``heldout_pytorch.json`` into ``--model-dir`` (next to ``heldout.safetensors``).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3NextForCausalLM


@torch.no_grad()
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf", type=Path, required=True, help="the original-layout checkpoint train_small.py wrote")
    p.add_argument("--model-dir", type=Path, required=True, help="the converted model with heldout.safetensors")
    args = p.parse_args()
    tokens = load_file(str(args.model_dir / "heldout.safetensors"))["tokens"].long()
    model = Qwen3NextForCausalLM.from_pretrained(args.hf, dtype=torch.bfloat16).eval()
    losses = []
    for ids in tokens:
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1].float()
        losses.append(F.cross_entropy(logits, ids[1:]).item())
        print(len(losses), losses[-1], flush=True)
    result = {"checkpoint": "bf16 original layout", "framework": f"torch {torch.__version__} (cpu)",
              "seq_len": int(tokens.shape[1]), "loss_per_sequence": losses, "mean": sum(losses) / len(losses)}
    (args.model_dir / "heldout_pytorch.json").write_text(json.dumps(result, indent=1))
    print("mean", result["mean"])


if __name__ == "__main__":
    main()
