"""Train the small Qwen3-Next (with its MTP head) that mlx-streaming embeds as its default model.

One command on a CUDA machine with PyTorch, transformers (``Qwen3NextForCausalLM``), tokenizers and
safetensors; nothing is downloaded:

    python3 training/train_small.py --out OUT [--epochs 1] [--measure-steps N]

Corpus: the ``*.py`` files of the running Python's site-packages, split by file (a file whose path hashes
to ``crc32 % 100 < 2`` is held out). Tokenizer: byte-level BPE trained on the training split. Model: the
Qwen3-Next layout scaled down (see ``model_config``: 128 routed experts, top-4, a shared expert), trained
from scratch for ``--epochs`` passes over the training split with the main next-token loss plus
``--mtp-weight`` x the MTP head's loss on tokens t+2 .. t+1+``--mtp-unroll`` (the head run on its own output, as
it drafts), and the router's load-balancing loss. Transformers'
Gated-DeltaNet runs on flash-linear-attention's kernels where that package is importable.

Writes ``OUT/model.tar.xz.NN`` (parts of one xz tar; ``cat OUT/model.tar.xz.* | tar -xJ -C OUT``) holding:
    hf/model-*.safetensors      the main model in the original (Hugging Face) layout, bf16
    hf/model-mtp.safetensors    the MTP head under ``mtp.*`` (listed in the index like any shard)
    hf/config.json, the index, the tokenizer files
    meta/heldout.safetensors    the held-out sequences
    meta/heldout_pytorch.json   PyTorch's loss on each of them (bf16 weights)
    meta/report.json            settings and figures: held-out loss and bits per byte, expert usage, MTP
                                draft acceptance at K = 2, 3, 4, generated samples
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.utils.import_utils import is_flash_linear_attention_available
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRMSNorm,
    load_balancing_loss_func,
)

EOS = "<|endoftext|>"
HELDOUT_PERCENT = 2
DEVICE = torch.device("cuda")


def log(*parts):
    print(*parts, flush=True)


# ---------------------------------------------------------------- corpus and tokenizer

def corpus_files(roots, max_bytes):
    """(train texts, held-out texts): every ``*.py`` under ``roots`` in path order, split by file."""
    train, heldout, total = [], [], 0
    for root in roots:
        for path in sorted(Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            rel = str(path.relative_to(root))
            (heldout if zlib.crc32(rel.encode()) % 100 < HELDOUT_PERCENT else train).append(text)
            total += len(text)
            if total >= max_bytes:
                return train, heldout
    return train, heldout


def train_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok, texts):
    """All texts tokenized, each followed by EOS, as one int64 tensor."""
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


# ---------------------------------------------------------------- model

def model_config(args, vocab_size):
    layers = args.layers
    return Qwen3NextConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, intermediate_size=4 * args.hidden,
        num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
        shared_expert_intermediate_size=args.shared_intermediate, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], full_attention_interval=4,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        max_position_embeddings=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 0.25},
        rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=args.aux_weight,
        mtp_num_hidden_layers=1, bos_token_id=None, eos_token_id=0, pad_token_id=None,
    )


class MTPHead(nn.Module):
    """Qwen3-Next's MTP module: ``fc(cat(norm_e(embed(t+1)), norm_h(hidden_t)))``, one full-attention MoE
    decoder layer, ``norm``; embedding and lm_head are the main model's. Names match ``mtp.*``."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList([Qwen3NextDecoderLayer(config, layer_idx=config.full_attention_interval - 1)])
        self.norm = Qwen3NextRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, embeddings, hidden, position_embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeddings), self.pre_fc_norm_hidden(hidden)], -1))
        x = self.layers[0](x, position_embeddings=position_embeddings)
        return self.norm(x)


def init_mtp(mtp, std):
    for name, p in mtp.named_parameters():
        if name.endswith("norm.weight") or "layernorm" in name or name.endswith(("q_norm.weight", "k_norm.weight")):
            nn.init.zeros_(p)  # zero-centred: the norm multiplies by 1 + w
        else:
            nn.init.normal_(p, std=std)


def positions(model, x, length):
    pos = torch.arange(length, device=x.device)[None]
    return model.model.rotary_emb(x, pos)


def forward_losses(model, mtp, ids, aux_weight, unroll):
    """Main next-token loss, the MTP head's loss (summed over ``unroll`` passes), router balance loss.

    Pass j of the head is what drafts token t+j+1 at inference: pass 1 takes ``(embed(t+1), hidden_t)``,
    pass j takes ``(embed(t+j), output of pass j-1)``, as the drafter feeds its own output back. Training
    only pass 1 leaves the later drafts to a head that never saw its own outputs as input."""
    out = model.model(input_ids=ids, use_cache=False, output_router_logits=True)
    hidden = out.last_hidden_state
    logits = model.lm_head(hidden[:, :-1])
    main = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    n, h, mtp_losses = ids.shape[1], hidden, []
    for j in range(1, unroll + 1):
        emb = model.model.embed_tokens(ids[:, j:n - 1])
        h = mtp(emb, h[:, : n - 1 - j], positions(model, emb, emb.shape[1]))
        mtp_logits = model.lm_head(h)
        mtp_losses.append(F.cross_entropy(mtp_logits.float().reshape(-1, mtp_logits.shape[-1]),
                                          ids[:, j + 1:].reshape(-1)))
    mtp_loss = torch.stack(mtp_losses).sum()
    # Balanced per layer, not only over all layers together: a global balance leaves dead experts in a layer.
    config = model.config
    aux = torch.stack([load_balancing_loss_func((logits,), config.num_experts, config.num_experts_per_tok)
                       for logits in out.router_logits]).mean()
    return main, mtp_loss, aux


def epoch_batches(stream, batch, seq, generator):
    """Batches of ``seq``-token windows: the stream is cut into non-overlapping windows, and each epoch visits
    them in a new random order, all but the fewer than ``batch`` left over after its last whole batch."""
    windows = stream[: stream.numel() // seq * seq].reshape(-1, seq)
    while True:
        order = torch.randperm(windows.shape[0], generator=generator)
        for i in range(0, order.numel() - batch + 1, batch):
            yield windows[order[i:i + batch]]


def steps_for(args, train_tokens):
    """Steps for ``--epochs`` passes over the training split (``--steps`` overrides)."""
    return args.steps or math.ceil(args.epochs * (train_tokens // args.seq) / args.batch)


@torch.no_grad()
def heldout_losses(model, sequences, batch=16):
    """Mean next-token loss of each held-out sequence."""
    losses = []
    for i in range(0, sequences.shape[0], batch):
        ids = sequences[i:i + batch].to(DEVICE)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
        per_token = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        losses.extend(per_token.mean(1).tolist())
    return losses


def bits_per_byte(tokenizer, sequences, losses):
    """Held-out loss in bits per byte of text predicted, which stays comparable across tokenizers. A
    byte-level BPE token's string holds one character per byte; the EOS token holds none."""
    special = tokenizer.token_to_id(EOS)
    nbytes = sum(0 if t == special else len(tokenizer.id_to_token(t)) for t in sequences[:, 1:].reshape(-1).tolist())
    nats = sum(losses) * (sequences.shape[1] - 1)
    return nats / math.log(2) / nbytes


@torch.no_grad()
def expert_usage(model, sequences, batch=16):
    """Per MoE layer, the routed share of the least and the most used expert on held-out text (a share is
    the expert's part of all top-k selections; uniform routing gives 1 / experts)."""
    config = model.config
    counts = torch.zeros(config.num_hidden_layers, config.num_experts, dtype=torch.int64)
    for i in range(0, sequences.shape[0], batch):
        out = model.model(input_ids=sequences[i:i + batch].to(DEVICE), use_cache=False, output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):
            chosen = logits.topk(config.num_experts_per_tok, dim=-1).indices.reshape(-1).cpu()
            counts[layer] += torch.bincount(chosen, minlength=config.num_experts)
    shares = counts.double() / counts.sum(1, keepdim=True)
    return {"uniform_share": 1 / config.num_experts,
            "min_share": [round(v, 5) for v in shares.min(1).values.tolist()],
            "max_share": [round(v, 5) for v in shares.max(1).values.tolist()],
            "unused_experts": (counts == 0).sum(1).tolist()}


@torch.no_grad()
def greedy(model, prompts, new_tokens):
    seqs = prompts.to(DEVICE)
    for _ in range(new_tokens):
        logits = model(input_ids=seqs, use_cache=False).logits[:, -1]
        seqs = torch.cat([seqs, logits.argmax(-1, keepdim=True)], dim=1)
    return seqs


@torch.no_grad()
def mtp_acceptance(model, mtp, seqs, prompt_len, ks=(2, 3, 4)):
    """Greedy speculative decoding simulated on greedy continuations: accepted drafts per verify step.

    Draft j at position t is the MTP head run j times from the main hidden state h_t: pass 1 takes
    ``(embed(s[t+1]), h_t)``, pass j takes ``(embed(s[t+j]), out_{j-1})`` and predicts ``s[t+j+1]``.
    A verify step after committed token s[c] accepts drafts while they equal the greedy tokens."""
    hidden = model.model(input_ids=seqs, use_cache=False).last_hidden_state
    n = seqs.shape[1]
    hits, h = [], hidden
    for j in range(1, max(ks)):
        emb = model.model.embed_tokens(seqs[:, j:n - 1])
        h = mtp(emb, h[:, : n - 1 - j], positions(model, emb, emb.shape[1]))
        drafts = model.lm_head(h).argmax(-1)
        hits.append((drafts == seqs[:, j + 1:]).cpu())  # hits[j-1][b, t]: draft j from position t is right
    result = {}
    for k in ks:
        steps = accepted = 0
        for b in range(seqs.shape[0]):
            c = prompt_len  # s[c] was just produced by the main model from h[c-1]
            while c + k <= n - 1:
                t, a = c - 1, 0
                while a < k - 1 and bool(hits[a][b, t]):
                    a += 1
                steps += 1
                accepted += a
                c += a + 1
        result[str(k)] = accepted / steps
    return result


# ---------------------------------------------------------------- saving

def split_experts(state, prefix, num_experts):
    """transformers' fused expert tensors -> the per-expert original-layout keys."""
    out = {}
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = value.shape[1] // 2
            for e in range(num_experts):
                out[f"{prefix}{base}{e}.gate_proj.weight"] = value[e, :inter].contiguous()
                out[f"{prefix}{base}{e}.up_proj.weight"] = value[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(num_experts):
                out[f"{prefix}{base}{e}.down_proj.weight"] = value[e].contiguous()
        else:
            out[prefix + name] = value.contiguous()
    return out


def save_checkpoint(model, mtp, tokenizer, hf_dir):
    model.to(torch.bfloat16).save_pretrained(hf_dir)
    mtp_state = split_experts({k: v.detach().to(torch.bfloat16).cpu() for k, v in mtp.state_dict().items()},
                              "mtp.", model.config.num_experts)
    save_file(mtp_state, str(hf_dir / "model-mtp.safetensors"), metadata={"format": "pt"})
    index_path = hf_dir / "model.safetensors.index.json"
    if not index_path.exists():  # a single shard: write the index ourselves
        from safetensors import safe_open
        (shard,) = [p.name for p in hf_dir.glob("model*.safetensors") if p.name != "model-mtp.safetensors"]
        with safe_open(str(hf_dir / shard), "pt") as f:
            index = {"metadata": {}, "weight_map": {k: shard for k in f.keys()}}
    else:
        index = json.loads(index_path.read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp_state})
    index_path.write_text(json.dumps(index, indent=2))
    # mlx-lm 0.32 and the published Qwen3-Next config.json want these at the top level.
    config = json.loads((hf_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    config["rope_theta"] = rope.get("rope_theta", 10000.0)
    config["partial_rotary_factor"] = rope.get("partial_rotary_factor", 0.25)
    (hf_dir / "config.json").write_text(json.dumps(config, indent=2))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(hf_dir)


def pack_for_transfer(out, part_mib):
    """``OUT/model.tar.xz.NN``: hf/ and meta/ in one xz tar, cut into parts of ``part_mib`` MiB.

    What comes back from the GPU machine is limited in file count and size; xz takes bf16 weights to about
    70% of their size. ``cat OUT/model.tar.xz.* | tar -xJ -C OUT`` restores both folders."""
    archive = out / "model.tar.xz"
    subprocess.run(["tar", "-cf", str(archive), "-I", "xz -T0 -6", "-C", str(out), "hf", "meta"], check=True)
    data, part = archive.read_bytes(), int(part_mib * 2**20)
    for i in range(0, len(data), part):
        (out / f"model.tar.xz.{i // part:02d}").write_bytes(data[i:i + part])
    archive.unlink()
    shutil.rmtree(out / "hf")
    shutil.rmtree(out / "meta")
    return len(data)


# ---------------------------------------------------------------- main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--corpus-mb", type=float, default=160)
    p.add_argument("--tokenizer-mb", type=float, default=24)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=32)
    p.add_argument("--shared-intermediate", type=int, default=256)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--epochs", type=float, default=1.15, help="passes over the training split")
    p.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --epochs)")
    p.add_argument("--measure-steps", type=int, default=0,
                   help="time this many steps, print the speed and the time --epochs would take, and stop")
    p.add_argument("--mtp-weight", type=float, default=0.5)
    p.add_argument("--mtp-unroll", type=int, default=2,
                   help="passes of the MTP head trained, each feeding its output to the next (drafts t+2, t+3, ...)")
    p.add_argument("--aux-weight", type=float, default=0.01)
    p.add_argument("--heldout-seqs", type=int, default=64)
    p.add_argument("--accept-prompts", type=int, default=16)
    p.add_argument("--accept-new", type=int, default=96)
    p.add_argument("--part-mib", type=float, default=15.5, help="size of each returned part of model.tar.xz")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cpu runs a smoke test of the recipe")
    return p.parse_args(argv)


def newline_prompt(heldout_texts, lines=6):
    """The first held-out file with at least ``lines`` non-empty lines, cut after its ``lines``-th line."""
    for text in heldout_texts:
        head = text.split("\n")[:lines]
        if len(head) == lines and all(line.strip() for line in head):
            return "\n".join(head) + "\n"
    return heldout_texts[0].split("\n")[0] + "\n"


def main(argv=None):
    global DEVICE
    args = parse_args(argv)
    DEVICE = torch.device(args.device)
    t_start = time.time()
    torch.manual_seed(args.seed)
    hf_dir, meta_dir = args.out / "hf", args.out / "meta"
    hf_dir.mkdir(parents=True, exist_ok=True)
    meta_dir.mkdir(parents=True, exist_ok=True)

    roots = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    train_texts, heldout_texts = corpus_files(roots, args.corpus_mb * 1e6)
    log(f"corpus: {len(train_texts)} train files, {len(heldout_texts)} held-out files from {roots}")
    sample, size = [], 0
    for text in train_texts[:: max(1, int(args.corpus_mb / args.tokenizer_mb))]:
        sample.append(text)
        size += len(text)
    tokenizer = train_tokenizer(sample, args.vocab)
    train_ids, heldout_ids = encode_stream(tokenizer, train_texts), encode_stream(tokenizer, heldout_texts)
    log(f"tokenizer: vocab {tokenizer.get_vocab_size()} trained on {size / 1e6:.1f} MB; "
        f"train {train_ids.numel()} tokens, held-out {heldout_ids.numel()} tokens "
        f"({time.time() - t_start:.0f} s)")

    config = model_config(args, tokenizer.get_vocab_size())
    model = Qwen3NextForCausalLM(config).to(DEVICE)
    mtp = MTPHead(config).to(DEVICE)
    init_mtp(mtp, config.initializer_range)
    n_main = sum(p.numel() for p in model.parameters())
    n_mtp = sum(p.numel() for p in mtp.parameters())
    log(f"model: {n_main / 1e6:.2f}M parameters + MTP {n_mtp / 1e6:.2f}M = {2 * (n_main + n_mtp) / 2**20:.1f} MiB "
        f"in bf16; experts {config.num_experts} top-{config.num_experts_per_tok} "
        f"({config._experts_implementation}), flash-linear-attention kernels: "
        f"{is_flash_linear_attention_available()}, layers {config.layer_types}")

    params = list(model.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=DEVICE.type == "cuda")
    data = epoch_batches(train_ids, args.batch, args.seq, torch.Generator().manual_seed(args.seed))
    total_steps = steps_for(args, train_ids.numel())
    tokens_per_step = args.batch * args.seq
    log(f"{total_steps} steps of {tokens_per_step} tokens: {args.epochs if not args.steps else '-'} epochs")
    model.train()
    mtp.train()
    step, t_train, t_timed = 0, time.time(), None
    while step < total_steps:
        if step < args.warmup:
            lr = args.lr * (step + 1) / args.warmup
        else:
            frac = (step - args.warmup) / max(1, total_steps - args.warmup)
            lr = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))
        for group in opt.param_groups:
            group["lr"] = lr
        ids = next(data).to(DEVICE)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            main_loss, mtp_loss, aux = forward_losses(model, mtp, ids, args.aux_weight, args.mtp_unroll)
            loss = main_loss + args.mtp_weight * mtp_loss + args.aux_weight * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        if args.measure_steps and step in (5, 5 + args.measure_steps):  # the first steps compile kernels
            if DEVICE.type == "cuda":
                torch.cuda.synchronize()
            if step == 5:
                t_timed = time.time()
                continue
            per_step = (time.time() - t_timed) / args.measure_steps
            log(f"measured: {per_step * 1000:.0f} ms/step, {tokens_per_step / per_step:,.0f} tok/s; "
                f"{total_steps} steps would take {total_steps * per_step:.0f} s "
                f"(start-up {t_train - t_start:.0f} s, first 5 steps {t_timed - t_train:.0f} s)")
            return
        if step % 100 == 0 or step == total_steps:
            elapsed = time.time() - t_train
            log(f"step {step}/{total_steps} loss {main_loss.item():.3f} mtp {mtp_loss.item():.3f} "
                f"aux {aux.item():.3f} lr {lr:.2e} {step * tokens_per_step / elapsed:,.0f} tok/s")
    train_s = time.time() - t_train
    model.eval()
    mtp.eval()

    n_held = min(args.heldout_seqs, heldout_ids.numel() // args.seq)
    heldout = heldout_ids[: n_held * args.seq].reshape(n_held, args.seq)
    losses_fp32 = heldout_losses(model, heldout)
    report = {"settings": vars(args) | {"out": str(args.out)}, "steps": step,
              "tokens_trained": step * tokens_per_step, "epochs": step * tokens_per_step / train_ids.numel(),
              "train_seconds": round(train_s, 1), "tokens_per_second": round(step * tokens_per_step / train_s),
              "parameters": {"main": n_main, "mtp": n_mtp},
              "corpus": {"train_files": len(train_texts), "heldout_files": len(heldout_texts),
                         "train_tokens": train_ids.numel(), "heldout_tokens": heldout_ids.numel()},
              "heldout": {"sequences": n_held, "seq_len": args.seq, "loss_fp32": sum(losses_fp32) / n_held}}
    model.to(torch.bfloat16)
    mtp.to(torch.bfloat16)
    losses = heldout_losses(model, heldout)
    report["heldout"]["loss_bf16"] = sum(losses) / n_held
    report["heldout"]["bits_per_byte_bf16"] = bits_per_byte(tokenizer, heldout, losses)
    report["expert_usage"] = expert_usage(model, heldout)
    prompt_len = 64
    starts = torch.arange(args.accept_prompts) * (heldout_ids.numel() // (args.accept_prompts + 1))
    prompts = torch.stack([heldout_ids[s:s + prompt_len] for s in starts.tolist()])
    seqs = greedy(model, prompts, args.accept_new)
    report["mtp_accept_bf16"] = {"prompts": args.accept_prompts, "prompt_len": prompt_len,
                                 "new_tokens": args.accept_new, "avg_accepted_drafts":
                                 mtp_acceptance(model, mtp, seqs, prompt_len)}
    report["samples"] = {}
    for prompt in ("def fibonacci(n):\n", newline_prompt(heldout_texts)):
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        report["samples"][prompt] = tokenizer.decode(greedy(model, ids, 64)[0].tolist())
    log(json.dumps({k: v for k, v in report.items() if k != "settings"}, indent=1))

    save_checkpoint(model, mtp, tokenizer, hf_dir)
    save_file({"tokens": heldout.to(torch.int32)}, str(meta_dir / "heldout.safetensors"))
    (meta_dir / "report.json").write_text(json.dumps(report, indent=1))
    (meta_dir / "heldout_pytorch.json").write_text(json.dumps(
        {"checkpoint": "bf16 original layout", "framework": f"torch {torch.__version__} ({DEVICE.type})",
         "seq_len": args.seq, "loss_per_sequence": losses, "mean": report["heldout"]["loss_bf16"]}, indent=1))
    packed = pack_for_transfer(args.out, args.part_mib)
    log(f"done in {time.time() - t_start:.0f} s; model.tar.xz {packed / 2**20:.1f} MiB in "
        f"{sorted(p.name for p in args.out.glob('model.tar.xz.*'))}")


if __name__ == "__main__":
    main()
