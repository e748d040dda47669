"""The error object of the HTTP API (OpenAI's shape), shared by its endpoints' modules."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse


class ApiError(Exception):
    """A request answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def kind(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status == 404 and self.code == "model_not_found":
            return "invalid_request_error"
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self, body: dict | None = None) -> JSONResponse:
        """The HTTP response: OpenAI's error object, or `body` (another API's)."""
        headers = {"Retry-After": "1"} if self.status in (429, 503) else None
        return JSONResponse(self.body() if body is None else body, status_code=self.status, headers=headers)


def type_error(name: str, wanted: str, value) -> ApiError:
    return ApiError(400, f"{name} must be {wanted}, got {json.dumps(value)[:80]}", param=name)


def flag(body: dict, name: str, default: bool = False) -> bool:
    """A request's true/false field (`default` when it is absent or null)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise type_error(name, "true or false", value)
    return value
