"""metrale-jax: a JAX/Pallas LLM inference engine."""

from metrale_jax.engine import EngineConfig, LLMEngine
from metrale_jax.llm import LLM
from metrale_jax.model import Model, load_model, random_model
from metrale_jax.sampling import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "Model", "SamplingParams", "load_model", "random_model"]
