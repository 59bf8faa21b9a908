"""The gateway as the official ``openai`` SDK sees it, on a fleet of FAKE workers."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from bench.support.fleet import GatewayFleet
from libs.db.keys import ensure_dev_key
from libs.settings import PoolSettings, Settings
from tests.integration.gateway.conftest import new_key

pytestmark = pytest.mark.integration

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "tell me about rivers"}]


@pytest.fixture
def sdk_settings(gw_settings: Settings) -> Settings:
    # A second pool nobody serves, to see "no worker" (503) without spilling over.
    gw_settings.pools.append(PoolSettings(name="large", model="big-model", backend="fake"))
    gw_settings.router.spill_over = False
    return gw_settings


def client(base: str, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20)


async def test_sdk_chat_and_completions(sdk_settings: Settings) -> None:
    key = await ensure_dev_key(sdk_settings)
    async with GatewayFleet(sdk_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c:
            chat = await c.chat.completions.create(model="auto", messages=MESSAGES, max_tokens=5)
            assert chat.object == "chat.completion"
            assert chat.model == "fake-model"  # the model that answered, not "auto"
            assert chat.choices[0].message.role == "assistant"
            assert len(chat.choices[0].message.content.split()) == 5  # type: ignore[union-attr]
            assert chat.choices[0].finish_reason == "length"
            assert chat.usage is not None and chat.usage.completion_tokens == 5
            assert chat.usage.total_tokens == chat.usage.prompt_tokens + 5

            stream = await c.chat.completions.create(
                model="default",
                messages=MESSAGES,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [ch async for ch in stream]
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert len(text.split()) == 4
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 4
            assert {ch.model for ch in chunks} == {"fake-model"}

            text_resp = await c.completions.create(
                model="fake-model", prompt="once upon", max_tokens=3
            )
            assert text_resp.object == "text_completion"
            assert len(text_resp.choices[0].text.split()) == 3
            assert text_resp.usage is not None and text_resp.usage.prompt_tokens == 2

            tstream = await c.completions.create(
                model="auto", prompt=[11, 12, 13], max_tokens=3, stream=True
            )
            tchunks = [ch async for ch in tstream]
            assert len("".join(ch.choices[0].text for ch in tchunks if ch.choices).split()) == 3

            # Stop strings: the text ends right before the stop word, finish_reason "stop".
            full = await c.completions.create(
                model="auto", prompt="stop test", max_tokens=8, seed=7
            )
            words = full.choices[0].text.split()
            cut = next(i for i, w in enumerate(words) if i > 0 and w not in words[:i])
            stopped = await c.completions.create(
                model="auto", prompt="stop test", max_tokens=8, seed=7, stop=[words[cut]]
            )
            assert stopped.choices[0].text.split() == words[:cut]
            assert stopped.choices[0].finish_reason == "stop"

            # Seeds: same seed, same text (the second is served by the response cache);
            # another seed, another text.
            async def seeded(seed: int) -> tuple[str, str]:
                raw = await c.chat.completions.with_raw_response.create(
                    model="auto",
                    messages=MESSAGES,
                    max_tokens=12,
                    temperature=0.9,
                    seed=seed,
                )
                return raw.parse().choices[0].message.content or "", raw.headers["x-strait-cache"]

            a, a_cache = await seeded(1)
            b, b_cache = await seeded(1)
            d, _ = await seeded(2)
            assert (a_cache, b_cache) == ("miss", "hit")
            assert a == b and a != d
            # A streamed request with the same body is a hit too, replayed as SSE.
            hit_stream = await c.chat.completions.create(
                model="auto",
                messages=MESSAGES,
                max_tokens=12,
                temperature=0.9,
                seed=1,
                stream=True,
            )
            assert (
                "".join(
                    [ch.choices[0].delta.content or "" async for ch in hit_stream if ch.choices]
                )
                == a
            )

            models = await c.models.list()
            assert {"auto", "default", "fake-model"} <= {m.id for m in models.data}


async def test_sdk_errors(sdk_settings: Settings) -> None:
    key = await ensure_dev_key(sdk_settings)
    slow_key = await new_key(sdk_settings, "one-a-minute", rpm=1)
    async with GatewayFleet(sdk_settings) as fleet:
        await fleet.add_worker("w1")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        async with client(base, key) as c:
            with pytest.raises(openai.BadRequestError) as bad:
                await c.chat.completions.create(model="auto", messages=MESSAGES, temperature=3.5)
            assert bad.value.body["param"] == "temperature"  # type: ignore[index]
            with pytest.raises(openai.BadRequestError):
                await c.chat.completions.create(model="auto", messages=[])
            with pytest.raises(openai.NotFoundError) as nf:
                await c.chat.completions.create(model="no-such-model", messages=MESSAGES)
            assert nf.value.code == "model_not_found"
            with pytest.raises(openai.APIStatusError) as too_long:
                await c.completions.create(model="auto", prompt="hello", max_tokens=5000)
            assert too_long.value.status_code == 413
            assert too_long.value.code == "context_length_exceeded"
            with pytest.raises(openai.InternalServerError) as unavailable:
                await c.chat.completions.create(model="large", messages=MESSAGES)
            assert unavailable.value.status_code == 503
            assert unavailable.value.response.headers["retry-after"] == "2"
            # Errors on a streamed request surface before the first byte, as plain HTTP errors.
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="nope", messages=MESSAGES, stream=True)
        async with client(base, "sk-strait-000000000000-wrong") as c:
            with pytest.raises(openai.AuthenticationError):
                await c.chat.completions.create(model="auto", messages=MESSAGES)
        async with client(base, slow_key) as c:
            await c.chat.completions.create(model="auto", messages=MESSAGES, max_tokens=2)
            with pytest.raises(openai.RateLimitError) as limited:
                await c.chat.completions.create(model="auto", messages=MESSAGES, max_tokens=2)
            assert int(limited.value.response.headers["retry-after"]) >= 1
