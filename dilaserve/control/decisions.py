"""What the scheduler is configured with and what it returns (the control plane's outputs)."""

from __future__ import annotations

from dataclasses import dataclass

from dilaserve.protocol import KVCacheMode, StepBatch


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    kv_cache: KVCacheMode = KVCacheMode.DUAL
    block_len: int = 32
    slo: float = 10.0  # seconds, for requests that carry no deadline
    refresh_every_tokens: int = 8
    max_requests_per_instance: int = 64
    load_control_interval: float = 0.05  # seconds between re-runs triggered by refreshes only

    def __post_init__(self):
        object.__setattr__(self, "kv_cache", KVCacheMode(self.kv_cache))
        if self.slo <= 0:
            raise ValueError(f"{self.slo=} must be positive")
        if self.refresh_every_tokens <= 0:
            raise ValueError(f"{self.refresh_every_tokens=} must be positive")

    @property
    def cache_block(self) -> int | None:
        """The block length Alg. 4/5 need, or None without a KV cache."""
        return None if self.kv_cache is KVCacheMode.NONE else self.block_len


@dataclass(frozen=True, slots=True)
class StepLaunch:
    instance_id: str
    batch: StepBatch


@dataclass(frozen=True, slots=True)
class Decisions:
    launches: tuple[StepLaunch, ...] = ()
    releases: tuple[tuple[str, str], ...] = ()  # (instance, request) whose state must go
    finished: tuple[str, ...] = ()
