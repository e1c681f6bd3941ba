"""A WebSocket test client for the project's ASGI application (the dashboard's consumers)."""

from asgiref.testing import ApplicationCommunicator


class WebSocketClient(ApplicationCommunicator):
    """channels.testing.WebsocketCommunicator's connect/receive/disconnect, on asgiref's
    ApplicationCommunicator: importing channels.testing needs daphne, which this project does not
    install (uvicorn serves it)."""

    def __init__(self, application, path: str, headers: list[tuple[bytes, bytes]]) -> None:
        super().__init__(
            application,
            {"type": "websocket", "path": path, "query_string": b"", "headers": headers, "subprotocols": []},
        )

    async def connect(self, timeout: float = 5) -> tuple[bool, int | None]:
        await self.send_input({"type": "websocket.connect"})
        response = await self.receive_output(timeout)
        if response["type"] == "websocket.close":
            return False, response.get("code", 1000)
        assert response["type"] == "websocket.accept", response
        return True, None

    async def send_to(self, text_data: str) -> None:
        await self.send_input({"type": "websocket.receive", "text": text_data})

    async def receive_from(self, timeout: float = 5) -> str:
        response = await self.receive_output(timeout)
        assert response["type"] == "websocket.send" and "text" in response, response
        return response["text"]

    async def disconnect(self, code: int = 1000, timeout: float = 5) -> None:
        await self.send_input({"type": "websocket.disconnect", "code": code})
        await self.wait(timeout)
