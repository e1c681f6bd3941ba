"""Django settings, read from environment variables.

Every deployment (the embedded `make run`, CI, the docker-compose production stack) uses this one
module; only the environment differs. Integrations with more than a line or two of wiring live in
`controlplane/integrations.py`.
"""

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from controlplane import integrations
from controlplane.env import env_bool, env_int, env_list, env_str

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
    "controlplane.accounts",
    "controlplane.catalog",
    "controlplane.fleet",
    "controlplane.billing",
    "controlplane.gateway",
    "controlplane.dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
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
CHANNEL_LAYERS = integrations.channel_layers(REDIS_URL)

CELERY_BROKER_URL, CELERY_BROKER_TRANSPORT_OPTIONS = integrations.celery_broker(REDIS_URL, VAR_DIR)
CELERY_RESULT_BACKEND = integrations.celery_result_backend(REDIS_URL, VAR_DIR)
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = TIME_ZONE
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE_FILENAME = str(VAR_DIR / "celerybeat-schedule")
CELERY_BEAT_SCHEDULE = {
    "fleet-mark-stale-workers": {
        "task": "controlplane.fleet.tasks.mark_stale_workers",
        "schedule": 10.0,
    },
}

# A worker that misses heartbeats for this long is marked offline (workers beat about every second).
FLEET_WORKER_HEARTBEAT_TIMEOUT_SECONDS = env_int("FLEET_WORKER_HEARTBEAT_TIMEOUT_SECONDS", 30)

# --- HTTPS and cookies: on by default whenever DEBUG is off -----------------------------------
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", not DEBUG)
# Health probes come from inside the host over plain HTTP.
SECURE_REDIRECT_EXEMPT = [r"^healthz$"]
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
