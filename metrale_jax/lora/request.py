"""`LoRARequest`: which adapter a request runs with (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """A LoRA adapter, named by the caller.

    lora_name: the name clients use (the server's `model` field picks it).
    lora_int_id: a positive integer unique per adapter; the engine keys its slots and caches by it
        (and prefix caching keys KV blocks by it).
    lora_path: a local PEFT folder (`adapter_config.json` + `adapter_model.safetensors`).
    base_model_name: informational (what /v1/models reports as the adapter's parent).

    As in vLLM, two requests are the same adapter when their names are equal.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        from metrale_jax.errors import LoRAError

        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        self.lora_path = str(self.lora_path)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
