"""``mock://`` backend for asyncsess: a tiny numpy bigram model with real gradients and fault injection."""

from .backend import MockBackend
from .trainer import MockTrainer
from .faults import MockConfig
from .tokenizer import CharTokenizer

__all__ = ["MockBackend", "MockTrainer", "MockConfig", "CharTokenizer"]
