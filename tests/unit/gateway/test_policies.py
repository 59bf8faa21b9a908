"""The gateway's in-memory policies: response cache, rate limits, key secrets."""

from __future__ import annotations

import pytest

from libs.db.keys import check_secret, hash_secret, key_id_of, new_secret
from libs.flow import ratelimit as limits_mod
from libs.protocol import ChatMessage, GenerateRequest, SamplingParams
from libs.settings import GatewaySettings
from services.gateway import cache as cache_mod
from services.gateway.auth import KeyInfo
from services.gateway.cache import ResponseCache, cache_key, is_deterministic
from services.gateway.errors import ApiError
from services.gateway.limits import RateLimiter
from services.gateway.schemas import ChatCompletionRequest

pytestmark = pytest.mark.unit


def body(**kw: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "auto", "messages": [{"role": "user", "content": "x"}], **kw}
    )


def test_cache_key_ignores_stream_flags_and_nothing_else() -> None:
    a = cache_key("k", "chat", body(temperature=0))
    assert a == cache_key(
        "k", "chat", body(temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert a != cache_key("k", "chat", body(temperature=0, max_tokens=3))
    assert a != cache_key("other-key", "chat", body(temperature=0))
    assert a != cache_key("k", "text", body(temperature=0))


def test_only_deterministic_requests_are_cacheable() -> None:
    assert is_deterministic(body(temperature=0))
    assert is_deterministic(body(temperature=1.0, seed=3))
    assert not is_deterministic(body())
    assert not is_deterministic(body(temperature=0.5))


def test_cache_bounds_entries_bytes_and_age(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr(cache_mod.time, "monotonic", lambda: now[0])
    c = ResponseCache(
        GatewaySettings(response_cache_entries=2, response_cache_bytes=200, response_cache_ttl_s=10)
    )
    c.put("a", {"x": "1"})
    c.put("b", {"x": "2"})
    assert c.get("a") == {"x": "1"}  # a is now the most recent
    c.put("c", {"x": "3"})
    assert (c.get("b"), len(c)) == (None, 2)  # least recently used went first
    c.put("big", {"x": "y" * 150})
    assert c.bytes <= 200 and c.get("big") is not None and c.get("a") is None
    c.put("huge", {"x": "y" * 500})  # larger than the whole budget: never stored
    assert c.get("huge") is None
    now[0] += 11
    assert c.get("big") is None and len(c) == 1


def test_rate_limits_refill_and_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    monkeypatch.setattr(limits_mod.time, "monotonic", lambda: now[0])
    lim = RateLimiter(default_rpm=600, default_tpm=1000)
    key = KeyInfo("k", "k", rpm=2, tpm=None)
    lim.admit(key, 10)
    lim.admit(key, 10)
    with pytest.raises(ApiError) as e:
        lim.admit(key, 10)
    assert e.value.status == 429 and e.value.retry_after_s == pytest.approx(30.0)
    assert e.value.headers() == {"Retry-After": "30"}
    now[0] += 30
    lim.admit(key, 10)
    # Tokens: the reservation is replaced by the real usage.
    big = KeyInfo("b", "b", rpm=1000, tpm=100)
    reserved = lim.admit(big, 90)
    lim.settle(big, reserved, 20)
    lim.admit(big, 70)
    with pytest.raises(ApiError, match="tokens per minute"):
        lim.admit(big, 20)
    # A reservation larger than a minute's tokens is capped, so it can still pass.
    assert lim.admit(KeyInfo("c", "c", tpm=50), 10_000) == 50


def test_one_reservation_estimate_for_ids_text_and_messages() -> None:
    """The gateway (per key) and the router (per team) reserve this same estimate."""
    sampling = SamplingParams(max_tokens=10, n=2)
    ids = GenerateRequest(request_id="a", prompt_token_ids=[1] * 7, sampling=sampling)
    assert limits_mod.reserve_estimate(ids) == 7 + 10 * 2
    text = GenerateRequest(request_id="b", prompt="x" * 41, sampling=sampling)
    assert limits_mod.reserve_estimate(text) == 41 // 4 + 1 + 20
    turns = [ChatMessage("system", "y" * 20), ChatMessage("user", "z" * 21)]
    chat = GenerateRequest(request_id="c", messages=turns, sampling=sampling)
    assert limits_mod.reserve_estimate(chat) == limits_mod.reserve_estimate(text)


def test_secrets_verify_by_hash_only() -> None:
    key_id, secret = new_secret()
    assert key_id_of(secret) == key_id
    stored = hash_secret(secret)
    assert secret not in stored and check_secret(secret, stored)
    assert not check_secret(secret + "x", stored)
    assert hash_secret(secret) != stored  # per-key salt
    assert not check_secret(secret, "garbage")
    for bad in ("", "sk-strait-", "sk-strait-abc", "sk-other-abc-def", "sk-strait-a.b-c"):
        assert key_id_of(bad) is None


def test_vllm_extensions_reach_the_sampling_params_and_the_cache_key() -> None:
    b = body(temperature=0, ignore_eos=True, stop_token_ids=[7, 9])
    s = b.sampling(default_max_tokens=16, logprobs=None)
    assert s.ignore_eos and s.stop_token_ids == [7, 9]
    assert not body().sampling(16, None).ignore_eos
    assert cache_key("k", "chat", b) != cache_key("k", "chat", body(temperature=0))
