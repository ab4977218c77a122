"""Test settings: the same as base, with fast password hashing and no secure-cookie requirement."""

import base64
import hashlib
import os

os.environ.setdefault("GPUMARKET_EPHEMERAL_SECRET", "1")
# Every process of a test stack (pytest, gunicorn, Celery) shares one key, a test-only one: a
# secret one process stores, another decrypts.
os.environ.setdefault(
    "SECRETS_ENCRYPTION_KEYS",
    base64.urlsafe_b64encode(hashlib.sha256(b"gpumarket test secrets").digest()).decode(),
)

from config.settings.base import *  # noqa: F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
SESSION_COOKIE_SECURE = False
CSRF_COOKIE_SECURE = False
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
# Quiet unless asked: the scale-out test reads its workers' INFO cycle lines.
LOGGING["root"]["level"] = os.environ.get("LOG_LEVEL", "WARNING")  # noqa: F405
MIDDLEWARE = [m for m in MIDDLEWARE if not m.startswith("whitenoise.")]  # noqa: F405
# Tests that are not about money need no balance; billing's own tests and the end-to-end tests
# turn the check back on and top the customer up (a stack started by a test, with
# BILLING_FUNDS_CHECK=1 in its environment).
BILLING_FUNDS_CHECK = os.environ.get("BILLING_FUNDS_CHECK") == "1"
# Nor account limits: the tests of limits set them.
BILLING_MAX_CONCURRENT_GPUS = 0
BILLING_MAX_RENTALS_PER_MINUTE = 0
# Agents in the end-to-end tests report every second instead of every five.
# Tests read the offers they just changed: no offers cache unless a test turns it on.
GPUMARKET = {**GPUMARKET, "HEARTBEAT_INTERVAL_S": 1, "OFFERS_CACHE_TTL_S": 0}  # noqa: F405
# The suite makes many requests a second from one address; the throttle tests lower these.
REST_FRAMEWORK = {
    **REST_FRAMEWORK,  # noqa: F405
    "DEFAULT_THROTTLE_RATES": {
        **REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"],  # noqa: F405
        "anon": "100000/min",
        "user": "100000/min",
    },
}
# Mail goes to the SMTP server a test starts (tests.conftest.smtp_server) or stays in memory
# (locmem) unless a test or the environment says otherwise; an end-to-end test's worker gets its
# SMTP server from the environment. Webhook tests run their receiver on loopback.
EMAIL_BACKEND = os.environ.get("EMAIL_BACKEND", "django.core.mail.backends.locmem.EmailBackend")
NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = True
# allauth's own rate limits (sign-up, mails, failed sign-ins per address) would count across the
# whole suite in the shared cache; django-axes still locks sign-ins out, and its tests lower that.
ACCOUNT_RATE_LIMITS = False
# Where the SMTP backend is chosen without a test server, none answers here.
# (An end-to-end test's worker is given its test's server in EMAIL_HOST / EMAIL_PORT.)
EMAIL_HOST = os.environ.get("EMAIL_HOST", "127.0.0.1")
EMAIL_PORT = int(os.environ.get("EMAIL_PORT", "9"))
EMAIL_TIMEOUT = 5
EMAIL_SEND_ATTEMPTS = 1
