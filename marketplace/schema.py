"""OpenAPI descriptions of the project's own authentication schemes (drf-spectacular)."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiTokenScheme(OpenApiAuthenticationExtension):
    target_class = "marketplace.authentication.ApiTokenAuthentication"
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
