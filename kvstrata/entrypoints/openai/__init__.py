"""The OpenAI-compatible HTTP API over an `AsyncLLMEngine`, and its Prometheus metrics."""
