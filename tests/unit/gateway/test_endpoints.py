"""``GET /v1/models/{id}`` and the 404 of a ``/v1/...`` path Strait does not serve, through the
real FastAPI app (no fleet: neither needs one)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from libs.settings import Settings
from services.gateway.app import create_app

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def client() -> TestClient:
    s = Settings()
    s.gateway.auth_enabled = False
    return TestClient(create_app(s))


def test_a_model_is_retrieved_by_its_id(client: TestClient) -> None:
    pool = Settings().pools[0]
    for model_id in (pool.name, pool.model, "auto"):
        r = client.get(f"/v1/models/{model_id}")
        assert r.status_code == 200, r.text
        assert r.json()["id"] == model_id and r.json()["object"] == "model"
    r = client.get("/v1/models/gpt-nonexistent")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "gpt-nonexistent" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("method", "path", "code", "named"),
    [
        ("POST", "/v1/embeddings", "endpoint_not_served", "Embeddings"),
        ("GET", "/v1/vector_stores/vs_1/files", "endpoint_not_served", "Vector stores"),
        ("POST", "/v1/chat/completion", "unknown_url", "Invalid URL (POST /v1/chat/completion)"),
    ],
)
def test_an_endpoint_strait_does_not_serve_is_named(
    client: TestClient, method: str, path: str, code: str, named: str
) -> None:
    r = client.request(method, path, json={})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "not_found_error" and err["code"] == code
    assert named in err["message"] and path in err["message"]
