"""Errors in OpenAI's shape `{"error": {message, type, param, code}}`, and the translation of
a ValueError or pydantic's validation errors into one readable message that names the field."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status,
                        headers=headers)


def param_of(e: ValueError) -> str | None:
    """The parameter a ValueError names ("temperature: must be >= 0" -> "temperature")."""
    head = str(e).split(":", 1)[0]
    return head if head.isidentifier() else None


def as_api_error(e: ValueError, schema_from: str | None = None) -> APIError:
    """400 naming the parameter; a schema that came in response_format or tools is named so."""
    msg, param = str(e), param_of(e)
    if param == "json_schema" and schema_from is not None:
        msg, param = schema_from + msg[len("json_schema"):], schema_from
    return APIError(400, msg, param)


# pydantic names union members and validators in an error's location; they are not fields
_NOT_FIELDS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _is_field(part) -> bool:
    if isinstance(part, int):
        return True
    return (part.isidentifier() and part not in _NOT_FIELDS) or part.isdigit()


def validation_error(errors: list[dict]) -> APIError:
    """A 400 for pydantic's errors about a request body: the first one, with its field."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        loc = first.get("loc", ())
        where = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        why = (first.get("ctx") or {}).get("error", "")
        return APIError(400, f"the request body is not valid JSON{where}"
                        + (f": {why}" if why else ""), None)
    loc = list(first.get("loc", ()))
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ".".join(str(x) for x in loc if _is_field(x)) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if param is None:
        return APIError(400, f"request body: {msg}", None)
    return APIError(400, f"{param}: {msg}", param)
