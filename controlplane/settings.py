"""Django settings, read from environment variables.

Every deployment (the embedded `make run`, CI, the docker-compose production stack) uses this one
module; only the environment differs. Integrations with more than a line or two of wiring live in
`controlplane/integrations.py`.
"""

from datetime import timedelta
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from controlplane import integrations
from controlplane.env import env_bool, env_decimal, env_float, env_int, env_list, env_networks, env_str
from controlplane.tokens import read_or_create_secret_file

BASE_DIR = Path(__file__).resolve().parent.parent
# Where the embedded defaults keep their state (SQLite file, Celery folders, beat schedule).
VAR_DIR = Path(env_str("VAR_DIR", str(BASE_DIR / "var"))).resolve()

# The development default is on, as in Django's own project template; production images set
# DEBUG=0 (the Dockerfile bakes it in), which also switches every secure default below on.
DEBUG = env_bool("DEBUG", True)

SECRET_KEY = env_str("SECRET_KEY", "")
if not SECRET_KEY:
    if not DEBUG:
        raise ImproperlyConfigured("SECRET_KEY must be set when DEBUG is off.")
    SECRET_KEY = "django-insecure-development-key-only-used-when-DEBUG-is-on"

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"] if DEBUG else [])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "axes",
    "controlplane.accounts",
    "controlplane.catalog",
    "controlplane.fleet",
    "controlplane.billing",
    "controlplane.batches",
    "controlplane.gateway",
    "controlplane.dashboard",
    "controlplane.audit",
    "controlplane.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "controlplane.audit.middleware.audit_source_middleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # After htmx's: it needs request.htmx (an ended session's redirect becomes HX-Redirect).
    "controlplane.dashboard.session_expiry.htmx_login_redirect_middleware",
    # Last, as django-axes asks: it turns a lockout into the page below.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "controlplane.dashboard.navigation.nav",
            ],
        },
    },
]

DATABASES = {"default": integrations.database(env_str("DATABASE_URL", ""), VAR_DIR)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_USER_MODEL = "accounts.User"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Login throttling (django-axes) on the dashboard's login and /admin: after LOGIN_FAILURE_LIMIT
# failed attempts for one username from one IP address, that pair is refused for
# LOGIN_LOCKOUT_MINUTES (a 429 with the page below); a successful login clears the count. The
# AxesStandaloneBackend only checks the lockout; ModelBackend checks passwords. The address is
# common.client_address's, as everywhere an address counts.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = env_int("LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("LOGIN_LOCKOUT_MINUTES", 15))
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "controlplane.dashboard.views.login_locked_out"
AXES_CLIENT_IP_CALLABLE = "controlplane.common.client_address.client_address"
# The proxies (addresses or CIDR networks) whose X-Forwarded-For names the client; nobody else's
# header counts. Default none: the client is the socket's peer.
TRUSTED_PROXIES = env_networks("TRUSTED_PROXIES")

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard:home"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = BASE_DIR / "staticfiles"
# The ASGI app serves /static/ itself unless a proxy or CDN takes over (SERVE_STATIC=0).
SERVE_STATIC = env_bool("SERVE_STATIC", True)

# --- Redis-backed integrations, or their embedded stand-ins when REDIS_URL is unset -----------
REDIS_URL = env_str("REDIS_URL", "")
CACHES = integrations.caches(REDIS_URL)
# The fleet's live state (each worker's latest heartbeat) is written by the web server and read by
# the Celery worker that detects lost workers, so it needs a cache all processes share: Redis, or
# files under VAR_DIR in the embedded set-up (whose default cache is per process).
CACHES["live"] = (
    {**CACHES["default"], "KEY_PREFIX": "gpuserve-live"}
    if REDIS_URL
    else {"BACKEND": "django.core.cache.backends.filebased.FileBasedCache", "LOCATION": str(VAR_DIR / "cache" / "live")}
)
# Without Redis, the UDP port on 127.0.0.1 where the web server receives the live events the other
# processes publish (the launcher sets it; 0: not relayed).
LIVE_EVENTS_RELAY_PORT = env_int("LIVE_EVENTS_RELAY_PORT", 0)
CHANNEL_LAYERS = integrations.channel_layers(REDIS_URL, relay_port=LIVE_EVENTS_RELAY_PORT)

CELERY_BROKER_URL, CELERY_BROKER_TRANSPORT_OPTIONS = integrations.celery_broker(REDIS_URL, VAR_DIR)
CELERY_RESULT_BACKEND = integrations.celery_result_backend(REDIS_URL)
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = TIME_ZONE
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")

# --- The fleet: GPU worker daemons and the control loop ----------------------------------------
# One fleet-wide bearer token, both ways: daemons present it to /internal/, the gateway to replicas.
FLEET_WORKER_TOKEN = env_str("GPUSERVE_WORKER_TOKEN", "")
if not FLEET_WORKER_TOKEN:
    if not DEBUG:
        raise ImproperlyConfigured("GPUSERVE_WORKER_TOKEN must be set when DEBUG is off.")
    # `make run` starts the web server, Celery and the daemon without configuration: they all
    # read (the first one creates) this file.
    FLEET_WORKER_TOKEN = read_or_create_secret_file(VAR_DIR / "worker-token")
# The broker as the daemons should reach it, when that differs from the control plane's view.
FLEET_WORKER_BROKER_URL = env_str("GPUSERVE_WORKER_BROKER_URL", CELERY_BROKER_URL)
FLEET_HEARTBEAT_INTERVAL_SECONDS = 1.0
# A worker silent this long is lost and its replicas are failed and replaced.
FLEET_WORKER_LOST_AFTER_SECONDS = env_int("FLEET_WORKER_LOST_AFTER_SECONDS", 3)
# A lost worker silent this much longer is considered gone (offline).
FLEET_WORKER_OFFLINE_AFTER_SECONDS = env_int("FLEET_WORKER_OFFLINE_AFTER_SECONDS", 600)
# A placed replica whose worker has not confirmed the load message by then is failed and re-placed.
FLEET_REPLICA_ACK_TIMEOUT_SECONDS = env_int("FLEET_REPLICA_ACK_TIMEOUT_SECONDS", 30)
# Beat reconciles every deployment this often; it is also what retries a failed load once its
# backoff has passed (so a retry comes at most this much after its time).
FLEET_RECONCILE_INTERVAL_SECONDS = env_int("FLEET_RECONCILE_INTERVAL_SECONDS", 5)
# A failed load (or a replica dying before it was ready) leaves that worker out of the deployment's
# placements for FLEET_LOAD_RETRY_INITIAL_SECONDS, doubling with each further failure in a row up
# to FLEET_LOAD_RETRY_MAX_SECONDS; other workers are tried first meanwhile.
FLEET_LOAD_RETRY_INITIAL_SECONDS = env_int("FLEET_LOAD_RETRY_INITIAL_SECONDS", 10)
FLEET_LOAD_RETRY_MAX_SECONDS = env_int("FLEET_LOAD_RETRY_MAX_SECONDS", 300)
# After this many failed loads in a row (all workers together) a deployment short of replicas shows
# as degraded, with the error's cause; it keeps retrying at the capped interval.
FLEET_LOAD_DEGRADED_AFTER_FAILURES = env_int("FLEET_LOAD_DEGRADED_AFTER_FAILURES", 3)
# How long an unloaded replica may finish in-flight requests, and a drained worker all of its.
FLEET_UNLOAD_DRAIN_TIMEOUT_SECONDS = env_int("FLEET_UNLOAD_DRAIN_TIMEOUT_SECONDS", 30)
FLEET_WORKER_DRAIN_TIMEOUT_SECONDS = env_int("FLEET_WORKER_DRAIN_TIMEOUT_SECONDS", 60)
# After a replica moves off a crowded worker (fleet.rebalance), the deployment waits this long
# before its next move, so replicas do not flap between workers.
FLEET_REBALANCE_COOLDOWN_SECONDS = env_int("FLEET_REBALANCE_COOLDOWN_SECONDS", 60)

# What one GPU-hour costs the operator (USD): the admins' home page sets each model's GPU-hours
# against its revenue at this rate (dashboard.margins.model_margins).
GPU_HOUR_COST_USD = env_decimal("GPU_HOUR_COST_USD", "2.00")

# Credits an admin grants or takes back by hand (billing.ledger): no single entry may move more than
# CREDIT_ENTRY_MAX_USD, and one moving more than CREDIT_CONFIRM_ABOVE_USD must be confirmed.
CREDIT_ENTRY_MAX_USD = env_decimal("CREDIT_ENTRY_MAX_USD", "10000")
CREDIT_CONFIRM_ABOVE_USD = env_decimal("CREDIT_CONFIRM_ABOVE_USD", "500")

# --- The autoscaler (controlplane/fleet/autoscaling.py: the policy; fleet/services/autoscaling.py:
# one decision per deployment per tick). Defaults for new deployments, each editable per deployment:
# requests (running + waiting) per replica at full utilisation, the p95 latency SLOs, and how long
# without a request before a deployment scales to zero (0: never).
AUTOSCALE_TARGET_CONCURRENCY = env_int("AUTOSCALE_TARGET_CONCURRENCY", 8)
AUTOSCALE_TTFT_SLO_MS = env_int("AUTOSCALE_TTFT_SLO_MS", 2000)
AUTOSCALE_ITL_SLO_MS = env_int("AUTOSCALE_ITL_SLO_MS", 100)
AUTOSCALE_IDLE_TO_ZERO_SECONDS = env_int("AUTOSCALE_IDLE_TO_ZERO_SECONDS", 900)
# Fleet-wide: aim at this share of target_concurrency, scale up above target×(1+hysteresis) and
# down below target×(1−hysteresis) (percentages); KV-cache use at or above the high mark scales up.
AUTOSCALE_TARGET_UTILISATION_PERCENT = env_int("AUTOSCALE_TARGET_UTILISATION_PERCENT", 70)
AUTOSCALE_HYSTERESIS_PERCENT = env_int("AUTOSCALE_HYSTERESIS_PERCENT", 20)
AUTOSCALE_KV_CACHE_HIGH_PERCENT = env_int("AUTOSCALE_KV_CACHE_HIGH_PERCENT", 90)
# After any change of desired replicas (the autoscaler's or an operator's), no scale-up for this
# long, and no scale-down for the second (a replica needs time to load and to show its effect).
AUTOSCALE_SCALE_UP_COOLDOWN_SECONDS = env_int("AUTOSCALE_SCALE_UP_COOLDOWN_SECONDS", 30)
AUTOSCALE_SCALE_DOWN_COOLDOWN_SECONDS = env_int("AUTOSCALE_SCALE_DOWN_COOLDOWN_SECONDS", 300)
# The AUTOSCALE_POPULAR_TOP_K models with the most requests over the window keep a replica warm.
AUTOSCALE_POPULAR_TOP_K = env_int("AUTOSCALE_POPULAR_TOP_K", 3)
AUTOSCALE_POPULAR_WINDOW_SECONDS = env_int("AUTOSCALE_POPULAR_WINDOW_SECONDS", 3600)
# The request rate the autoscaler reads is averaged over this window (gateway counters).
AUTOSCALE_RATE_WINDOW_SECONDS = env_int("AUTOSCALE_RATE_WINDOW_SECONDS", 60)
# How often the beat task decides for every deployment with autoscaling on.
AUTOSCALE_INTERVAL_SECONDS = env_int("AUTOSCALE_INTERVAL_SECONDS", 10)
# The fleet-wide figures' bounds (the per-deployment defaults are checked by the Deployment fields).
for _name, _low, _high in (
    ("AUTOSCALE_TARGET_UTILISATION_PERCENT", 1, 100),
    ("AUTOSCALE_HYSTERESIS_PERCENT", 0, 99),
    ("AUTOSCALE_KV_CACHE_HIGH_PERCENT", 1, 100),
    ("AUTOSCALE_INTERVAL_SECONDS", 1, 3600),
    ("AUTOSCALE_SCALE_UP_COOLDOWN_SECONDS", 0, 24 * 3600),
    ("AUTOSCALE_SCALE_DOWN_COOLDOWN_SECONDS", 0, 24 * 3600),
    ("AUTOSCALE_POPULAR_TOP_K", 0, 1000),
    ("AUTOSCALE_POPULAR_WINDOW_SECONDS", 10, 7 * 24 * 3600),
    ("AUTOSCALE_RATE_WINDOW_SECONDS", 10, 3600),
):
    if not _low <= globals()[_name] <= _high:
        raise ImproperlyConfigured(f"{_name} must lie between {_low:,} and {_high:,}; got {globals()[_name]:,}.")

# --- The Files and Batch APIs (controlplane.batches; the runner: controlplane.gateway.batch_lines) ---
# Uploaded and produced batch files live here (an S3-compatible store can replace the folder).
BATCH_STORAGE_DIR = env_str("BATCH_STORAGE_DIR", str(VAR_DIR / "batch-files"))
BATCH_MAX_FILE_BYTES = env_int("BATCH_MAX_FILE_BYTES", 200 * 1024 * 1024)
BATCH_MAX_FILE_LINES = env_int("BATCH_MAX_FILE_LINES", 50_000)
# Lines of one batch in flight at once: batch work fills idle capacity, it does not crowd it out.
BATCH_CONCURRENCY = env_int("BATCH_CONCURRENCY", 4)
# A replica with this many interactive requests in flight is sent no new batch lines until fewer
# are (lines already sent finish). In the embedded set-up (no Redis) the Celery worker does not see
# the web server's requests in flight, so this applies only with Redis.
BATCH_REPLICA_BUSY_AT = env_int("BATCH_REPLICA_BUSY_AT", 1)
# A runner works on a batch this long per task, then sends the next task (which waits behind any
# other task on the broker): no batch holds a Celery worker for long.
BATCH_TASK_SLICE_SECONDS = env_int("BATCH_TASK_SLICE_SECONDS", 20)
# A runner's claim on a batch; one that dies leaves it to run out, then beat sends the batch on.
BATCH_LEASE_SECONDS = env_int("BATCH_LEASE_SECONDS", 60)
BATCH_RESUME_INTERVAL_SECONDS = env_int("BATCH_RESUME_INTERVAL_SECONDS", 10)
if BATCH_LEASE_SECONDS <= BATCH_TASK_SLICE_SECONDS:
    raise ImproperlyConfigured("BATCH_LEASE_SECONDS must be longer than BATCH_TASK_SLICE_SECONDS.")

CELERY_BEAT_SCHEDULE = {
    "fleet-mark-lost-workers": {
        "task": "controlplane.fleet.tasks.mark_lost_workers",
        "schedule": 1.0,
        # A check that waited longer than its period is superseded by the next one.
        "options": {"expires": 1.0},
    },
    "fleet-reconcile": {
        "task": "controlplane.fleet.tasks.reconcile",
        "schedule": float(FLEET_RECONCILE_INTERVAL_SECONDS),
        "options": {"expires": float(FLEET_RECONCILE_INTERVAL_SECONDS)},
    },
    "batches-resume": {
        "task": "controlplane.batches.resume",
        "schedule": float(BATCH_RESUME_INTERVAL_SECONDS),
        "options": {"expires": float(BATCH_RESUME_INTERVAL_SECONDS)},
    },
    "fleet-autoscale": {
        "task": "controlplane.fleet.tasks.autoscale",
        "schedule": float(AUTOSCALE_INTERVAL_SECONDS),
        "options": {"expires": float(AUTOSCALE_INTERVAL_SECONDS)},
    },
    "gateway-sweep-stored-responses": {
        "task": "controlplane.gateway.tasks.sweep_stored_responses",
        "schedule": 3600.0,
        "options": {"expires": 3600.0},
    },
}

# --- The public /v1 API (controlplane.gateway) -----------------------------------------------
# The bearer token a Prometheus scraper sends to /metrics; empty: only an admin's login opens it.
METRICS_TOKEN = env_str("METRICS_TOKEN", "")

# How long a gateway process trusts its cached copy of an API key at most. Changes to keys,
# tenants and plans are recorded in the database and read by every gateway process each
# GATEWAY_KEY_CHANGES_POLL_MS (and announced through Redis, so usually acted on at once).
GATEWAY_KEY_CACHE_SECONDS = env_int("GATEWAY_KEY_CACHE_SECONDS", 30)
GATEWAY_KEY_CHANGES_POLL_MS = env_int("GATEWAY_KEY_CHANGES_POLL_MS", 500)
# How stale the gateway's view of models and ready replicas may get.
GATEWAY_ROUTING_REFRESH_MS = env_int("GATEWAY_ROUTING_REFRESH_MS", 1000)
# A request for a model with no ready replica waits up to this long for one to load (a cold start:
# the gateway asks the fleet for a replica if none is loading) before it gets a 503; its answer
# carries `x-gpuserve-cold-start: <seconds waited>`.
GATEWAY_COLD_START_WAIT_SECONDS = env_int("GATEWAY_COLD_START_WAIT_SECONDS", 60)
# At most this many requests per model wait so in one gateway process; more get a 503 at once.
GATEWAY_COLD_START_QUEUE_MAX = env_int("GATEWAY_COLD_START_QUEUE_MAX", 256)
# The retry-after a 503 (no replica ready, or a dependency down) suggests.
GATEWAY_RETRY_AFTER_SECONDS = env_int("GATEWAY_RETRY_AFTER_SECONDS", 5)
GATEWAY_UPSTREAM_CONNECT_TIMEOUT_SECONDS = env_int("GATEWAY_UPSTREAM_CONNECT_TIMEOUT_SECONDS", 3)
# The largest request body the gateway reads (bytes); a longer one is a 413 before any other work
# (key, parsing, holds). 4 MiB holds a 128k-token context's text several times over.
GATEWAY_MAX_REQUEST_BYTES = env_int("GATEWAY_MAX_REQUEST_BYTES", 4 * 1024 * 1024)
# Under that cap, a model takes a body of at most its context length times this many bytes, plus
# the allowance (messages, tools): a long-context model's limit grows with it (raise the cap to let
# it), a short-context one's stays small. Checked with the body's parsing, off the event loop.
GATEWAY_REQUEST_BYTES_PER_TOKEN = env_int("GATEWAY_REQUEST_BYTES_PER_TOKEN", 16)
GATEWAY_REQUEST_BYTES_ALLOWANCE = env_int("GATEWAY_REQUEST_BYTES_ALLOWANCE", 1024 * 1024)
# Bodies up to this many bytes are parsed on the event loop (well under a millisecond); larger ones
# in a pool of GATEWAY_BODY_PARSERS worker processes per gateway process, at most
# GATEWAY_BODY_PARSERS_PER_TENANT of one tenant's at a time, after the request was admitted
# against its key's and tenant's limits (controlplane.gateway.body_parsing).
GATEWAY_INLINE_BODY_BYTES = env_int("GATEWAY_INLINE_BODY_BYTES", 64 * 1024)
GATEWAY_BODY_PARSERS = env_int("GATEWAY_BODY_PARSERS", 2)
GATEWAY_BODY_PARSERS_PER_TENANT = env_int("GATEWAY_BODY_PARSERS_PER_TENANT", 1)
# The longest a request may run, streaming included; its credit hold lives a minute longer.
GATEWAY_REQUEST_TIMEOUT_SECONDS = env_int("GATEWAY_REQUEST_TIMEOUT_SECONDS", 600)
# A replica that failed a request is passed over this long (by every gateway process).
GATEWAY_REPLICA_COOLDOWN_SECONDS = env_int("GATEWAY_REPLICA_COOLDOWN_SECONDS", 10)
# Limits for tenants without a plan.
GATEWAY_DEFAULT_RATE_LIMIT_PER_MINUTE = env_int("GATEWAY_DEFAULT_RATE_LIMIT_PER_MINUTE", 60)
GATEWAY_DEFAULT_MAX_CONCURRENT_REQUESTS = env_int("GATEWAY_DEFAULT_MAX_CONCURRENT_REQUESTS", 8)
# Prompts at least this long (characters, rendered) go to the replica their affinity key hashes to,
# to hit its prefix cache, while it has at most GATEWAY_AFFINITY_MAX_EXTRA requests more in flight
# than the least busy replica. The key (replica_choice.affinity_key): a completion prompt's first
# this-many characters; for chat, a digest of the system prompt and then up to this many characters
# of the conversation's opening messages.
GATEWAY_AFFINITY_PREFIX_CHARS = env_int("GATEWAY_AFFINITY_PREFIX_CHARS", 512)
GATEWAY_AFFINITY_MAX_EXTRA = env_int("GATEWAY_AFFINITY_MAX_EXTRA", 4)
# How long a completed non-streaming request's result is replayed for its Idempotency-Key.
GATEWAY_IDEMPOTENCY_SECONDS = env_int("GATEWAY_IDEMPOTENCY_SECONDS", 24 * 3600)
# How often expired credit holds (from gateways that died mid-request) are settled.
GATEWAY_HOLD_SWEEP_SECONDS = env_int("GATEWAY_HOLD_SWEEP_SECONDS", 30)
# How often each gateway process writes its tallies of refused requests (billing.Refusal): the
# request log and the error figures lag the refusals by up to this long.
GATEWAY_REFUSAL_FLUSH_SECONDS = env_float("GATEWAY_REFUSAL_FLUSH_SECONDS", 5.0)
# How long the Responses API keeps a stored response (`store`, its default) before the hourly sweep
# deletes it; a tenant may delete one sooner (DELETE /v1/responses/{id}).
GATEWAY_RESPONSES_RETENTION_DAYS = env_int("GATEWAY_RESPONSES_RETENTION_DAYS", 30)
# A gateway process renews its claim on the background responses it runs every third of this;
# one whose claim ran out (its process died) is run again by another, at most
# GATEWAY_BACKGROUND_RUNS times in all before it is marked failed.
GATEWAY_BACKGROUND_LEASE_SECONDS = env_int("GATEWAY_BACKGROUND_LEASE_SECONDS", 30)
GATEWAY_BACKGROUND_RUNS = env_int("GATEWAY_BACKGROUND_RUNS", 3)

# The tenant whose credit pays for operators' and admins' playground requests (they belong to no
# tenant): created, with no credit, on first use; an admin grants it credit as any tenant's.
PLAYGROUND_STAFF_TENANT = env_str("PLAYGROUND_STAFF_TENANT", "Operators")

# --- HTTPS and cookies: on by default whenever DEBUG is off -----------------------------------
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
# Health probes and the worker daemons come from inside the host or its private network over
# plain HTTP.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^readyz$", r"^internal/"]
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", not DEBUG)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", not DEBUG)
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 0 if DEBUG else 31536000)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", not DEBUG)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
# Set behind a TLS-terminating proxy that sends X-Forwarded-Proto.
if env_bool("SECURE_PROXY_SSL_HEADER", False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
}
