"""The engine: scheduler, compilation manager and the `LLMEngine` loop."""

from metrale_jax.engine.config import EngineConfig
from metrale_jax.engine.engine import EngineStats, LLMEngine
from metrale_jax.engine.outputs import CompletionOutput, Logprob, RequestOutput

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "CompletionOutput", "Logprob", "RequestOutput"]
