"""Tokenizer files that load offline with transformers' AutoTokenizer (and so with mlx_lm.load).

A byte-level BPE over the 256 byte symbols (GPT-2's byte-to-unicode alphabet, as Qwen's tokenizer uses)
and Qwen's three special tokens; no merges, so no corpus is needed and the files are the same every time.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_byte_tokenizer(out_dir: Path) -> int:
    """Write tokenizer.json and tokenizer_config.json; return the number of token ids used."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": None,
        "model_max_length": 32768,
    }, indent=2))
    return tokenizer.get_vocab_size()
