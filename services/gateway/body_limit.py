"""The gateway's request-body size limit: a pure ASGI middleware, ``BodyLimit``.

``create_app`` installs it with ``gateway.max_body_bytes``; uvicorn then calls it for every
request, before any route parses a body. Only HTTP POST is looked at (every other method and
scope type passes through untouched). A POST is answered 413 ``request_too_large`` in OpenAI's
error shape

- at once, reading nothing, when its ``Content-Length`` is over the limit;
- otherwise (a chunked upload has no ``Content-Length``) as soon as the bytes received pass the
  limit: the body is read here message by message and counted, and at most the limit plus the
  one message that passes it is ever held.

A body within the limit reaches the route as the same messages, in order; after them ``receive``
is the server's own again, so streaming responses still see the client's ``http.disconnect``.
After the 413 the server reads whatever the client still sends of that body and drops it (none
of it is held), so the client reads its 413 instead of a reset connection.
"""

from __future__ import annotations

from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import ApiError


class BodyLimit:
    """ASGI middleware: POST bodies over ``max_bytes`` bytes get 413 before the app sees them."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes  # bytes of request body; one more is refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        declared = content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self.refuse(scope, receive, send)
            return
        held: list[Message] = []
        size = 0  # bytes of body received so far
        while True:
            message = await receive()
            held.append(message)
            if message["type"] != "http.request":
                break  # http.disconnect: the route meets it where it would have
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                held.clear()
                await self.refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, replay(held, receive), send)

    async def refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the 413; called before the app has seen the request, so nothing was sent yet."""
        err = ApiError(
            413,
            f"request body is larger than {self.max_bytes} bytes (gateway.max_body_bytes)",
            code="request_too_large",
            param=None,
        )
        await err.response()(scope, receive, send)


def content_length(scope: Scope) -> int | None:
    """The request's ``Content-Length`` in bytes; None when absent or not a plain number (the
    body is then counted as it arrives)."""
    for name, value in scope["headers"]:
        if name.lower() == b"content-length":
            text = value.decode("latin-1").strip()
            return int(text) if text.isascii() and text.isdigit() else None
    return None


def replay(held: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``held`` in order, then the server's own ``receive``."""
    pending = deque(held)

    async def next_message() -> Message:
        if pending:
            return pending.popleft()
        return await receive()

    return next_message
