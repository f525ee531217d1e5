"""The memory plan: what a streaming model will hold, from the checkpoint's headers, before any weight is read.

``pool_capacity`` is the one function that turns the pool option that is set (slots, bytes, a share of the
experts, or a budget for the whole process) into slots per MoE layer; ``MemoryPlan`` adds up what the built
model will hold: the dense weights, the MTP head's dense weights, the expert pool and the prefetcher's host
staging, against the budget where one was given. ``--memory-budget auto`` is ``auto_memory_budget()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import cgroup
from .config import DEFAULT_MEMORY_ALLOWANCE, StreamingConfig, format_size
from .errors import PoolTooSmallError

#: ``--memory-budget auto``: this share of the memory the process may take when the command starts (the rest is
#: the margin left to the OS and other programs).
AUTO_BUDGET_SHARE = 0.8


def allowance_within(config: StreamingConfig, budget: Optional[int]) -> int:
    """The caches' allowance under ``budget`` bytes in all (None: no budget): ``config.memory_allowance`` where it
    is set, else the default, or a quarter of a budget too small for it (where the default would leave no pool)."""
    if config.memory_allowance is not None:
        return config.memory_allowance
    return DEFAULT_MEMORY_ALLOWANCE if budget is None else min(DEFAULT_MEMORY_ALLOWANCE, budget // 4)


def auto_memory_budget(available: Optional[int] = None) -> int:
    """``AUTO_BUDGET_SHARE`` of the memory this process may take now (``available``, where the caller read it
    already): the machine's available memory, or what its memory cgroup's limit leaves, whichever is less
    (``cgroup.available_bytes``)."""
    return int((cgroup.available_bytes() if available is None else available) * AUTO_BUDGET_SHARE)


@dataclass(frozen=True)
class PoolSize:
    """What ``pool_capacity`` decided: slots per MoE layer, the one line saying so, and the memory budget and
    caches' allowance it was sized under (``budget`` None where no budget sized it)."""
    slots: int
    note: str
    budget: Optional[int]
    allowance: int


def pool_capacity(config: StreamingConfig, num_experts: int, top_k: int, expert_bytes: int, moe_layers: int,
                  dense_bytes: int, staging_bytes: int = 0) -> PoolSize:
    """The pool from whichever sizing knob is set. With none set, every expert is resident where the whole model
    fits in what this process may take, else the pool is the one ``--memory-budget auto`` gives (the line says
    why). A pool bigger than the model's experts is cut to them (and says so); one below ``top_k`` is refused,
    naming the knob."""
    layer_bytes = expert_bytes * moe_layers
    budget = config.memory_budget

    def within(asked: str) -> int:
        allowance = allowance_within(config, budget)
        left = budget - dense_bytes - allowance - staging_bytes
        if left <= 0:
            raise PoolTooSmallError(
                f"{asked} is below the dense weights ({format_size(dense_bytes)}) plus the caches' allowance "
                f"({format_size(allowance)}) plus prefetch staging ({format_size(staging_bytes)}): "
                f"nothing is left for the expert pool")
        return left // layer_bytes

    if config.pool_slots is not None:
        slots, asked = config.pool_slots, f"pool_slots={config.pool_slots}"
    elif config.pool_bytes is not None:
        slots, asked = config.pool_bytes // layer_bytes, f"pool_bytes={format_size(config.pool_bytes)}"
    elif budget is not None:
        asked = f"memory_budget={format_size(budget)}"
        slots = within(asked)
    elif config.pool_fraction is not None:
        slots, asked = round(num_experts * config.pool_fraction), f"pool_fraction={config.pool_fraction}"
    else:
        every = dense_bytes + num_experts * layer_bytes + allowance_within(config, None) + staging_bytes
        available = cgroup.available_bytes()
        if every <= available:
            slots, asked = num_experts, "no pool size given"
        else:
            budget = auto_memory_budget(available)
            asked = (f"no pool size given, and the whole model ({format_size(every)}) does not fit in the "
                     f"{format_size(available)} this process may take: memory_budget=auto, {format_size(budget)}")
            slots = within(asked)
    if slots < top_k:
        raise PoolTooSmallError(
            f"{asked} gives {slots} expert slots per MoE layer, below num_experts_per_tok={top_k}: one token needs "
            f"{top_k} experts resident, at least {format_size(top_k * layer_bytes)} "
            f"({moe_layers} MoE layers x {format_size(expert_bytes)} per expert)")
    note = ""
    if slots > num_experts:
        slots, note = num_experts, f", more than the model has: cut to {num_experts}"
    line = (f"pool: {slots} of {num_experts} experts per MoE layer x {moe_layers} layers = "
            f"{format_size(slots * layer_bytes)} ({asked}{note})")
    return PoolSize(slots, line, budget, allowance_within(config, budget))


@dataclass
class MemoryPlan:
    """Bytes a streaming model will hold, by part, and the pool that follows from the config."""

    dense_bytes: int  #: the main model's dense (non-expert) weights, resident
    mtp_dense_bytes: int  #: the MTP head's dense weights (its experts share the pool), 0 without the head
    slots: int  #: pool slots per MoE layer
    num_experts: int
    moe_layers: int  #: MoE layers with a pool (the MTP head's included)
    expert_bytes: int  #: one expert's bytes (every tensor of it)
    staging_bytes: int  #: the prefetcher's host staging limit, 0 without prefetch
    allowance: int  #: kept for KV caches, activations and temporaries
    budget: Optional[int]  #: the memory budget, where one was given
    note: str  #: one line: what the pool became and which option sized it

    @property
    def pool_bytes(self) -> int:
        return self.slots * self.moe_layers * self.expert_bytes

    @property
    def weights_bytes(self) -> int:
        """What MLX holds once built: dense weights, the head's, the pool."""
        return self.dense_bytes + self.mtp_dense_bytes + self.pool_bytes

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.staging_bytes + self.allowance

    def describe(self) -> str:
        lines = [f"memory plan: dense weights {format_size(self.dense_bytes)}",
                 f"  {self.note}",
                 f"  MTP head dense weights {format_size(self.mtp_dense_bytes)}",
                 f"  prefetch staging (host) {format_size(self.staging_bytes)}",
                 f"  caches and activations allowance {format_size(self.allowance)}",
                 f"  total {format_size(self.total_bytes)} (weights {format_size(self.weights_bytes)} in MLX memory)"]
        if self.budget is not None:
            lines.append(f"  budget {format_size(self.budget)}, margin left {format_size(self.budget - self.total_bytes)}")
        return "\n".join(lines)
