"""Production: base settings plus the HTTPS hardening `manage.py check --deploy` asks for.

TLS ends at the proxy or ingress in front of gunicorn, which must set X-Forwarded-Proto; the
header is trusted only because this setting module is used behind such a proxy.
Optional: SECURE_HSTS_SECONDS (one year by default), SECURE_SSL_REDIRECT (on by default).
"""

from config.settings.base import *  # noqa: F403
from config.settings.base import env

if DEBUG:  # noqa: F405
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("config.settings.production runs with DEBUG=0 only")

SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=True)
# The probes and Prometheus talk to the pods directly over plain HTTP.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31_536_000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
# Preloading is a one-way commitment of the whole domain that the operator makes, not a default.
SILENCED_SYSTEM_CHECKS = ["security.W021"]
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_CONTENT_TYPE_NOSNIFF = True
X_FRAME_OPTIONS = "DENY"
# Links in mails (address verification, password reset) are https even when built by a worker.
ACCOUNT_DEFAULT_HTTP_PROTOCOL = "https"
