from __future__ import annotations

import pytest

from bench.serve import is_local_url
from bench.serve_client import SSEEvent, SSEParser, Target

pytestmark = pytest.mark.unit


def test_sse_events_survive_any_split_of_the_byte_stream() -> None:
    stream = (
        ": keep-alive comment\r\n"
        'data: {"a": 1}\r\n\r\n'
        "event: error\ndata: line one\ndata:line two\n\n"
        "data: [DONE]\r\r"
    )
    expected = [
        SSEEvent("message", '{"a": 1}'),
        SSEEvent("error", "line one\nline two"),
        SSEEvent("message", "[DONE]"),
    ]
    for size in (1, 2, 3, 7, len(stream)):
        parser = SSEParser()
        events = []
        for i in range(0, len(stream), size):
            events += parser.feed(stream[i : i + size])
        events += parser.close()
        assert events == expected, size


def test_sse_close_flushes_an_unterminated_last_event() -> None:
    parser = SSEParser()
    assert parser.feed("data: [DONE]") == []
    assert parser.close() == [SSEEvent("message", "[DONE]")]


def test_target_specs() -> None:
    target = Target.parse("strait=http://127.0.0.1:8000,key=sk-1,model=smol")
    assert target == Target("strait", "http://127.0.0.1:8000", "sk-1", "smol")
    assert target.api_root == "http://127.0.0.1:8000/v1"
    assert target.headers() == {"Authorization": "Bearer sk-1"}
    assert Target.parse("http://localhost:8081/v1/").api_root == "http://localhost:8081/v1"
    with pytest.raises(ValueError):
        Target.parse("x=http://h:1,token=abc")


@pytest.mark.parametrize(
    ("url", "local"),
    [
        ("http://127.0.0.1:8000", True),
        ("http://localhost:8081", True),
        ("http://[::1]:8000", True),
        ("http://10.1.2.3:80", True),
        ("http://gateway:8000", True),
        ("https://api.openai.com", False),
        ("http://8.8.8.8", False),
    ],
)
def test_only_local_urls_are_local(url: str, local: bool) -> None:
    assert is_local_url(url) is local
