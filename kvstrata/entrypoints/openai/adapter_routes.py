"""LoRA adapters at run time, as vLLM serves them: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter. The engine thread does the work (`AsyncLLMEngine.call`): an adapter is read
and checked before it is served, and a bad one changes nothing."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvstrata.entrypoints.openai.errors import ApiError
from kvstrata.entrypoints.openai.protocol import LoadLoRARequest, UnloadLoRARequest
from kvstrata.model.adapters.lora import AdapterError

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
        await state.engine.call(lambda engine: engine.adapters.register(name, body.lora_path))
    except AdapterError as exc:
        raise ApiError(400, str(exc), param="lora_path") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@adapter_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, body: UnloadLoRARequest):
    state = request.app.state.kvstrata
    try:
        await state.engine.call(lambda engine: engine.adapters.unregister(body.lora_name))
    except AdapterError as exc:
        raise ApiError(404, str(exc), param="lora_name") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
