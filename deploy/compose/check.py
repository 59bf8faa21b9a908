"""`make compose-check`: build the images and run docker-compose.yml end to end on this host.

Stdlib only (run with any Python >= 3.11; no Strait install needed). Stages, one progress line
each: the compose file is accepted by every Compose found (v1 `docker-compose`, v2 `docker
compose`); the infrastructure images are the official ones where they can be pulled, else
stand-ins built from Debian packages (deploy/compose/standins/, through an override file that
changes only image names; Jaeger and Grafana have none and are left out, traces off); `strait:cpu`
is built from the Dockerfile with the pinned CPU torch; then, for the default profile and for
"disaggregated": the stack comes up, a streaming chat goes through the gateway with a key made in
the gateway container, its ledger row is read from PostgreSQL, Prometheus has the workers up and
scraped, a worker is killed and serves again after its restart, and `down -v` removes it all.
The summary prints image sizes, build time, time to a ready stack, first token, restart time.

Environment: COMPOSE_CHECK_PROFILES (default "default,disaggregated"), COMPOSE_CHECK_FILES_PORT
(the host port the build fetches the torch wheel and pip's CA bundle from, default 18756),
COMPOSE_CHECK_TIMEOUT_S (per wait, default 900). Exit status 0 only when every stage passed.
"""

from __future__ import annotations

import functools
import http.client
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STANDINS = ROOT / "deploy" / "compose" / "standins"
OVERRIDE = ROOT / "deploy" / "compose" / "standins.yml"
PROJECT = "strait-check"
BASE_IMAGE = "strait-debian:bookworm"
DEFAULT_BASE = "python:3.11-slim"  # the Dockerfile's BASE_IMAGE default
STRAIT_IMAGE = "strait:cpu"
LABEL = "strait.compose-check=1"  # on every image this script builds (dangling ones pruned)
CPU_INDEX = "https://download.pytorch.org/whl/cpu/"
OFFICIAL = {  # service -> image, as docker-compose.yml names them
    "nats": "nats:2.10-alpine",
    "postgres": "postgres:16",
    "prometheus": "prom/prometheus:v2.54.1",
    "jaeger": "jaegertracing/all-in-one:1.62.0",
    "grafana": "grafana/grafana:11.2.2",
}
NO_STANDIN = ("jaeger", "grafana")  # no Debian package ships them
STRAIT_SERVICES = ("gateway", "router", "worker")
PROFILE_SERVICES = {"default": (), "disaggregated": ("cache", "prefill", "decode")}
# profile -> (model the chat asks for, service killed for the restart check, worker jobs)
PROFILE_CHECKS = {
    "default": ("auto", "worker", ("strait-worker",)),
    "disaggregated": ("disagg", "decode", ("strait-worker", "strait-prefill", "strait-decode")),
}
HOST_PORTS = ("NATS_PORT", "NATS_MONITOR_PORT", "POSTGRES_PORT", "PROMETHEUS_PORT", "GATEWAY_PORT")
TIMEOUT_S = float(os.environ.get("COMPOSE_CHECK_TIMEOUT_S", "900"))
POLL_S = 2.0
T0 = time.monotonic()


class CheckFailed(Exception):
    """A stage did not pass; the message says which and why."""


def say(stage: str, msg: str) -> None:
    print(f"[compose-check {time.monotonic() - T0:7.1f}s] {stage}: {msg}", flush=True)


def sh(*cmd: str, env: dict[str, str] | None = None, check: bool = True, timeout: float = 3600):
    """Run a command, output captured; raise CheckFailed with its tail when it fails."""
    p = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise CheckFailed(f"`{' '.join(cmd)}` exited {p.returncode}:\n{tail}")
    return p


def wait_for(what: str, probe, timeout: float = TIMEOUT_S):
    """Call probe() until it returns a truthy value; its last exception explains a timeout."""
    deadline, last = time.monotonic() + timeout, "no answer"
    while time.monotonic() < deadline:
        try:
            got = probe()
            if got:
                return got
        except (OSError, http.client.HTTPException, CheckFailed, ValueError, KeyError) as e:
            last = str(e)[-500:]
        time.sleep(POLL_S)
    raise CheckFailed(f"{what}: not within {timeout:.0f} s ({last})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reachable(url: str, timeout: float = 10) -> bool:
    try:
        urllib.request.urlopen(url, timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------ compose and images


def compose_commands() -> list[list[str]]:
    """Every Compose this host has: v2 (`docker compose`) first, then v1 (`docker-compose`)."""
    found = []
    for cmd in (["docker", "compose"], ["docker-compose"]):
        try:
            if sh(*cmd, "version", check=False).returncode == 0:
                found.append(cmd)
        except FileNotFoundError:
            continue
    if not found:
        raise CheckFailed("no Compose: install docker-compose (v1) or the compose plugin (v2)")
    return found


def image_present(ref: str, pull: bool) -> bool:
    if sh("docker", "image", "inspect", ref, check=False).returncode == 0:
        return True
    return pull and sh("docker", "pull", "-q", ref, check=False, timeout=600).returncode == 0


def image_size_mb(ref: str) -> float:
    return int(sh("docker", "image", "inspect", "-f", "{{.Size}}", ref).stdout) / 1e6


def debian_base() -> str:
    """A Debian bookworm base image from Debian's packages (mmdebstrap), built once."""
    if image_present(BASE_IMAGE, pull=False):
        return BASE_IMAGE
    say("images", f"{BASE_IMAGE}: mmdebstrap --variant=minbase bookworm, docker import ...")
    with tempfile.TemporaryDirectory() as tmp:
        tar = str(Path(tmp) / "base.tar")
        sh("nice", "mmdebstrap", "--variant=minbase", "bookworm", tar)
        path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        sh(
            "docker",
            "import",
            "--change",
            f"ENV {path}",
            "--change",
            'CMD ["bash"]',
            tar,
            BASE_IMAGE,
        )
    return BASE_IMAGE


def standin_names() -> dict[str, str]:
    """service -> stand-in image, read from the override file (a fixed, simple shape)."""
    names, service = {}, None
    for line in OVERRIDE.read_text().splitlines():
        if m := re.match(r"^  (\w+):\s*$", line):
            service = m.group(1)
        elif (m := re.match(r"^    image:\s*(\S+)\s*$", line)) and service:
            names[service] = m.group(1)
    return names


def write_override(services: list[str], directory: Path) -> Path:
    """The override restricted to the services that need a stand-in here."""
    names = standin_names()
    text = "services:\n" + "".join(f"  {s}:\n    image: {names[s]}\n" for s in services)
    path = directory / "standins.yml"
    path.write_text(text)
    return path


# ------------------------------------------------------------ what the builds fetch from here


class FileServer:
    """Serves a directory on 127.0.0.1 for `docker build --network host`: the CPU torch wheel
    and pip's CA bundle. A fixed port keeps the build args, and so Docker's layer cache,
    the same from run to run."""

    def __init__(self, directory: Path) -> None:
        port = int(os.environ.get("COMPOSE_CHECK_FILES_PORT", "18756"))
        handler = functools.partial(Quiet, directory=str(directory))
        try:
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
        except OSError:  # taken: any port works, the builds only miss the cache
            self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def host_pip_cert() -> Path | None:
    """The CA bundle this host's pip trusts (PIP_CERT or pip config `cert`), if one is set."""
    if os.environ.get("PIP_CERT"):
        return Path(os.environ["PIP_CERT"])
    out = sh(sys.executable, "-m", "pip", "config", "list", check=False).stdout
    m = re.search(r"^[\w:.-]*\.cert='([^']+)'$", out, re.M)
    return Path(m.group(1)) if m else None


def torch_pin() -> str:
    m = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(), re.M)
    if not m:
        raise CheckFailed("Dockerfile: no ARG TORCH_VERSION")
    return m.group(1)


def local_torch_wheel(directory: Path) -> Path:
    """The pinned torch as this host's pip finds it (its find-links / wheelhouse / index), for
    a build that cannot reach the CPU index. Only a CPU wheel is accepted."""
    version = torch_pin()
    sh(
        sys.executable, "-m", "pip", "download", f"torch=={version}", "--no-deps",
        "--only-binary=:all:", "--python-version", "3.11", "-d", str(directory),
    )  # fmt: skip
    wheels = sorted(directory.glob(f"torch-{version}*.whl"))
    if not wheels or "+cpu" not in wheels[0].name:
        raise CheckFailed(f"pip found no CPU build of torch {version}: {wheels} (never CUDA)")
    return wheels[0]


@dataclass
class Build:
    """What every `docker build` here gets: its extra arguments and how long builds took."""

    args: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    used: list[str] = field(default_factory=list)  # the infrastructure services started

    def image(self, tag: str, context: Path, *extra: str) -> None:
        t = time.monotonic()
        say("build", f"{tag} from {context.relative_to(ROOT)}/ ...")
        cmd = ["nice", "docker", "build", "-q", "--label", LABEL, "-t", tag, *self.args, *extra]
        sh(*cmd, str(context))
        self.seconds[tag] = time.monotonic() - t
        say("build", f"{tag}: {self.seconds[tag]:.0f} s, {image_size_mb(tag):.0f} MB")


def build_args(files: Path, server: FileServer) -> list[str]:
    """Every build runs with --network host (it fetches from `server`), and with PIP_CERT_URL
    when this host's pip trusts a CA bundle of its own (a TLS-intercepting proxy)."""
    cert = host_pip_cert()
    if cert is None or not cert.is_file():
        return ["--network", "host"]
    (files / "pip-cert.pem").write_bytes(cert.read_bytes())
    say("build", f"pip in the builds trusts this host's CA bundle ({cert})")
    return ["--network", "host", "--build-arg", f"PIP_CERT_URL={server.url}/pip-cert.pem"]


def check_config(composes: list[list[str]]) -> None:
    for cmd in composes:
        for extra in ([], ["--profile", "disaggregated"], ["-f", str(OVERRIDE)]):
            sh(*cmd, "-f", "docker-compose.yml", *extra, "config", "-q")
        say("config", f"`{' '.join(cmd)} config` accepts docker-compose.yml (+ profile, override)")
    if len(composes) == 1:
        say(
            "config",
            f"only {' '.join(composes[0])} is installed here; the other Compose not checked",
        )


def prepare_images(build: Build, files: Path, server: FileServer) -> tuple[list[str], list[str]]:
    """Official images where pullable, else stand-ins. -> (infrastructure to start, stand-ins)."""
    missing = [s for s, ref in OFFICIAL.items() if not image_present(ref, pull=True)]
    for s in missing:
        if s in NO_STANDIN:
            say(
                "images",
                f"{s}: {OFFICIAL[s]} cannot be pulled and no Debian package ships {s}: left out",
            )
    standins = [s for s in missing if s not in NO_STANDIN]
    base = None
    if standins or not image_present(DEFAULT_BASE, pull=True):
        t = time.monotonic()
        base = debian_base()
        build.seconds[BASE_IMAGE] = time.monotonic() - t
        say("images", f"Debian base {BASE_IMAGE} ready ({build.seconds[BASE_IMAGE]:.0f} s)")
    names = standin_names()
    for s in standins:
        say("images", f"{s}: {OFFICIAL[s]} cannot be pulled: stand-in {names[s]}")
        build.image(names[s], STANDINS / s, "--build-arg", f"BASE_IMAGE={base}")
    extra = [] if base is None else ["--build-arg", f"BASE_IMAGE={base}"]
    if reachable(CPU_INDEX + "torch/"):
        say("images", f"torch {torch_pin()} from {CPU_INDEX}")
    else:
        wheel = local_torch_wheel(files)
        say("images", f"{CPU_INDEX} unreachable: torch from this host's pip ({wheel.name})")
        extra += ["--build-arg", f"TORCH_WHEEL_URL={server.url}/{wheel.name}"]
    build.image(STRAIT_IMAGE, ROOT, *extra)
    infra = [s for s in OFFICIAL if s not in missing or s in standins]
    return infra, standins


# ------------------------------------------------------------------------- the running stack


@dataclass
class Stack:
    """One `up` of docker-compose.yml (+ the stand-in override) under project PROJECT."""

    compose: list[str]
    profile: str
    services: list[str]
    env: dict[str, str]

    @classmethod
    def make(cls, cmd: list[str], profile: str, infra: list[str], override: Path | None) -> Stack:
        files = ["-f", "docker-compose.yml", *(["-f", str(override)] if override else [])]
        prof = ["--profile", profile] if profile != "default" else []
        services = [*infra, *STRAIT_SERVICES, *PROFILE_SERVICES[profile]]
        env = dict(os.environ, **{var: str(free_port()) for var in HOST_PORTS})
        if "jaeger" not in infra:
            env["OTLP_ENDPOINT"] = ""  # no collector: traces off
        return cls([*cmd, *files, "-p", PROJECT, *prof], profile, services, env)

    def run(self, *args: str, timeout: float = 3600):
        return sh(*self.compose, *args, env=self.env, timeout=timeout)

    def url(self, port_var: str) -> str:
        return f"http://127.0.0.1:{self.env[port_var]}"

    def container(self, service: str) -> str:
        cid = self.run("ps", "-q", service).stdout.strip()
        if not cid:
            raise CheckFailed(f"no container for {service}")
        return cid

    def state(self, cid: str) -> dict:
        return json.loads(sh("docker", "inspect", "-f", "{{json .State}}", cid).stdout)

    def ready(self) -> bool:
        """Every service running, and healthy where it has a healthcheck."""
        for service in self.services:
            st = self.state(self.container(service))
            if (
                st["Status"] != "running"
                or st.get("Health", {}).get("Status", "healthy") != "healthy"
            ):
                return False
        return True

    def sql(self, query: str) -> str:
        return self.run(
            "exec", "-T", "postgres", "psql", "-U", "strait", "-d", "strait", "-tAc", query
        ).stdout.strip()


def stream_chat(gateway: str, key: str, model: str) -> tuple[float, str, str]:
    """One streaming chat. -> (seconds to the first content token, the text, X-Request-Id)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in five words."}],
        "stream": True,
        "max_tokens": 16,
        "temperature": 0,
    }
    req = urllib.request.Request(
        gateway + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    t, first, text = time.monotonic(), None, []
    with urllib.request.urlopen(req, timeout=300) as resp:
        request_id = resp.headers.get("X-Request-Id", "")
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise CheckFailed(f"error event: {chunk['error']}")
            for choice in chunk.get("choices", []):
                if piece := (choice.get("delta") or {}).get("content"):
                    first = first if first is not None else time.monotonic() - t
                    text.append(piece)
    if first is None:
        raise CheckFailed("the stream carried no token")
    return first, "".join(text), request_id


def make_key(stack: Stack) -> tuple[str, str]:
    """`strait keys create` in the gateway container. -> (key id, secret)."""
    out = stack.run("exec", "-T", "gateway", "strait", "keys", "create", "compose-check").stdout
    key_id, secret = (
        re.search(r"^id:\s*(\S+)", out, re.M),
        re.search(r"^secret:\s*(\S+)", out, re.M),
    )
    if not (key_id and secret):
        raise CheckFailed(f"strait keys create printed no key: {out!r}")
    return key_id.group(1), secret.group(1)


def ledger_row(stack: Stack, request_id: str, key_id: str) -> str:
    if not re.fullmatch(r"[\w.:-]+", request_id):
        raise CheckFailed(f"no usable X-Request-Id: {request_id!r}")
    query = (
        "select status, pool, prompt_tokens, completion_tokens from requests "
        f"where request_id = '{request_id}' and api_key_id = '{key_id}'"
    )
    row = stack.sql(query)
    if row and int(row.split("|")[3]) <= 0:
        raise CheckFailed(f"ledger row without completion tokens: {row}")
    return row


def prometheus_scrapes(stack: Stack, worker_jobs: tuple[str, ...]) -> str:
    """Every Strait target of the profile up, each worker job scraped with its token counter."""
    prom = stack.url("PROMETHEUS_PORT")
    with urllib.request.urlopen(prom + "/api/v1/targets?state=active", timeout=10) as r:
        targets = json.load(r)["data"]["activeTargets"]
    health = {t["labels"]["job"]: t["health"] for t in targets}
    jobs = ("strait-gateway", "strait-router", *worker_jobs)
    if any(health.get(job) != "up" for job in jobs):
        return ""
    query = urllib.parse.quote("sum by (job) (strait_worker_output_tokens_total)")
    with urllib.request.urlopen(f"{prom}/api/v1/query?query={query}", timeout=10) as r:
        tokens = {x["metric"]["job"]: float(x["value"][1]) for x in json.load(r)["data"]["result"]}
    if set(worker_jobs) - set(tokens) or sum(tokens.values()) <= 0:
        return ""
    return ", ".join(f"{job} up" for job in jobs) + f"; output tokens scraped {tokens}"


def kill_and_recover(stack: Stack, service: str, key: str, model: str) -> float:
    """SIGKILL the service's main process (a crash, which the restart policy answers; `docker
    kill` would count as a manual stop). -> seconds until a chat is served again."""
    cid = stack.container(service)
    st = stack.state(cid)
    restarts = int(sh("docker", "inspect", "-f", "{{.RestartCount}}", cid).stdout)
    t = time.monotonic()
    os.kill(int(st["Pid"]), signal.SIGKILL)
    say(stack.profile, f"killed {service} (pid {st['Pid']}); waiting for its restart")
    wait_for(
        f"{service} restarted",
        lambda: (
            int(sh("docker", "inspect", "-f", "{{.RestartCount}}", cid).stdout) > restarts
            or stack.state(cid)["StartedAt"] != st["StartedAt"]
        ),
        timeout=120,
    )
    wait_for(f"{service} healthy again", stack.ready)
    wait_for("a chat after the restart", lambda: stream_chat(stack.url("GATEWAY_PORT"), key, model))
    return time.monotonic() - t


def run_profile(stack: Stack) -> dict[str, float]:
    """Up, chat, ledger, Prometheus, kill and recover; `down -v` whatever happens."""
    model, victim, worker_jobs = PROFILE_CHECKS[stack.profile]
    name = stack.profile
    t = time.monotonic()
    try:
        say(name, f"up -d {' '.join(stack.services)}")
        stack.run("up", "-d", "--no-build", *stack.services)
        wait_for("the stack healthy", stack.ready)
        ready_s = time.monotonic() - t
        say(name, f"every service healthy after {ready_s:.0f} s")
        key_id, key = make_key(stack)
        say(name, f"key {key_id} made by `strait keys create` in the gateway container")
        first, text, rid = wait_for(
            "a streaming chat", lambda: stream_chat(stack.url("GATEWAY_PORT"), key, model), 300
        )
        say(name, f"model {model!r}: first token {first:.2f} s, {text!r} ({rid})")
        row = wait_for("the ledger row", lambda: ledger_row(stack, rid, key_id), 60)
        say(name, f"ledger row in PostgreSQL (status|pool|prompt|completion): {row}")
        say(
            name,
            wait_for("Prometheus scraping", lambda: prometheus_scrapes(stack, worker_jobs), 120),
        )
        restart_s = kill_and_recover(stack, victim, key, model)
        say(name, f"{victim} restarted and serving {restart_s:.0f} s after the kill")
        return {"ready_s": ready_s, "first_token_s": first, "restart_s": restart_s}
    except CheckFailed:
        print(stack.run("logs", "--no-color", "--tail", "30", timeout=120).stdout[-6000:])
        raise
    finally:
        stack.run("down", "-v", "--remove-orphans", timeout=600)
        say(name, "down -v")


def summary(build: Build, results: dict[str, dict[str, float]], standins: list[str]) -> None:
    print("\n== compose-check summary ==")
    for tag in [*standin_names().values(), STRAIT_IMAGE, BASE_IMAGE]:
        if image_present(tag, pull=False) and (tag == STRAIT_IMAGE or tag in build.seconds):
            print(
                f"image {tag:38s} {image_size_mb(tag):7.0f} MB  built in {build.seconds[tag]:5.0f} s"
            )
    print(
        f"stand-ins for: {', '.join(standins) or 'none'}; left out: "
        f"{', '.join(s for s in NO_STANDIN if s not in build.used) or 'none'}"
    )
    for profile, r in results.items():
        print(
            f"profile {profile:14s} stack ready {r['ready_s']:5.0f} s  first token "
            f"{r['first_token_s']:5.2f} s  restart to serving {r['restart_s']:5.0f} s"
        )


def main() -> int:
    profiles = os.environ.get("COMPOSE_CHECK_PROFILES", "default,disaggregated").split(",")
    build, results, standins = Build(), {}, list[str]()
    try:
        composes = compose_commands()
        check_config(composes)
        with tempfile.TemporaryDirectory() as tmp:
            server = FileServer(Path(tmp))
            try:
                build.args = build_args(Path(tmp), server)
                infra, standins = prepare_images(build, Path(tmp), server)
            finally:
                server.close()
            build.used = infra
            override = write_override(standins, Path(tmp)) if standins else None
            for profile in profiles:
                stack = Stack.make(composes[0], profile, infra, override)
                results[profile] = run_profile(stack)
    except CheckFailed as e:
        say("FAILED", str(e))
        return 1
    finally:
        sh("docker", "image", "prune", "-f", "--filter", f"label={LABEL}", check=False)
    summary(build, results, standins)
    say("passed", f"profiles {', '.join(profiles)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
