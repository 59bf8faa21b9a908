"""What one gateway process can stream, with FAKE workers that cost nothing per token.

    .venv/bin/python -m bench.gateway_load --streams 500 1000 2000 --gateways 1 2 --duration 20

Starts its own JetStream nats-server (free port), a router, ``--workers`` FAKE-engine workers
(``libs/backend/fake.py``, ``per_token_s = 0``, ``per_prompt_token_s = 0``: no model, the workers
publish token frames as fast as they can) and G gateways, each a separate OS process
(``python -m services.cli <role>``, as ``bench/support/procs.ProcessFleet`` runs them). Auth, rate
limits, the ledger and the response cache are off; every capacity bound is far above the load;
``gateway.open_metrics`` is on. Two gateways are stateless replicas on two ports of this
machine; the client spreads its streams over them round-robin (no load balancer).

The load client is a separate process (this script with ``--client``), so its CPU is not the
gateway's: it keeps S streaming ``POST /v1/chat/completions`` requests open (``stream: true``,
``max_tokens`` M, ``ignore_eos``, ``stream_options.include_usage``) over raw asyncio sockets
(HTTP/1.1 keep-alive, chunked framing and SSE parsed by hand: cheaper per token than httpx),
starting a new request on a connection as soon as one ends. The window opens after a ramp
(``--ramp``), once every stream's first request has ended (the first wave starts all together)
and ``--warmup`` seconds more; it measures for ``--duration`` seconds:

- tokens/s delivered: content chunks read in the window x tokens per chunk (from the
  ``usage.completion_tokens`` of whole requests; the fake sends one token per frame, so 1.0
  here), and requests/s (requests that ended in the window);
- streams held (requests between their send and their last byte, sampled every 0.25 s);
- TTFT (send → first content chunk) and the inter-chunk gap between consecutive content chunks
  of a stream as the client reads them, p50/p99. Chunks that arrive in one socket read get a gap
  of ~0: the gap is what a client observes, bursts included. The gateway's own view (its
  ``/metrics``: ``strait_gateway_*`` scraped before and after the window) is printed in a second
  table;
- with ``--probe``, the latency the gateway *adds* per token: the client also subscribes to every
  stream subject on nats-server itself (one raw-protocol connection, parsed by hand: a few µs a
  frame), so each token frame reaches this process twice, once from nats-server directly and once
  as the gateway's SSE chunk. Per token, added = (SSE chunk read) − (the same frame read from
  NATS), both on this process's one clock and event loop; matched by request id (the response's
  ``X-Request-Id``) and the token's ordinal in its stream. It counts everything between
  nats-server and the client that the direct path does not: the gateway's socket read, its event
  loop's queue, decoding, the SSE encode and write, and one more loopback TCP hop. Beside it,
  per frame, how many delta frames reached the probe in the same socket read (how bursty the
  stream from nats-server is); ``--pin-gateway`` gives the gateway a CPU of its own;
- request errors by HTTP status / error code;
- CPU of each gateway process, of the client, and of the rest of the fleet (router, workers,
  nats-server) over the window, as % of one core (psutil).

It also runs the same S through the NATS path with the Python client library
(``libs.client.StraitClient``, as ``examples/batch_submit.py`` does) in a client process of its
own, with the gateway idle, for comparison.

Honest caveat: everything (client, gateways, router, workers, nats-server) shares the one
machine this runs on — 2 cores where the figures in docs/performance.md were taken. The client
and the zero-cost workers compete with the gateway for those cores, so the rows bound what a
gateway does on a busy 2-core box, not what it does on a core of its own; read the CPU columns
alongside the rates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

from bench.stats import nearest_rank

ROOT = Path(__file__).resolve().parent.parent
MODEL = "fake-model"


def raise_nofile() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (thousands of sockets); returns the new soft."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ============================================================================ load client


class ClientState:
    """Counters of one client process; only what happens inside the window is recorded."""

    def __init__(self) -> None:
        self.stop = False
        self.recording = False
        self.inflight = 0
        self.connections = 0
        self.tokens = 0
        self.chunks = 0
        self.reads = 0  # socket reads of a response body (HTTP)
        self.requests = 0
        self.errors: Counter[str] = Counter()
        self.ttft = array("d")
        self.gaps = array("d")
        self.added = array("d")  # --probe: per token, SSE read − NATS read (s)
        # --probe: read times of each stream's delta frames from NATS, by request id (bytes).
        self.nats_seen: dict[bytes, list[float]] = {}
        # --probe: per frame, how many delta frames came in the same socket read (a burst).
        self.burst = array("d")
        self.held: list[int] = []
        self.probing = False
        self.started = 0  # slots that have sent their first request
        self.first_done = 0  # slots whose first request has ended
        self.streams = 0
        self.all_started = asyncio.Event()
        self.all_first_done = asyncio.Event()
        # Whole requests that ended (in the window or not): tokens by usage, content chunks read.
        self.done_tokens = 0
        self.done_chunks = 0

    def slot_started(self) -> None:
        self.started += 1
        if self.started >= self.streams:
            self.all_started.set()

    def request_ended(self, first: bool) -> None:
        if first:
            self.first_done += 1
            if self.first_done >= self.streams:
                self.all_first_done.set()

    def finished(self, tokens: int, chunks: int) -> None:
        self.done_tokens += tokens
        self.done_chunks += chunks
        if self.recording and not self.stop:
            self.requests += 1
            self.tokens += tokens

    def error(self, what: str) -> None:
        if self.recording and not self.stop:
            self.errors[what] += 1

    def match(self, rid: bytes, sse: list[float]) -> None:
        """--probe: a request ended; its content chunks' read times against its frames'."""
        seen = self.nats_seen.pop(rid, None)
        if seen is not None and self.recording:
            self.added.extend(b - a for a, b in zip(seen, sse, strict=False))

    def chunk(self, now: float, last: float, t0: float) -> None:
        """A content chunk read at ``now`` (the stream's previous one at ``last``, 0: none;
        its request sent at ``t0``): a gap, or the TTFT when it is the first."""
        if self.recording:
            self.chunks += 1
            if last:
                self.gaps.append(now - last)
            else:
                self.ttft.append(now - t0)


def chat_body(i: int, max_tokens: int) -> bytes:
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"Write a haiku about the number {i}."}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        },
        separators=(",", ":"),
    ).encode()


_CONTENT_LENGTH = re.compile(rb"content-length:\s*(\d+)")
_REQUEST_ID = re.compile(rb"x-request-id:\s*(\S+)")


async def http_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes, st: ClientState
) -> bool:
    """One streamed completion on an open connection; returns whether it may be reused."""
    perf = time.perf_counter
    t0 = perf()
    writer.write(raw)
    buf = b""
    while (i := buf.find(b"\r\n\r\n")) < 0:
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("closed before the response head")
        buf += data
    head = buf[:i].lower()
    buf = buf[i + 4 :]
    status = int(head[9:12])
    keep = b"connection: close" not in head
    if status != 200:
        m = _CONTENT_LENGTH.search(head)
        n = int(m.group(1)) if m else 0
        while len(buf) < n:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
        code = ""
        with contextlib.suppress(Exception):
            code = json.loads(buf[:n])["error"]["code"]
        st.error(f"{status} {code}".strip())
        await asyncio.sleep(0.05)  # refused: do not spin
        return keep
    now = perf()
    last = 0.0
    usage = chunks = 0
    probe = st.probing
    rid = b""
    sse: list[float] = []
    if probe:
        m = _REQUEST_ID.search(head)
        rid = m.group(1) if m else b""
    while True:
        pos, n = 0, len(buf)
        while (j := buf.find(b"\r\n", pos)) >= 0:
            size = int(buf[pos:j], 16)
            if size == 0:  # the last chunk: the response is over
                st.finished(usage, chunks)
                if probe:
                    st.match(rid, sse)
                return keep
            end = j + 2 + size
            if n < end + 2:
                break
            for ev in buf[j + 2 : end].split(b"\n\n"):
                if b'"finish_reason":null' in ev:  # a content chunk (one token from the fake)
                    chunks += 1
                    st.chunk(now, last, t0)
                    last = now
                    if probe:
                        sse.append(now)
                elif ev.startswith(b'data: {"error"'):
                    code = "stream_error"
                    with contextlib.suppress(Exception):
                        code = "stream " + json.loads(ev[6:])["error"]["code"]
                    st.error(code)
                elif b'"usage":{' in ev:
                    usage = json.loads(ev[6:])["usage"]["completion_tokens"]
            pos = end + 2
        buf = buf[pos:]
        data = await reader.read(65536)
        if not data:
            raise ConnectionError("closed mid-stream")
        now = perf()
        if st.recording:
            st.reads += 1
        buf += data


async def nats_probe(url: str, subject: str, st: ClientState) -> None:
    """--probe: every stream frame straight from nats-server, as the gateway gets it. Raw NATS
    protocol (INFO, CONNECT, SUB, MSG/HMSG, PING/PONG) parsed by hand: nats-py would cost this
    process tens of µs a frame, which at 10k frames/s would load the machine the bench measures.
    Records each delta frame's read time under its request id."""
    host, port = url.split("://", 1)[-1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    await reader.readline()  # INFO {...}
    writer.write(
        b'CONNECT {"verbose":false,"pedantic":false,"headers":true}\r\n'
        + f"SUB {subject} 1\r\nPING\r\n".encode()
    )
    seen = st.nats_seen
    perf = time.perf_counter
    buf = b""
    while not st.stop:
        data = await reader.read(1 << 20)
        if not data:
            raise ConnectionError("nats-server closed the probe's connection")
        now = perf()
        buf += data
        pos, n = 0, len(buf)
        frames = 0
        while (j := buf.find(b"\r\n", pos)) >= 0:
            if buf.startswith(b"MSG ", pos) or buf.startswith(b"HMSG ", pos):
                parts = buf[pos:j].split()
                end = j + 2 + int(parts[-1])
                if n < end + 2:
                    break
                if buf.find(b'"type":"delta"', j, end) >= 0:
                    rid = parts[1].rsplit(b".", 1)[1]  # <prefix>.reply.<gateway>.<rid>
                    if (times := seen.get(rid)) is None:
                        seen[rid] = times = []
                    times.append(now)
                    frames += 1
                pos = end + 2
            else:
                if buf.startswith(b"PING", pos):
                    writer.write(b"PONG\r\n")
                pos = j + 2
        buf = buf[pos:]
        if st.recording and frames:
            st.burst.extend([frames] * frames)
    writer.close()


async def http_slot(i: int, host: str, port: int, delay: float, m: int, st: ClientState) -> None:
    body = chat_body(i, m)
    raw = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    await asyncio.sleep(delay)
    writer: asyncio.StreamWriter | None = None
    first = first_request = True
    try:
        while not st.stop:
            if writer is None:
                try:
                    reader, writer = await asyncio.open_connection(host, port)
                    st.connections += 1
                except OSError as e:
                    st.error(f"connect {type(e).__name__}")
                    await asyncio.sleep(0.5)
                    continue
            if first:
                st.slot_started()
                first = False
            st.inflight += 1
            try:
                keep = await http_request(reader, writer, raw, st)
            except (OSError, ValueError, asyncio.IncompleteReadError) as e:
                st.error(f"conn {type(e).__name__}")
                keep = False
            finally:
                st.inflight -= 1
                st.request_ended(first_request)
                first_request = False
            if not keep:
                writer.transport.abort()
                writer = None
                st.connections -= 1
    finally:
        if writer is not None:
            writer.transport.abort()


async def nats_slot(client: Any, i: int, delay: float, m: int, st: ClientState) -> None:
    from libs.client import StraitError

    prompt = f"Write a haiku about the number {i}."
    perf = time.perf_counter
    await asyncio.sleep(delay)
    st.slot_started()
    first_request = True
    while not st.stop:
        t0 = perf()
        last = 0.0
        chunks = 0
        st.inflight += 1
        try:
            gen = client.generate(
                messages=[{"role": "user", "content": prompt}],
                model=MODEL,
                max_tokens=m,
                ignore_eos=True,
            )
            async with gen:
                async for _d in gen:
                    now = perf()
                    chunks += 1
                    st.chunk(now, last, t0)
                    last = now
            if gen.usage is not None:
                st.finished(gen.usage.completion_tokens, chunks)
        except StraitError as e:
            st.error(e.code or type(e).__name__)
            await asyncio.sleep(0.05)
        finally:
            st.inflight -= 1
            st.request_ended(first_request)
            first_request = False


async def client_main(args: argparse.Namespace) -> None:
    raise_nofile()
    st = ClientState()
    s, m = args.streams[0], args.max_tokens
    st.streams = s
    targets = args.targets.split(",")
    ramp = args.ramp
    nats_client = None
    probe_task = None
    if args.client == "http" and args.probe_nats:
        st.probing = True
        probe_task = asyncio.create_task(nats_probe(args.probe_nats, args.probe_subject, st))
    if args.client == "http":
        hosts = [t.removeprefix("http://").rsplit(":", 1) for t in targets]
        tasks = [
            asyncio.create_task(
                http_slot(
                    i, hosts[i % len(hosts)][0], int(hosts[i % len(hosts)][1]), ramp * i / s, m, st
                )
            )
            for i in range(s)
        ]
    else:
        from libs.client import StraitClient

        nats_client = StraitClient(targets[0], name="gateway-load-bench")
        await nats_client.connect()
        tasks = [
            asyncio.create_task(nats_slot(nats_client, i, ramp * i / s, m, st)) for i in range(s)
        ]
    t_begin = time.perf_counter()
    await asyncio.sleep(ramp)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(st.all_started.wait(), 30)
    # Past the first wave (all S requests started together), then the warm-up proper.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(st.all_first_done.wait(), args.first_wave_max)
    warm = time.perf_counter() - t_begin
    await asyncio.sleep(args.warmup)

    st.recording = True
    cpu0, t0 = time.process_time(), time.perf_counter()
    print("WINDOW_START", flush=True)

    async def sample() -> None:
        while True:
            st.held.append(st.inflight)
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample())
    await asyncio.sleep(args.duration)
    st.recording = False
    took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    print("WINDOW_END", flush=True)
    sampler.cancel()
    # Keep the load on until the orchestrator has read the gateways' counters and CPU times.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.to_thread(sys.stdin.readline), 60)
    st.stop = True
    for t in [*tasks, *([probe_task] if probe_task else [])]:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if nats_client is not None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nats_client.close(), 10)
    ms = 1000.0
    ratio = st.done_tokens / st.done_chunks if st.done_chunks else 1.0
    res = {
        "kind": args.client,
        "streams": s,
        "window_s": took,
        "held_mean": sum(st.held) / len(st.held) if st.held else 0,
        "held_min": min(st.held) if st.held else 0,
        "tokens": st.tokens,
        "chunks": st.chunks,
        "requests": st.requests,
        # Tokens delivered in the window: content chunks read in it x tokens per chunk (from
        # the usage of whole requests). Not "usage of the requests that ended in the window",
        # which undercounts while slow streams are still in their first wave.
        "tokens_per_chunk": ratio,
        "tokens_per_s": st.chunks * ratio / took,
        "usage_tokens_per_s": st.tokens / took,
        "chunks_per_s": st.chunks / took,
        "first_wave_s": warm,
        "chunks_per_read": st.chunks / st.reads if st.reads else None,
        "req_per_s": st.requests / took,
        "ttft_ms": [(nearest_rank(st.ttft, q) or 0) * ms for q in (0.5, 0.99)],
        "gap_ms": [(nearest_rank(st.gaps, q) or 0) * ms for q in (0.5, 0.99)],
        "added_ms": [(nearest_rank(st.added, q) or 0) * ms for q in (0.5, 0.99, 0.999)]
        if st.added
        else None,
        "added_n": len(st.added),
        "burst": [nearest_rank(st.burst, q) for q in (0.5, 0.99)] if st.burst else None,
        "errors": dict(st.errors),
        "client_cpu_pct": 100 * cpu / took,
    }
    print("RESULT " + json.dumps(res), flush=True)


# ============================================================================ the fleet


# Every capacity bound far above a load bench's (and auth, cache off): the fleet's limits
# never shape what a FAKE-engine bench measures. bench/chaos/ uses it too.
UNBOUNDED = 1_000_000
UNBOUNDED_GATEWAY = f"""
[gateway]
auth_enabled = false
open_metrics = true
response_cache_enabled = false
max_inflight = {UNBOUNDED}
shed_queue_depth = {UNBOUNDED}
default_rpm = {10**12}
default_tpm = {10**15}
"""


def config_toml(args: argparse.Namespace) -> str:
    big = UNBOUNDED
    return f"""{UNBOUNDED_GATEWAY}ledger_enabled = false

[router]
max_pool_queue = {big}
max_watched = {big}

[worker]
max_waiting = {big}

[engine]
max_num_seqs = {big}

[fake_engine]
per_token_s = {args.per_token_ms / 1000}
per_prompt_token_s = 0.0

[[pools]]
name = "default"
model = "{MODEL}"
backend = "fake"
workers = {args.workers}
"""


def start_fleet(tmp: Path, nats_url: str, args: argparse.Namespace, gateways: int) -> Any:
    """A ProcessFleet (router, workers, first gateway) plus gateways 2..G on ports of their own."""
    from bench.support.procs import ProcessFleet
    from bench.support.services import free_port, wait_gateway

    fleet = ProcessFleet(
        tmp, nats_url, config_toml(args), workers=[{} for _ in range(args.workers)]
    )
    fleet.__enter__()
    try:
        urls = [fleet.base_url]
        for j in range(1, gateways):
            port = free_port()
            fleet.start(f"gateway{j}", "gateway", {"STRAIT_GATEWAY__PORT": str(port)})
            urls.append(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 60
        for url in urls:  # every gateway sees every worker
            wait_gateway(url, args.workers, deadline, f"gateway {url} not ready")
    except BaseException:
        fleet.__exit__(None, None, None)
        raise
    return fleet, urls


def pin(gateways: list[Any], rest: list[Any]) -> None:
    """The gateways on the last CPU, ``rest`` (psutil processes, threads included) on the
    others: what the gateway adds per token, without waiting for a core behind the fleet."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin-gateway needs two CPUs")
    for procs, mask in ((gateways, cpus[-1:]), (rest, cpus[:-1])):
        for p in procs:
            for t in p.threads():  # sched_setaffinity binds one thread: every one of them
                os.sched_setaffinity(t.id, mask)


def gateway_procs(fleet: Any) -> list[Any]:
    return [p for n, p in fleet.procs.items() if n.startswith("gateway")]


# ---------------------------------------------------------------- the gateways' /metrics


def scrape(url: str) -> dict[str, Any]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {"requests": Counter(), "rejected": Counter(), "ttft": {}, "e2e": {}}
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return out
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            name, labels, v = smp.name, smp.labels, smp.value
            if name == "strait_gateway_output_tokens_total":
                out["tokens"] = v
            elif name == "strait_gateway_requests_total":
                out["requests"][labels["status"]] += v
            elif name == "strait_gateway_rejected_total":
                out["rejected"][labels["code"]] += v
            elif name == "strait_gateway_inflight_requests":
                out["inflight"] = v
            elif name == "strait_gateway_ttft_seconds_bucket":
                out["ttft"][float(labels["le"])] = v
            elif name == "strait_gateway_e2e_seconds_bucket":
                out["e2e"][float(labels["le"])] = v
            elif name == "process_cpu_seconds_total":
                out["cpu_s"] = v
    return out


def hist_quantile(b0: dict[float, float], b1: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile over the buckets' increase (linear within a bucket)."""
    bounds = sorted(b1)
    counts = [b1[b] - b0.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    rank, prev_b, prev_c = q * counts[-1], 0.0, 0.0
    for b, c in zip(bounds, counts, strict=True):
        if c >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0)
        prev_b, prev_c = b, c
    return None


def metrics_delta(m0: dict[str, Any], m1: dict[str, Any], took: float) -> dict[str, Any]:
    req = {k: m1["requests"][k] - m0["requests"].get(k, 0) for k in m1["requests"]}
    rej = {k: m1["rejected"][k] - m0["rejected"].get(k, 0) for k in m1["rejected"]}
    ttft = [hist_quantile(m0["ttft"], m1["ttft"], q) for q in (0.5, 0.99)]
    e2e = [hist_quantile(m0["e2e"], m1["e2e"], q) for q in (0.5, 0.99)]
    return {
        "tokens_per_s": (m1.get("tokens", 0) - m0.get("tokens", 0)) / took,
        "requests": {k: v for k, v in req.items() if v},
        "rejected": {k: v for k, v in rej.items() if v},
        "ttft_ms": [None if x is None else 1000 * x for x in ttft],
        "e2e_ms": [None if x is None else 1000 * x for x in e2e],
        "inflight_end": m1.get("inflight"),
        "cpu_pct": 100 * (m1.get("cpu_s", 0) - m0.get("cpu_s", 0)) / took,
    }


# ---------------------------------------------------------------- one point


def cpu_s(proc: Any) -> float:
    try:
        t = proc.cpu_times()
        return float(t.user + t.system)
    except Exception:
        return 0.0


def run_point(
    kind: str,
    targets: list[str],
    streams: int,
    args: argparse.Namespace,
    fleet: Any,
    gw_urls: list[str],
    log_dir: Path,
    nats_url: str,
) -> dict[str, Any]:
    import psutil

    cmd = [
        sys.executable, "-m", "bench.gateway_load", "--client", kind,
        "--targets", ",".join(targets), "--streams", str(streams),
        "--max-tokens", str(args.max_tokens), "--duration", str(args.duration),
        "--warmup", str(args.warmup), "--ramp", str(args.ramp),
        "--first-wave-max", str(args.first_wave_max),
    ]  # fmt: skip
    if args.probe and kind == "http":
        from libs.protocol import Subjects
        from libs.settings import Settings

        # Every gateway's replies (Subjects.reply_streams): <prefix>.reply.<gateway>.<rid>.
        cmd += ["--probe-nats", nats_url, "--probe-subject",
                Subjects(Settings().nats.subject_prefix).reply_streams("*")]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    err = open(log_dir / f"client-{kind}-{len(targets)}-{streams}.log", "wb")
    client = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True
    )
    gw = [psutil.Process(p.pid) for p in gateway_procs(fleet)]
    others = {
        "router": [psutil.Process(fleet.procs["router"].pid)],
        "workers": [psutil.Process(p.pid) for n, p in fleet.procs.items() if n.startswith("worker")],
        "nats": [
            c for c in psutil.Process().children() if "nats-server" in (c.name() or "")
        ],
    }  # fmt: skip
    if args.pin_gateway:
        pin(gw, [psutil.Process(client.pid), *(p for ps in others.values() for p in ps)])
    res: dict[str, Any] = {}
    c0: dict[str, Any] = {}
    m0: list[dict[str, Any]] = []
    t0 = 0.0
    assert client.stdout is not None
    for line in client.stdout:
        if line.startswith("WINDOW_START"):
            t0 = time.monotonic()
            c0 = {"gw": [cpu_s(p) for p in gw]}
            c0 |= {k: sum(cpu_s(p) for p in ps) for k, ps in others.items()}
            m0 = [scrape(u) for u in gw_urls] if kind == "http" else []
        elif line.startswith("WINDOW_END"):
            took = time.monotonic() - t0
            res["gateway_cpu_pct"] = [
                100 * (cpu_s(p) - a) / took for p, a in zip(gw, c0["gw"], strict=True)
            ]
            res["other_cpu_pct"] = {
                k: 100 * (sum(cpu_s(p) for p in ps) - c0[k]) / took for k, ps in others.items()
            }
            if kind == "http":
                m1 = [scrape(u) for u in gw_urls]
                res["gateway_metrics"] = [
                    metrics_delta(a, b, took) for a, b in zip(m0, m1, strict=True)
                ]
            assert client.stdin is not None
            client.stdin.write("go\n")
            client.stdin.close()
        elif line.startswith("RESULT "):
            res |= json.loads(line[7:])
    client.wait()
    err.close()
    if "tokens_per_s" not in res:
        raise RuntimeError(f"client failed (see {err.name}):\n{Path(err.name).read_text()[-3000:]}")
    settle(gw_urls)
    return res


def settle(gw_urls: list[str], timeout: float = 30.0) -> None:
    """Wait until no gateway holds a request (the client's disconnects were all closed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((scrape(u).get("inflight") or 0) == 0 for u in gw_urls):
            break
        time.sleep(0.5)
    time.sleep(1.0)


# ---------------------------------------------------------------- tables


def fmt_pair(x: list[float | None]) -> str:
    return " / ".join("–" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}" for v in x)


def fmt_errors(e: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(e.items())) or "0"


def print_tables(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\nmax_tokens {args.max_tokens}, {args.workers} FAKE workers "
        f"(per_token {args.per_token_ms} ms); each window {args.duration:g} s, opened after a "
        f"{args.ramp:g} s ramp, every stream's first request, and {args.warmup:g} s more; "
        "CPU in % of one core\n"
    )
    print(
        "| path | gateways | streams | held (mean / min) | tokens/s | req/s | TTFT p50 / p99 ms "
        "| gap p50 / p99 ms | errors | gateway CPU % | client CPU % | router / workers / nats CPU % |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        o = r["other_cpu_pct"]
        gw = " / ".join(f"{x:.0f}" for x in r["gateway_cpu_pct"])
        path = "HTTP (gateway)" if r["kind"] == "http" else "NATS (StraitClient)"
        print(
            f"| {path} | {r['gateways'] if r['kind'] == 'http' else '–'} | {r['streams']} "
            f"| {r['held_mean']:.0f} / {r['held_min']} | {r['tokens_per_s']:.0f} "
            f"| {r['req_per_s']:.1f} | {fmt_pair(r['ttft_ms'])} | {fmt_pair(r['gap_ms'])} "
            f"| {fmt_errors(r['errors'])} | {gw if r['kind'] == 'http' else '(idle)'} "
            f"| {r['client_cpu_pct']:.0f} "
            f"| {o['router']:.0f} / {o['workers']:.0f} / {o['nats']:.0f} |"
        )
    http = [r for r in rows if r["kind"] == "http"]
    if not http:
        return
    probed = [r for r in http if r.get("added_ms")]
    if probed:
        print(
            "\nWhat the gateway adds per token (--probe: SSE chunk read − the same frame read "
            "from nats-server, in the client):\n"
        )
        print(
            "| gateways | streams | tokens/s | tokens matched | added p50 / p99 / p99.9 ms "
            "| frames per NATS read p50 / p99 |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in probed:
            a, b = r["added_ms"], r.get("burst") or [0, 0]
            print(
                f"| {r['gateways']} | {r['streams']} | {r['tokens_per_s']:.0f} | {r['added_n']} "
                f"| {a[0]:.2f} / {a[1]:.2f} / {a[2]:.2f} | {b[0]:.0f} / {b[1]:.0f} |"
            )
    print("\nThe gateways' own /metrics over the same window (histogram quantiles, bucketed):\n")
    print(
        "| gateways | streams | gateway | output tokens/s | requests by status "
        "| rejected | TTFT p50 / p99 ms | e2e p50 / p99 ms | in flight at the end |"
    )
    print("| ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: |")
    for r in http:
        for j, g in enumerate(r["gateway_metrics"]):
            reqs = ", ".join(f"{k} {v:.0f}" for k, v in sorted(g["requests"].items()))
            print(
                f"| {r['gateways']} | {r['streams']} | {j + 1} | {g['tokens_per_s']:.0f} "
                f"| {reqs or '0'} | {fmt_errors({k: int(v) for k, v in g['rejected'].items()})} "
                f"| {fmt_pair(g['ttft_ms'])} | {fmt_pair(g['e2e_ms'])} "
                f"| {g['inflight_end'] or 0:.0f} |"
            )


# ---------------------------------------------------------------- orchestration


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from bench.support.services import nats_server

    raise_nofile()  # inherited by every process started below
    rows: list[dict[str, Any]] = []
    keep = Path(args.logs) if args.logs else None
    with tempfile.TemporaryDirectory(prefix="gateway-load-") as d:
        tmp = keep or Path(d)
        tmp.mkdir(parents=True, exist_ok=True)
        with nats_server(tmp) as nats_url:
            for n, g in enumerate(args.gateways):
                fleet_dir = tmp / f"fleet-g{g}-{n}"
                fleet, urls = start_fleet(fleet_dir, nats_url, args, g)
                try:
                    for s in args.streams:
                        print(f"HTTP: {g} gateway(s), {s} streams ...", file=sys.stderr)
                        r = run_point("http", urls, s, args, fleet, urls, fleet_dir, nats_url)
                        rows.append(r | {"gateways": g})
                        print(json.dumps(rows[-1]), file=sys.stderr)
                    if n == 0 and not args.no_nats:
                        for s in args.streams:
                            print(f"NATS: {s} streams ...", file=sys.stderr)
                            r = run_point(
                                "nats", [nats_url], s, args, fleet, urls, fleet_dir, nats_url
                            )
                            rows.append(r | {"gateways": 0})
                            print(json.dumps(rows[-1]), file=sys.stderr)
                except BaseException:
                    for name in fleet.procs:
                        print(fleet.logs(name), file=sys.stderr)
                    raise
                finally:
                    fleet.__exit__(None, None, None)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--streams", type=int, nargs="+", default=[500, 1000, 2000])
    p.add_argument("--gateways", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured per point")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--workers", type=int, default=2, help="FAKE workers")
    p.add_argument("--per-token-ms", type=float, default=0.0, help="the fake's cost per token")
    p.add_argument("--ramp", type=float, default=2.0, help="seconds over which streams open")
    p.add_argument(
        "--first-wave-max",
        type=float,
        default=60.0,
        help="after the ramp, wait (at most this long) until every stream's first request ended",
    )
    p.add_argument(
        "--warmup", type=float, default=3.0, help="then this many seconds more, unmeasured"
    )
    p.add_argument("--no-nats", action="store_true", help="skip the NATS-path rows")
    p.add_argument(
        "--pin-gateway",
        action="store_true",
        help="the gateway process on the last CPU, every other process of the bench on the rest",
    )
    p.add_argument(
        "--probe",
        action="store_true",
        help="measure what the gateway adds per token (a raw NATS subscriber in the client)",
    )
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--logs", default="", help="keep the processes' logs in this directory")
    # The load client's own role (started by the benchmark itself).
    p.add_argument("--client", choices=["http", "nats"], help=argparse.SUPPRESS)
    p.add_argument("--targets", default="", help=argparse.SUPPRESS)
    p.add_argument("--probe-nats", default="", help=argparse.SUPPRESS)
    p.add_argument("--probe-subject", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.client:
        asyncio.run(client_main(args))
        return 0
    rows = bench(args)
    print_tables(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
