"""The engine loop (`LLMEngine`), the thread that serves it (`AsyncLLMEngine`), the in-process `LLM`,
and what the engine thread publishes for other threads."""
