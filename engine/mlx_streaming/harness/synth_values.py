"""The values ``synth --preset qwen3-next-80b`` writes, generated block by block: each block of a tensor drawn from a
seed derived from (seed, tensor name, block), so the same seed gives byte-identical files and a layer's bytes do
not depend on how many layers are written. Nothing is quantized: packed 4-bit (8-bit) words are drawn uniformly and
their scales and biases chosen so each weight dequantizes to zero mean and the smaller presets' standard deviation;
each MoE router row (one expert) is scaled by a popularity drawn once per layer (``popularity``), so some experts
are hot, as after training."""

from __future__ import annotations

import zlib
from typing import Iterator

import numpy as np

from .synth_plan import GROUP_SIZE, TensorSpec

#: The most bytes of one tensor generated at once (rows of its first axis; one expert never straddles blocks).
BLOCK_BYTES = 4 << 20
#: Router rows: std ``ROUTER_GAIN / sqrt(hidden)`` (as the smaller presets), times a popularity per expert.
ROUTER_GAIN = 4.0
#: Spread of the experts' popularity: ``exp(POPULARITY_SIGMA * N(0, 1))``, drawn per router.
POPULARITY_SIGMA = 0.25
#: Norm weights as the MLX layout holds them (``1 + w``): ``1 + NORM_STD * N(0, 1)``.
NORM_STD = 0.1

_NORMS = ("layernorm.weight", "norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


def _rng(seed: int, name: str, block: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode()), block])))


def _raw(rng: np.random.Generator, n: int, dtype) -> np.ndarray:
    """``n`` uniformly random values of unsigned ``dtype``, straight from the bit generator (GB/s)."""
    words = -(-n * np.dtype(dtype).itemsize // 8)
    return rng.bit_generator.random_raw(words).view(dtype)[:n]


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to nearest even, as ``astype(mx.bfloat16)`` does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)


def from_bf16(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def popularity(seed: int, router: str, experts: int) -> np.ndarray:
    """Each expert's router-row scale (lognormal): the hot experts of one layer."""
    rng = _rng(seed, router + ":popularity", 0)
    return np.exp(rng.standard_normal(experts, dtype=np.float32) * np.float32(POPULARITY_SIGMA))


def _quant_std(base: str, fan_in: int) -> float:
    if base.endswith("embed_tokens"):
        return 1.0
    if base.endswith("mlp.gate"):
        return ROUTER_GAIN / np.sqrt(fan_in)
    return 1.0 / np.sqrt(fan_in)


def _plain(name: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """float32 values of a tensor the converter leaves unquantized (norms, DeltaNet parameters, conv)."""
    normal = lambda std: rng.standard_normal(shape, dtype=np.float32) * np.float32(std)  # noqa: E731
    if name.endswith(_NORMS):
        return 1 + normal(NORM_STD)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1, 16, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.uniform(0.5, 1.5, shape).astype(np.float32)
    if name.endswith("conv1d.weight"):  # (channels, kernel, 1): the original layout's fan-in is the kernel
        return normal(1.0 / np.sqrt(shape[1]))
    return normal(1.0 / np.sqrt(shape[-1]))


def _scales(spec: TensorSpec, seed: int, block: int, r0: int, shape: tuple) -> np.ndarray:
    """float32 scales of rows ``r0:r0 + shape[0]`` of ``spec`` (a ``.scales`` tensor, or a ``.biases`` one's)."""
    base = spec.name.rpartition(".")[0]
    levels = 1 << spec.bits
    q_std = np.sqrt((levels * levels - 1) / 12.0)  # of a uniform 0..levels-1
    rng = _rng(seed, base + ".scales", block)
    jitter = _raw(rng, int(np.prod(shape)), np.uint16).reshape(shape).astype(np.float32)
    scales = jitter * np.float32(0.2 / 65535) + np.float32(0.9)  # +-10% from group to group
    scales *= np.float32(_quant_std(base, spec.shape[-1] * GROUP_SIZE) / q_std)
    if base.endswith("mlp.gate"):
        hot = popularity(seed, base, spec.shape[0])[r0:r0 + shape[0]]
        scales *= hot.reshape((-1,) + (1,) * (len(shape) - 1))
    return scales


def _stored(spec: TensorSpec, values: np.ndarray) -> np.ndarray:
    """float32 ``values`` as ``spec`` stores them: bfloat16 bits (uint16), or float32."""
    return to_bf16(values) if spec.dtype == "BF16" else values.astype(np.float32)


def _as_stored(spec: TensorSpec, values: np.ndarray) -> np.ndarray:
    """float32 ``values`` rounded as ``spec`` stores them."""
    return from_bf16(to_bf16(values)) if spec.dtype == "BF16" else values


def tensor_blocks(spec: TensorSpec, seed: int) -> Iterator[np.ndarray]:
    """The bytes of ``spec`` as arrays (uint32 words, uint16 bfloat16 bits or float32) of whole rows of its first
    axis, at most ``BLOCK_BYTES`` (or one row) each; block ``b`` is drawn from seed (seed, name, b)."""
    if not spec.shape:
        yield _stored(spec, _plain(spec.name, (), _rng(seed, spec.name, 0)))
        return
    rows = spec.shape[0]
    unit = max(1, BLOCK_BYTES // (spec.nbytes // rows))
    part = spec.name.rpartition(".")[2]
    for block, r0 in enumerate(range(0, rows, unit)):
        shape = (min(rows, r0 + unit) - r0,) + tuple(spec.shape[1:])
        if spec.bits and part == "weight":
            yield _raw(_rng(seed, spec.name, block), int(np.prod(shape)), np.uint32).reshape(shape)
        elif spec.bits and part == "scales":
            yield _stored(spec, _scales(spec, seed, block, r0, shape))
        elif spec.bits and part == "biases":  # zero mean: bias = -(levels - 1) / 2 * scale, of the scale as stored
            mid = np.float32(((1 << spec.bits) - 1) / 2)
            yield _stored(spec, -mid * _as_stored(spec, _scales(spec, seed, block, r0, shape)))
        else:
            yield _stored(spec, _plain(spec.name, shape, _rng(seed, spec.name, block)))


# ----------------------------------------------------------------------------- files
