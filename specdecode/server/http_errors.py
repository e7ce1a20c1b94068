"""OpenAI-shaped HTTP errors.

Every error the server returns has the body OpenAI's clients parse,
``{"error": {"message", "type", "param", "code"}}``, so the official client raises its usual
``BadRequestError`` / ``NotFoundError`` / ``RateLimitError`` with our message instead of a
decoding failure. This module turns our exceptions and pydantic's validation errors into that
shape; the app registers it for every path, so no input can produce a bare traceback.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

from specdecode.errors import (DamagedCacheError, KVCacheFullError, NonFiniteLogitsError, PromptTooLongError,
                               ServerBusyError, SpecDecodeError)

RETRY_AFTER_S = 1  # what a 429 asks the client to wait; a step of the engine is well under this
REPAIR_RETRY_S = 30  # what a 503 for damaged weights asks: a repack from the GGUF takes seconds


class APIError(Exception):
    """An error response: HTTP status plus OpenAI's four error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_spec_error(exc: SpecDecodeError) -> APIError:
    """Map a user error raised below the HTTP layer to its status."""
    if isinstance(exc, ServerBusyError):
        return APIError(429, str(exc), type="rate_limit_error", code="server_busy",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, KVCacheFullError):  # memory, not the request rate: retry when requests end
        return APIError(503, str(exc), type="server_error", code="kv_cache_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, PromptTooLongError):
        return APIError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, NonFiniteLogitsError):  # the model's fault, not the request's
        return APIError(500, str(exc), type="server_error", code="model_damaged")
    if isinstance(exc, DamagedCacheError):  # being repaired: the same request will succeed later
        return APIError(503, str(exc), type="server_error", code="model_damaged",
                        headers={"Retry-After": str(REPAIR_RETRY_S)})
    return bad_request(str(exc))  # bad sampling values, a model without a chat template, ...


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem pydantic found, worded for a person and naming the field (``param``)."""
    err = exc.errors(include_url=False)[0]
    param = ".".join(str(part) for part in err["loc"]) or None
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    shown = repr(err.get("input"))
    if len(shown) > 80:
        shown = shown[:77] + "..."
    where = f"'{param}'" if param else "the request body"
    got = f" (got {shown})" if "input" in err and kind != "value_error" else ""
    return bad_request(f"Invalid value for {where}: {msg}{got}.", param, "invalid_value")

