"""Small reference models used by the demo, the examples, the benchmarks and the tests."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
