"""Small reference models used by the demo, the examples, the benchmarks and the tests."""

from .gpt import GPT, GPTShape

__all__ = ["GPT", "GPTShape"]
