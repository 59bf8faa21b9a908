"""The benches' smoke tier: every bench module runs once, as a reader runs it
(``python -m bench.NAME``, a process of its own), with the tiniest arguments it takes, and must
exit 0 having printed its figures. What a bench measures is not checked here, only that it still
starts, measures and prints: a changed signature under a bench fails this tier, not a reader's
command.

Three kinds of run:

- ``RUNS``: the bench itself, FAKE engine or tiny random model where the bench allows, the
  default pool's real model where it measures that model (skipped, or failed with ``CI=true``,
  when the model is not prepared: ``make models``);
  The ``heavy`` ones (a minute or more each on 2 cores) and the real-model ones (each loads
  the model: 20-60 s) run in full only with ``STRAIT_BENCH_SMOKE=full``; the default suite
  parses their ``--help``, which keeps this tier to a few minutes;
- ``HELP_ONLY``: benches that need what this machine lacks (a GPU, a model server left running,
  or a run of minutes with no knob to shorten it): their imports and argument parsing
  (``--help``) only;
- ``SHELL_SYNTAX``: the shell scripts, parsed with ``bash -n`` (never run: they build or need
  a GPU).

``test_every_bench_module_has_a_smoke_run`` keeps the lists complete: a new bench module with a
``__main__`` must be added to one of them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.support.procs import ProcessFleet
from bench.support.services import nats_server
from libs.settings import Settings
from tests.support.services import missing

pytestmark = pytest.mark.bench

ROOT = Path(__file__).resolve().parents[2]
# The default pool's model, which the real-model benches load (prepared by `make models`).
REAL_MODEL = "smollm2-135m-instruct"
# Seconds one bench run may take here before it counts as hung (a busy 2-core machine).
RUN_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Run:
    """One bench run: ``args`` (split at spaces) after ``python -m bench.<module>`` (``{tmp}``
    is the test's directory, ``{fake_openai}`` and ``{gateway}`` base URLs of the servers
    below); every regular expression of ``prints`` must match its standard output, and the
    file ``writes`` (under ``{tmp}``), when given, must not be empty: a bench whose figures go
    to a file."""

    module: str
    args: str
    prints: tuple[str, ...]
    real_model: bool = False
    writes: str = ""
    env: dict[str, str] = field(default_factory=dict)
    # A minute or more here even with its tiniest arguments: run in full only with
    # STRAIT_BENCH_SMOKE=full, otherwise its imports and argument parsing (``--help``).
    heavy: bool = False


# The real-model benches compile nothing: a smoke run is not worth torch.compile's minutes.
EAGER = {"STRAIT_ENGINE__COMPILE": "false"}

RUNS = [
    Run(
        "fair_preempt_sim",
        "",
        (r"^fair_preempt=false newcomers= 8: steps to a seat", r"^fair_preempt=true "),
    ),
    # Minutes against a running fleet (flow control's phases).
    Run(
        "fairness",
        "--base-url {gateway} --streams 2 --phase-s 1 --warmup-s 0.5 --tokens 4",
        (r"two floods, weighted",),
        heavy=True,
    ),
    # Ten kill -9 rounds of the real fleet's worker.
    Run("restart", "--rounds 1", (r"served again within 30 s in",), real_model=True, heavy=True),
    # The real model with four LoRA adapters against the base.
    Run("lora_mix", "", (), real_model=True, heavy=True),
    Run(
        "router",
        "--workers 4 --requests 30 --docs 2 --doc-words 40",
        (r"fake word tokenizer +n=30 +p50=",),
    ),
    Run(
        "planner_forecast",
        "--traces steady --methods holt --stride 50",
        (r"\| steady \| holt \| \d+ \| [\d.]+",),
    ),
    Run(
        "planner_sim",
        "--traces burst --policies reactive,forecast --drivers",
        (r"^burst +reactive +0 +[\d.]+% ", r"^burst +forecast +0 +[\d.]+% ", r"^    \{"),
    ),
    Run(
        "traces",
        "steady --duration 5 --out {tmp}/steady.jsonl",
        (),
        writes="steady.jsonl",
    ),
    Run("memory_states", "0.5", (r"GB/s", r"^ +\d+ +[\d.]+ +[\d.]+ +\d+%$")),
    Run("spec_tiny", "--tokens 8 --prompts 2", (r"^ngram +\d+ ", r"^draft +\d+ ")),
    Run(
        "gpu_step",
        "--device cpu --tiny --streams 1 --prompt-tokens 8 --max-tokens 4 --kv-gib 1 --peer --out {tmp}/gpu.json",
        (r"copy bandwidth [\d.]+ GB/s", r"^\| variant \| 1 streams \|"),
        heavy=True,
    ),
    Run(
        "serve",
        "--target fake={fake_openai} --num-requests 4 --concurrency 2 --warmup 0 --max-tokens 8 --out {tmp}/serve --no-progress",
        (r"TTFT p50", r"^results: "),
    ),
    Run(
        "hostile",
        "--url {gateway} --requests 8 --concurrency 4 --max-huge-mb 1",
        (r"^hostile requests: 8 ", r"^PASS$"),
        heavy=True,
    ),
    Run(
        "nats_vs_http",
        # concurrency is also the FAKE workers' capacity: above batch.reserve_slots (8), so the
        # router does not hold the NATS path's batch-priority requests for room.
        "--n 8 --concurrency 16 --workers 1",
        (r"\| NATS \(batch_submit\) \| 8 \|", r"\| HTTP \(/v1/completions\) \| 8 \|"),
    ),
    Run("responses_overhead", "--requests 3", (r"\| chat \| [\d.]+ \|", r"\| responses \|")),
    Run(
        "batch_ttft",
        "--lines 4 --streams 2 --seconds 1 --max-tokens 4 --batch-tokens 4 --batch-inflight 2 "
        "--pairs 2",
        (
            r"\| 1 \| alone \| [\d.]+ → [\d.]+ \| \d+ \|",
            r'"status": "completed"',
            r'^summary: .*"pairs": 2',
        ),
    ),
    Run(
        "batch_ttft",
        "--processes --lines 4 --streams 2 --seconds 1 --max-tokens 4 --batch-tokens 4 "
        "--batch-inflight 2 --pairs 1",
        (
            r"\| 0 \| beside \| [\d.]+ → [\d.]+ \| \d+ \|",
            r'"status": "completed"',
            r'"batch": \[[\d.]+, [\d.]+\]',
        ),
    ),
    Run("security", "--requests 3", (r"request p50 [\d.]+ ms", r"revoke:")),
    Run(
        "gateway_load",
        "--streams 4 --gateways 1 --duration 1 --warmup 0 --ramp 0.2 --workers 1 --max-tokens 4 --no-nats",
        (r"^\| HTTP \(gateway\) \| 1 \| 4 \|",),
    ),
    Run(
        "chaos",
        "--scenarios kill-worker --streams 2 --max-tokens 10 --per-token-s 0.01 --fault-at 0.5 --after 0.5 --nats-every 0",
        (r"\| kill-worker \| 2 \| \d+ \|",),
        heavy=True,
    ),
    Run(
        "regions",
        "--requests 4 --streams 1 --max-tokens 4",
        (r"^\| a's gateway → b's workers \(across the gateway\) \| 2/2 \|", r"^failover: "),
        heavy=True,
    ),
    Run(
        "soak",
        "--minutes 0.05 --streams 2 --every 1",
        (r"^\| t \(s\) \|", r"^requests \d+, completed \d+, failed 0,"),
        heavy=True,
    ),
    Run(
        "restarts",
        "--rounds 1",
        (r'"scenario": "kill-worker"', r'"scenario": "kill-router"'),
        heavy=True,
    ),
    Run(
        "planner_timeline",
        "--calm-s 1 --wave-s 2 --after-s 1 --max-replicas 2 --tokens 4 --calm-rps 2 --wave-rps 4",
        (r"^wave starts at", r"^requests: \d+ sent"),
    ),
    Run(
        "engine",
        # --no-split: the step-split pass asks 64 new tokens a request, more than the KV cache
        # the bench sizes for --max-tokens 4.
        "--concurrency 1 --prompt-tokens 8 --max-tokens 4 --skip-static --skip-one-at-a-time --repeats 1 --no-split --out {tmp}/engine.json",
        (r"^weights: ", r"^concurrency 1: engine"),
        real_model=True,
        env=EAGER,
    ),
    Run(
        "fake_calibration",
        "--rows 1,2 --prompt-tokens 8,16 --tokens 3 --repeats 1",
        (r"^# decode step = ", r"^per_token_s = "),
        real_model=True,
        env=EAGER,
    ),
    Run(
        "quality",
        "--formats none --window 64 --prompts 2 --max-tokens 4 --out {tmp}/quality.json",
        (r"perplexity [\d.]+", r"^wrote "),
        real_model=True,
        env=EAGER,
        heavy=True,
    ),
    Run(
        "structured",
        "--concurrency 2 --max-tokens 8 --repeats 1 --schemas 2 --out {tmp}/structured.json",
        (r"^\| unconstrained \| [\d.]+ \|", r"^\| one JSON schema \|"),
        real_model=True,
        env=EAGER,
        heavy=True,
    ),
    Run(
        "structured_cases",
        "--max-tokens 4",
        (r"^\| case \| rules \|", r"^\| .+ \| \d+ \| \w+ \| `"),
        real_model=True,
        env=EAGER,
    ),
    Run(
        "tail",
        "--scenario chat --targets 0 --streams 2 --requests 2 --max-tokens 4 --compile off",
        (r"^engine.itl_target_ms = 0", r"tok/s +TTFT p50"),
        real_model=True,
    ),
    Run(
        "tail",
        "--scenario batch --targets 60 --rounds 1 --arrivals 2 --streams 2 --requests 2 --batch-rows 2 "
        "--max-tokens 4 --batch-tokens 2 --long-tokens 64 --compile off",
        (
            r"^  one arrival among 2 streams, sharing +: TTFT p50 \d+",
            r"^  round 0: TTFT p99 alone \d+ ms",
            r"^  sharing +2 requests: .* tok/s$",
        ),
        real_model=True,
    ),
    Run(
        "spec_engine",
        "--num-requests 1 --max-tokens 4 --concurrency 1 --compile off",
        (r"^ +1 +\w+ +[\d.]+ ",),
        real_model=True,
    ),
    Run(
        "disagg",
        "--prompt-tokens 16 --reps 1 --streams 1 --stream-tokens 4 --transport-mb 1 --out {tmp}/disagg.json",
        (r"^wrote ",),
        real_model=True,
        env=EAGER,
    ),
]

# module -> why only its imports and argument parsing are checked here.
HELP_ONLY = {
    "hf_server": "a server of transformers' generate on a real model that runs until stopped",
    "autoscaling": "replays whole traces (minutes a run) and has no argument to shorten them",
}
# The shell scripts: parsed, never run (one builds llama.cpp for 10+ minutes, one needs a GPU).
SHELL_SYNTAX = ("llama_server.sh", "gpu_step.sh")


def bench_modules_with_main() -> set[str]:
    """The benches ``python -m bench.NAME`` runs: modules with a main guard, packages with a
    ``__main__``."""
    modules = {
        p.stem
        for p in (ROOT / "bench").glob("*.py")
        if re.search(r'^if __name__ == "__main__":', p.read_text(), re.M)
    }
    return modules | {p.parent.name for p in (ROOT / "bench").glob("*/__main__.py")}


def run_bench(module: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def fake_openai() -> Iterator[str]:
    """The OpenAI-shaped fake of the serving bench's unit tests, served in a thread."""
    import importlib.util
    import threading
    import time

    import uvicorn

    path = ROOT / "tests" / "unit" / "bench" / "bench_fake_openai.py"
    spec = importlib.util.spec_from_file_location("bench_fake_openai", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    server = uvicorn.Server(
        uvicorn.Config(mod.fake_app(), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fleet as processes (router, one FAKE worker, a gateway without auth): what
    ``bench.hostile`` is pointed at."""
    tmp = tmp_path_factory.mktemp("hostile-fleet")
    config = (
        "[gateway]\nauth_enabled = false\n\n[fake_engine]\nper_token_s = 0.005\n\n"
        '[[pools]]\nname = "default"\nmodel = "fake-model"\nbackend = "fake"\n'
    )
    with nats_server(tmp) as url, ProcessFleet(tmp / "fleet", url, config) as fleet:
        yield fleet.base_url


@pytest.mark.parametrize("run", RUNS, ids=[r.module for r in RUNS])
def test_bench_runs_with_tiny_arguments(
    run: Run, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if (run.heavy or run.real_model) and os.environ.get("STRAIT_BENCH_SMOKE") != "full":
        done = run_bench(run.module, ["--help"], {})
        assert done.returncode == 0, done.stderr[-3000:]
        assert "usage:" in done.stdout
        return
    if run.real_model and not (Path(Settings().models.dir) / REAL_MODEL / "config.json").exists():
        missing(f"{REAL_MODEL} under models.dir (make models)")
    urls = {
        name: request.getfixturevalue(name)
        for name in ("fake_openai", "gateway")
        if "{" + name + "}" in run.args
    }
    args = [a.format(tmp=tmp_path, **urls) for a in run.args.split()]
    done = run_bench(run.module, args, run.env)
    assert done.returncode == 0, (
        f"exit {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    )
    for pattern in run.prints:
        assert re.search(pattern, done.stdout, re.M), (
            f"bench.{run.module} did not print /{pattern}/:\n{done.stdout[-3000:]}"
        )
    if run.writes:
        assert (tmp_path / run.writes).stat().st_size > 0


@pytest.mark.parametrize("module", sorted(HELP_ONLY))
def test_bench_needing_absent_hardware_parses_help_only(module: str) -> None:
    done = run_bench(module, ["--help"], {})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "usage:" in done.stdout


@pytest.mark.parametrize("script", SHELL_SYNTAX)
def test_bench_shell_script_parses_only(script: str) -> None:
    done = subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], capture_output=True)
    assert done.returncode == 0, done.stderr


def test_every_bench_module_has_a_smoke_run() -> None:
    covered = {r.module for r in RUNS} | set(HELP_ONLY)
    assert bench_modules_with_main() == covered
    assert {p.name for p in (ROOT / "bench").glob("*.sh")} == set(SHELL_SYNTAX)
