"""OpenAI's Files and Batch APIs' objects and work (docs/gateway.md#batch-api); the routes are
``routes/batches.py``.

``POST /v1/files`` keeps a JSONL file (purpose ``batch``) in the database; ``POST /v1/batches``
checks every line of it (``check_lines``), writes the batch row, then publishes one
``BatchLine`` a line on the JetStream batch stream under ``Nats-Msg-Id`` ``<batch_id>:<index>``
(``publish_lines``) and moves the batch to ``in_progress``. The batch runner
(``batch_runner.py``) answers the lines; the routes read the rows it leaves. A batch found
``validating`` later (this process died publishing) is published again by a runner's sweep
(``publish_lines`` is idempotent).
"""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

from nats.js import JetStreamContext
from pydantic import BaseModel, ConfigDict, Field

from libs.db.batches import BatchStore, Page
from libs.db.models import BatchRow, StoredFile
from libs.protocol import BatchLine, Subjects, encode
from libs.settings import Settings
from libs.wire.nats_util import publish_acked
from services.gateway.errors import ApiError

# The endpoints a batch may run, as OpenAI names them.
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
# OpenAI's one completion window; the fleet cannot promise another.
COMPLETION_WINDOW = "24h"
# The purposes of files this gateway keeps (uploads), and of the files it writes.
UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
# OpenAI's list pages: default and largest `limit`.
LIST_LIMIT_DEFAULT = 20
LIST_LIMIT_MAX = 100


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # Refused when set: nothing here expires output files.
    output_expires_after: Any = None


def file_object(f: StoredFile) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.size,
        "created_at": unix(f.created_at),
        "expires_at": None,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_object(b: BatchRow) -> dict[str, Any]:
    body = b.body
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": body.get("errors"),
        "input_file_id": b.input_file_id,
        "completion_window": COMPLETION_WINDOW,
        "status": b.status,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": unix(b.created_at),
        "in_progress_at": body.get("in_progress_at"),
        "expires_at": body.get("expires_at"),
        "finalizing_at": body.get("finalizing_at"),
        "completed_at": body.get("completed_at"),
        "failed_at": body.get("failed_at"),
        "expired_at": body.get("expired_at"),
        "cancelling_at": body.get("cancelling_at"),
        "cancelled_at": body.get("cancelled_at"),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": body.get("metadata"),
    }


def unix(t: datetime) -> int:
    """Unix seconds of a stored time (SQLite gives it back without its zone: UTC)."""
    return int((t if t.tzinfo else t.replace(tzinfo=UTC)).timestamp())


def page_object(page: Page, shape: Any) -> dict[str, Any]:
    data = [shape(r) for r in page.rows]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": page.has_more,
    }


def parse_multipart(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A ``multipart/form-data`` body's fields: name → (filename, bytes)."""
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(400, "send the file as multipart/form-data", "invalid_request", "file")
    head = f"Content-Type: {content_type}\r\n\r\n".encode()
    msg = BytesParser(policy=HTTP).parsebytes(head + body)
    if not msg.is_multipart():
        raise ApiError(400, "the multipart body could not be read", "invalid_request", "file")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in msg.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if not isinstance(name, str):
            continue
        data = part.get_payload(decode=True)
        fields[name] = (part.get_filename(), data if isinstance(data, bytes) else b"")
    return fields


def check_lines(
    content: bytes, endpoint: str, max_lines: int
) -> tuple[list[BatchLine], list[dict[str, Any]]]:
    """The input file's lines as ``BatchLine``s (batch id left empty), and OpenAI-shaped
    errors (``code``, ``line`` 1-based, ``message``, ``param``) for lines that cannot run."""
    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()

    def bad(n: int, code: str, message: str, param: str | None = None) -> None:
        errors.append({"code": code, "line": n, "message": message, "param": param})

    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        bad(1, "invalid_json_line", "the file is not UTF-8")
        return lines, errors
    rows = [(i + 1, raw) for i, raw in enumerate(text.splitlines()) if raw.strip()]
    if not rows:
        bad(1, "empty_file", "the input file has no lines")
    if len(rows) > max_lines:
        bad(1, "too_many_lines", f"{len(rows)} lines, over batch.max_lines ({max_lines})")
        return lines, errors
    for n, raw in rows:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            bad(n, "invalid_json_line", f"line {n} is not JSON: {e.msg}")
            continue
        if not isinstance(obj, dict):
            bad(n, "invalid_json_line", f"line {n} is not a JSON object")
            continue
        unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
        custom_id, method, url, body = (
            obj.get("custom_id"),
            obj.get("method"),
            obj.get("url"),
            obj.get("body"),
        )
        if unknown:
            bad(n, "invalid_request", f"unknown field {unknown[0]!r}", unknown[0])
        elif not isinstance(custom_id, str) or not custom_id:
            bad(
                n, "missing_required_parameter", "custom_id must be a non-empty string", "custom_id"
            )
        elif custom_id in seen:
            bad(n, "duplicate_custom_id", f"custom_id {custom_id!r} is used twice", "custom_id")
        elif method != "POST":
            bad(n, "invalid_method", "method must be POST", "method")
        elif url != endpoint:
            bad(n, "mismatched_endpoint", f"url must be the batch's endpoint {endpoint}", "url")
        elif not isinstance(body, dict):
            bad(n, "invalid_request", "body must be a JSON object", "body")
        else:
            seen.add(custom_id)
            lines.append(
                BatchLine(batch_id="-", index=len(lines), custom_id=custom_id, url=url, body=body)
            )
    return lines, errors


async def publish_lines(
    js: JetStreamContext, settings: Settings, store: BatchStore, batch: BatchRow
) -> bool:
    """Publish every line of ``batch`` (each under its own Nats-Msg-Id, so a repeat is stored
    once) and move it to in_progress. False: the batch was no longer validating."""
    f = await store.get_file(batch.input_file_id, batch.api_key_id)
    if f is None:
        return await store.set_status(
            batch.id,
            "failed",
            ["validating"],
            errors=errors_object(
                [
                    {
                        "code": "file_not_found",
                        "line": None,
                        "message": "input file deleted",
                        "param": None,
                    }
                ]
            ),
        )
    lines, _ = check_lines(f.content, batch.endpoint, settings.batch.max_lines)
    subject = Subjects.of(settings.nats).batch(batch.id)
    g = settings.gateway
    for line in lines:
        line.batch_id = batch.id
        await publish_acked(
            js,
            subject,
            encode(line),
            f"{batch.id}:{line.index}",
            g.publish_ack_timeout_s,
            g.publish_attempts,
        )
    return await store.set_status(batch.id, "in_progress", ["validating"])


def errors_object(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": data}
