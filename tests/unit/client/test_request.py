"""Requests the client builds, and the exceptions it raises, without a server."""

from __future__ import annotations

from typing import get_args

import pytest

from libs.client import (
    ERROR_CLASSES,
    InvalidRequest,
    Retryable,
    StraitClient,
    StraitError,
    Timeout,
    error_from_message,
)
from libs.protocol import ErrorCode, ErrorMessage

pytestmark = pytest.mark.unit


def test_request_maps_http_fields_onto_the_wire() -> None:
    c = StraitClient(api_key_id="team-x")
    req = c.request(
        messages=[{"role": "user", "content": "hi"}], model="small", max_tokens=7,
        temperature=0.0, top_p=0.9, top_k=5, min_p=0.1, stop="END", seed=3, n=2,
        presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1, logprobs=2,
        priority="batch", user="u1", request_id="r-1",
    )  # fmt: skip
    assert (req.request_id, req.model, req.api_key_id, req.user) == ("r-1", "small", "team-x", "u1")
    assert req.messages is not None and req.messages[0].content == "hi"
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.stop, s.seed, s.n, s.logprobs) == (
        7, 0.0, 5, ["END"], 3, 2, 2,
    )  # fmt: skip
    assert req.priority == "batch" and req.prompt is None


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one"),
        ({}, "exactly one"),
        ({"prompt": "a", "temperature": 3.0}, "temperature"),
        ({"prompt": "a", "n": 0}, "$.sampling.n"),
        ({"prompt": "a", "request_id": "has.dot"}, "request_id"),
        ({"prompt": "a", "priority": "urgent"}, "priority"),
        ({"prompt": "a", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ],
)
def test_invalid_requests_fail_before_sending(kwargs: dict[str, object], needle: str) -> None:
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(InvalidRequest) as e:
        StraitClient().request(prompt, **kwargs)  # type: ignore[arg-type]
    assert needle in str(e.value)


def test_every_error_code_has_a_class() -> None:
    assert set(ERROR_CLASSES) == set(get_args(ErrorCode))
    for code, cls in ERROR_CLASSES.items():
        err = error_from_message(ErrorMessage(seq=1, request_id="r", code=code, message="m"))  # type: ignore[arg-type]
        assert type(err) is cls and err.code == code and isinstance(err, StraitError)
    assert issubclass(Timeout, TimeoutError)
    assert {c for c, k in ERROR_CLASSES.items() if issubclass(k, Retryable)} == {
        "no_capacity", "no_worker", "rate_limited", "worker_lost", "over_share",
    }  # fmt: skip


def test_an_unknown_code_from_a_newer_fleet_is_still_a_strait_error() -> None:
    msg = ErrorMessage(seq=1, request_id="r", code="brand_new", message="m")  # type: ignore[arg-type]
    err = error_from_message(msg)
    assert type(err) is StraitError and err.code == "brand_new"


def test_connection_settings_come_from_the_nats_cli_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k in ("NATS_URL", "NATS_NKEY", "NATS_CA", "NATS_CERT", "NATS_KEY"):
        monkeypatch.delenv(k, raising=False)
    plain = StraitClient()
    assert plain._url == "nats://127.0.0.1:4222" and not plain.nkey_seed_file
    assert plain.report_usage is True  # no team credentials: the client reports usage
    monkeypatch.setenv("NATS_URL", "tls://nats.example:4333")
    monkeypatch.setenv("NATS_NKEY", "/creds/team.nk")
    monkeypatch.setenv("NATS_CA", "/creds/ca.pem")
    team = StraitClient()
    assert (team._url, team.nkey_seed_file, team.tls_ca_file) == (
        "tls://nats.example:4333",
        "/creds/team.nk",
        "/creds/ca.pem",
    )
    assert team.report_usage is False  # a team cannot publish usage events
    assert StraitClient(report_usage=True).report_usage is True
    explicit = StraitClient("nats://other:4222", nkey_seed_file="", tls_ca_file="")
    assert (explicit._url, explicit.nkey_seed_file, explicit.tls_ca_file) == (
        "nats://other:4222",
        "",
        "",
    )


def test_a_prediction_travels_in_the_sampling_params() -> None:
    req = StraitClient().request("edit this", prediction="def f():\n    return 1\n")
    assert req.sampling.prediction == "def f():\n    return 1\n"
    with pytest.raises(InvalidRequest):
        StraitClient().request("x", prediction="a" * 262_145)
