"""OpenAI's Files and Batch APIs: ``/v1/files`` and ``/v1/batches`` (docs/gateway.md#batch-api).

The objects, the line check and the publishing are ``batches.py``'s; the batch runner
(``batch_runner.py``) answers the lines. Without a database (no ``BatchStore``) every route is
a 400 naming the reason.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from fastapi import APIRouter, Request, Response

from libs.db.batches import BatchStore
from libs.db.models import BatchRow, StoredFile
from libs.protocol import Subjects
from libs.wire.nats_util import batch_stream_config, ensure_stream
from services.gateway.batches import (
    BATCH_ENDPOINTS,
    COMPLETION_WINDOW,
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    UPLOAD_PURPOSES,
    BatchCreate,
    batch_object,
    check_lines,
    errors_object,
    file_object,
    new_id,
    page_object,
    parse_multipart,
    publish_lines,
)
from services.gateway.deps import BatchesDep, FleetDep, KeyDep, SettingsDep
from services.gateway.errors import ApiError

router = APIRouter()
T = TypeVar("T")


def stored(store: BatchStore | None) -> BatchStore:
    """The batch store, or a 400 naming why there is none."""
    if store is None:
        raise ApiError(
            400,
            "files and batches need the database (gateway.ledger_enabled or gateway.store_responses)",
            "invalid_request",
        )
    return store


def limit_of(limit: int | None) -> int:
    n = LIST_LIMIT_DEFAULT if limit is None else limit
    if not 1 <= n <= LIST_LIMIT_MAX:
        raise ApiError(
            400, f"limit must be between 1 and {LIST_LIMIT_MAX}", "invalid_request", "limit"
        )
    return n


# ------------------------------------------------------------ files


@router.post("/v1/files")
async def create_file(request: Request, key: KeyDep, batches: BatchesDep) -> dict[str, Any]:
    fields = parse_multipart(request.headers.get("content-type", ""), await request.body())
    unknown = sorted(set(fields) - {"file", "purpose"})
    if unknown:
        name = unknown[0]
        if name.startswith("expires_after"):
            raise ApiError(
                400,
                "files here do not expire; expires_after is not supported",
                "unsupported_parameter",
                name,
            )
        raise ApiError(
            400, f"Unrecognized request argument supplied: {name}", "invalid_request", name
        )
    if "file" not in fields:
        raise ApiError(400, "file is required", "missing_required_parameter", "file")
    purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace")
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(
            400,
            f"purpose {purpose!r} is not supported here; files are for the Batch API (purpose 'batch')",
            "unsupported_parameter" if purpose else "missing_required_parameter",
            "purpose",
        )
    filename, content = fields["file"]
    if not content:
        raise ApiError(400, "the file is empty", "invalid_request", "file")
    row = await stored(batches).put_file(
        new_id("file-"), key.key_id, purpose, filename or "upload.jsonl", content
    )
    return file_object(row)


@router.get("/v1/files")
async def list_files(
    key: KeyDep,
    batches: BatchesDep,
    purpose: str | None = None,
    limit: int | None = None,
    after: str | None = None,
    order: str = "desc",
) -> dict[str, Any]:
    if order != "desc":
        raise ApiError(
            400, "only order=desc (newest first) is supported", "unsupported_parameter", "order"
        )
    page = await stored(batches).list_files(key.key_id, purpose, limit_of(limit), after)
    return page_object(page, file_object)


async def owned(
    get: Callable[[str, str], Awaitable[T | None]],
    object_id: str,
    key_id: str,
    kind: str,
    param: str,
) -> T:
    """The caller's ``kind`` object ``object_id`` (``get``: the store's lookup by id and key),
    or a 404 naming it (``param``: the request field); ``owned_file`` and ``owned_batch``."""
    found = await get(object_id, key_id)
    if found is None:
        raise ApiError(404, f"No such {kind} object: {object_id}", "not_found", param)
    return found


async def owned_file(batches: BatchStore | None, file_id: str, key_id: str) -> StoredFile:
    return await owned(stored(batches).get_file, file_id, key_id, "File", "id")


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, key: KeyDep, batches: BatchesDep) -> dict[str, Any]:
    return file_object(await owned_file(batches, file_id, key.key_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, key: KeyDep, batches: BatchesDep) -> Response:
    f = await owned_file(batches, file_id, key.key_id)
    return Response(f.content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, key: KeyDep, batches: BatchesDep) -> dict[str, Any]:
    if not await stored(batches).delete_file(file_id, key.key_id):
        raise ApiError(404, f"No such File object: {file_id}", "not_found", "id")
    return {"id": file_id, "object": "file", "deleted": True}


# ------------------------------------------------------------ batches


def check_create(body: BatchCreate) -> None:
    """A 400 for what a batch asks that this gateway cannot give."""
    if body.output_expires_after is not None:
        raise ApiError(
            400,
            "output files here do not expire; output_expires_after is not supported",
            "unsupported_parameter",
            "output_expires_after",
        )
    if body.completion_window != COMPLETION_WINDOW:
        raise ApiError(
            400,
            f"completion_window {body.completion_window!r} cannot be met; the only window is {COMPLETION_WINDOW!r}",
            "invalid_request",
            "completion_window",
        )
    if body.endpoint not in BATCH_ENDPOINTS:
        raise ApiError(
            400,
            f"endpoint {body.endpoint!r} is not served for batches; use one of {', '.join(BATCH_ENDPOINTS)}",
            "unsupported_parameter",
            "endpoint",
        )


async def input_file(store: BatchStore, body: BatchCreate, key_id: str) -> StoredFile:
    """The batch's input file: the caller's, of purpose ``batch`` (a 404 / 400 otherwise)."""
    f = await store.get_file(body.input_file_id, key_id)
    if f is None:
        raise ApiError(
            404, f"No such File object: {body.input_file_id}", "not_found", "input_file_id"
        )
    if f.purpose != "batch":
        raise ApiError(
            400,
            f"file {f.id} has purpose {f.purpose!r}, not 'batch'",
            "invalid_request",
            "input_file_id",
        )
    return f


@router.post("/v1/batches")
async def create_batch(
    body: BatchCreate, key: KeyDep, settings: SettingsDep, fleet: FleetDep, batches: BatchesDep
) -> dict[str, Any]:
    b = settings.batch
    check_create(body)
    store = stored(batches)
    f = await input_file(store, body, key.key_id)
    lines, errors = check_lines(f.content, body.endpoint, b.max_lines)
    now = time.time()
    row = BatchRow(
        id=new_id("batch_"),
        api_key_id=key.key_id,
        team=key.team,
        endpoint=body.endpoint,
        input_file_id=f.id,
        status="validating",
        total=len(lines),
        completed=0,
        failed=0,
        body={"metadata": body.metadata, "expires_at": int(now + b.window_s)},
        created_at=datetime.fromtimestamp(now, UTC),
    )
    if errors:
        row.status, row.total = "failed", 0
        listed = errors[: b.max_errors_listed]
        row.body = {**row.body, "failed_at": int(now), "errors": errors_object(listed)}
        await store.add_batch(row)
        return batch_object(row)
    await store.add_batch(row)
    js = fleet.js
    if js is None:
        raise ApiError(503, "the serving fleet is unavailable; retry shortly", "no_worker")
    await ensure_stream(js, batch_stream_config(settings.nats, b.window_s, b.dedupe_window_s))
    try:
        await publish_lines(js, settings, store, row)
    except Exception as e:
        # The batch stays validating; a runner's sweep publishes it again.
        raise ApiError(
            503,
            f"could not queue the batch's lines ({e!r}); it is retried",
            "no_worker",
            retry_after_s=settings.gateway.shed_retry_after_s,
        ) from e
    got = await store.get_batch(row.id, key.key_id)
    assert got is not None
    return batch_object(got)


@router.get("/v1/batches")
async def list_batches(
    key: KeyDep, batches: BatchesDep, limit: int | None = None, after: str | None = None
) -> dict[str, Any]:
    page = await stored(batches).list_batches(key.key_id, limit_of(limit), after)
    return page_object(page, batch_object)


async def owned_batch(batches: BatchStore | None, batch_id: str, key_id: str) -> BatchRow:
    return await owned(stored(batches).get_batch, batch_id, key_id, "Batch", "batch_id")


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, key: KeyDep, batches: BatchesDep) -> dict[str, Any]:
    return batch_object(await owned_batch(batches, batch_id, key.key_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(
    batch_id: str, key: KeyDep, settings: SettingsDep, fleet: FleetDep, batches: BatchesDep
) -> dict[str, Any]:
    row = await owned_batch(batches, batch_id, key.key_id)
    if row.status in ("cancelling", "cancelled"):
        return batch_object(row)
    if not await stored(batches).set_status(batch_id, "cancelling", ["validating", "in_progress"]):
        raise ApiError(
            409,
            f"Cannot cancel a batch with status {row.status!r}.",
            "invalid_request",
            "batch_id",
        )
    if fleet.js is not None:
        # Lines not yet taken leave the stream; a runner finalizes the batch (cancelled,
        # with the files of the lines answered) once none of its lines is in flight.
        try:
            subject = Subjects.of(settings.nats).batch(batch_id)
            await fleet.js.purge_stream(settings.nats.batch_stream, subject=subject)
        except Exception:
            pass  # the runner skips a cancelled batch's lines anyway
    return batch_object(await owned_batch(batches, batch_id, key.key_id))
