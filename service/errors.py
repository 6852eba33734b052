"""The API's errors, each with its HTTP status and OpenAI error ``type``.

    ApiError                      -- base; rendered as {"error": {message, type, param, code}}
    ├── InvalidRequest      400   -- bad parameter: names the parameter, limit, observed value
    ├── Unauthorized        401   -- no API key, or not a valid one
    ├── Forbidden           403   -- the key may not use this model or route
    ├── NotFound            404   -- unknown request id (or another tenant's: same answer)
    └── ServiceUnavailable  503   -- dependency down / over capacity; carries Retry-After

A body over the size limit is Litestar's own 413, rendered in the same shape
(``service/api/app.py``); 429 is ``service/api/admission.RateLimited``.

Errors *after* the first streamed byte are not exceptions: they are ``error``
events in the log, rendered in band (see ``service/stream/render.py``).
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status_code = 500
    error_type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(ApiError):
    status_code = 400
    error_type = "invalid_request_error"


class Unprocessable(ApiError):
    status_code = 422
    error_type = "invalid_request_error"


class Unauthorized(ApiError):
    status_code = 401
    error_type = "authentication_error"

    def __init__(self, message: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("WWW-Authenticate", "Bearer")


class Forbidden(ApiError):
    status_code = 403
    error_type = "permission_error"


class NotFound(ApiError):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    """A model this server does not know: a 404 of OpenAI's kind (as its API and vLLM's
    server answer it)."""

    error_type = "invalid_request_error"


class ServiceUnavailable(ApiError):
    status_code = 503
    error_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after_s: int = 1, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(retry_after_s))
