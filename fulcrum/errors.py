"""Exception types, one per kind of failure, each carrying a message a user can act on."""


class FulcrumError(Exception):
    """Base class of fulcrum's own errors."""


class ModelLoadError(FulcrumError):
    """A model folder cannot be loaded: missing files, unknown architecture, bad config."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture that no fulcrum model class implements."""


class WeightLoadError(ModelLoadError):
    """A checkpoint tensor is missing, unexpected, or has the wrong shape."""


class ModelNotCachedError(ModelLoadError):
    """A Hugging Face Hub ID names a model the local Hugging Face cache does not hold (fulcrum never downloads)."""


class InvalidRequestError(FulcrumError, ValueError):
    """A request or sampling parameter has an invalid value; `param` names the field (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(FulcrumError):
    """The engine-core process has died; in-flight requests cannot complete (HTTP 500)."""


class WorkerDiedError(EngineDeadError):
    """A rank of a parallel engine died: the model is incomplete, so the engine cannot go on."""


class EngineClosedError(FulcrumError):
    """An `LLM` was used after close(): its engine and workers are gone; build a new one."""


class EngineOverloadedError(FulcrumError):
    """The waiting queue is over its bound; the client should retry later (HTTP 503)."""


class RequestFailedError(FulcrumError):
    """One request failed inside an engine step; the engine and the other requests go on (HTTP 500)."""


class ShuttingDownError(FulcrumError):
    """The server is shutting down: a new request is refused, or one in flight was cut when the drain
    timeout ran out (HTTP 503)."""


class KVCacheTooSmallError(FulcrumError):
    """The memory given to the KV cache cannot hold even one sequence of max_model_len tokens."""


class UnknownHardwareError(FulcrumError, ValueError):
    """--hardware names no catalog entry; the message lists the names there are."""


class WeightShapeError(FulcrumError, ValueError):
    """A checkpoint tensor does not fit the parameter it is loaded into (the loader turns it into a
    WeightLoadError naming the tensor)."""

    def __init__(self, expected: tuple, got: tuple):
        super().__init__(f"expected shape {tuple(expected)}, checkpoint has {tuple(got)}")
        self.expected, self.got = tuple(expected), tuple(got)


class KernelBindingError(FulcrumError, TypeError):
    """A CPU kernel's ctypes binding differs from its C declaration (kernels/csrc/exports.h), or the source breaks
    the fixed style its loader reads: a call would corrupt memory, so the kernel refuses to load. The message names
    the kernel and the function."""


class ModelNotFoundError(FulcrumError):
    """A request names a model this server does not serve (HTTP 404)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def is_fatal(e: BaseException) -> bool:
    """Failures that may have corrupted state shared by every request: the process must end.
    A CUDA error poisons the device context (and the KV cache on it); anything else raised inside
    a forward or the sampler belongs to the requests of that step."""
    if not isinstance(e, Exception) or isinstance(e, WorkerDiedError):
        return True  # KeyboardInterrupt, SystemExit; a parallel engine's rank gone
    return "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError"
