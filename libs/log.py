"""Structured logging: one JSON object per line on stderr (or plain text for humans).

Every service calls ``setup_logging(service)`` once from its entry function. Request logs pass
fields through ``extra={"fields": {...}}``; prompt text is never a field unless the operator set
``gateway.log_prompts``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_SERVICE = "strait"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "service": _SERVICE,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        tail = ""
        if isinstance(fields, dict):
            tail = " " + " ".join(f"{k}={v}" for k, v in fields.items())
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        line = f"{stamp} {record.levelname:<5} {_SERVICE:<8} {record.getMessage()}{tail}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(service: str, level: str = "INFO", as_json: bool = True) -> None:
    global _SERVICE
    _SERVICE = service
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if as_json else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("nats", "uvicorn.access", "httpx", "aiosqlite", "asyncio", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def fields(**kv: Any) -> dict[str, Any]:
    """``log.info("request", extra=fields(request_id=..., ...))``."""
    return {"fields": kv}
