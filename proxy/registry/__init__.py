"""The turn registry: fencing tokens per turn key, and the supersede signal.

`base` holds the interface and `Lease`; `memory` is the one-process backend; `redis`
shares fencing across processes.
"""

from __future__ import annotations

from proxy.registry.base import Lease, Registry
from proxy.registry.memory import MemoryRegistry

__all__ = ["Lease", "MemoryRegistry", "Registry"]
