"""Team credentials, the server configuration they imply, the dev CA, and the router's
per-team admission (libs.security, services.router.teams)."""

from __future__ import annotations

import ssl
import stat
import subprocess
from pathlib import Path

import msgspec
import nkeys
import pytest

from bench.support.services import nats_binary
from libs.flow.ratelimit import reserve_estimate
from libs.protocol import GenerateRequest, SamplingParams, Subjects
from libs.security.server_config import grants, render
from libs.security.teams import TeamError, TeamStore
from libs.security.tls import ensure_dev_tls
from libs.settings import Settings
from services.router.teams import TeamPolicy, TeamRefusal

pytestmark = pytest.mark.unit


def test_a_team_gets_a_usable_nkey_and_revocation_removes_it(tmp_path: Path) -> None:
    store = TeamStore(tmp_path)
    team = store.add("alpha", rpm=5)
    seed = store.seed_file("alpha").read_bytes().strip()
    assert nkeys.from_seed(bytearray(seed)).public_key.decode() == team.public_key
    assert team.public_key.startswith("U")
    assert stat.S_IMODE(store.seed_file("alpha").stat().st_mode) == 0o600
    tf = store.load()
    assert tf.fleet_public_key.startswith("U") and tf.fleet_public_key != team.public_key
    assert [t.name for t in tf.active()] == ["alpha"] and tf.teams[0].rpm == 5
    with pytest.raises(TeamError, match="exists"):
        store.add("alpha")
    for bad in ("Alpha", "a.b", "a*", "", "9lives", "x" * 40):
        with pytest.raises(TeamError, match="must match"):
            store.add(bad)
    store.revoke("alpha")
    assert not store.seed_file("alpha").exists() and store.load().active() == []
    with pytest.raises(TeamError):
        store.revoke("alpha")
    again = store.add("alpha")  # a new key: the old one stays refused
    assert again.public_key != team.public_key


def test_team_subjects_parse_only_their_shapes() -> None:
    s = Subjects("p.v1")
    assert s.team_of("p.v1.requests", "requests") is None
    assert s.team_of("p.v1.requests.alpha", "requests") == "alpha"
    assert s.team_of("p.v1.cancel.r1", "cancel") is None
    assert s.team_of("p.v1.cancel.alpha.r1", "cancel") == "alpha"
    assert s.team_of("p.v1.resend.alpha.r1", "resend") == "alpha"
    # A team's cancel is for the request its subject names, whatever its message says.
    assert s.addressed("p.v1.cancel.alpha.r1", "cancel", "other") == ("alpha", "r1")
    assert s.addressed("p.v1.cancel.r1", "cancel", "named") == (None, "named")
    assert s.addressed("p.v1.resend.r1", "resend") == (None, "r1")
    for bad, kind in (
        ("p.v1.requests.a.b", "requests"),
        ("p.v1.cancel.a.b.c", "cancel"),
        ("p.v1.cancel.BAD.r1", "cancel"),
        ("p.v1.stream.r1", "cancel"),
    ):
        with pytest.raises(ValueError):
            s.team_of(bad, kind)  # type: ignore[arg-type]


def test_the_server_config_grants_each_active_team_exactly_its_four_subjects(
    tmp_path: Path,
) -> None:
    store = TeamStore(tmp_path)
    store.add("alpha")
    store.add("beta")
    store.revoke("beta")
    tf = store.load()
    tls = ensure_dev_tls(tmp_path / "tls", ["127.0.0.1"])
    text = render(
        prefix="p.v1",
        fleet_public_key=tf.fleet_public_key,
        teams=tf.teams,
        listen="127.0.0.1:4333",
        max_payload=1024,
        store_dir=tmp_path / "js",
        tls=tls,
    )
    g = grants("p.v1", "alpha")
    assert [local for _, local in g.services] == ["p.v1.requests", "p.v1.cancel.*", "p.v1.resend.*"]
    assert g.streams == [("p.v1.stream.alpha.*", "p.v1.stream.*")]
    assert g.subscribe == ["p.v1.stream.*", "_INBOX.>"]
    for remote, _ in g.services + g.streams:
        assert text.count(f'"{remote}"') == 2  # exported to alpha, imported by alpha
    assert text.count('accounts: ["TEAM_alpha"]') == 4
    assert "beta" not in text  # a revoked team has no account and no user
    assert tf.get("alpha").public_key in text  # type: ignore[union-attr]
    assert f'cert_file: "{tls.cert}"' in text
    binary = nats_binary()
    if binary is not None:  # the server itself accepts it
        conf = tmp_path / "n.conf"
        conf.write_text(text)
        r = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr


def test_a_staged_team_has_its_account_and_imports_but_no_user(tmp_path: Path) -> None:
    store = TeamStore(tmp_path)
    alpha, beta = store.add("alpha"), store.add("beta")
    tf = store.load()
    kw = {
        "prefix": "p.v1",
        "fleet_public_key": tf.fleet_public_key,
        "teams": tf.teams,
        "listen": "127.0.0.1:4333",
        "max_payload": 1024,
        "store_dir": tmp_path / "js",
        "monitor": "127.0.0.1:8333",
    }
    staged = render(**kw, staged=frozenset({"beta"}))  # type: ignore[arg-type]
    full = render(**kw)  # type: ignore[arg-type]
    assert beta.public_key not in staged and beta.public_key in full
    assert alpha.public_key in staged
    assert '"TEAM_beta": {\n    users: []' in staged  # the account, nobody in it
    for remote, _ in grants("p.v1", "beta").services:  # with every import already
        assert staged.count(f'"{remote}"') == full.count(f'"{remote}"') == 2
    assert 'http: "127.0.0.1:8333"' in staged


def test_the_dev_ca_signs_a_server_certificate_that_verifies_and_is_reused(
    tmp_path: Path,
) -> None:
    files = ensure_dev_tls(tmp_path, ["127.0.0.1", "localhost"])
    ctx = ssl.create_default_context(cafile=str(files.ca))
    ctx.load_verify_locations(cafile=str(files.ca))
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(str(files.cert), str(files.key))  # key matches the certificate
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    before = files.cert.read_bytes()
    assert ensure_dev_tls(tmp_path, ["127.0.0.1"]).cert.read_bytes() == before
    # A host the certificate does not cover: a new one, from the same CA.
    again = ensure_dev_tls(tmp_path, ["127.0.0.1", "strait.example"])
    assert again.cert.read_bytes() != before and again.ca.read_bytes() == files.ca.read_bytes()


def _req(rid: str = "r1", **kw: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid, prompt="x" * 40, sampling=SamplingParams(max_tokens=10), **kw
    )  # type: ignore[arg-type]


def test_the_router_believes_the_subject_not_the_sender(tmp_path: Path) -> None:
    s = Settings(state_dir=str(tmp_path))
    s.nats.subject_prefix = "p.v1"
    policy = TeamPolicy(s)
    forged = _req(team="beta", api_key_id="beta-key", reply_subject="p.v1.stream.beta.r1")
    got = policy.attribute(forged, "p.v1.requests.alpha")
    assert (got.team, got.api_key_id, got.reply_subject) == ("alpha", None, "p.v1.stream.alpha.r1")
    assert got.origin == "alpha" and got.key == "alpha.r1"  # its ids are alpha's own
    # The fleet's own subject (gateway, trusted clients): left as written, but never an origin.
    assert policy.attribute(forged, "p.v1.requests") is forged
    claimed = policy.attribute(_req(origin="alpha"), "p.v1.requests")
    assert claimed.origin is None and claimed.key == "r1"


def test_team_limits_and_revocation_come_from_the_teams_file(tmp_path: Path) -> None:
    s = Settings(state_dir=str(tmp_path))
    s.teams.reload_interval_s = 0.0
    store = TeamStore(s.teams_file.parent)
    store.add("alpha", rpm=2)
    policy = TeamPolicy(s)
    assert policy.admit(_req()) == 0  # no team: nothing to limit
    alpha = _req(team="alpha")
    # max_tokens + the prompt's estimate, as the gateway reserves (libs.flow.ratelimit)
    assert policy.admit(alpha) == reserve_estimate(alpha) == 10 + 40 // 4 + 1
    assert isinstance(policy.admit(alpha), int)
    third = policy.admit(alpha)
    assert isinstance(third, TeamRefusal) and third.code == "rate_limited"
    assert third.retry_after_s is not None and 0 < third.retry_after_s <= 30
    unknown = policy.admit(_req(team="zeta"))  # in no file: the defaults apply
    assert isinstance(unknown, int)
    store.revoke("alpha")
    refused = policy.admit(alpha)
    assert isinstance(refused, TeamRefusal) and refused.code == "permission_denied"
    assert msgspec.json.decode(s.teams_file.read_bytes())["teams"][0]["revoked_at"]


def test_strait_teams_add_list_revoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services import cli

    s = Settings(state_dir=str(tmp_path))
    s.nats.url = "tls://127.0.0.1:4333"
    monkeypatch.setattr(cli, "get_settings", lambda: s)
    assert cli.main(["teams", "add", "alpha", "--rpm", "7"]) == 0
    out = capsys.readouterr().out
    seed = tmp_path / "secure" / "teams" / "alpha.nk"
    assert str(seed) in out and "NATS_NKEY" in out and "no secured server runs now" in out
    conf = (tmp_path / "secure" / "nats.conf").read_text()
    assert '"TEAM_alpha"' in conf and 'listen: "127.0.0.1:4333"' in conf
    assert cli.main(["teams", "add", "alpha"]) == 1  # exists
    assert cli.main(["teams", "list"]) == 0
    listed = [msgspec.json.decode(x) for x in capsys.readouterr().out.splitlines()]
    assert [(t["name"], t["rpm"], t["revoked_at"]) for t in listed] == [("alpha", 7, None)]
    assert cli.main(["teams", "revoke", "alpha"]) == 0
    assert "revoked" in capsys.readouterr().out
    assert '"TEAM_alpha"' not in (tmp_path / "secure" / "nats.conf").read_text()
    assert not seed.exists()
