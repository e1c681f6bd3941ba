"""Routes under /v1; the endpoints arrive with the gateway issue."""

app_name = "gateway"

urlpatterns: list = []
