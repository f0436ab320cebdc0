"""The API's errors in OpenAI's shape `{"error": {"message", "type", "param", "code"}}`: the
exception every check raises (`ApiError`), the answer to a turn's failure (`error_of`) and the
404/405 handlers."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dualpath.frontend.backend import BackendError

log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        if self.retry_after_s is not None:
            headers = {"Retry-After": str(max(1, math.ceil(self.retry_after_s))), **(headers or {})}
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


class AuthError(ApiError):
    """A refused API key or an exhausted rate limit: the response carries `headers`."""

    def __init__(self, status: int, message: str, code: str, type_: str, headers: dict) -> None:
        super().__init__(status, message, code=code, type_=type_)
        self.headers = headers
        self.retry_after_s = None  # the Retry-After of a rate limit is in `headers`

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return super().response({**self.headers, **(headers or {})})


def error_of(err: Exception) -> ApiError:
    """The API's answer to a turn's failure: an ApiError as is, a cluster refusal with its
    status (429 for overload, with Retry-After), anything else a logged 500."""
    if isinstance(err, ApiError):
        return err
    if isinstance(err, BackendError):
        return ApiError(
            err.status,
            f"cluster {'overloaded' if err.status == 429 else 'unavailable'}: {err}",
            code="overloaded" if err.status == 429 else "unavailable",
            type_="rate_limit_error" if err.status == 429 else "server_error",
            retry_after_s=err.retry_after_s,
        )
    log.error("turn failed: %s", err, exc_info=err)
    return ApiError(
        500, f"internal error: {type(err).__name__}", code="internal_error", type_="server_error"
    )


async def not_found(request: Request, exc: Exception) -> Response:
    return ApiError(404, f"no route {request.url.path}", code="not_found").response()


async def bad_method(request: Request, exc: Exception) -> Response:
    return ApiError(
        405,
        f"method {request.method} not allowed on {request.url.path}",
        code="method_not_allowed",
    ).response()
