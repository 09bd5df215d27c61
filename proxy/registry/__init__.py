"""The turn registry: fencing tokens per turn key, and the supersede signal.

`base` holds the interface, `Lease` and the answers of `claim_or_follow`; `memory` is the
one-process backend; `redis` shares fencing (and generations, through `genlog`) across
processes. Which backend a process has is decided here, once (`create`): nothing outside
this package asks.
"""

from __future__ import annotations

from proxy.config.schema import Backend, RegistryConfig
from proxy.registry.base import BESIDE, Beside, Follow, Lease, Registry
from proxy.registry.memory import MemoryRegistry

__all__ = ["BESIDE", "Beside", "Follow", "Lease", "MemoryRegistry", "Registry", "create"]


def create(config: RegistryConfig) -> Registry:
    """The backend `[registry]` names."""
    if config.backend == Backend.REDIS:
        from proxy.registry.redis import RedisRegistry  # noqa: PLC0415 - optional backend

        return RedisRegistry(config)
    return MemoryRegistry()
