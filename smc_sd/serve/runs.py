"""One HTTP request's runs on the engine: its child requests (n choices of every prompt) and the
asyncio queue their events arrive on.

The engine loop runs in its own thread and calls `on_event` there; each event is handed to the
HTTP handler's event loop with `loop.call_soon_threadsafe`, so handlers await events without
blocking and without touching engine state. Cancelling a run cancels every child that has not
finished; the engine frees their rows and KV at its next cycle.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

from smc_sd.serve.errors import engine_dead, queue_full

#: seconds between checks that a waiting client is still connected
DISCONNECT_POLL_SECONDS = 0.5


class Run:
    """The children of one HTTP request; choice index = position in the submitted list."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles = []

    def submit(self, engine, requests: list) -> None:
        """Submit every child (call it off the event loop: `submit` compiles each request).

        Raises:
            APIError: 429 when the engine's queue is full, 503 when the engine has died; the
                children already queued are cancelled.
        """
        from smc_sd.engine.batch import QueueFullError

        try:
            for index, request in enumerate(requests):
                self.handles.append(engine.submit(request, on_event=self._receiver(index)))
        except QueueFullError:
            self.cancel()
            raise queue_full(engine.max_waiting) from None
        except RuntimeError:
            self.cancel()
            if engine.dead is None:
                raise
            raise engine_dead(engine.dead) from None

    def _receiver(self, index: int):
        def receive(event) -> None:
            # called in the engine's thread; a closed loop means the handler is gone
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))
            except RuntimeError:
                pass
        return receive

    async def events(self, client=None) -> AsyncIterator[tuple[int, object]]:
        """(choice index, Event) as they come, until every child has ended ("done" or "error").

        Args:
            client: the starlette Request; when given, the run is cancelled and the iteration
                ends as soon as the client has disconnected (checked every DISCONNECT_POLL_SECONDS).
        """
        open_children = len(self.handles)
        while open_children:
            try:
                index, event = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_SECONDS)
            except asyncio.TimeoutError:
                if client is not None and await client.is_disconnected():
                    self.cancel()
                    return
                continue
            if event.kind != "tokens":
                open_children -= 1
            yield index, event

    def cancel(self) -> None:
        """Cancel every child that has not finished (thread-safe; freed at the next cycle)."""
        for handle in self.handles:
            if not handle.done:
                handle.cancel()
