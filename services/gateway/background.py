"""Background responses: ``POST /v1/responses`` with ``background: true``.

``routes/responses.py`` answers the create at once with the response ``queued`` (already
stored, with its conversation and an empty assistant turn, so ``GET`` and ``input_items``
work), then runs it here as a task of this gateway replica (``BackgroundRuns``). The stored status moves
``queued`` → ``in_progress`` (the first token came) → ``completed`` / ``incomplete`` /
``failed``, each step a ``ResponseStore.advance`` that writes only from the status the task
expects: a ``cancel`` (``cancelled``) or a ``DELETE`` that lands first wins, and the task's
later writes are no-ops. The request itself is a chat request like a foreground one (same
admission, rate limits, ledger row); its whole answer is shaped by ``whole_response``.

A gateway killed outright cannot store its responses ``failed``: each running response carries
its gateway's ``owner`` id and a lease (``gateway.background_lease_s``) that gateway renews every
third of it (``BackgroundRuns.keep_leases``, one UPDATE for all its responses). Every replica's
keeper also sweeps, at start and then every third of the lease: a response still ``queued`` /
``in_progress`` whose lease ran out is stored ``failed`` (``server_error``), by the same kind of
conditional write, so an owner that renewed in between or a run that ended wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from libs.db.responses import ResponseStore
from libs.log import fields
from libs.protocol import ChatMessage, StreamMessage
from services.gateway.completions import CompletionRun
from services.gateway.errors import ApiError
from services.gateway.response_output import ResponseShape, whole_response

log = logging.getLogger("strait.gateway")

# Statuses of a background response that is still running (cancel moves it to "cancelled").
ACTIVE = ("queued", "in_progress")
# Statuses a follow-up's previous_response_id may name: the response has its whole output.
ENDED_WITH_OUTPUT = ("completed", "incomplete")
# Expired responses one sweep reads at a time (it reads again until fewer come back).
SWEEP_PAGE = 100
LOST_OWNER = "the gateway running this response stopped before it ended (its lease ran out)"


def pending_history(conversation: list[ChatMessage]) -> list[dict[str, Any]]:
    """What a running response stores as its conversation: the input and an empty assistant
    turn (``input_items`` drops the last message, the output, as for an ended one)."""
    return [msgspec.to_builtins(m) for m in [*conversation, ChatMessage("assistant", "")]]


class BackgroundRuns:
    """The background responses this replica runs: one task each, by response id."""

    def __init__(self, lease_s: float) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.lease_s = lease_s
        self.owner = f"gw-{uuid.uuid4().hex[:16]}"  # this process, in the rows it runs
        self._keeper: asyncio.Task[None] | None = None

    def lease_until(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.lease_s)

    def start_keeper(self, store: ResponseStore) -> None:
        """Renew this replica's leases and sweep expired ones, from now on (``keep_leases``)."""
        self._keeper = asyncio.create_task(self.keep_leases(store), name="background leases")

    async def keep_leases(self, store: ResponseStore) -> None:
        while True:
            try:
                if self.tasks:
                    await store.renew(self.owner, self.lease_until(), ACTIVE)
                await self.sweep(store)
            except Exception as e:  # the database is away: try again next round
                log.warning("background leases not kept", extra=fields(error=repr(e)))
            await asyncio.sleep(self.lease_s / 3)

    async def sweep(self, store: ResponseStore) -> list[str]:
        """Store ``failed`` every running response whose lease ran out; returns their ids."""
        reaped: list[str] = []
        while True:
            now = datetime.now(UTC)
            rows = await store.expired(now, ACTIVE, SWEEP_PAGE)
            for row in rows:
                body = {
                    **row.body,
                    "status": "failed",
                    "error": {"code": "server_error", "message": LOST_OWNER},
                }
                if await store.reap(row, body, now, ACTIVE):
                    reaped.append(row.id)
                    log.warning(
                        "background response failed: its gateway is gone",
                        extra=fields(request_id=row.id, owner=row.owner),
                    )
            if len(rows) < SWEEP_PAGE:
                return reaped

    def start(self, response_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work, name=f"background-response {response_id}")
        self.tasks[response_id] = task
        task.add_done_callback(lambda t: self._ended(response_id, t))

    def _ended(self, response_id: str, task: asyncio.Task[None]) -> None:
        self.tasks.pop(response_id, None)
        if not task.cancelled() and task.exception() is not None:
            # Its last write failed too (the database is down): the row says what it last said.
            log.error(
                "background response not stored",
                extra=fields(request_id=response_id, error=repr(task.exception())),
            )

    def cancel(self, response_id: str) -> bool:
        """Cancel the task of ``response_id`` if this replica runs it (its run's close cancels
        the request on the fleet); False if it does not."""
        task = self.tasks.get(response_id)
        if task is None:
            return False
        task.cancel()
        return True

    async def stop(self, timeout_s: float) -> None:
        """The gateway is stopping: cancel every task (each stores itself ``failed``) and wait
        up to ``timeout_s`` for them."""
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)


async def run_background(
    store: ResponseStore,
    api_key_id: str | None,
    shape: ResponseShape,
    conversation: list[ChatMessage],
    begin: Callable[[], Awaitable[tuple[CompletionRun, StreamMessage]]],
) -> None:
    """The task of one background response, already stored ``queued``. ``begin`` admits and
    submits its request and waits for the first message (``Admission.begin``)."""
    body = shape.body
    response_id = body["id"]
    pending = pending_history(conversation)

    async def write(history: list[dict[str, Any]]) -> bool:
        return await store.advance(response_id, api_key_id, body, history, ACTIVE)

    def failed(code: str, message: str) -> None:
        body["status"] = "failed"
        body["error"] = {"code": code, "message": message}

    try:
        run, first = await begin()
        body["model"] = run.shaper.model
        body["status"] = "in_progress"
        if not await write(pending):  # cancelled or deleted while queued
            await asyncio.shield(run.close())
            return
        whole_response(shape, await run.collect(first))
        await write([msgspec.to_builtins(m) for m in [*conversation, *shape.history_messages()]])
    except ApiError as e:
        failed(e.code or "server_error", e.message)
        await write(pending)
    except asyncio.CancelledError:
        # A cancel stored "cancelled" first (this write is then a no-op); else the gateway is
        # stopping, and the response would otherwise read in_progress forever.
        failed("server_error", "the gateway running this response stopped before it ended")
        await write(pending)
        raise
    except Exception as e:
        log.exception("background response failed", extra=fields(request_id=response_id))
        failed("server_error", f"the response failed: {type(e).__name__}")
        await write(pending)
