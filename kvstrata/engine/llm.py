"""`LLM`: the in-process Python API. One object, a loaded model, and blocking calls.

    from kvstrata import LLM, SamplingParams
    llm = LLM(kv_cache_memory="256MiB")
    print(llm.chat([{"role": "user", "content": "What is the capital of France?"}])[0].text)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstrata.core.config import EngineConfig
from kvstrata.core.outputs import RequestOutput
from kvstrata.core.sampling_params import SamplingParams
from kvstrata.engine.llm_engine import LLMEngine, Prompt


class LLM:
    def __init__(self, model: str | None = None, **options: Any):
        """`options` are any engine option by field name (see `kvstrata serve --help`)."""
        self.engine = LLMEngine(EngineConfig.from_options(model=model, **options))

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Complete each prompt (text or token ids); outputs in prompt order. `lora`: an adapter's name
        (started with `enable_lora=True, lora_modules=("NAME=PATH",)`), or one per prompt."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self.engine.generate(list(prompts), params, lora)

    def chat(self, conversations: Sequence[dict] | Sequence[Sequence[dict]],
             params: SamplingParams | None = None, lora: str | Sequence[str | None] | None = None
             ) -> list[RequestOutput]:
        """Reply to one conversation (a list of messages) or to several, under `lora` as in `generate`."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.engine.generate([self.engine.chat_prompt(c) for c in conversations], params, lora)

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at `path` as `name` (again: replaced by the files' new content)."""
        self.engine.adapters.register(name, path)

    def close(self) -> None:
        """Write the cache to the store, when there is one (so the next process finds it), and close it."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *_) -> None:
        self.close()
