"""metrale-jax: a JAX/Pallas LLM inference engine."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

try:
    __version__ = _dist_version("metrale-jax")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

from metrale_jax.beam_search import BeamSearchParams
from metrale_jax.engine import EngineConfig, LLMEngine
from metrale_jax.llm import LLM, EngineArgs
from metrale_jax.lora import LoRARequest
from metrale_jax.model import Model, load_model, random_model
from metrale_jax.sampling import RequestOutputKind, SamplingParams

__all__ = ["__version__", "LLM", "EngineArgs", "EngineConfig", "LLMEngine", "Model", "SamplingParams",
           "RequestOutputKind", "load_model", "random_model", "LoRARequest", "BeamSearchParams"]
