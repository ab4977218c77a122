"""Settings read from the environment (12-factor). No secret lives here.

Required: DATABASE_URL (PostgreSQL only: the invariants use exclusion constraints and range types).
Optional: REDIS_URL or CELERY_BROKER_URL, SECRET_KEY, SECRETS_ENCRYPTION_KEYS, DEBUG,
ALLOWED_HOSTS, STRIPE_* keys, EMAIL_* (SMTP) settings, S3_* (object storage).
`python3 dev.py up` and `python3 dev.py test` set DATABASE_URL, REDIS_URL and S3_* to embedded
services when they are not set.
"""

import os
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import environ
from django.core.exceptions import ImproperlyConfigured

from config.observability.logs import logging_config

BASE_DIR = Path(__file__).resolve().parent.parent.parent


class _LiteralEnv(environ.Env):
    """django-environ reads a value that starts with "$" as the name of another variable, and
    an unset one as the default: a secret such as `$k9...` (one random key in fifty) silently
    became "". Values here are always literal."""

    def get_value(self, var, cast=None, default=environ.Env.NOTSET, parse_default=False):
        raw = self.ENVIRON.get(f"{self.prefix}{var}")
        if isinstance(raw, str) and raw.startswith("$"):
            return self.parse_value(raw, cast)
        return super().get_value(var, cast=cast, default=default, parse_default=parse_default)


env = _LiteralEnv()

DEBUG = env.bool("DEBUG", default=False)
SECRET_KEY = env.str("SECRET_KEY", default="")
if not SECRET_KEY:
    if not DEBUG and not env.bool("GPUMARKET_EPHEMERAL_SECRET", default=False):
        raise ImproperlyConfigured("SECRET_KEY is not set (set DEBUG=1 for a local throwaway key)")
    # Local runs only: a fresh key per process start invalidates sessions, which is acceptable.
    from django.core.management.utils import get_random_secret_key

    SECRET_KEY = get_random_secret_key()
# Team secrets (accounts.secrets) are encrypted at rest with these Fernet keys: the first
# encrypts, every one decrypts, so a new key goes first and an old one is dropped once
# `manage.py secrets_rotate` has re-encrypted everything with the new one. Every web and worker
# process of a deployment must share them. A local run (DEBUG or an ephemeral key) derives one
# from SECRET_KEY; production refuses to start without them, as without SECRET_KEY.
SECRETS_ENCRYPTION_KEYS = env.list("SECRETS_ENCRYPTION_KEYS", default=[])
if not SECRETS_ENCRYPTION_KEYS:
    if not DEBUG and not env.bool("GPUMARKET_EPHEMERAL_SECRET", default=False):
        raise ImproperlyConfigured(
            "SECRETS_ENCRYPTION_KEYS is not set (one or more Fernet keys, comma-separated, "
            "newest first: `openssl rand -base64 32 | tr +/ -_` makes one)"
        )
    import base64
    import hashlib

    SECRETS_ENCRYPTION_KEYS = [
        base64.urlsafe_b64encode(
            hashlib.sha256(f"gpumarket team secrets:{SECRET_KEY}".encode()).digest()
        ).decode()
    ]
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.postgres",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "axes",
    "accounts",
    "marketplace",
    "scheduler",
    "provisioning",
    "billing",
    "notifications",
    "advisor",
    "storage",
    # After the project's apps, whose templates (the site's layout) override allauth's.
    "allauth",
    "allauth.account",
    "allauth.mfa",
]

MIDDLEWARE = [
    # Observability first, so the request id and the timing cover everything below.
    "config.observability.logs.RequestIdMiddleware",
    "config.observability.metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    # Before anything reads the request: odd input refused, the client's address decided.
    "core.api.guards.RequestGuardMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "allauth.account.middleware.AccountMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",
    # After sessions, auth and messages: it reads the user and says why it redirects.
    "accounts.signup.StaffTwoFactorMiddleware",
]
# The agent API (node tokens, no browser) is served by its own handler with only the middleware
# a machine's request needs (config/wsgi.py): sessions, CSRF, the user, allauth, messages, axes
# and the staff check did nothing for it but cost a tenth of a heartbeat's server time.
AGENT_API_PREFIX = "/api/agent/"
AGENT_MIDDLEWARE = [
    "config.observability.logs.RequestIdMiddleware",
    "config.observability.metrics.RequestMetricsMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "core.api.guards.RequestGuardMiddleware",
    "django.middleware.common.CommonMiddleware",
]

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "accounts.context.teams",
            ],
        },
    },
]

if "DATABASE_URL" not in env:
    raise ImproperlyConfigured(
        "DATABASE_URL is not set: run `python3 dev.py up` (embedded PostgreSQL) "
        "or point it at a PostgreSQL server"
    )
DATABASES = {"default": env.db_url("DATABASE_URL")}
if not DATABASES["default"]["ENGINE"].endswith("postgresql"):
    raise ImproperlyConfigured("DATABASE_URL must point at PostgreSQL")
DATABASES["default"].setdefault("CONN_MAX_AGE", env.int("DB_CONN_MAX_AGE", default=60))
# Django's backend with a health check that polls the socket before paying a round trip.
DATABASES["default"]["ENGINE"] = "config.postgresql"
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"].setdefault("OPTIONS", {})
# A statement that runs away must not hold locks the scheduler needs.
DATABASES["default"]["OPTIONS"].setdefault("options", "-c statement_timeout=30000")
# pg_stat_activity names the process (a worker's pool processes carry their parent's pid), so a
# lock or a long query can be traced to the process that holds it, over TCP or a Unix socket.
DATABASES["default"]["OPTIONS"].setdefault("application_name", f"gpumarket pid={os.getpid()}")
# Values bound by the server, and a statement run 5 times on a connection kept prepared there
# (parsed and planned once): PostgreSQL's CPU per API create fell by a third. Django keeps both
# off by default for transaction-mode poolers, which cannot keep a prepared statement between
# transactions: behind one, set DB_PREPARED_STATEMENTS=0.
if env.bool("DB_PREPARED_STATEMENTS", default=True):
    DATABASES["default"]["OPTIONS"].setdefault("server_side_binding", True)
    DATABASES["default"]["OPTIONS"].setdefault("prepare_threshold", 5)

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
AUTH_USER_MODEL = "marketplace.User"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Sign-in lockout (django-axes): AXES_FAILURE_LIMIT failed sign-ins for one username from one
# address lock that pair out for AXES_COOLOFF_MINUTES; the answer is a 429 saying so.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "allauth.account.auth_backends.AuthenticationBackend",
]
AXES_FAILURE_LIMIT = env.int("AXES_FAILURE_LIMIT", default=5)
AXES_COOLOFF_TIME = timedelta(minutes=env.int("AXES_COOLOFF_MINUTES", default=15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
# allauth's sign-in form calls its field "login" (a username or an email address).
AXES_USERNAME_CALLABLE = "accounts.signup.axes_username"
AXES_CLIENT_IP_CALLABLE = "core.api.guards.client_ip"
AXES_COOLOFF_MESSAGE = (
    "Too many failed sign-ins for this account from your address: try again later."
)

# Proxies (addresses or CIDR ranges) whose X-Forwarded-For is believed; from anyone else the
# client is the peer address. Empty: the server faces clients directly.
TRUSTED_PROXIES = env.list("TRUSTED_PROXIES", default=[])
# Only behind a proxy that sets it (e.g. "HTTP_X_FORWARDED_PROTO=https"); unset, a client could
# claim HTTPS by sending the header.
if env.str("SECURE_PROXY_SSL_HEADER", default=""):
    _name, _, _value = env.str("SECURE_PROXY_SSL_HEADER").partition("=")
    SECURE_PROXY_SSL_HEADER = (_name, _value or "https")

# Request bodies: Django's own limit (forms, request.body) and the API parser's are the same.
API_MAX_BODY_BYTES = env.int("API_MAX_BODY_BYTES", default=1 << 20)
API_MAX_JSON_DEPTH = env.int("API_MAX_JSON_DEPTH", default=64)
DATA_UPLOAD_MAX_MEMORY_SIZE = API_MAX_BODY_BYTES

LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/"

# Sign-up and sign-in (django-allauth): a username or the email address signs in; the address
# must be verified (a link by mail) before the first sign-in; TOTP is optional for customers and
# required for staff before the admin opens (accounts.signup.StaffTwoFactorMiddleware).
ACCOUNT_ADAPTER = "accounts.signup.AccountAdapter"
ACCOUNT_LOGIN_METHODS = {"username", "email"}
ACCOUNT_SIGNUP_FIELDS = ["email*", "username*", "password1*", "password2*"]
ACCOUNT_EMAIL_VERIFICATION = "mandatory"
ACCOUNT_UNIQUE_EMAIL = True
ACCOUNT_EMAIL_CONFIRMATION_EXPIRE_DAYS = env.int("EMAIL_CONFIRMATION_EXPIRE_DAYS", default=3)
# A taken address is named on the sign-up form, an unknown one on the password-reset form (a
# taken username says as much anyway); django-axes and allauth's rate limits slow guessing.
ACCOUNT_PREVENT_ENUMERATION = False
ACCOUNT_EMAIL_SUBJECT_PREFIX = "[gpumarket] "
MFA_SUPPORTED_TYPES = ["totp", "recovery_codes"]
MFA_TOTP_ISSUER = env.str("MFA_TOTP_ISSUER", default="gpumarket")
# One 30 s step either side, for the clock of a phone.
MFA_TOTP_TOLERANCE = 1

# Mail (verification links, password resets, sign-in notices) through Django's backend: SMTP by
# default, the console in `python3 dev.py up`. EMAIL_TIMEOUT bounds every SMTP call; a send that
# fails on the connection is tried EMAIL_SEND_ATTEMPTS times (accounts.signup.email_send).
EMAIL_BACKEND = env.str("EMAIL_BACKEND", default="django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env.str("EMAIL_HOST", default="localhost")
EMAIL_PORT = env.int("EMAIL_PORT", default=25)
EMAIL_HOST_USER = env.str("EMAIL_HOST_USER", default="")
EMAIL_HOST_PASSWORD = env.str("EMAIL_HOST_PASSWORD", default="")
EMAIL_USE_TLS = env.bool("EMAIL_USE_TLS", default=False)
EMAIL_USE_SSL = env.bool("EMAIL_USE_SSL", default=False)
EMAIL_TIMEOUT = env.int("EMAIL_TIMEOUT", default=10)
EMAIL_SEND_ATTEMPTS = env.int("EMAIL_SEND_ATTEMPTS", default=3)
DEFAULT_FROM_EMAIL = env.str("DEFAULT_FROM_EMAIL", default="gpumarket <noreply@localhost>")
SERVER_EMAIL = DEFAULT_FROM_EMAIL

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = env.path("STATIC_ROOT", default=BASE_DIR / ".var" / "static")
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
WHITENOISE_USE_FINDERS = True

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SECURE = env.bool("SECURE_COOKIES", default=not DEBUG)
CSRF_COOKIE_SECURE = SESSION_COOKIE_SECURE

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.ApiTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_FILTER_BACKENDS": ["django_filters.rest_framework.DjangoFilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "core.api.pagination.Pagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "core.api.exceptions.exception_handler",
    # JSON only, through the guard (size, depth, NUL); a form body is a 415.
    "DEFAULT_PARSER_CLASSES": ["core.api.guards.GuardedJSONParser"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "DEFAULT_THROTTLE_CLASSES": [
        "core.api.throttles.CustomerAnonThrottle",
        "core.api.throttles.CustomerUserThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "agent": env.str("AGENT_THROTTLE_RATE", default="600/min"),
        # Heartbeats per client address whose token a web process has not yet seen valid: each
        # agent passes once per process every 5 minutes, a forger on every request.
        "agent_unverified": env.str("AGENT_UNVERIFIED_THROTTLE_RATE", default="3000/min"),
        "anon": env.str("API_ANON_THROTTLE_RATE", default="60/min"),
        "user": env.str("API_USER_THROTTLE_RATE", default="600/min"),
    },
    # The client address comes from guards.client_ip (REMOTE_ADDR after RequestGuardMiddleware),
    # never from a header DRF would read on its own.
    "NUM_PROXIES": 0,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "GPU marketplace API",
    "DESCRIPTION": "Search GPU offers, rent GPUs, follow rentals and usage.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["rest_framework.permissions.AllowAny"],
    # Names for choice sets that would otherwise get generated names (Status469Enum).
    "ENUM_NAME_OVERRIDES": {
        "RentalStatusEnum": "marketplace.models.RentalStatus",
        "TopUpStatusEnum": "billing.models.payments.TopUpStatus",
        "NotificationKindEnum": "notifications.models.NotificationKind",
        # The advisor's recompute and checkpointing fields: advisor.engine.memory.Checkpointing.
        "RecomputeEnum": ["none", "selective", "full"],
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "marketplace.schema.document_error_responses",
    ],
}

REDIS_URL = env.str("REDIS_URL", default="redis://127.0.0.1:6379/0")
CACHES = {
    "default": {
        "BACKEND": "config.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "OPTIONS": {"socket_timeout": 2, "socket_connect_timeout": 2},
    }
}
CELERY_BROKER_URL = env.str("CELERY_BROKER_URL", default=REDIS_URL)
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# What a task prints (the console mail backend's messages in `dev.py up`) is logged at INFO, not as
# a warning.
CELERY_WORKER_REDIRECT_STDOUTS_LEVEL = "INFO"
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
# Every task names its own time_limit and soft_time_limit (a global soft limit above a task's own
# hard limit made Celery refuse to send that task); these defaults only cover Celery's own.
CELERY_TASK_TIME_LIMIT = 300
CELERY_TASK_SOFT_TIME_LIMIT = 240
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_timeout": 10, "socket_connect_timeout": 5}
CELERY_TASK_ALWAYS_EAGER = env.bool("CELERY_TASK_ALWAYS_EAGER", default=False)
# A queue per worker pool, so that no latency-bound task waits for a process another holds: the
# scheduler's placement cycles (create -> SCHEDULED), the billing pass (a singleton whose run
# grows with the running rentals; usage must be rated every minute), and the rest (sweeps, the
# telemetry flush, notifications, hourly housekeeping). A worker started without -Q consumes
# every queue (dev.py up, a small install); production runs a pool per queue (deploy/).
CELERY_TASK_DEFAULT_QUEUE = "celery"
CELERY_TASK_QUEUES = {"celery": {}, "scheduler": {}, "billing": {}}
CELERY_TASK_ROUTES = {
    "scheduler.cycle": {"queue": "scheduler"},
    "scheduler.tick": {"queue": "scheduler"},
    "billing.pass": {"queue": "billing"},
}
# The periodic work, defined here once: name -> (task, every). Nothing depends on a message
# getting through: each periodic task re-reads its work from PostgreSQL, so a lost message, a
# broker restart or a killed worker delays that work by one interval at most.
# BEAT_MAX_INTERVAL_S caps every interval (the end-to-end tests run beat in seconds).
PERIODIC_TASKS: dict[str, tuple[str, timedelta]] = {
    "scheduler-tick": ("scheduler.tick", timedelta(seconds=5)),
    "silent-nodes": ("provisioning.mark_silent_nodes", timedelta(seconds=15)),
    "booked-time": ("provisioning.end_booked_time", timedelta(seconds=15)),
    "gang-start-timeout": ("provisioning.gangs_start_timeout", timedelta(seconds=15)),
    "node-reliability": ("provisioning.measure_reliability", timedelta(hours=1)),
    "node-benchmarks": ("provisioning.schedule_benchmarks", timedelta(minutes=10)),
    "telemetry-flush": ("provisioning.flush_telemetry", timedelta(seconds=5)),
    "advisor-calibrate": ("provisioning.calibrate_advisor", timedelta(minutes=5)),
    "run-logs-expire": ("provisioning.expire_run_logs", timedelta(hours=1)),
    "billing-pass": ("billing.pass", timedelta(seconds=60)),
    "billing-telemetry-prune": ("billing.telemetry_prune", timedelta(hours=1)),
    "billing-invoices-issue": ("billing.invoices_issue", timedelta(hours=1)),
    "billing-payments-retry": ("billing.payments_retry", timedelta(minutes=5)),
    "storage-artifacts-expire": ("storage.artifacts_expire", timedelta(hours=1)),
    "storage-uploads-abandon": ("storage.dataset_uploads_abandon", timedelta(hours=1)),
    "notifications-sweep": ("notifications.sweep", timedelta(seconds=15)),
}
_beat_cap = env.float("BEAT_MAX_INTERVAL_S", default=0.0)
CELERY_BEAT_SCHEDULE: dict[str, dict] = {
    name: {
        "task": task,
        "schedule": min(every, timedelta(seconds=_beat_cap)) if _beat_cap > 0 else every,
    }
    for name, (task, every) in PERIODIC_TASKS.items()
}
CELERY_BEAT_MAX_LOOP_INTERVAL = min(5.0, _beat_cap) if _beat_cap > 0 else 5.0

# Stripe: without a secret key everything but card payments works (ops credit accounts by hand).
STRIPE_SECRET_KEY = env.str("STRIPE_SECRET_KEY", default="")
STRIPE_PUBLISHABLE_KEY = env.str("STRIPE_PUBLISHABLE_KEY", default="")
STRIPE_WEBHOOK_SECRET = env.str("STRIPE_WEBHOOK_SECRET", default="")
# Points the SDK at a Stripe-compatible server (localstripe in the test suite).
STRIPE_API_BASE = env.str("STRIPE_API_BASE", default="")
STRIPE_CONNECT_ENABLED = env.bool("STRIPE_CONNECT_ENABLED", default=False)
STRIPE_TIMEOUT_S = env.float("STRIPE_TIMEOUT_S", default=10.0)
STRIPE_MAX_NETWORK_RETRIES = env.int("STRIPE_MAX_NETWORK_RETRIES", default=2)

# Billing: money in integer micro-dollars; see billing/conf.py for what each one means.
BILLING_PLATFORM_FEE_BPS = env.int("BILLING_PLATFORM_FEE_BPS", default=2000)
BILLING_POSTING_INTERVAL_S = env.int("BILLING_POSTING_INTERVAL_S", default=3600)
BILLING_LOW_BALANCE_HOURS = env.int("BILLING_LOW_BALANCE_HOURS", default=1)
BILLING_FUNDS_CHECK = env.bool("BILLING_FUNDS_CHECK", default=True)
# Credit every new sign-up gets, in dollars, so a new account can try the product before it
# pays (the dev stack sets it; 0, none, unless the operator chooses otherwise).
try:
    SIGNUP_CREDIT_USD = Decimal(env.str("SIGNUP_CREDIT_USD", default="0"))
except ArithmeticError:
    SIGNUP_CREDIT_USD = Decimal(-1)
if not 0 <= SIGNUP_CREDIT_USD <= 10_000:
    raise ImproperlyConfigured("SIGNUP_CREDIT_USD must be an amount in dollars, 0 to 10000")
BILLING_CLOCK_SKEW_S = env.int("BILLING_CLOCK_SKEW_S", default=120)
BILLING_TELEMETRY_RETENTION_DAYS = env.int("BILLING_TELEMETRY_RETENTION_DAYS", default=7)
BILLING_CURRENCY = env.str("BILLING_CURRENCY", default="usd")
BILLING_TOPUP_MIN_CENTS = env.int("BILLING_TOPUP_MIN_CENTS", default=500)
BILLING_TOPUP_MAX_CENTS = env.int("BILLING_TOPUP_MAX_CENTS", default=1_000_000)
# Per-account limits unless ops set another ceiling on the account (0: no limit).
BILLING_MAX_CONCURRENT_GPUS = env.int("BILLING_MAX_CONCURRENT_GPUS", default=64)
BILLING_MAX_RENTALS_PER_MINUTE = env.int("BILLING_MAX_RENTALS_PER_MINUTE", default=30)

GPUMARKET = {
    # Agents that have not heartbeaten for this long are marked OFFLINE.
    "NODE_SILENCE_TIMEOUT_S": env.int("NODE_SILENCE_TIMEOUT_S", default=60),
    "HEARTBEAT_INTERVAL_S": env.int("HEARTBEAT_INTERVAL_S", default=5),
    # With a wake server (WAKE_URL), work reaches an idle node at once, and its heartbeats only
    # say it is alive: idle nodes are then asked to heartbeat less often as the fleet grows, so
    # all of them together offer at most this many a second (never less often than every
    # IDLE_HEARTBEAT_MAX_S; 0: every node at HEARTBEAT_INTERVAL_S). A node is lost after three
    # missed intervals (or NODE_SILENCE_TIMEOUT_S, whichever is longer).
    "IDLE_HEARTBEATS_PER_S": env.int("IDLE_HEARTBEATS_PER_S", default=100),
    "IDLE_HEARTBEAT_MAX_S": env.int("IDLE_HEARTBEAT_MAX_S", default=120),
    # The same for nodes holding GPUs: with a wake server, the busy fleet offers at most this
    # many heartbeats a second, each node never less often than every BUSY_HEARTBEAT_MAX_S
    # (15 s: three of them stay within NODE_SILENCE_TIMEOUT_S, so a dead busy node is noticed
    # as soon as at the base interval). Usage is cumulative and a run's start, exit or failure
    # is sent at once; only the live log, metric lines and telemetry arrive later.
    "BUSY_HEARTBEATS_PER_S": env.int("BUSY_HEARTBEATS_PER_S", default=100),
    "BUSY_HEARTBEAT_MAX_S": env.int("BUSY_HEARTBEAT_MAX_S", default=15),
    # Heartbeats one web process serves at once (provisioning.admission); one more is answered
    # 503 with Retry-After before any of its work, so the process's other threads stay free for
    # customers. Default: half of WEB_THREADS (config/gunicorn.py), at least one; the other
    # half kept for customers (0: refuse every one).
    "AGENT_HEARTBEATS_IN_FLIGHT": env.int(
        "AGENT_HEARTBEATS_IN_FLIGHT", default=max(1, env.int("WEB_THREADS", default=4) // 2)
    ),
    # The wake server agents long-poll to hear of a change at once (provisioning.wakeserver):
    # its URL as agents reach it (absolute, or a path on the server URL behind one ingress);
    # empty: no wake server, agents hear of changes at their next heartbeat. Its pub/sub
    # channel on REDIS_URL, and how long a wake ticket lasts (a fresh one comes with every
    # heartbeat answer).
    "WAKE_URL": env.str("WAKE_URL", default=""),
    "WAKE_CHANNEL": env.str("WAKE_CHANNEL", default="gpumarket:wake"),
    "WAKE_TICKET_TTL_S": env.int("WAKE_TICKET_TTL_S", default=600),
    # A multi-node rental whose members have not all started this long after its placement is
    # placed again (provisioning/services/gangs.py), and failed after this many placements.
    "GANG_START_TIMEOUT_S": env.int("GANG_START_TIMEOUT_S", default=600),
    "GANG_START_ATTEMPTS": env.int("GANG_START_ATTEMPTS", default=3),
    # What the advisor books when the customer names no image: the training harness.
    "HARNESS_IMAGE": env.str("HARNESS_IMAGE", default="gpumarket/harness:dev"),
    # What happens to a started rental whose node goes silent: "fail" or "requeue".
    # What a preemption does to an interruptible rental, chosen per rental at its create (the
    # customer may choose): "requeue" (resume from its last checkpoint), "end" (PREEMPTED), or
    # "auto": requeue for a rental that checkpoints (the harness), end for any other.
    "PREEMPTION_POLICY": env.str("PREEMPTION_POLICY", default="auto"),
    "NODE_LOST_POLICY": env.str("NODE_LOST_POLICY", default="fail"),
    # The platform's benchmark (provisioning/services/health.py): the harness image (pin it by
    # digest in production) and the command run in it. Nothing on the host changes either.
    "BENCHMARK_IMAGE": env.str("BENCHMARK_IMAGE", default="gpumarket/harness:dev"),
    "BENCHMARK_COMMAND": ("python", "-m", "harness", "benchmark", "--quick"),
    # An idle node is measured again this often; a node with a FAILED GPU is checked again
    # this often (the check that brings the GPU back).
    "BENCHMARK_EVERY_S": env.int("BENCHMARK_EVERY_S", default=24 * 3600),
    "BENCHMARK_RECHECK_S": env.int("BENCHMARK_RECHECK_S", default=3600),
    # An offers page (API, web page, CLI) is served from Redis for this long after one request
    # ran its statement: a GPU booked meanwhile stays listed at most this long (booking checks
    # capacity again). 0: every page runs the statement.
    "OFFERS_CACHE_TTL_S": env.float("OFFERS_CACHE_TTL_S", default=5.0),
    # How long the live log of a run (its output lines) is kept.
    "LOG_RETENTION_DAYS": env.int("LOG_RETENTION_DAYS", default=7),
}

# Object storage (S3 API: SeaweedFS embedded, or AWS, MinIO, R2...). Without S3_BUCKET, datasets
# and artifacts answer 503 and /readyz skips the check. Presigned URLs are signed for
# S3_PUBLIC_ENDPOINT_URL (what agents and browsers reach), S3_ENDPOINT_URL by default.
S3_ENDPOINT_URL = env.str("S3_ENDPOINT_URL", default="")
S3_PUBLIC_ENDPOINT_URL = env.str("S3_PUBLIC_ENDPOINT_URL", default="")
S3_ACCESS_KEY_ID = env.str("S3_ACCESS_KEY_ID", default="")
S3_SECRET_ACCESS_KEY = env.str("S3_SECRET_ACCESS_KEY", default="")
S3_BUCKET = env.str("S3_BUCKET", default="")
S3_REGION = env.str("S3_REGION", default="us-east-1")
S3_ADDRESSING_STYLE = env.str("S3_ADDRESSING_STYLE", default="path")
S3_CONNECT_TIMEOUT_S = env.float("S3_CONNECT_TIMEOUT_S", default=3.0)
S3_READ_TIMEOUT_S = env.float("S3_READ_TIMEOUT_S", default=30.0)
S3_MAX_ATTEMPTS = env.int("S3_MAX_ATTEMPTS", default=3)
STORAGE = {
    # How long a presigned URL works (agents re-ask every heartbeat; uploads ask per sync).
    "PRESIGN_EXPIRY_S": env.int("STORAGE_PRESIGN_EXPIRY_S", default=900),
    # Datasets are free up to this many bytes per account; an upload beyond it is refused.
    "DATASET_QUOTA_BYTES": env.int("STORAGE_DATASET_QUOTA_BYTES", default=100 * 1024**3),
    # One file above this goes up in parts of MULTIPART_PART_BYTES (S3's minimum part is 5 MiB).
    "MULTIPART_THRESHOLD_BYTES": env.int("STORAGE_MULTIPART_THRESHOLD_BYTES", default=64 << 20),
    "MULTIPART_PART_BYTES": env.int("STORAGE_MULTIPART_PART_BYTES", default=64 << 20),
    "MAX_FILE_BYTES": env.int("STORAGE_MAX_FILE_BYTES", default=1024**4),
    "MAX_FILES_PER_REQUEST": env.int("STORAGE_MAX_FILES_PER_REQUEST", default=1000),
    # Artifacts (a rental's synced output) are kept this many days after the rental ends, free.
    "ARTIFACT_RETENTION_DAYS": env.int("STORAGE_ARTIFACT_RETENTION_DAYS", default=7),
    "ARTIFACT_MAX_BYTES_PER_RENTAL": env.int(
        "STORAGE_ARTIFACT_MAX_BYTES_PER_RENTAL", default=500 * 1024**3
    ),
    # An agent may still sync a run's output this long after its GPUs were freed (the last
    # checkpoint of a stopped or preempted run is written after the stop).
    "ARTIFACT_SYNC_GRACE_S": env.int("STORAGE_ARTIFACT_SYNC_GRACE_S", default=600),
    # A dataset registered from a URL is copied into the bucket by a worker within this time.
    "FETCH_TIMEOUT_S": env.int("STORAGE_FETCH_TIMEOUT_S", default=3600),
}

# Observability: structured logs (LOG_FORMAT=json in production, console locally) and the bearer
# token `/metrics` asks for (no token: no endpoint). `/readyz` checks the bucket above.
LOGGING = logging_config(
    log_format=env.str("LOG_FORMAT", default="console"), level=env.str("LOG_LEVEL", default="INFO")
)
# A worker's task lines carry the task's name, id and runtime, never its arguments or result.
LOGGING.setdefault("filters", {})["celery_task"] = {"()": "config.celery.TaskLogFilter"}
LOGGING["loggers"].update(
    {name: {"filters": ["celery_task"]} for name in ("celery.worker.strategy", "celery.app.trace")}
)
# Celery logs through the LOGGING above instead of replacing the root logger's handlers.
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
METRICS_TOKEN = env.str("METRICS_TOKEN", default="")
# Notifications: a failed delivery is retried after 30 s, doubling to at most an hour, 8 times.
NOTIFICATIONS_MAX_ATTEMPTS = env.int("NOTIFICATIONS_MAX_ATTEMPTS", default=8)
NOTIFICATIONS_RETRY_BASE_S = env.float("NOTIFICATIONS_RETRY_BASE_S", default=30.0)
NOTIFICATIONS_RETRY_MAX_DELAY_S = env.float("NOTIFICATIONS_RETRY_MAX_DELAY_S", default=3600.0)
NOTIFICATIONS_WEBHOOK_CONNECT_TIMEOUT_S = env.float(
    "NOTIFICATIONS_WEBHOOK_CONNECT_TIMEOUT_S", default=5.0
)
NOTIFICATIONS_WEBHOOK_READ_TIMEOUT_S = env.float(
    "NOTIFICATIONS_WEBHOOK_READ_TIMEOUT_S", default=10.0
)
# Webhooks go to public https URLs only; development may also send them over http to loopback.
NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK = env.bool(
    "NOTIFICATIONS_WEBHOOK_ALLOW_LOOPBACK", default=DEBUG
)
