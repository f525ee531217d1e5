"""Tokenizer files that load offline with transformers' AutoTokenizer (and so with mlx_lm.load).

A byte-level BPE over the 256 byte symbols (GPT-2's byte-to-unicode alphabet, as Qwen's tokenizer uses)
and Qwen's three special tokens; no merges, so no corpus is needed and the files are the same every time.
Given a vocabulary size, every id up to it decodes: Qwen's special tokens sit at Qwen's ids (where the
vocabulary reaches them) and filler words (`` ab``, `` x7Q``...) fill the rest, so a random model's text is
readable.
"""

from __future__ import annotations

import itertools
import json
import string
from pathlib import Path
from typing import Optional

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Qwen's special tokens at Qwen's ids (``<|im_end|>`` ends a turn of the Instruct model).
QWEN_SPECIAL_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def write_byte_tokenizer(out_dir: Path, vocab_size: Optional[int] = None) -> int:
    """Write tokenizer.json and tokenizer_config.json; return the number of token ids used. With ``vocab_size``,
    every id below it decodes, and a turn ends with ``<|im_end|>`` as Qwen's Instruct models end it."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=ord)
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    if vocab_size:
        special = dict(QWEN_SPECIAL_IDS) if vocab_size > max(QWEN_SPECIAL_IDS.values()) else \
            {t: len(alphabet) + i for i, t in enumerate(SPECIAL_TOKENS)}
        by_id = {i: t for t, i in special.items()}
        chars = string.ascii_letters + string.digits
        words = ("\u0120" + "".join(c) for n in itertools.count(2) for c in itertools.product(chars, repeat=n))
        vocab.update({by_id.get(i) or next(words): i for i in range(len(alphabet), vocab_size)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tokenizer.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>" if vocab_size else SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": None,
        "model_max_length": 262144 if vocab_size else 32768,
    }, indent=2))
    return tokenizer.get_vocab_size()
