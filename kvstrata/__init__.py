"""kvstrata: an LLM serving engine whose KV cache spans device, host and store tiers."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    """Import the heavy parts (torch, transformers) only when they are asked for."""
    if name == "LLM":
        from kvstrata.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kvstrata.core.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
