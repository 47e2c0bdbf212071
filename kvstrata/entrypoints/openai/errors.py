"""OpenAI-format errors: `{"error": {"message", "type", "param", "code"}}` with the right status."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 503: "overloaded_error"}


STEP_FAILED = ("the engine step computing this request failed; the request was ended and everything it held "
               "was released (the server goes on serving): retry it")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param): `param` is the top-level field the user sent (`messages`), never pydantic's
    path; the message points inside it (`messages[1].content`), without pydantic's type tags."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = str(loc[0]) if loc else None
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            path += f".{part}" if path else part
        else:
            break                    # a union member's tag (str, list[...], function-after[...]): stop
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unknown parameter '{path}'", param
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{path or 'body'}: {message}", param


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "any"}
