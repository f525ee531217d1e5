"""ExpertIndex: (layer, expert) -> the byte ranges of its tensors, from safetensors headers alone.

mlx-lm saves a MoE block's routed experts as its switch module's parameters stacked over experts (e.g.
``model.layers.0.mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}``), so expert ``e`` of a tensor
is the contiguous slice ``e * stride`` after its start. Which tensors a layer has (``fc1``/``fc2``, linear
``bias``...) comes from the model's switch module, not from a fixed list; every streamed layer must hold the
same tensors, dtypes and shapes, because the pool has one layout.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, NamedTuple, Sequence, Tuple

from ..errors import ConfigMismatchError, MissingTensorError
from .safetensors import TensorInfo

FLOAT_DTYPES = ("BF16", "F16", "F32")


class ExpertSlice(NamedTuple):
    """One tensor of one expert: ``nbytes`` at ``offset`` of ``path``; ``shape`` without the expert axis. A named
    tuple: a load makes one per tensor of every expert it reads, on the miss path's critical path."""

    tensor: str  # e.g. "gate_proj.scales"
    path: object
    offset: int
    nbytes: int
    dtype: str
    shape: tuple


class ExpertIndex:
    """Where every expert of every streamed MoE layer lies on disk.

    ``layers`` maps the engine's layer id to (tensor prefix of that layer's switch module, its parameter
    names), e.g. ``{0: ("model.layers.0.mlp.switch_mlp", ["gate_proj.weight", ...])}``; the MTP layer joins
    with its own id.
    """

    def __init__(self, tensors: Mapping[str, TensorInfo], layers: Mapping[int, Tuple[str, Sequence[str]]]):
        self._layers: Dict[int, Dict[str, TensorInfo]] = {}
        #: Per layer and tensor: (file, offset of expert 0, bytes from one expert to the next).
        self.placement: Dict[int, Dict[str, Tuple[object, int, int]]] = {}
        self.tensor_specs: Dict[str, Tuple[str, tuple]] = {}
        self.num_experts = 0
        for layer, (prefix, names) in layers.items():
            infos = {}
            for name in names:
                full = f"{prefix}.{name}"
                if full not in tensors:
                    raise MissingTensorError(f"{full}: expert tensor is in no shard")
                infos[name] = info = tensors[full]
                self.num_experts = self.num_experts or info.shape[0]
                self._check(info, part_of=name)
                spec = (info.dtype, tuple(info.shape[1:]))
                self.tensor_specs.setdefault(name, spec)
                if self.tensor_specs[name] != spec:
                    raise ConfigMismatchError(f"{info.path}: tensor {full} is {spec}, other layers have "
                                              f"{self.tensor_specs[name]}; layers of different expert layouts "
                                              f"cannot share one pool")
            if set(infos) != set(self.tensor_specs):
                raise ConfigMismatchError(f"{prefix}: expert tensors {sorted(infos)}, other layers have "
                                          f"{sorted(self.tensor_specs)}")
            self._layers[layer] = infos
            self.placement[layer] = {n: (i.path, i.offset, i.nbytes // self.num_experts) for n, i in infos.items()}
        self.tensor_names = list(self.tensor_specs)
        self.tensor_nbytes = {n: i.nbytes // self.num_experts for n, i in next(iter(self._layers.values())).items()} if self._layers else {}
        self.expert_bytes = sum(self.tensor_nbytes.values())

    def _check(self, info: TensorInfo, part_of: str) -> None:
        where = f"{info.path}: tensor {info.name}"
        if not info.shape or info.shape[0] != self.num_experts:
            raise ConfigMismatchError(f"{where} has shape {list(info.shape)}, other expert tensors hold "
                                      f"{self.num_experts} experts")
        part = part_of.rpartition(".")[2]
        if part == "weight" and info.dtype not in ("U32",) + FLOAT_DTYPES:
            raise ConfigMismatchError(f"{where} has dtype {info.dtype}, expected U32 (quantized) or one of "
                                      f"{', '.join(FLOAT_DTYPES)}")

    @property
    def layers(self) -> List[int]:
        return list(self._layers)

    def slices(self, layer: int, expert: int) -> List[ExpertSlice]:
        """The tensors of one expert, in ``tensor_names`` order."""
        return [
            ExpertSlice(name, path, base + expert * stride, self.tensor_nbytes[name], *self.tensor_specs[name])
            for name, (path, base, stride) in self.placement[layer].items()
        ]

    def relocated(self, placement: Dict[int, Dict[str, Tuple[object, int, int]]]) -> "ExpertIndex":
        """A copy of this index whose experts are read from ``placement`` (e.g. the packed layout)."""
        if set(placement) != set(self.placement) or any(set(p) != set(self.tensor_names) for p in placement.values()):
            raise ConfigMismatchError("the packed expert index does not cover the checkpoint's MoE layers and tensors")
        copy = object.__new__(ExpertIndex)
        copy.__dict__.update(self.__dict__, placement=placement)
        return copy

    def expert_tensor_names(self) -> List[str]:
        """Full names of every expert tensor the index covers (what the dense load must leave alone)."""
        return [info.name for infos in self._layers.values() for info in infos.values()]
