"""Errors churon raises for bad input. Each message names the file, tensor, field or value."""


class ChuronError(Exception):
    """Base class of every error churon raises on purpose."""


class ModelFileError(ChuronError):
    """A model file or directory is missing, malformed, truncated or inconsistent."""


class UnsupportedModelError(ChuronError):
    """The model uses an architecture or tensor type churon does not implement."""


class ContextLengthError(ChuronError, ValueError):
    """A prompt (plus the tokens to generate) does not fit the context window."""


class GenerationError(ChuronError, RuntimeError):
    """One request failed while it generated (the model's logits were NaN, its grammar or detokenizer
    failed): that request alone finishes, with finish_reason "error"; the others in its batch go on."""


class TaskError(ChuronError, ValueError):
    """A model was asked for what it does not do: text from an embedding model, vectors from a model
    loaded to generate."""
