"""The playground's WebSocket (ws/playground/): takes Send and Stop from the page (htmx's ws
extension sends the forms as JSON) and relays the answer back as HTML fragments addressed by id.

The consumer authenticates, holds the session's playground key and relays; validation is the
form's, the key's life is accounts' services', the generation is `playground.stream_chat`'s.
"""

import asyncio
import json
import logging
from datetime import timedelta

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.template.loader import render_to_string
from django.utils import timezone

from controlplane.accounts.services import api_key_revoke, playground_key_create
from controlplane.dashboard.permissions import PLAYGROUND_ROLES, has_role
from controlplane.dashboard.tenant import playground

logger = logging.getLogger(__name__)

# A key closer than this to its expiry is replaced before a request (a request already admitted
# is not affected by its key expiring).
_KEY_RENEW_BEFORE = timedelta(minutes=5)
FORBIDDEN = 4403
# The answer's text reaches the page at most this often (playground.DeltaBatcher says why).
DELTA_INTERVAL_S = 0.05


class PlaygroundConsumer(AsyncWebsocketConsumer):
    # The playground joins no group and receives nothing from other processes, so it needs no
    # channel layer: an alias that names none gives it none (and no Redis channel per socket).
    channel_layer_alias = "none (the playground uses no channel layer)"

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not has_role(user, PLAYGROUND_ROLES):
            await self.close(code=FORBIDDEN)
            return
        self.user = user
        self.key = None  # ApiKeyCreated of this session, minted on the first Send
        self.generation: asyncio.Task | None = None
        self.stop = asyncio.Event()
        await self.accept()

    async def disconnect(self, code) -> None:
        generation = getattr(self, "generation", None)
        if generation is not None and not generation.done():
            self.stop.set()  # as an API client going away: the gateway aborts it on the replica
            try:
                await asyncio.wait_for(asyncio.shield(generation), timeout=30)
            except Exception:
                logger.warning("a playground generation did not end cleanly", exc_info=True)
        if getattr(self, "key", None) is not None:
            await database_sync_to_async(api_key_revoke)(api_key=self.key.api_key)
            self.key = None

    async def receive(self, text_data=None, bytes_data=None) -> None:
        try:
            data = json.loads(text_data or "")
        except ValueError:
            data = None
        if not isinstance(data, dict):
            await self._send_fragment(
                "dashboard/tenant/_playground_error.html",
                {"message": "The page sent something this server does not understand."},
            )
            return
        data.pop("HEADERS", None)
        action = data.get("action")
        running = self.generation is not None and not self.generation.done()
        if action == "stop":
            if running:
                self.stop.set()
            return
        if action == "clear":
            if running:
                await self._send_fragment(
                    "dashboard/tenant/_playground_error.html",
                    {"message": "An answer is still streaming: stop it first."},
                )
            else:
                await self._send_fragment("dashboard/tenant/_playground_cleared.html", {})
            return
        if action != "send":
            await self._send_fragment(
                "dashboard/tenant/_playground_error.html", {"message": f"Unknown action {action!r}."}
            )
            return
        if running:
            await self._send_fragment(
                "dashboard/tenant/_playground_error.html", {"message": "An answer is still streaming: stop it first."}
            )
            return
        form = await database_sync_to_async(playground.PlaygroundForm)(data)
        if not await database_sync_to_async(form.is_valid)():
            await self._send_fragment("dashboard/tenant/_playground_form_errors.html", {"form": form})
            return
        api_key = await database_sync_to_async(self._session_key)()
        self.stop = asyncio.Event()
        self.generation = asyncio.ensure_future(self._generate(form.prompt(), api_key))

    def _session_key(self) -> str:
        """This session's key, minted on first use and replaced shortly before it would expire."""
        if self.key is not None and self.key.api_key.expires_at - timezone.now() < _KEY_RENEW_BEFORE:
            api_key_revoke(api_key=self.key.api_key)
            self.key = None
        if self.key is None:
            self.key = playground_key_create(user=self.user)
        return self.key.plaintext

    async def _generate(self, prompt: playground.PlaygroundPrompt, api_key: str) -> None:
        await self._send_fragment(
            "dashboard/tenant/_playground_started.html",
            {"prompt": prompt, "field_names": list(playground.PlaygroundForm.base_fields)},
        )
        final, answer = None, []
        deltas = playground.DeltaBatcher(
            lambda text: self._send_fragment("dashboard/tenant/_playground_delta.html", {"text": text}),
            interval=DELTA_INTERVAL_S,
        )
        try:
            async for event in playground.stream_chat(api_key=api_key, prompt=prompt, stop=self.stop):
                if isinstance(event, playground.Delta):
                    answer.append(event.text)
                    deltas.add(event.text)
                else:
                    final = event
        except Exception:
            logger.exception("the playground generation failed")
            final = playground.Failed("The server had an error while generating the answer.", "internal_error", 500)
        await deltas.flush()
        # A finished or stopped answer joins the conversation (as much of it as was shown); after
        # a failure the conversation stays as it was, so Send tries the same message again.
        failed = final if isinstance(final, playground.Failed) else None
        await self._send_fragment(
            "dashboard/tenant/_playground_finished.html",
            {
                "finished": final if isinstance(final, playground.Finished) else None,
                "stopped": isinstance(final, playground.Stopped),
                "failed": failed,
                "history_json": None if failed else json.dumps(prompt.history_after("".join(answer))),
                "message_input": None if failed else playground.empty_message_input(),
                "image_sent": bool(prompt.image),  # the image field is emptied with the message box
            },
        )

    async def _send_fragment(self, template: str, context: dict) -> None:
        try:
            await self.send(text_data=render_to_string(template, context))
        except Exception:  # the socket closed under us; the generation still ends and settles
            logger.debug("could not send a playground fragment", exc_info=True)
