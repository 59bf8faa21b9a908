"""Random request bodies never make the gateway answer 5xx or break its error shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.support.fleet import GatewayFleet
from libs.settings import Settings
from tests.integration.gateway.conftest import new_key

pytestmark = pytest.mark.integration

EXAMPLES = 80

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def maybe(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly plausible values, sometimes anything at all."""
    return st.one_of(valid, valid, json_value)


message = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"]))},
    optional={"content": maybe(st.text(max_size=40) | st.just([{"type": "text", "text": "hi"}]))},
)
common = {
    "max_tokens": maybe(st.integers(-2, 6)),
    "temperature": maybe(st.floats(-1, 3)),
    "top_p": maybe(st.floats(-0.5, 1.5)),
    "top_k": maybe(st.integers(-3, 100)),
    "seed": maybe(st.integers(-(2**64), 2**64)),
    "n": maybe(st.integers(0, 3)),
    "stop": maybe(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5)),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": maybe(st.booleans())})),
    "presence_penalty": maybe(st.floats(-3, 3)),
    "repetition_penalty": maybe(st.floats(-1, 12)),
    "user": maybe(st.text(max_size=10)),
    "priority": maybe(st.sampled_from(["interactive", "batch", "urgent"])),
}
model = maybe(st.sampled_from(["auto", "default", "fake-model", "no-such-model", ""]))
chat_body = st.fixed_dictionaries(
    {"model": model, "messages": maybe(st.lists(message, max_size=3))},
    optional={
        **common,
        "logprobs": maybe(st.booleans()),
        "top_logprobs": maybe(st.integers(-1, 25)),
        "max_completion_tokens": maybe(st.integers(-1, 6)),
    },
)
text_body = st.fixed_dictionaries(
    {
        "model": model,
        "prompt": maybe(st.text(max_size=30) | st.lists(st.integers(-5, 60_000), max_size=4)),
    },
    optional={**common, "logprobs": maybe(st.integers(-1, 6)), "echo": maybe(st.booleans())},
)
request = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), chat_body.map(json.dumps)),
    st.tuples(st.just("/v1/completions"), text_body.map(json.dumps)),
    st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), st.text(max_size=30)),
)


def check(client: httpx.Client, path: str, body: str) -> None:
    with client.stream(
        "POST", path, content=body.encode(), headers={"Content-Type": "application/json"}
    ) as r:
        raw = r.read()
    assert r.status_code < 500, (r.status_code, raw[:300], body)
    if r.status_code >= 400:
        err = json.loads(raw)["error"]
        assert isinstance(err["message"], str) and err["type"], err
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert raw.rstrip().endswith(b"data: [DONE]") or b'"error"' in raw, raw[-200:]
    else:
        assert json.loads(raw)["choices"] is not None


async def test_random_bodies_never_5xx(gw_settings: Settings) -> None:
    gw_settings.fake_engine.per_token_s = 0.0
    secret = await new_key(gw_settings, "fuzz", rpm=10**9, tpm=10**9)
    async with GatewayFleet(gw_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(request)
        def fuzz(case: tuple[str, str]) -> None:
            check(client, *case)

        with httpx.Client(
            base_url=base, headers={"Authorization": f"Bearer {secret}"}, timeout=20
        ) as client:
            await asyncio.to_thread(fuzz)
