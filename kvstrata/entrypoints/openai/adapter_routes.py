"""LoRA adapters at run time, as vLLM serves them: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, registered only with --allow-runtime-lora-updating (or vLLM's
VLLM_ALLOW_RUNTIME_LORA_UPDATING): without it both are 404 whatever the body, as in vLLM.

A load names a path on the server, so it is a client's probe of the file system unless every refusal
looks the same: a path that does not exist, is a file, lies outside --lora-root, is too long or holds
a NUL, or a folder whose files are malformed, oversized or of another model, are all one 400 with one
message; the reason goes to the server's log. The files are read and checked in a thread of their own
(`AsyncLLMEngine.read_adapter`), and only the install, a few dict updates, runs between engine steps.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvstrata.entrypoints.openai.errors import ApiError
from kvstrata.entrypoints.openai.protocol import LoadLoRARequest, UnloadLoRARequest
from kvstrata.model.adapters.lora import AdapterError

logger = logging.getLogger(__name__)

REFUSED = "cannot load a LoRA adapter from this path"

adapter_router = APIRouter()


@adapter_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, body: LoadLoRARequest):
    state = request.app.state.kvstrata
    name = body.lora_name
    if name == state.model_name:
        raise ApiError(400, f"'{name}' is the base model's name; give the adapter another", param="lora_name")
    if name in state.engine.adapters and not body.load_inplace:
        raise ApiError(400, f"the LoRA adapter '{name}' is already loaded; send load_inplace: true to replace its "
                            "weights", param="lora_name")
    try:
        weights = await state.engine.read_adapter(name, body.lora_path)
    except Exception as exc:        # an AdapterError, or a bug (logged with its trace): the same refusal either way
        logger.warning("refused to load LoRA adapter %r from %r: %s", name[:64], body.lora_path[:256], exc,
                       exc_info=not isinstance(exc, AdapterError))
        raise ApiError(400, REFUSED, param="lora_path") from None
    try:
        await state.engine.call(lambda engine: engine.adapters.install(name, body.lora_path, weights, trusted=False,
                                                                       replace=body.load_inplace))
    except AdapterError as exc:
        raise ApiError(400, str(exc), param="lora_name") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@adapter_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, body: UnloadLoRARequest):
    state = request.app.state.kvstrata
    try:
        await state.engine.call(lambda engine: engine.adapters.unregister(body.lora_name))
    except AdapterError as exc:
        raise ApiError(404, str(exc), param="lora_name") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
