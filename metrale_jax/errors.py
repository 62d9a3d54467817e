"""Exception types. Every load or request error the engine raises is one of these.

Each class carries `code`, a snake_case string the HTTP server reports as the OpenAI error
object's `code` (server/app.py lists the whole mapping).
"""


class MetraleError(Exception):
    """Base class of every error metrale-jax raises on purpose."""

    code: str = "metrale_error"


# ---- loading -------------------------------------------------------------------------------------
class LoadError(MetraleError):
    """A checkpoint could not be loaded. The message names the file or tensor."""

    code = "load_error"


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

    code = "model_not_found"


# ---- requests ------------------------------------------------------------------------------------
class InvalidRequestError(MetraleError, ValueError):
    """A request was rejected before anything was queued (bad prompt or sampling value)."""

    code = "invalid_request"


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit in max_model_len."""

    code = "context_length_exceeded"


class MaxTokensTooLargeError(InvalidRequestError):
    """The prompt's tokens plus max_tokens exceed max_model_len (vLLM's 400 for the same)."""

    code = "context_length_exceeded"


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""

    code = "empty_prompt"


class InvalidPromptError(InvalidRequestError):
    """The prompt cannot be tokenized (text that is not valid UTF-8, a token id outside the
    vocabulary, a value that is no prompt at all)."""

    code = "invalid_prompt"


class InvalidMessagesError(InvalidRequestError):
    """Chat messages that are not a list of {"role": str, "content": str | content parts}."""

    code = "invalid_messages"


class ChatTemplateError(InvalidRequestError):
    """The chat template failed to render these messages (a jinja2 error, or the template's own
    raise_exception)."""

    code = "chat_template_error"


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""

    code = "invalid_sampling_params"


# ---- LoRA adapters -------------------------------------------------------------------------------
class LoRAError(InvalidRequestError):
    """A LoRA adapter was refused (checked when it is added, before any request that names it is
    queued). The message names the adapter folder and, where one is at fault, the tensor."""

    code = "invalid_lora"


class LoRANotEnabledError(LoRAError):
    """A request names a LoRA adapter but the engine was built without `enable_lora=True`."""

    code = "lora_not_enabled"


class LoRAAdapterNotFoundError(LoRAError):
    """The adapter folder, its adapter_config.json or its adapter_model.safetensors is missing
    (or the server knows no adapter of that name)."""

    code = "lora_not_found"


class LoRAFormatError(LoRAError):
    """The adapter is not a plain PEFT LoRA this engine can serve: a pickled `.bin` (refused),
    another peft_type, DoRA, trained biases, modules_to_save, a corrupt file."""

    code = "invalid_lora_format"


class LoRARankTooLargeError(LoRAError):
    """A module's rank exceeds the engine's max_lora_rank."""

    code = "lora_rank_too_large"


class LoRATargetError(LoRAError):
    """The adapter targets a module the engine does not serve LoRA for (only the q/k/v/o and
    gate/up/down projections, or on MoE models the experts' gate/up/down)."""

    code = "invalid_lora_target"


class LoRAShapeError(LoRAError):
    """A LoRA tensor's shape does not fit the base model (another model's adapter)."""

    code = "lora_shape_mismatch"


class InvalidStructuredOutputsError(InvalidRequestError):
    """`structured_outputs` (a JSON schema, regex, choice list or grammar) is malformed, sets
    other than exactly one constraint, or cannot be compiled against the model's tokenizer."""

    code = "invalid_structured_outputs"
