"""metrale-jax: a JAX/Pallas LLM inference engine."""

from metrale_jax.model import Model, load_model, random_model

__all__ = ["Model", "load_model", "random_model"]
