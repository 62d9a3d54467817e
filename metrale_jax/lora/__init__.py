"""Multi-LoRA serving: PEFT adapters in per-row slots of one batch.

`request.LoRARequest` names an adapter (vLLM's API); `adapter.py` reads PEFT folders into the
slot layout; `ops.py` computes the per-token deltas inside the step (dense projections and MoE
experts); `manager.py` keeps adapters on the host and in the device slots (two LRUs) and writes
slots with one executable compiled at start-up.
"""

from metrale_jax.lora.request import LoRARequest

__all__ = ["LoRARequest"]
