"""WebSocket routes, one list for the whole project; the dashboard's consumers register here."""

websocket_urlpatterns: list = []
