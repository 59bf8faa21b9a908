"""``DeltaHold``: a batch request's chunks merged per choice into deltas of ``tokens`` tokens,
the choice's end (or its tool calls) sent at once, nothing lost or reordered."""

from __future__ import annotations

import pytest

from libs.engine.outputs import GenerationChunk
from libs.engine.params import LogprobEntry
from services.worker.coalesce import DeltaHold

pytestmark = pytest.mark.unit


def chunk(index: int, k: int, finish: str | None = None) -> GenerationChunk:
    return GenerationChunk(
        index=index,
        text=f" w{k}",
        token_ids=[k],
        finish_reason=finish,  # type: ignore[arg-type]
        logprobs=[LogprobEntry(token=f" w{k}", token_id=k, logprob=-0.5)],
        num_prompt_tokens=7,
        num_cached_tokens=k,
    )


def test_chunks_merge_per_choice_to_the_limit_and_the_end() -> None:
    hold = DeltaHold(3)
    sent = []
    # Two choices interleaved, 7 tokens each, the last one finishing.
    for k in range(7):
        for i in (0, 1):
            out = hold.add(chunk(i, k, "length" if k == 6 else None), last=False)
            if out is not None:
                sent.append(out)
    for i in (0, 1):
        mine = [c for c in sent if c.index == i]
        assert [c.token_ids for c in mine] == [[0, 1, 2], [3, 4, 5], [6]]
        assert "".join(c.text for c in mine) == "".join(f" w{k}" for k in range(7))
        assert [c.finish_reason for c in mine] == [None, None, "length"]
        assert [[e.token_id for e in c.logprobs or []] for c in mine] == [[0, 1, 2], [3, 4, 5], [6]]
        assert mine[0].num_cached_tokens == 2  # the newest chunk's counters
    assert hold.held == {}


def test_a_chunk_with_tool_calls_is_sent_with_what_was_held() -> None:
    hold = DeltaHold(16)
    assert hold.add(chunk(0, 0), last=False) is None
    out = hold.add(chunk(0, 1), last=True)
    assert out is not None and out.token_ids == [0, 1] and out.text == " w0 w1"
    assert hold.held == {}
