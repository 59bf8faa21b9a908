"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Raised anywhere in a request as ``ApiError``; FastAPI's validation errors become 400 with
``param`` set to the offending field. 429 and 503 always carry ``Retry-After``.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from libs.protocol import ERROR_HTTP_STATUS, ErrorMessage

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "cancelled",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        if status in (429, 503) and retry_after_s is None:
            retry_after_s = 1.0
        self.retry_after_s = retry_after_s

    @classmethod
    def from_stream(cls, err: ErrorMessage) -> ApiError:
        return cls(
            ERROR_HTTP_STATUS.get(err.code, 500),
            err.message,
            err.code,
            err.param,
            err.retry_after_s,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers())


# OpenAI's endpoints Strait does not serve, by their first path segment under /v1.
OPENAI_ENDPOINTS_NOT_SERVED = {
    "assistants": "Assistants",
    "audio": "Audio",
    "chatkit": "ChatKit",
    "containers": "Containers",
    "conversations": "Conversations",
    "embeddings": "Embeddings",
    "evals": "Evals",
    "fine_tuning": "Fine-tuning",
    "images": "Images",
    "moderations": "Moderations",
    "organization": "Administration",
    "realtime": "Realtime",
    "threads": "Assistants (threads)",
    "uploads": "Uploads",
    "vector_stores": "Vector stores",
    "videos": "Videos",
}


def not_served(method: str, path: str) -> ApiError:
    """A 404 for a ``/v1/...`` path no route serves: an OpenAI endpoint Strait does not serve
    says so by name; any other path gets OpenAI's own ``Invalid URL`` answer."""
    segment = path.removeprefix("/v1/").split("/", 1)[0]
    name = OPENAI_ENDPOINTS_NOT_SERVED.get(segment)
    if name is None:
        return ApiError(404, f"Invalid URL ({method} {path})", "unknown_url")
    return ApiError(
        404,
        f"Strait does not serve OpenAI's {name} API ({method} {path}); it serves "
        "/v1/chat/completions, /v1/completions, /v1/responses, /v1/files, /v1/batches and "
        "/v1/models",
        "endpoint_not_served",
    )


def _param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or None


def validation_api_error(errs: list[Any]) -> ApiError:
    """The 400 for a body's validation errors (FastAPI's or pydantic's ``errors()``)."""
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    param = _param(tuple(first.get("loc", ())))
    ctx = first.get("ctx")
    cause = ctx.get("error") if isinstance(ctx, dict) else None
    if first.get("type") == "extra_forbidden":
        # OpenAI's own answer to a field it does not know.
        msg = f"Unrecognized request argument supplied: {param}"
        return ApiError(400, msg, "invalid_request", param)
    if isinstance(cause, ValueError) and hasattr(cause, "name"):  # schemas.UnsupportedField
        field = f"{param}.{cause.name}" if param else str(cause.name)
        return ApiError(400, str(cause), "unsupported_parameter", field)
    text = str(first.get("msg")).removeprefix("Value error, ")
    msg = f"{param}: {text}" if param else text
    return ApiError(400, msg, "invalid_request", param)


def install_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_api_error(list(exc.errors())).response()

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 404 and request.url.path.startswith("/v1/"):
            return not_served(request.method, request.url.path).response()
        return ApiError(exc.status_code, str(exc.detail), None).response()

    async def unhandled(_: Request, exc: Exception) -> JSONResponse:
        return ApiError(500, "internal server error", "internal_error").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unhandled)
