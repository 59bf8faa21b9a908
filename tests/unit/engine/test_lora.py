"""LoRA adapters (libs/engine/lora) on tiny random models, against ``peft`` itself.

- greedy output with an adapter equals ``generate`` of ``peft``'s merged model in float32
  (torch's kernels, Strait's, under torch.compile), and on GGUF blocks the float model
  converted from them with the adapter merged;
- one batch mixing three adapters and the base gives every row its own adapter's tokens, and
  the prefix cache never hands one adapter's blocks to another;
- a bad adapter is refused whole with an error naming what does not fit; slots are bounded,
  evicted least recently used when idle, and an adapter unloaded mid-request finishes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.support.tiny_models import tiny_config, tiny_model
from libs.engine import lora
from libs.engine.engine import LLMEngine
from libs.engine.errors import BackendError
from libs.protocol import SamplingParams
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine
from tests.unit.engine.test_invariance import prompts

pytestmark = [
    pytest.mark.unit,
    # peft 0.21 calls transformers 5's deprecated alias while wrapping a model.
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`:UserWarning"),
]

peft = pytest.importorskip("peft")

MAX_NEW = 10
ALL = list(lora.TARGETS)
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


def make_adapter(
    path: Path, seed: int, *, r: int = 4, targets: list[str] | None = None, **config: Any
) -> torch.nn.Module:
    """A random LoRA (A and B both random: peft's default B = 0 would change nothing) of the
    tiny llama saved to ``path``; returns peft's merged model (the reference)."""
    base = tiny_model("llama")
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(
        r=r,
        lora_alpha=config.pop("lora_alpha", 2 * r),
        target_modules=targets or ALL,
        init_lora_weights=False,
        **config,
    )
    model = peft.get_peft_model(base, cfg)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def serve(engine: LLMEngine, subs: list[Submission], adapters: dict[str, str]) -> dict:
    """``run_engine`` with each submission's adapter (request id → adapter name)."""
    add = engine.add_request

    def with_lora(request_id: str, *args: Any, **kw: Any) -> None:
        add(request_id, *args, lora=adapters.get(request_id, ""), **kw)

    engine.add_request = with_lora  # type: ignore[method-assign]
    try:
        return run_engine(engine, subs)
    finally:
        del engine.add_request


def lora_engine(tmp_path: Path, **kw: Any) -> LLMEngine:
    model = tiny_model("llama")
    defaults: dict[str, Any] = dict(max_loras=3, max_lora_rank=8, lora_dir=str(tmp_path))
    defaults.update(kw)
    return LLMEngine(model, None, engine_settings(model, **defaults), "tiny")


@pytest.mark.parametrize(("cpu_kernels", "compile"), [("off", False), ("on", False), ("on", True)])
def test_one_batch_of_three_adapters_and_the_base_answers_each_rows_own(
    tmp_path: Path, cpu_kernels: str, compile: bool
) -> None:
    """Three adapters (all linears; attention only, rank 8; the MLP only, rsLoRA) and the base
    model, every prompt asked of each, all in the same steps: each row's greedy tokens are
    its own merged model's. The same prompts under different adapters share no KV blocks;
    under the same adapter they do."""
    refs_models = {
        "all": make_adapter(tmp_path / "all", 1),
        "attn": make_adapter(tmp_path / "attn", 2, r=8, targets=["q_proj", "k_proj", "v_proj"]),
        "mlp": make_adapter(
            tmp_path / "mlp", 3, targets=["gate_proj", "up_proj", "down_proj"], use_rslora=True
        ),
        "": tiny_model("llama"),
    }
    ps = prompts()[:4]
    refs = {
        (name, i): reference_greedy(m, p, MAX_NEW)
        for name, m in refs_models.items()
        for i, p in enumerate(ps)
    }
    assert len({tuple(refs[(n, 0)]) for n in refs_models}) == 4  # four different answers
    engine = lora_engine(
        tmp_path,
        cpu_kernels=cpu_kernels,
        compile=compile,
        max_num_seqs=16,
        max_num_batched_tokens=64,
        prefill_chunk_tokens=64,
    )
    assert engine.runner.compiling == compile
    subs, adapters = [], {}
    for i, p in enumerate(ps):
        for name in refs_models:
            rid = f"{name or 'base'}-{i}"
            adapters[rid] = name
            subs.append(Submission(rid, p, GREEDY, arrive_at_step=0 if i < 2 else 3))
    results = serve(engine, subs, adapters)
    for (name, i), ref in refs.items():
        assert results[(f"{name or 'base'}-{i}", 0)].token_ids == ref, (name, i)
    # prompts 0-3 of the tiny set: 0-2 share a 20-token system prompt (5 blocks of 4).
    for name in refs_models:
        # Prompt 2 arrived after prompt 0 of the same adapter had registered its blocks.
        assert results[(f"{name or 'base'}-2", 0)].num_cached_tokens >= 20, name
    # Prompts 0 and 1 of different adapters ran together: none reused another's blocks.
    assert all(results[(f"{n or 'base'}-0", 0)].num_cached_tokens == 0 for n in refs_models)
    assert engine.pool.num_used == 0
    assert (
        engine.loras is not None
        and engine.loras.slots
        and all(loaded.refs == 0 for loaded in engine.loras.slots.values())
    )


def test_an_adapter_on_gguf_blocks_answers_as_the_converted_float_model(tmp_path: Path) -> None:
    """GGUF Q4_1 blocks on Strait's block kernel with float32 activations give the float model
    converted from them (test_quant); with an adapter they give that model with the adapter
    merged by peft."""
    from tests.unit.engine.test_quant import _kernels, write_tiny_gguf

    _kernels()
    model = tiny_model("llama")
    write_tiny_gguf(model, tmp_path / "tiny")  # model now holds the dequantised weights
    torch.manual_seed(4)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False)
    merged_src = tiny_model("llama")
    merged_src.load_state_dict(model.state_dict())
    pm = peft.get_peft_model(merged_src, cfg)
    pm.save_pretrained(tmp_path / "adapters" / "a")
    merged = pm.merge_and_unload().eval()
    ps = prompts()[:3]
    refs = [reference_greedy(merged, p, MAX_NEW) for p in ps]
    from libs.engine import quant
    from libs.settings import EngineSettings

    fmt = EngineSettings(quantization="gguf", cpu_kernels="on", quant_activations="float32")
    assert quant.quantize_model(model, tmp_path / "tiny", fmt).layers == {"gguf-q4_1": 15}
    settings = engine_settings(
        model,
        quantization="gguf",
        cpu_kernels="on",
        quant_activations="float32",
        max_loras=1,
        lora_dir=str(tmp_path / "adapters"),
    )
    engine = LLMEngine(model, None, settings, "tiny")
    subs = [Submission(f"r{i}", p, GREEDY, arrive_at_step=i) for i, p in enumerate(ps)]
    results = serve(engine, subs, {s.request_id: "a" for s in subs})
    assert [results[(s.request_id, 0)].token_ids for s in subs] == refs


def test_bad_adapters_are_refused_whole_naming_what_does_not_fit(tmp_path: Path) -> None:
    make_adapter(tmp_path / "good", 1)
    engine = lora_engine(tmp_path / "none", max_lora_rank=4)
    slots = engine.loras
    assert slots is not None

    def refused(path: Path, match: str) -> None:
        with pytest.raises(lora.AdapterError, match=match):
            slots.load("bad", path)
        assert not slots.slots and not slots.by_name  # nothing kept
        for layer in slots.bank.layers:  # no tensor half-written
            assert not any(
                b.any() for b in layer.buffers(recurse=False) if b is not layer.lora_mask
            )

    make_adapter(tmp_path / "rank", 1, r=8)
    refused(tmp_path / "rank", "rank r = 8 exceeds engine.max_lora_rank = 4")
    make_adapter(tmp_path / "head", 1, targets=["q_proj", "lm_head"])
    refused(tmp_path / "head", "target module 'lm_head' is not served")
    # An adapter of another model's shapes (hidden 32): the first linear's shapes are named.
    other = tiny_config("llama")
    other.hidden_size, other.head_dim = 32, 8
    from transformers import AutoModelForCausalLM

    small = AutoModelForCausalLM.from_config(other)
    peft.get_peft_model(
        small, peft.LoraConfig(r=4, target_modules=ALL, init_lora_weights=False)
    ).save_pretrained(tmp_path / "shapes")
    refused(tmp_path / "shapes", r"shapes A \(4, 32\)")
    # The good adapter with its last tensor cut short: refused with nothing written before it.
    from safetensors.torch import load_file, save_file

    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / lora.CONFIG_FILE).write_text((tmp_path / "good" / lora.CONFIG_FILE).read_text())
    tensors = load_file(tmp_path / "good" / lora.WEIGHTS_FILE)
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last][:, :-1].contiguous()
    save_file(tensors, cut / lora.WEIGHTS_FILE)
    refused(cut, "do not fit the base model")
    config = json.loads((tmp_path / "good" / lora.CONFIG_FILE).read_text())
    for key, value, match in [
        ("base_model_name_or_path", "meta-llama/Llama-3-8B", "base model 'meta-llama"),
        ("use_dora", True, "use_dora"),
        ("peft_type", "IA3", "only LORA"),
    ]:
        bad = tmp_path / f"cfg-{key}"
        bad.mkdir()
        (bad / lora.CONFIG_FILE).write_text(json.dumps({**config, key: value}))
        (bad / lora.WEIGHTS_FILE).write_bytes((tmp_path / "good" / lora.WEIGHTS_FILE).read_bytes())
        refused(bad, match)
    refused(tmp_path / "missing", "no adapter_config.json")
    slots.load("good", tmp_path / "good")  # the good one still goes in
    assert slots.loaded() == ["good"]


def test_unknown_adapter_and_an_engine_without_slots_say_model_not_found(tmp_path: Path) -> None:
    engine = lora_engine(tmp_path)
    with pytest.raises(BackendError) as e:
        engine.add_request("x", [1, 2, 3], GREEDY, lora="nope")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(BackendError) as e:  # never a path out of engine.lora_dir
        engine.add_request("x", [1, 2, 3], GREEDY, lora="../a")
    assert e.value.code == "model_not_found" and "adapter name" in str(e.value)
    make_adapter(tmp_path / "a", 1)
    model = tiny_model("llama")
    plain = LLMEngine(model, None, engine_settings(model, lora_dir=str(tmp_path)), "tiny")
    assert plain.runner.lora is None  # engine.max_loras = 0: the forward untouched
    with pytest.raises(BackendError, match="max_loras = 0") as e:
        plain.add_request("x", [1, 2, 3], GREEDY, lora="a")
    assert e.value.code == "model_not_found"
    assert not engine.requests and not plain.requests


METRICS = ("requests", "output_tokens", "loads", "evictions")


def metric(what: str, adapter: str) -> float:
    """The engine's per-adapter counter ``strait_lora_<what>_total`` (0 before its first use)."""
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(f"strait_lora_{what}_total", {"adapter": adapter})
    return value or 0.0


def test_slots_are_bounded_evicted_lru_when_idle_and_unload_lets_running_requests_finish(
    tmp_path: Path,
) -> None:
    merged = {n: make_adapter(tmp_path / n, seed) for seed, n in enumerate(["a", "b", "c"], 1)}
    p = prompts()[1]
    ref = {n: reference_greedy(m, p, MAX_NEW) for n, m in merged.items()}
    engine = lora_engine(tmp_path, max_loras=2)
    slots = engine.loras
    assert slots is not None
    before = {m: {n: metric(m, n) for n in "abc"} for m in METRICS}
    results = serve(engine, [Submission(n, p, GREEDY) for n in "ab"], {"a": "a", "b": "b"})
    assert slots.loaded() == ["a", "b"] and slots.evictions == 0
    # "a" was used before "b": it goes when "c" needs a slot.
    results |= serve(engine, [Submission("c", p, GREEDY)], {"c": "c"})
    assert slots.loaded() == ["b", "c"] and slots.evictions == 1 and slots.loads == 3
    assert {n: results[(n, 0)].token_ids for n in "abc"} == ref
    grew = {m: {n: metric(m, n) - before[m][n] for n in "abc"} for m in METRICS}
    assert grew == {
        "requests": {"a": 1, "b": 1, "c": 1},
        "output_tokens": {n: MAX_NEW for n in "abc"},
        "loads": {"a": 1, "b": 1, "c": 1},
        "evictions": {"a": 1, "b": 0, "c": 0},
    }

    # Both slots busy: a third adapter waits for none, it is refused as retryable.
    engine.add_request("b1", p, GREEDY, lora="b")
    engine.add_request("c1", p, GREEDY, lora="c")
    with pytest.raises(BackendError) as e:
        engine.add_request("a1", p, GREEDY, lora="a")
    assert e.value.code == "no_capacity" and "engine.max_loras" in str(e.value)
    # "b" unloaded while b1 runs: b1 finishes on it; the slot is cleared after.
    out: dict[str, list[int]] = {"b1": [], "c1": []}
    b_slot = slots.by_name["b"]
    for step in range(100):
        if step == 2:  # b1 is running on "b"
            assert "b1" in engine.requests and slots.slots[b_slot].refs == 1
            assert slots.unload("b") and slots.loaded() == ["c"]
        for o in engine.step():
            out[o.request_id] += o.chunk.token_ids
        if not engine.has_unfinished():
            break
    assert step > 2
    assert out == {"b1": ref["b"], "c1": ref["c"]}
    assert list(slots.slots) == [slots.by_name["c"]]
    bank = engine.runner.lora
    assert bank is not None and not bank.layers[0].lora_a[b_slot - 1].any()  # "b" zeroed


def test_the_slots_bytes_come_out_of_the_kv_budget() -> None:
    model = tiny_model("llama")
    settings = engine_settings(model, num_blocks=256)
    plain = LLMEngine(model, None, settings, "tiny")
    assert plain.runner.num_blocks == 256
    lora_settings = settings.model_copy(update={"max_loras": 2, "max_lora_rank": 2})
    reserved = lora.bank_bytes(tiny_model("llama"), lora_settings, torch.float32)
    with_lora = LLMEngine(tiny_model("llama"), None, lora_settings, "tiny")
    bank = with_lora.runner.lora
    assert bank is not None
    # 2 slots x rank 2 x (in + out) of 7 projections x 2 layers, + the row mask, float32.
    assert reserved == bank.nbytes() + bank.mask.numel() * 4 == (2 * 2 * 1024 * 2 + 256 * 2) * 4
    per_block = settings.kv_cache_bytes // 256
    assert with_lora.runner.num_blocks == (256 * per_block - reserved) // per_block


def test_adapters_through_the_cuda_graphs_bookkeeping(tmp_path: Path) -> None:
    """The decode-graph path (engine.cuda_graphs; ``eager_capture`` replays each graph as a
    plain call on the CPU): rows padded to the graph's bucket, steps with prompt tokens as
    graphs, steps run ahead with the mask of the step before. Every row still gets its own
    adapter's tokens."""
    from libs.engine.cuda_graphs import eager_capture

    refs_models = {
        "a": make_adapter(tmp_path / "a", 1),
        "b": make_adapter(tmp_path / "b", 2, targets=["o_proj", "down_proj"]),
        "": tiny_model("llama"),
    }
    ps = prompts()[:2]
    model = tiny_model("llama")
    settings = engine_settings(
        model,
        num_blocks=64,
        max_num_seqs=6,
        cpu_kernels="off",
        cuda_graph_batch_sizes=[1, 2, 4],
        cuda_attention="sdpa",
        cuda_graph_max_tokens=16,
        max_loras=2,
        max_lora_rank=4,
        lora_dir=str(tmp_path),
    )
    engine = LLMEngine(model, None, settings, "tiny", graph_capture=eager_capture)
    runner = engine.runner
    assert runner.graphs is not None and runner.lora is not None
    assert not runner.lora.eager  # a captured forward computes every step's dense update
    subs, adapters = [], {}
    for i, p in enumerate(ps):
        for name in refs_models:
            rid = f"{name or 'base'}-{i}"
            adapters[rid] = name
            subs.append(Submission(rid, p, GREEDY, arrive_at_step=2 * i))
    results = serve(engine, subs, adapters)
    for name, m in refs_models.items():
        for i, p in enumerate(ps):
            ref = reference_greedy(m, p, MAX_NEW)
            assert results[(f"{name or 'base'}-{i}", 0)].token_ids == ref, (name, i)
    assert runner.graphs.replays > 0 and runner.prompt_graph_steps > 0
    assert 0 < runner.ahead_used <= runner.ahead_launched


@pytest.mark.parametrize("eager", [True, False])
def test_grouped_and_dense_updates_give_each_row_its_own_slots(eager: bool) -> None:
    """A fused three-part linear, four slots, rows of slots 0 (base), 2, 3 and 4 in uneven
    numbers (slot 1 absent: a subset of the stacks, groups padded): the grouped update (eager)
    and the dense masked one both give row ``t`` ``base(x_t) + B_s A_s x_t``, and a base row
    exactly ``base(x_t)``."""
    gen = torch.Generator().manual_seed(0)
    parts, s, r, d_in = [("q", 6), ("k", 3), ("v", 3)], 4, 2, 5
    mask = torch.zeros(16, s)
    bank = lora.LoraBank(s, r, mask, eager=eager)
    base = torch.nn.Linear(d_in, 12, bias=False)
    layer = lora.LoraLinear(base, parts, bank, torch.float32)
    with torch.no_grad():
        layer.lora_a.copy_(torch.randn(layer.lora_a.shape, generator=gen))
        for p in range(len(parts)):
            b = getattr(layer, f"lora_b{p}")
            b.copy_(torch.randn(b.shape, generator=gen))
    rows = [0, 2, 3, 3, 4, 2, 3, 0, 3]
    x = torch.randn(len(rows), d_in, generator=gen)
    bank.set_rows(rows)
    with torch.no_grad():
        got, plain = layer(x), base(x)
    for t, slot in enumerate(rows):
        if slot == 0:
            assert torch.equal(got[t], plain[t])
            continue
        a = layer.lora_a[slot - 1]  # [P, R, in]
        want = torch.cat(
            [getattr(layer, f"lora_b{p}")[slot - 1].t() @ (a[p] @ x[t]) for p in range(3)]
        )
        torch.testing.assert_close(got[t], plain[t] + want)
    bank.set_rows([0] * len(rows))  # no adapter row: the base output alone
    with torch.no_grad():
        assert torch.equal(layer(x), base(x))
