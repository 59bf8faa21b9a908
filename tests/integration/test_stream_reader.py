"""StreamReader on a real nats-server: order, duplicates, and gaps that end clearly instead of
waiting out the idle timeout."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest

from libs.protocol import Finished, ResendRequest, TokenDelta, Usage, decode, encode
from libs.wire.stream_reader import StreamGap, StreamReader
from libs.wire.stream_writer import StreamWriter

pytestmark = pytest.mark.integration


def delta(seq: int, text: str) -> bytes:
    return encode(TokenDelta(seq=seq, request_id="r", text=text, token_ids=[seq]))


async def test_reordered_and_duplicated_messages_come_out_in_order(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    async with StreamReader(nc, "sr.order", 5, 5) as reader:
        for seq in (2, 1, 1, 3):
            await nc.publish("sr.order", delta(seq, str(seq)))
        await nc.publish("sr.order", encode(Finished(seq=4, request_id="r", usage=Usage())))
        got = [m async for m in reader.messages()]
    assert [m.seq for m in got] == [1, 2, 3, 4] and reader.stats.duplicates == 1
    await nc.close()


async def test_a_lost_message_is_a_gap_after_the_gap_timeout_not_the_idle_timeout(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    async with StreamReader(nc, "sr.gap", 5, 60, gap_timeout_s=0.3) as reader:
        await nc.publish("sr.gap", delta(1, "a"))
        await nc.publish("sr.gap", delta(3, "c"))  # seq 2 never comes; the stream goes quiet
        t0 = time.monotonic()
        got = []
        with pytest.raises(StreamGap) as gap:
            async for m in reader.messages():
                got.append(m)
    assert [m.seq for m in got] == [1]
    assert (gap.value.expected, gap.value.got) == (2, 3)
    assert time.monotonic() - t0 < 2.0
    await nc.close()


async def test_after_a_reconnect_a_silent_started_stream_is_a_gap(nats_url: str) -> None:
    """Messages published while the connection re-subscribed are gone for good: a started
    stream that goes silent after a reconnect ends with a gap, not at the idle timeout."""
    nc = await nats.connect(nats_url)
    async with StreamReader(nc, "sr.recon", 5, 60, gap_timeout_s=0.3) as reader:
        await nc.publish("sr.recon", delta(1, "a"))
        messages = reader.messages()
        assert (await anext(messages)).seq == 1
        nc.stats["reconnects"] += 1  # what nats-py counts when it reconnects
        t0 = time.monotonic()
        with pytest.raises(StreamGap):
            await anext(messages)
    assert time.monotonic() - t0 < 2.0
    await nc.close()


async def test_a_reader_already_waiting_when_the_connection_reconnects_ends_the_gap(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    async with StreamReader(nc, "sr.wait", 5, 60, gap_timeout_s=0.3) as reader:
        await nc.publish("sr.wait", delta(1, "a"))
        messages = reader.messages()
        assert (await anext(messages)).seq == 1
        pending = asyncio.ensure_future(anext(messages))  # waiting, idle timeout 60 s
        await asyncio.sleep(0.5)
        nc.stats["reconnects"] += 1
        t0 = time.monotonic()
        with pytest.raises(StreamGap):
            await pending
    assert time.monotonic() - t0 < 2.0
    await nc.close()


async def test_a_lost_message_is_sent_again_when_the_reader_asks(nats_url: str) -> None:
    """A message that never reached the reader (sent into a reconnect): the reader asks
    ``resend.<id>``, the writer publishes again what it kept, and the stream completes."""
    nc = await nats.connect(nats_url)
    out = StreamWriter(nc, "sr.lost", "lost", keep=16)

    async def on_resend(msg: nats.aio.msg.Msg) -> None:
        await out.resend(decode(msg.data, ResendRequest).from_seq)

    await nc.subscribe("sr.resend.lost", cb=on_resend)
    async with StreamReader(
        nc, "sr.lost", 5, 60, gap_timeout_s=3, resend_subject="sr.resend.lost"
    ) as reader:
        await out.send(TokenDelta(seq=1, request_id="lost", text="a"))
        out.sent.append((2, encode(TokenDelta(seq=2, request_id="lost", text="b"))))  # lost
        out._seq = 2
        await out.send(TokenDelta(seq=3, request_id="lost", text="c"))
        await out.send(Finished(seq=4, request_id="lost", usage=Usage()))
        got = [m async for m in reader.messages()]
    assert [m.seq for m in got] == [1, 2, 3, 4]
    assert "".join(m.text for m in got if isinstance(m, TokenDelta)) == "abc"
    assert reader.stats.resends == 1
    await nc.close()


async def test_once_a_stream_flows_again_after_a_reconnect_silence_is_not_a_gap(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    async with StreamReader(nc, "sr.flow", 5, 60, gap_timeout_s=0.3) as reader:
        await nc.publish("sr.flow", delta(1, "a"))
        messages = reader.messages()
        assert (await anext(messages)).seq == 1
        nc.stats["reconnects"] += 1
        await nc.publish("sr.flow", delta(2, "b"))  # arrives after the reconnect: it flows
        assert (await anext(messages)).seq == 2

        async def later() -> None:
            await asyncio.sleep(1.0)  # longer than gap_timeout_s: a slow step, not a loss
            await nc.publish("sr.flow", delta(3, "c"))

        task = asyncio.create_task(later())
        assert (await anext(messages)).seq == 3
        await task
    await nc.close()


async def test_messages_past_max_pending_end_the_read_with_a_gap_not_a_truncation(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    async with StreamReader(nc, "sr.full", 5, 5, max_pending=2) as reader:
        for seq in (1, 2, 3):
            await nc.publish("sr.full", delta(seq, str(seq)))
        await nc.publish("sr.full", encode(Finished(seq=4, request_id="r", usage=Usage())))
        await nc.flush()
        await asyncio.sleep(0.1)  # all four delivered before the first read
        with pytest.raises(StreamGap):
            _ = [m async for m in reader.messages()]
    assert reader.overflowed
    await nc.close()


async def test_a_waiting_reader_wakes_for_each_message_and_times_out_on_silence(
    nats_url: str,
) -> None:
    nc = await nats.connect(nats_url)
    async with StreamReader(nc, "sr.wake", 5, 0.3) as reader:

        async def publish() -> None:
            for seq in (1, 2):
                await asyncio.sleep(0.05)  # the reader is waiting when each one comes
                await nc.publish("sr.wake", delta(seq, str(seq)))

        task = asyncio.create_task(publish())
        got = []
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async for m in reader.messages():
                got.append(m)
        await task
    # Both delivered as they came, then 0.3 s of silence is the idle timeout.
    assert [m.seq for m in got] == [1, 2]
    assert 0.3 <= time.monotonic() - t0 < 2.0
    await nc.close()


async def test_waits_on_a_flowing_stream_share_one_timer(
    nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A gateway waits once per streamed token: the waits re-use one armed timer (moved
    lazily) instead of scheduling and cancelling one each, and leaving frees it."""
    nc = await nats.connect(nats_url)
    loop = asyncio.get_running_loop()
    armed: list[asyncio.TimerHandle] = []
    call_at = loop.call_at

    def spy(when: float, cb: object, *args: object, **kw: object) -> asyncio.TimerHandle:
        handle = call_at(when, cb, *args, **kw)  # type: ignore[arg-type]
        if isinstance(getattr(cb, "__self__", None), StreamReader):
            armed.append(handle)
        return handle

    monkeypatch.setattr(loop, "call_at", spy)
    async with StreamReader(nc, "sr.timer", 5, 5) as reader:

        async def publish() -> None:
            for seq in range(1, 21):
                await asyncio.sleep(0.005)  # the reader is waiting when each one comes
                await nc.publish("sr.timer", delta(seq, "x"))
            await nc.publish("sr.timer", encode(Finished(seq=21, request_id="r", usage=Usage())))

        task = asyncio.create_task(publish())
        got = [m async for m in reader.messages()]
        await task
    assert [m.seq for m in got] == list(range(1, 22))
    assert len(armed) == 1 and armed[0].cancelled()
    await nc.close()
