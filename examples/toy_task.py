"""The toy RL task shared by the GRPO examples: answer with digits."""

PROMPTS = ["Code:", "PIN:", "Number:", "Digits:"]


def reward(text: str) -> float:
    """Fraction of characters that are digits."""
    return sum(c.isdigit() for c in text) / max(1, len(text))


def sample_seed(seed: int, step: int, prompt_index: int) -> int:
    return seed * 10_000 + step * 100 + prompt_index
