"""Django serves nothing under /v1: the public API is a Starlette app (controlplane.gateway.app)
that controlplane.asgi puts in front of Django for every /v1 path."""

app_name = "gateway"

urlpatterns: list = []
