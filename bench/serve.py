"""Load generator for OpenAI-compatible servers: ``python -m bench.serve`` / ``strait bench serve``.

```
workloads.generate ──> [BenchRequest] ──┐
                                        v
for target in --target:                 run_load (serve_run): closed loop (--concurrency N)
    for load in --rate / --concurrency:     or Poisson arrivals (--rate R), bounded by
        RunResult <─────────────────────    --num-requests and --duration
            │                                 └─ send_request (serve_client): httpx stream,
            v                                    own SSE parser, per-chunk clock readings
summarize_run (serve_report, stats) ──> comparison table, results.json, requests.jsonl,
                                        latency_cdf.png, sweep.png (plots)
```

Targets run one after another with the same requests (same seed), so their numbers compare.
Examples::

    python -m bench.serve --target llama=http://127.0.0.1:8081 --concurrency 8
    python -m bench.serve --target strait=http://127.0.0.1:8000,key=sk-dev \\
        --target llama=http://127.0.0.1:8081 --workload shared-prefix --rate 1,2,4 \\
        --num-requests 100 --slo-ttft-ms 500 --slo-itl-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import ipaddress
import json
import platform
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from bench import traces
from bench.serve_client import Sampling, Target, resolve_model, send_request
from bench.serve_report import comparison_table, latency_samples_ms, summarize_run, write_results
from bench.serve_run import Load, RunOptions, RunResult, run_load
from bench.stats import SLO
from bench.workloads import DEFAULT_PREFIX_WORDS, WORKLOADS, BenchRequest, generate


def _numbers(values: list[str] | None, kind: type[int] | type[float], flag: str) -> list[Any]:
    """Flatten ``--rate 1,2 4`` into ``[1.0, 2.0, 4.0]``."""
    out: list[Any] = []
    for value in values or []:
        for part in value.split(","):
            if part.strip():
                try:
                    out.append(kind(part))
                except ValueError:
                    raise argparse.ArgumentTypeError(f"{flag}: not a number: {part!r}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strait bench serve",
        description="Benchmark OpenAI-compatible streaming endpoints (TTFT, ITL, E2E, goodput).",
    )
    p.add_argument(
        "--target",
        action="append",
        required=True,
        metavar="NAME=URL[,key=K][,model=M][,spec=N]",
        help="server to benchmark; repeat to compare several (run one after another); spec=N "
        "sends Strait's num_speculative_tokens (0: speculation off for these requests); "
        "model=A|B|C names the models in turn, request by request (LoRA adapters mixed)",
    )
    p.add_argument(
        "--worker-metrics",
        action="append",
        default=[],
        metavar="URL",
        help="a Strait worker's /metrics (repeat for each): each run's speculative-decoding "
        "figures (strait_spec_*) are printed after the table",
    )
    p.add_argument("--api", choices=("chat", "completions"), default="chat")
    p.add_argument("--workload", choices=WORKLOADS, default="chat")
    load = p.add_argument_group("load (every run stops at --num-requests or --duration)")
    load.add_argument(
        "--concurrency",
        nargs="+",
        metavar="N",
        help="closed loop with N requests in flight (list: a sweep); with --rate: a cap",
    )
    load.add_argument(
        "--rate",
        nargs="+",
        metavar="R",
        help="open loop, Poisson arrivals of R req/s (list: a sweep)",
    )
    load.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay a trace (JSON lines: t, prompt_tokens, max_tokens; bench/traces/ ships "
        "some, `python -m bench.traces` writes more): each request at its time, with its "
        "prompt length and max_tokens; replaces --rate, --workload and --num-requests "
        "(--concurrency: a cap)",
    )
    load.add_argument("--num-requests", type=int, default=100, help="requests per run")
    load.add_argument("--duration", type=float, default=600.0, help="cap per run, seconds")
    load.add_argument("--request-timeout", type=float, default=120.0, help="seconds")
    load.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="unrecorded requests sent one by one before a target's runs (taken after the "
        "measured ones: none of them repeats a measured request)",
    )
    load.add_argument("--seed", type=int, default=0, help="seeds prompts and arrivals")
    gen = p.add_argument_group("requests")
    gen.add_argument("--max-tokens", type=int, help="override every request's output length")
    gen.add_argument("--prefix-words", type=int, default=DEFAULT_PREFIX_WORDS)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument(
        "--ignore-eos", action="store_true", help="ask for exactly max_tokens (llama.cpp, vLLM)"
    )
    gen.add_argument(
        "--json-schema",
        metavar="answer|PATH",
        help="every request's response_format is this JSON schema: 'answer' (a long answer "
        "string and a confidence) or a schema file; llama-server honours it too",
    )
    slo = p.add_argument_group("SLO for goodput (a request must meet all that are given)")
    slo.add_argument("--slo-ttft-ms", type=float)
    slo.add_argument("--slo-itl-ms", type=float, help="bound on a request's mean token gap")
    slo.add_argument("--slo-e2e-ms", type=float)
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, help="default: bench/results/<UTC timestamp>/")
    out.add_argument("--no-plots", action="store_true")
    out.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--allow-remote", action="store_true", help="allow targets that are not local addresses"
    )
    return p


def is_local_url(url: str) -> bool:
    """Loopback, private-network, ``localhost`` or single-label (container) hosts."""
    host = urlsplit(url).hostname or ""
    if host == "localhost" or host.endswith(".local") or _is_private_ip(host):
        return True
    return bool(host) and "." not in host and ":" not in host


def _is_private_ip(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_link_local


def _redact_key(arg: str) -> str:
    """Hide API keys of ``--target`` specs before they are written to results.json."""
    return ",".join("key=***" if p.startswith("key=") else p for p in arg.split(","))


def _loads(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[Load]:
    try:
        rates = _numbers(args.rate, float, "--rate")
        concurrencies = _numbers(args.concurrency, int, "--concurrency")
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    if rates and len(concurrencies) > 1:
        parser.error("with --rate, --concurrency is one cap, not a list")
    try:
        if rates:
            cap = concurrencies[0] if concurrencies else None
            return [Load(concurrency=cap, rate=r) for r in rates]
        return [Load(concurrency=c) for c in concurrencies or [8]]
    except ValueError as exc:
        parser.error(str(exc))


async def _warm_up(
    client: httpx.AsyncClient,
    target: Target,
    model: str,
    requests: list[BenchRequest],
    options: RunOptions,
    count: int,
) -> None:
    for request in requests[:count]:
        record = await send_request(
            client, target, model, options.api, request, options.sampling, options.request_timeout_s
        )
        if not record.ok:
            print(
                f"warning: warm-up request to {target.name} failed: {record.error}", file=sys.stderr
            )


async def _run_all(
    targets: list[Target],
    loads: list[Load],
    requests: list[BenchRequest],
    options: RunOptions,
    warmup: int,
) -> list[RunResult]:
    """Every target gets the warm-up, then each load in turn. ``requests`` holds
    ``len(loads) * N + warmup`` requests (see :func:`split_requests`): load ``k`` sends its own
    slice, so no request is sent twice to a target and a server's exact-match response cache
    (Strait's gateway has one for greedy requests) cannot answer a measured request."""
    per_load, warm = split_requests(requests, len(loads), warmup)
    runs: list[RunResult] = []
    spec_rows: list[dict[str, Any]] = []
    # One connection per request in flight: a pool smaller than the load would queue requests
    # inside the client and show up as server TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(options.request_timeout_s)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        for target in targets:
            try:
                model = await resolve_model(client, target)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                print(
                    f"warning: {target.name}: cannot list models ({exc}); using 'default'",
                    file=sys.stderr,
                )
                model = "default"
            await _warm_up(client, target, model, warm, options, warmup)
            for load, load_requests in zip(loads, per_load, strict=True):
                before = await spec_counters(client, options.worker_metrics)
                runs.append(await run_load(client, target, model, load_requests, load, options))
                after = await spec_counters(client, options.worker_metrics)
                if options.worker_metrics:
                    spec_rows.append(spec_row(target.name, load.label, before, after))
    if spec_rows:
        print(spec_table(spec_rows))
    return runs


SPEC_SERIES = {
    "proposed": "strait_spec_proposed_tokens_total",
    "accepted": "strait_spec_accepted_tokens_total",
    "verifications": "strait_spec_accepted_length_count",
}


async def spec_counters(client: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    """The workers' speculative-decoding counters summed over every label (0 when absent)."""
    out = dict.fromkeys(SPEC_SERIES, 0.0)
    for url in urls:
        try:
            text = (await client.get(url)).text
        except httpx.HTTPError as exc:
            print(f"warning: {url}: {exc}", file=sys.stderr)
            continue
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            for key, series in SPEC_SERIES.items():
                if name == series:
                    out[key] += float(line.rsplit(" ", 1)[1])
    return out


def spec_row(
    target: str, load: str, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    d = {k: after[k] - before[k] for k in SPEC_SERIES}
    return {
        "target": target,
        "load": load,
        **{k: int(v) for k, v in d.items()},
        "acceptance": d["accepted"] / d["proposed"] if d["proposed"] else None,
        "kept_per_verification": d["accepted"] / d["verifications"] if d["verifications"] else None,
    }


def spec_table(rows: list[dict[str, Any]]) -> str:
    """Speculative decoding during each run, from the workers' counters."""
    lines = [
        "speculative decoding (worker counters over each run):",
        f"{'target':<16} {'load':<10} {'proposed':>9} {'kept':>9} {'rate':>6} {'kept/verify':>11}",
    ]
    for r in rows:
        rate = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        per = f"{r['kept_per_verification']:.2f}" if r["kept_per_verification"] is not None else "-"
        lines.append(
            f"{r['target']:<16} {r['load']:<10} {r['proposed']:>9} {r['accepted']:>9} "
            f"{rate:>6} {per:>11}"
        )
    return "\n".join(lines)


def split_requests(
    requests: list[BenchRequest], num_loads: int, warmup: int
) -> tuple[list[list[BenchRequest]], list[BenchRequest]]:
    """Split ``num_loads * N + warmup`` requests into one slice of ``N`` per load (load 0 gets
    the workload's first ``N``) and the warm-up requests after them."""
    n = (len(requests) - warmup) // num_loads
    per_load = [requests[k * n : (k + 1) * n] for k in range(num_loads)]
    return per_load, requests[num_loads * n : num_loads * n + warmup]


def _write_plots(out_dir: Path, runs: list[RunResult], summaries: list[dict[str, Any]]) -> None:
    from bench import plots  # matplotlib is slow to import; only pay for it when plotting

    series = {f"{run.target} {run.load.label}": latency_samples_ms(run) for run in runs}
    plots.plot_latency_cdfs(series, out_dir / "latency_cdf.png")
    loads = {s["load"] for s in summaries}
    if len(loads) > 1:
        by_rate = all(s["rate"] is not None for s in summaries)
        points = [
            plots.SweepPoint(
                target=s["target"],
                x=s["rate"] if by_rate else s["concurrency"],
                output_tokens_per_s=s["output_token_throughput"],
                requests_per_s=s["request_throughput"],
                ttft_p50_ms=s["ttft_ms"]["p50"],
                ttft_p99_ms=s["ttft_ms"]["p99"],
                goodput_per_s=s["goodput"]["rate_per_s"],
            )
            for s in summaries
        ]
        x_label = "arrival rate (req/s)" if by_rate else "concurrency"
        plots.plot_sweep(points, x_label, out_dir / "sweep.png")


# --json-schema answer: long enough that a 128-token budget is spent inside the answer string.
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "minLength": 200, "maxLength": 1200},
        "confidence": {"enum": ["low", "medium", "high"]},
    },
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


def response_format(spec: str | None) -> dict[str, Any] | None:
    if spec is None:
        return None
    schema = ANSWER_SCHEMA if spec == "answer" else json.loads(Path(spec).read_text())
    return {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        targets = [Target.parse(spec) for spec in args.target]
    except ValueError as exc:
        parser.error(str(exc))
    if len({t.name for t in targets}) != len(targets):
        parser.error("--target names must differ")
    remote = [t.base_url for t in targets if not is_local_url(t.base_url)]
    if remote and not args.allow_remote:
        parser.error(f"not a local address: {', '.join(remote)} (pass --allow-remote)")
    if args.num_requests < 1 or args.duration <= 0 or args.request_timeout <= 0:
        parser.error("--num-requests, --duration and --request-timeout must be positive")
    if args.trace is not None:
        if args.rate or (args.concurrency and len(_numbers(args.concurrency, int, "-c")) > 1):
            parser.error("--trace replays its own arrivals: no --rate, one --concurrency cap")
        try:
            trace = traces.load(args.trace)
        except (OSError, ValueError) as exc:
            parser.error(f"--trace: {exc}")
        if not trace:
            parser.error(f"--trace: {args.trace} has no arrivals")
        cap = _numbers(args.concurrency, int, "--concurrency")
        loads = [
            Load(
                concurrency=cap[0] if cap else None,
                arrivals=tuple(a.t for a in trace),
                trace_name=args.trace.stem,
            )
        ]
        args.num_requests = len(trace)
        args.duration = max(args.duration, trace[-1].t + 1.0)
    else:
        loads = _loads(args, parser)
    slo = SLO(
        ttft_s=args.slo_ttft_ms / 1000 if args.slo_ttft_ms is not None else None,
        itl_s=args.slo_itl_ms / 1000 if args.slo_itl_ms is not None else None,
        e2e_s=args.slo_e2e_ms / 1000 if args.slo_e2e_ms is not None else None,
    )
    options = RunOptions(
        api=args.api,
        sampling=Sampling(
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            response_format=response_format(args.json_schema),
        ),
        duration_s=args.duration,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
        progress=not args.no_progress,
        worker_metrics=list(args.worker_metrics),
    )
    if args.trace is not None:
        # Warm-up requests come after the trace's own (same shape, never repeating one).
        extra = [traces.Arrival(0.0, a.prompt_tokens, a.max_tokens) for a in trace[: args.warmup]]
        requests = traces.bench_requests(trace + extra, args.seed)
    else:
        requests = generate(
            args.workload,
            len(loads) * args.num_requests + args.warmup,
            args.seed,
            max_tokens=args.max_tokens,
            prefix_words=args.prefix_words,
        )
    started = dt.datetime.now(dt.UTC)
    try:
        runs = asyncio.run(_run_all(targets, loads, requests, options, args.warmup))
    except KeyboardInterrupt:
        print("interrupted: no results written", file=sys.stderr)
        return 130

    summaries = [summarize_run(run, slo) for run in runs]
    print(comparison_table(summaries, slo))
    out_dir = args.out or Path("bench/results") / started.strftime("%Y%m%dT%H%M%SZ")
    meta = {
        "started": started.isoformat(),
        "argv": [_redact_key(a) for a in (sys.argv[1:] if argv is None else argv)],
        "workload": f"trace:{args.trace}" if args.trace is not None else args.workload,
        "api": args.api,
        "num_requests": args.num_requests,
        "duration_cap_s": args.duration,
        "seed": args.seed,
        "targets": [{"name": t.name, "url": t.base_url} for t in targets],
        "models": {run.target: run.model for run in runs},
        "python": platform.python_version(),
        "host": platform.node(),
    }
    written = write_results(out_dir, meta, runs, summaries)
    if not args.no_plots:
        _write_plots(out_dir, runs, summaries)
    print(f"results: {out_dir}/ ({', '.join(p.name for p in written)})")
    # A run where nothing succeeded is a failed benchmark (wrong URL, key or model).
    return 1 if any(s["completed"] == 0 for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
