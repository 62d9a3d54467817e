"""Exception types. Every load or request error the engine raises is one of these."""


class MetraleError(Exception):
    """Base class of every error metrale-jax raises on purpose."""


# ---- loading -------------------------------------------------------------------------------------
class LoadError(MetraleError):
    """A checkpoint could not be loaded. The message names the file or tensor."""


class UnknownArchitectureError(LoadError):
    """config.json names an architecture no model family handles."""


class MissingTensorError(LoadError):
    """A tensor the model needs is absent from the checkpoint."""


class TensorShapeError(LoadError):
    """A tensor's shape differs from what the config implies."""


class UnsupportedDtypeError(LoadError):
    """A tensor dtype or quantization type we cannot read."""


class CorruptCheckpointError(LoadError):
    """A truncated or corrupt safetensors / GGUF / JSON file."""


class ModelNotFoundError(LoadError, FileNotFoundError):
    """An unknown model path or alias."""


# ---- requests ------------------------------------------------------------------------------------
class InvalidRequestError(MetraleError, ValueError):
    """A request was rejected before anything was queued (bad prompt or sampling value)."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit in max_model_len."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""
