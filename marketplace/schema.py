"""OpenAPI descriptions of the project's own authentication schemes (drf-spectacular)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "accounts.authentication.ApiTokenAuthentication"
    name = "apiToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An API token (gpm_...) created at /api/v1/tokens/",
        }


class NodeTokenScheme(OpenApiAuthenticationExtension):
    target_class = "provisioning.api.views.NodeAuthentication"
    name = "nodeToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A node agent's token (gpn_...) received at join",
        }


# The answers any operation can give besides its own, with the one error body they share. Every
# request may be refused (400: a bad parameter or a NUL anywhere), carry a bad or no credential
# (401, 403), name something that is not there or not yours (404) or be throttled (429); a write
# may also meet a state that forbids it (409), an unpaid balance (402), a body too big or not JSON
# (413, 415) or a payment service that is down (503).
_ERRORS_ANY = {
    "400": "Invalid input; the body names each field refused",
    "401": "No valid credentials",
    "403": "Not allowed",
    "404": "Not found, or not yours",
    "429": "Too many requests; Retry-After says when to try again",
}
_ERRORS_WRITE = {
    "402": "The balance does not cover it",
    "409": "The current state forbids it",
    "413": "The request body is too large",
    "415": "The request body is not JSON",
    "503": "A service it needs is unavailable right now",
}
_ERROR_SCHEMA = {
    "type": "object",
    "description": (
        "`detail` says what went wrong and `code` what kind of error it is; a refused field "
        "appears under its own name with its messages."
    ),
    "properties": {"detail": {}, "code": {"type": "string"}},
    "additionalProperties": True,
}


def document_error_responses(result, generator, request, public):
    """Postprocessing hook: adds the error answers an operation can give to every operation that
    does not document them itself, all with the `Error` body."""
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = _ERROR_SCHEMA
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for path in result.get("paths", {}).values():
        for method, operation in path.items():
            codes = dict(_ERRORS_ANY)
            if method in ("post", "put", "patch", "delete"):
                codes.update(_ERRORS_WRITE)
            responses = operation.setdefault("responses", {})
            for code, description in codes.items():
                responses.setdefault(code, {"content": error, "description": description})
            responses["429"].setdefault(
                "headers",
                {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}},
            )
    return result
