"""The endpoints of OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvstrata.entrypoints.openai.errors import ApiError
from kvstrata.entrypoints.openai.responses.protocol import ResponsesRequest
from kvstrata.entrypoints.openai.responses.serving import create_response
from kvstrata.entrypoints.openai.responses.store import ResponseStore, StoredResponse


def responses_router(store: ResponseStore | None = None) -> APIRouter:
    """The endpoints over one store of responses (a new one unless given): one router per app."""
    store = store if store is not None else ResponseStore()
    router = APIRouter()

    @router.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        return await create_response(request.app.state.kvstrata, store, request, body)

    @router.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False):
        if stream:
            raise ApiError(400, "a stored response is returned whole; kvstrata does not replay its events",
                           param="stream")
        return _stored(store, response_id).body

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        _stored(store, response_id)
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _stored(store: ResponseStore, response_id: str) -> StoredResponse:
    stored = store.get(response_id)
    if stored is None:
        raise ApiError(404, f"no stored response '{response_id}'", param="response_id", code="response_not_found")
    return stored
