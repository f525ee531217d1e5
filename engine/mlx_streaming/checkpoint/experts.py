"""ExpertIndex: (layer, expert) -> the byte ranges of its 9 tensors, from safetensors headers alone.

In the MLX layout each MoE layer stores ``mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}``
stacked over experts, so expert ``e`` of a tensor is the contiguous slice ``e * stride`` after its start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Mapping, Tuple

from ..errors import ConfigMismatchError, MissingTensorError
from .safetensors import TensorInfo

PROJS = ("gate_proj", "up_proj", "down_proj")
PARTS = ("weight", "scales", "biases")
TENSOR_NAMES = tuple(f"{p}.{q}" for p in PROJS for q in PARTS)
FLOAT_DTYPES = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class ExpertSlice:
    """One tensor of one expert: ``nbytes`` at ``offset`` of ``path``; ``shape`` without the expert axis."""

    tensor: str  # e.g. "gate_proj.scales"
    path: object
    offset: int
    nbytes: int
    dtype: str
    shape: tuple


class ExpertIndex:
    """Where every expert of every streamed MoE layer lies on disk.

    ``layers`` maps the engine's layer id to the tensor prefix of that layer's switch_mlp, e.g.
    ``{0: "model.layers.0.mlp.switch_mlp"}``; the MTP layer joins with its own id.
    """

    def __init__(self, tensors: Mapping[str, TensorInfo], layers: Mapping[int, str], config: Mapping):
        self.num_experts = num_experts = config["num_experts"]
        dims = (config["hidden_size"], config["moe_intermediate_size"])
        self._layers: Dict[int, Dict[str, TensorInfo]] = {}
        #: Per layer and tensor: (file, offset of expert 0, bytes from one expert to the next).
        self.placement: Dict[int, Dict[str, Tuple[object, int, int]]] = {}
        self.tensor_specs: Dict[str, Tuple[str, tuple]] = {}
        for layer, prefix in layers.items():
            infos = {}
            for name in TENSOR_NAMES:
                full = f"{prefix}.{name}"
                if full not in tensors:
                    raise MissingTensorError(f"{full}: expert tensor is in no shard")
                infos[name] = info = tensors[full]
                quant = quant_params(config, f"{prefix}.{name.split('.')[0]}")
                self._check(info, name, num_experts, *dims, quant)
                spec = (info.dtype, tuple(info.shape[1:]))
                self.tensor_specs.setdefault(name, spec)
                if self.tensor_specs[name] != spec:
                    raise ConfigMismatchError(f"{info.path}: tensor {full} is {spec}, other layers have {self.tensor_specs[name]}")
            self._layers[layer] = infos
            self.placement[layer] = {n: (i.path, i.offset, i.nbytes // num_experts) for n, i in infos.items()}
        self.tensor_nbytes = {n: i.nbytes // num_experts for n, i in next(iter(self._layers.values())).items()} if self._layers else {}
        self.expert_bytes = sum(self.tensor_nbytes.values())

    @staticmethod
    def _check(info: TensorInfo, name: str, num_experts: int, hidden: int, inter: int, quant: dict) -> None:
        proj, part = name.split(".")
        where = f"{info.path}: tensor {info.name}"
        if part == "weight" and info.dtype != "U32":
            raise ConfigMismatchError(f"{where} has dtype {info.dtype}, a quantized expert weight must be U32")
        if part != "weight" and info.dtype not in FLOAT_DTYPES:
            raise ConfigMismatchError(f"{where} has dtype {info.dtype}, expected one of {', '.join(FLOAT_DTYPES)}")
        if len(info.shape) != 3 or info.shape[0] != num_experts:
            raise ConfigMismatchError(f"{where} has shape {list(info.shape)}, config.json says num_experts={num_experts}")
        out_dim, in_dim = (hidden, inter) if proj == "down_proj" else (inter, hidden)
        bits, group = quant["bits"], quant["group_size"]
        last = in_dim * bits // 32 if part == "weight" else in_dim // group
        if tuple(info.shape[1:]) != (out_dim, last):
            raise ConfigMismatchError(
                f"{where} has shape {list(info.shape)}, config.json (hidden_size={hidden}, "
                f"moe_intermediate_size={inter}, {bits}-bit group {group}) implies {[num_experts, out_dim, last]}"
            )

    @property
    def layers(self) -> List[int]:
        return list(self._layers)

    def slices(self, layer: int, expert: int) -> List[ExpertSlice]:
        """The 9 tensors of one expert, in ``TENSOR_NAMES`` order."""
        return [
            ExpertSlice(name, path, base + expert * stride, self.tensor_nbytes[name], *self.tensor_specs[name])
            for name, (path, base, stride) in self.placement[layer].items()
        ]

    def relocated(self, placement: Dict[int, Dict[str, Tuple[object, int, int]]]) -> "ExpertIndex":
        """A copy of this index whose experts are read from ``placement`` (e.g. the packed layout)."""
        if set(placement) != set(self.placement) or any(set(p) != set(TENSOR_NAMES) for p in placement.values()):
            raise ConfigMismatchError("the packed expert index does not cover the checkpoint's MoE layers and tensors")
        copy = object.__new__(ExpertIndex)
        copy.__dict__.update(self.__dict__, placement=placement)
        return copy

    def expert_tensor_names(self) -> List[str]:
        """Full names of every expert tensor the index covers (what the dense load must leave alone)."""
        return [info.name for infos in self._layers.values() for info in infos.values()]


def quant_params(config: Mapping, prefix: str) -> dict:
    """Bits and group size mlx-lm uses for module ``prefix`` (per-path entry, else the defaults)."""
    block = config.get("quantization") or {}
    entry = block.get(prefix)
    if isinstance(entry, dict):
        return {"bits": entry["bits"], "group_size": entry["group_size"]}
    return {"bits": block.get("bits", 4), "group_size": block.get("group_size", 64)}
