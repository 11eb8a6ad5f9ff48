"""``mock://`` backend for asyncsess: a tiny numpy bigram model with real gradients and fault injection."""

from .backend import MockBackend
from .faults import MockConfig
from .tokenizer import CharTokenizer
from .trainer import MockTrainer

__all__ = ["MockBackend", "MockTrainer", "MockConfig", "CharTokenizer"]
