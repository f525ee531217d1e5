"""MTPDrafter: the MTP head drafting the main model's next tokens.

The head keeps its own KV cache over the whole sequence: the entry for position ``t`` is built from the
token at ``t + 1`` and the main model's hidden state at ``t``. ``extend`` feeds those true pairs (after the
prefill and after each verify) and returns the head's last output; ``propose`` drafts by feeding its own
output hidden state back, which appends provisional entries that the next ``extend`` trims first.
"""

from __future__ import annotations

from typing import Sequence, Union

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from ..runtime.qwen3_next import embed, logits_from_hidden


class MTPDrafter:
    def __init__(self, mtp, model):
        self.mtp, self.model = mtp, model
        self.cache = KVCache()
        self._provisional = 0
        self._last = None

    def _step(self, tokens: Union[Sequence[int], mx.array], hidden: mx.array) -> mx.array:
        embeddings = embed(self.model, tokens)
        mask = create_attention_mask(embeddings, self.cache)
        return self.mtp(embeddings, hidden, mask=mask, cache=self.cache)

    def extend(self, next_tokens: Sequence[int], hiddens: mx.array) -> None:
        """Feed ``(next_tokens[i], hiddens[:, i])`` for consecutive committed positions."""
        if self._provisional:
            self.cache.trim(self._provisional)
            self._provisional = 0
        self._last = self._step(next_tokens, hiddens)[:, -1:]

    def settle(self) -> None:
        """Compute what ``extend`` queued (its cache entries and last output) now, not at the next draft."""
        mx.eval(self._last)

    def propose(self, n: int) -> mx.array:
        """Draft ``n`` tokens after the last extended position: an (n,) array, not evaluated. Each draft feeds the
        next on the device, so a step's drafts and its verify are queued without waiting for the host between
        them (where the head's forwards need no host sync themselves: at a complete pool); the step reads the
        drafts back with the verify's output."""
        h = self._last
        drafts = []
        for i in range(n):
            drafts.append(mx.argmax(logits_from_hidden(self.model, h)[0, -1]))
            if i + 1 < n:
                h = self._step(drafts[-1].reshape(1, 1), h)
                self._provisional += 1
        return mx.stack(drafts)
