"""The live greedy oracle: mlx-lm's in-memory model decoding the suite's test prompts, once per session.

Its answers (ids, logits, top-2 margins) are what the exactness checks compare against where the model fits in
memory; where it does not, the recorded reference (``reference.RecordedOracle``) answers the same questions
but logits.
"""

from __future__ import annotations

from pathlib import Path

#: Greedy steps the live oracle takes for each test prompt (the most any exactness check compares).
ORACLE_TOKENS = 64


class GreedyOracle:
    """mlx-lm's in-memory greedy decoding of each ``TEST_PROMPTS`` prompt, ``steps`` steps, run once
    per prompt per session: ids, the logits each id was taken from, and their top-2 margins. Every shorter
    greedy run is a prefix of it (same prefill, same steps), so tests ask for the first ``n``.

    Under pytest-xdist the first worker to ask for a prompt computes it (under a per-prompt lock file in the
    session's shared temp folder) and the other workers load what it wrote: the bf16 logits bit for bit."""

    kind = "mlx-lm in memory, live"

    def __init__(self, reference_model, prompt_ids, folder: Path, steps: int = ORACLE_TOKENS):
        self.reference_model, self.prompt_ids, self.folder, self.steps = reference_model, prompt_ids, folder, steps
        self._runs = {}

    def _run(self, prompt: int):
        if prompt not in self._runs:
            import mlx.core as mx

            path = self.folder / f"oracle-{prompt}-{self.steps}.safetensors"
            with file_lock(self.folder / f"oracle-{prompt}.lock"):
                if not path.exists():
                    from ..decode.greedy import greedy_steps

                    ids, logits = zip(*greedy_steps(self.reference_model, self.prompt_ids[prompt], self.steps))
                    partial = path.with_suffix(".partial.safetensors")
                    mx.save_safetensors(str(partial), {"ids": mx.array(ids, dtype=mx.int32), "logits": mx.stack(logits)})
                    partial.replace(path)
                saved = mx.load(str(path))
            logits = saved["logits"]
            self._runs[prompt] = (saved["ids"].tolist(), [logits[i] for i in range(logits.shape[0])])
        return self._runs[prompt]

    def _check(self, n: int) -> None:
        if not 0 < n <= self.steps:
            raise ValueError(f"the oracle holds {self.steps} greedy steps per prompt; {n} asked for")

    def ids(self, prompt: int, n: int) -> list:
        """The first ``n`` greedy ids of ``TEST_PROMPTS[prompt]``."""
        self._check(n)
        return self._run(prompt)[0][:n]

    def logits(self, prompt: int, n: int) -> list:
        """The logits each of the first ``n`` ids was taken from (one array per step)."""
        self._check(n)
        return self._run(prompt)[1][:n]

    def margins(self, prompt: int, n: int) -> list:
        """``top2_margin`` of each of the first ``n`` steps, as ``greedy_generate(..., margins=)`` gives them."""
        from ..decode.greedy import top2_margin

        return [top2_margin(logits) for logits in self.logits(prompt, n)]


class file_lock:
    """An exclusive ``flock`` on ``path`` (a no-op where ``fcntl`` does not exist)."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        try:
            import fcntl
        except ImportError:
            self.file = None
            return self
        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.file is not None:
            self.file.close()  # closing releases the lock
