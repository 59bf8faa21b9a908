"""LoRA adapters through the fleet on a real nats-server, a real engine worker (tiny model):
a request names an adapter in ``model`` (HTTP), the router sends it to the pool that serves
it, an unknown adapter is OpenAI's 404; ``strait adapters`` (``services.adapters.send``) lists,
loads and unloads at run time, and an unload while a request runs on the adapter loses none of
its tokens."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
import torch

from bench.support.fleet import InProcessFleet
from bench.support.tiny_models import save_tiny_model_dir, tiny_model
from libs.db.keys import create_key
from libs.engine.async_engine import AsyncEngineBackend
from libs.engine.lora import CONFIG_FILE, TARGETS, WEIGHTS_FILE
from libs.engine.lora.layers import adaptable_linears
from libs.protocol import AdapterCommand, Subjects
from libs.settings import EngineSettings, Settings
from libs.wire.nats_util import connect
from services.adapters import send

pytestmark = pytest.mark.integration

MAX_TOKENS = 48
REPLY_WAIT_S = 1.0


def write_adapter(directory: Path, name: str, seed: int, rank: int = 4) -> None:
    """A random adapter of the tiny llama on every projection (PEFT's layout)."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (d_in, d_out) in adaptable_linears(tiny_model("llama")).items():
        key = f"base_model.model.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen)
        tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen)
    (directory / name).mkdir(parents=True)
    save_file(tensors, directory / name / WEIGHTS_FILE)
    config: dict[str, object] = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}
    config["target_modules"] = list(TARGETS)
    (directory / name / CONFIG_FILE).write_text(json.dumps(config))


async def stream_tokens(client: httpx.AsyncClient, base: str, model: str, started: asyncio.Event):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "hello river"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage, finish = None, None
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            started.set()
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk["choices"]:
                finish = c.get("finish_reason") or finish
    return usage, finish


def tiny_backend(settings: Settings, tmp_path: Path) -> AsyncEngineBackend:
    """The tiny llama with two LoRA slots of rank 4, pool ``default`` serving ``adapters``."""
    adapters = tmp_path / "adapters"
    settings.pools[0].model = "tiny"
    settings.pools[0].adapters_dir = str(adapters)
    model_dir = save_tiny_model_dir(tmp_path / "tiny")
    engine = EngineSettings(
        block_size=4,
        kv_cache_bytes=8 * 2**20,
        max_model_len=256,
        num_threads=1,
        max_loras=2,
        max_lora_rank=4,
        lora_dir=str(adapters),
    )
    return AsyncEngineBackend(engine, str(model_dir), "tiny")


async def test_adapters_by_name_and_unloaded_while_serving(settings: Settings, tmp_path: Path):
    adapters = tmp_path / "adapters"
    write_adapter(adapters, "alpha", 1)
    write_adapter(adapters, "beta", 2)
    settings.gateway.auth_enabled = False
    backend = tiny_backend(settings, tmp_path)
    subjects = Subjects.of(settings.nats)
    async with InProcessFleet(settings) as fleet:
        await fleet.add_worker("w1", backend=backend, model="tiny")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        nc = await connect(settings.nats, "test-adapters")
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                started = asyncio.Event()
                running = asyncio.create_task(stream_tokens(client, base, "alpha", started))
                await asyncio.wait_for(started.wait(), 30)
                # "alpha" is unloaded while its request streams: the request ends whole.
                [reply] = await send(
                    nc,
                    subjects,
                    "default",
                    AdapterCommand(action="unload", name="alpha"),
                    REPLY_WAIT_S,
                )
                assert reply.ok and reply.loaded == [] and reply.worker_id == "w1"
                usage, finish = await running
                assert finish == "length" and usage["completion_tokens"] == MAX_TOKENS

                r = await client.post(
                    f"{base}/v1/chat/completions",
                    json={"model": "gamma", "messages": [{"role": "user", "content": "hi"}]},
                )
                assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"

            cmd = AdapterCommand(action="load", name="beta")
            [reply] = await send(nc, subjects, "default", cmd, REPLY_WAIT_S)
            assert reply.ok and reply.loaded == ["beta"]
            cmd = AdapterCommand(action="load", name="nope")
            [reply] = await send(nc, subjects, "default", cmd, REPLY_WAIT_S)
            assert not reply.ok and "not found" in reply.error and reply.loaded == ["beta"]
            [reply] = await send(
                nc, subjects, "default", AdapterCommand(action="list"), REPLY_WAIT_S
            )
            assert reply.ok and reply.loaded == ["beta"]
        finally:
            await nc.close()


async def test_admin_http_loads_unloads_and_lists(settings: Settings, tmp_path: Path):
    """``/admin/pools/{pool}/adapters``: admin keys only; load, list and unload reach the
    worker's engine; a refusal is OpenAI-shaped and names what does not fit."""
    adapters = tmp_path / "adapters"
    write_adapter(adapters, "alpha", 1)
    write_adapter(adapters, "wide", 3, rank=8)  # above engine.max_lora_rank = 4
    admin_id, admin_secret = await create_key(settings, "ops")
    _, user_secret = await create_key(settings, "app")
    settings.gateway.admin_keys = [admin_id]
    settings.router.assign_timeout_s = 10.0  # the bound on waiting for replies
    backend = tiny_backend(settings, tmp_path)
    admin = {"Authorization": f"Bearer {admin_secret}"}
    async with InProcessFleet(settings) as fleet:
        await fleet.add_worker("w1", backend=backend, model="tiny")
        base = await fleet.gateway()
        await fleet.wait_workers(1)
        url = f"{base}/admin/pools/default/adapters"
        async with httpx.AsyncClient(timeout=60) as client:
            r = await client.get(url, headers={"Authorization": f"Bearer {user_secret}"})
            assert r.status_code == 403, r.text
            assert r.json()["error"]["code"] == "permission_denied"
            assert (await client.get(url)).status_code == 401

            t0 = time.monotonic()
            r = await client.post(url, json={"name": "alpha"}, headers=admin)
            assert r.status_code == 200, r.text
            # Every live worker answered: no waiting out the bound.
            assert time.monotonic() - t0 < settings.router.assign_timeout_s
            [w] = r.json()["workers"]
            assert w == {"worker_id": "w1", "ok": True, "error": "", "loaded": ["alpha"]}

            r = await client.post(url, json={"name": "wide"}, headers=admin)
            err = r.json()["error"]
            assert r.status_code == 400 and err["code"] == "invalid_request", r.text
            assert "rank" in err["message"] and err["param"] == "name"
            r = await client.post(url, json={"name": "nope"}, headers=admin)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            r = await client.post(url, json={"name": "alpha", "path": "/etc"}, headers=admin)
            assert r.status_code == 400 and r.json()["error"]["param"] == "path", r.text
            r = await client.get(f"{base}/admin/pools/elsewhere/adapters", headers=admin)
            assert r.status_code == 404 and r.json()["error"]["param"] == "pool"

            r = await client.get(url, headers=admin)
            assert r.status_code == 200 and r.json()["workers"][0]["loaded"] == ["alpha"]
            r = await client.delete(f"{url}/alpha", headers=admin)
            assert r.status_code == 200 and r.json()["workers"][0]["loaded"] == [], r.text
            r = await client.delete(f"{url}/alpha", headers=admin)
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
