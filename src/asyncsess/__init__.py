"""asyncsess: write LLM training loops in plain async Python against live training sessions.

The backend is chosen by URL (``mock://``, ``local://``, ``http://host:port``, ``sagemaker://region``);
the loop does not change. See :class:`ServiceClient`.
"""

from .backend import Backend, Tokenizer, available_schemes, load_backend
from .client import SamplingClient, ServiceClient, TrainingClient
from .errors import (
    AsyncSessError,
    ConflictError,
    DeadlineExceededError,
    FacadeMisuseError,
    InvalidInputError,
    OperationCancelledError,
    PoisonedError,
    RetriesExhaustedError,
    ServerError,
    SessionGoneError,
    TransientError,
    UnsupportedError,
)
from .futures import APIFuture, InvalidStateError
from .retry import RetryEvent, RetryPolicy
from .sampling import SamplingStats
from .types import (
    AdamParams,
    Checkpoint,
    CheckpointResponse,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadStateResponse,
    LoadWeightsResponse,
    LossFnType,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    SaveStateResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
    ServerCapabilities,
    SupportedModel,
    TensorData,
    Usage,
)

__version__ = "0.1.0"

__all__ = [
    "APIFuture",
    "AdamParams",
    "AsyncSessError",
    "Backend",
    "Checkpoint",
    "CheckpointResponse",
    "ConflictError",
    "Datum",
    "DeadlineExceededError",
    "EncodedTextChunk",
    "FacadeMisuseError",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "InvalidInputError",
    "InvalidStateError",
    "LoadStateResponse",
    "LoadWeightsResponse",
    "LossFnType",
    "ModelInput",
    "OperationCancelledError",
    "OptimStepResponse",
    "PoisonedError",
    "RetriesExhaustedError",
    "RetryEvent",
    "RetryPolicy",
    "SampleResponse",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "SamplingStats",
    "SaveStateResponse",
    "SaveWeightsForSamplerResponse",
    "SaveWeightsResponse",
    "ServerCapabilities",
    "ServerError",
    "ServiceClient",
    "SessionGoneError",
    "SupportedModel",
    "TensorData",
    "Tokenizer",
    "TrainingClient",
    "TransientError",
    "UnsupportedError",
    "Usage",
    "available_schemes",
    "load_backend",
]
