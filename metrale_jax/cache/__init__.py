"""Engine state: the paged KV pools and the SSM state pool, donated through every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax

from metrale_jax.cache.kv import KVCache


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class EngineState:
    kv: KVCache | None  # None for a model with no attention layers
    ssm: dict = field(default_factory=dict)  # layer name -> {array name: [max_slots, ...]}

    @property
    def block_size(self) -> int | None:
        """Tokens per KV block (None without attention layers)."""
        return self.kv.block_size if self.kv is not None else None
