"""kvstrata: an LLM serving engine whose KV cache spans device, host and store tiers."""

__version__ = "0.1.0"
