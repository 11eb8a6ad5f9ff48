"""The backend seam: the :class:`Backend` protocol, the op records that cross it, the URL registry, the
per-session :class:`Sequencer` and per-sampler :class:`SampleStore` every driver can reuse, and the torch-free
``http://`` driver for a worker.

Nothing here imports a backend package; backends import this.
"""

from .base import (
    OP_TYPES,
    Backend,
    ForwardBackwardOp,
    ForwardOp,
    LoadStateOp,
    OptimStepOp,
    ParsedURL,
    PassOp,
    SampleRequest,
    SamplerSpec,
    SaveStateOp,
    SaveWeightsOp,
    Tokenizer,
    TrainingOp,
    TrainingOpKind,
    TrainingSessionSpec,
    parse_url,
    require_op,
    unknown_op,
)
from .registry import available_schemes, load_backend
from .sample_store import SampleStore
from .sequencer import Sequencer

__all__ = [
    "OP_TYPES",
    "Backend",
    "ForwardBackwardOp",
    "ForwardOp",
    "LoadStateOp",
    "OptimStepOp",
    "PassOp",
    "SaveStateOp",
    "SaveWeightsOp",
    "ParsedURL",
    "SampleRequest",
    "SampleStore",
    "SamplerSpec",
    "Sequencer",
    "Tokenizer",
    "TrainingOp",
    "TrainingOpKind",
    "TrainingSessionSpec",
    "available_schemes",
    "load_backend",
    "parse_url",
    "require_op",
    "unknown_op",
]
