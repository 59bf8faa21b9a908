"""LoRA adapters by name (libs/models/adapters.py): a request's ``model`` naming an adapter goes to
the pool that serves it (from the pool's ``adapters_dir`` or its workers' beats); an unknown
adapter, or another team's, is refused as an unknown model; ``/v1/models`` lists adapters
with their base as ``parent``; the worker runs the adapter only for an adapter's name."""

from __future__ import annotations

import random
from pathlib import Path

import msgspec
import pytest
from fastapi.testclient import TestClient

from libs.models.adapters import ADAPTER_CONFIG
from libs.protocol import GenerateRequest
from libs.security.teams import Team, TeamsFile
from libs.settings import PoolSettings, Settings
from services.gateway.app import create_app
from services.router.decision import Decision, Rejection
from services.router.router import Router
from services.worker.adapters import adapter_of
from tests.unit.router.helpers import beat, registry, request

pytestmark = pytest.mark.unit

SMALL, LARGE = "smollm2-135m-instruct", "gemma3-270m"


def fleet_settings(tmp_path: Path) -> Settings:
    """Two pools; "small" serves the adapters "alpha" and "beta" (directories), "beta" only
    to team acme (teams file)."""
    adapters = tmp_path / "adapters"
    for name in ("alpha", "beta"):
        (adapters / name).mkdir(parents=True)
        (adapters / name / ADAPTER_CONFIG).write_text("{}")
    (adapters / "not-an-adapter").mkdir()  # no config: not listed
    s = Settings()
    s.pools = [
        PoolSettings(name="small", model=SMALL, backend="fake", adapters_dir=str(adapters)),
        PoolSettings(name="large", model=LARGE, backend="fake"),
    ]
    teams = TeamsFile(teams=[Team(name="acme", public_key="U1", adapters=["beta"])])
    s.teams.file = str(tmp_path / "teams.json")
    Path(s.teams.file).write_bytes(msgspec.json.encode(teams))
    return s


def routed(r: Router, req: GenerateRequest) -> Decision | Rejection:
    return r.decide(req)


def test_an_adapter_name_picks_its_pool_and_another_teams_is_unknown(tmp_path: Path) -> None:
    reg = registry(
        beat("s1", pool="small", model=SMALL),
        beat("l1", pool="large", model=LARGE),
    )
    r = Router(None, None, fleet_settings(tmp_path), reg, rng=random.Random(0))  # type: ignore[arg-type]
    d = routed(r, request("hi", model="alpha"))
    assert isinstance(d, Decision) and (d.pool, d.code) == ("small", "explicit_adapter")
    acme = msgspec.structs.replace(request("hi", model="beta"), team="acme")
    d = routed(r, acme)
    assert isinstance(d, Decision) and d.pool == "small"
    for req in (
        request("hi", model="beta"),  # the fleet's own (no team)
        msgspec.structs.replace(request("hi", model="beta"), team="other"),
        request("hi", model="not-an-adapter"),
        request("hi", model="gamma"),
    ):
        rej = routed(r, req)
        assert isinstance(rej, Rejection) and rej.code == "model_not_found", req.model
    # An adapter a worker loaded from elsewhere is routable once its beats announce it.
    loaded = beat("l2", pool="large", model=LARGE)
    loaded.adapters = ["gamma"]
    reg.on_beat(loaded)
    d = routed(r, request("hi", model="gamma"))
    assert isinstance(d, Decision) and d.pool == "large"


def test_models_lists_adapters_with_their_parent_and_404s_unknown_ones(tmp_path: Path) -> None:
    s = fleet_settings(tmp_path)
    s.gateway.auth_enabled = False
    client = TestClient(create_app(s))
    cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
    assert cards["alpha"]["parent"] == SMALL and cards["alpha"]["strait_pool"] == "small"
    assert "beta" in cards and "not-an-adapter" not in cards
    r = client.get("/v1/models/alpha")
    assert r.status_code == 200 and r.json()["parent"] == SMALL
    r = client.get("/v1/models/gamma")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_a_worker_runs_an_adapter_only_for_an_adapters_name() -> None:
    names = (SMALL, f"{SMALL}@gguf+a8")
    for base in ("", "auto", "small", SMALL, f"{SMALL}@gguf+a8"):
        assert adapter_of(base, "small", names) == ""
    assert adapter_of("alpha", "small", names) == "alpha"


def test_placement_prefers_the_worker_holding_the_adapter_weighed_with_load(
    tmp_path: Path,
) -> None:
    s = fleet_settings(tmp_path)

    def placed(busy_holder: int) -> tuple[str, list[str]]:
        holder = beat("s1", pool="small", model=SMALL, running=busy_holder)
        holder.adapters = ["alpha"]
        reg = registry(holder, beat("s2", pool="small", model=SMALL))
        r = Router(None, None, s, reg, rng=random.Random(0))  # type: ignore[arg-type]
        d = routed(r, request("hi", model="alpha"))
        assert isinstance(d, Decision)
        route = d.route(d.ranked[0])
        return route.worker_id, route.factors

    # Idle alike: the worker with the adapter loaded.
    worker, factors = placed(0)
    assert worker == "s1" and "adapter=loaded" in factors
    # 2 of 10 running (load 0.2) still beats reading the adapter (0.5): the holder.
    assert placed(2)[0] == "s1"
    # 8 of 10 running (0.8 > 0.5): the idle worker without it, and the route says so.
    worker, factors = placed(8)
    assert worker == "s2" and "adapter_miss=0.500" in factors
