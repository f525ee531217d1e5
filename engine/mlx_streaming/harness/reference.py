"""Recorded references: the greedy oracle's answers kept on disk, for a model the machine cannot hold in memory.

Where mlx-lm's in-memory model fits, the suite's oracle computes greedy decoding live and keeps its logits, so
the strongest checks (bit-identical logits) run. Where it does not, the suite checks against a reference recorded
once (``pytest --streaming-record-reference``): for each test prompt, the greedy ids and, per step, the top-2 ids
and their logit margin (``decode.greedy.top2_margin``). The file names the model it belongs to (``model_identity``: its config, its checksum
manifest and its weight files' names and sizes), the oracle that made it (in memory, or layer by layer) and the
mlx / mlx-lm versions; a reference for another model is refused in one line. It is kept beside the perf
baselines (in this project ``baselines/references/<model folder>-<identity>.json``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Dict, List, Sequence

from ..errors import CheckpointError

FORMAT = 1


def model_bytes(model_dir: Path) -> int:
    """The bytes of the model's weight files that mlx-lm loads (the MTP head's file is the engine's own)."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors") if p.name.startswith("model"))


#: What a process holding mlx-lm's in-memory model needs besides its weights (Python, MLX, caches), and the
#: share of the weights it adds (tokenizer, logits, temporary arrays).
IN_MEMORY_OVERHEAD_BYTES = 1 << 30
IN_MEMORY_WEIGHTS_FACTOR = 1.2


class InMemoryPlan:
    """Whether mlx-lm's in-memory model of ``model_dir`` fits in what this process may take (the machine's
    available memory, or its memory cgroup's limit), decided before anything is loaded; ``workers`` processes
    that each load their own (pytest-xdist) each get their share."""

    def __init__(self, model_dir: Path, workers: int = 1):
        from .. import cgroup
        from ..config import format_size

        self.available = cgroup.available_bytes() // workers
        self.needed = int(model_bytes(model_dir) * IN_MEMORY_WEIGHTS_FACTOR) + IN_MEMORY_OVERHEAD_BYTES
        self.fits = self.needed <= self.available
        per = f" per worker of {workers}" if workers > 1 else ""
        self.why_not = (f"mlx-lm's in-memory model of {model_dir} needs about {format_size(self.needed)}, "
                        f"{format_size(self.available)} available{per} (memory limits included)")


def model_identity(model_dir: Path) -> str:
    """A digest of what makes the model this model: config.json, the expert checksum manifest (every expert's
    CRC32C, where the folder has one) and each weight file's name and size."""
    from ..checkpoint.manifest import MANIFEST_FILE

    folder = Path(model_dir)
    digest = hashlib.sha256()
    for name in ("config.json", MANIFEST_FILE):
        if (folder / name).exists():
            digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
    return digest.hexdigest()


def reference_path(folder: Path, model_dir: Path) -> Path:
    """The reference of ``model_dir`` in ``folder``: named by the model folder and its identity."""
    return Path(folder) / f"{Path(model_dir).resolve().name}-{model_identity(model_dir)[:12]}.json"


def write(path: Path, model_dir: Path, oracle: str, prompts: Sequence[str], runs: List[Dict]) -> Path:
    """Write a reference: ``runs`` holds, per prompt, ``ids`` and ``margins`` (per step, ``top2_margin`` of the
    logits the id was taken from: top-1 id, top-2 id, their logit gap, the top-1 logit)."""
    import mlx.core as mx
    import mlx_lm

    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": FORMAT, "model": {"folder": Path(model_dir).resolve().name, "identity": model_identity(model_dir)},
            "oracle": oracle, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "prompts": list(prompts),
            "runs": runs}
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1))
    partial.replace(path)
    return path


class RecordedOracle:
    """The greedy oracle's interface over a recorded reference: ids and margins; no logits (the checks that need
    them are skipped, saying why)."""

    def __init__(self, path: Path, model_dir: Path, prompts: Sequence[str]):
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: unreadable recorded reference ({exc})") from None
        if data.get("format") != FORMAT or data.get("model", {}).get("identity") != model_identity(model_dir):
            raise CheckpointError(f"{path}: a recorded reference of another model than {model_dir} (its identity "
                                  "differs): record it again with --streaming-record-reference")
        if data.get("prompts") != list(prompts):
            raise CheckpointError(f"{path}: recorded for other prompts than the suite's: record it again")
        self.path, self.runs = Path(path), data["runs"]
        self.kind = f"recorded reference {self.path.name} ({data['oracle']}, mlx {data.get('mlx')})"
        self.versions = {"mlx": data.get("mlx"), "mlx_lm": data.get("mlx_lm")}

    def _check(self, prompt: int, n: int) -> None:
        held = len(self.runs[prompt]["ids"])
        if not 0 < n <= held:
            import pytest

            pytest.fail(f"{self.path} holds {held} greedy steps per prompt and a check compares {n}: record it again "
                        f"with --streaming-record-reference --streaming-exact-tokens={n}", pytrace=False)

    def ids(self, prompt: int, n: int) -> list:
        self._check(prompt, n)
        return self.runs[prompt]["ids"][:n]

    def margins(self, prompt: int, n: int) -> list:
        """``top2_margin`` of each of the first ``n`` steps, as the live oracle gives them."""
        self._check(prompt, n)
        return [tuple(step) for step in self.runs[prompt]["margins"][:n]]

    def logits(self, prompt: int, n: int) -> list:
        import pytest

        pytest.skip(f"the oracle is the {self.kind}, which keeps no logits: "
                    "bit-identical checks need mlx-lm's in-memory model")
