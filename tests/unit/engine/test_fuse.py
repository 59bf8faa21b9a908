"""``engine.fuse_projections``: one linear for q/k/v and one for gate/up, same answers."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from bench.support.tiny_models import tiny_model
from libs.engine import fuse, kernels, quant
from libs.engine.engine import LLMEngine
from libs.engine.quant.int4 import int4_blocks
from libs.protocol import SamplingParams
from tests.unit.engine.helpers import Submission, engine_settings, run_engine

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("arch", "fused"), [("llama", 4), ("qwen2", 2), ("mistral", 2)])
def test_fused_model_gives_the_same_logits(arch: str, fused: int) -> None:
    model = tiny_model(arch)
    twin = copy.deepcopy(model)
    assert fuse.fuse_projections(twin) == fused  # llama: attention and MLP; others: the MLP
    mlp = twin.model.layers[0].mlp
    assert hasattr(mlp, "gate_up_proj") and not hasattr(mlp, "gate_proj")
    x = torch.randint(0, 300, (1, 11))
    with torch.inference_mode():
        want = model(x, use_cache=False).logits
        got = twin(x, use_cache=False).logits
        # transformers' own generate (a DynamicCache) still runs on the fused model.
        gen = twin.generate(x, max_new_tokens=5, do_sample=False)
        ref = model.generate(x, max_new_tokens=5, do_sample=False)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert gen.tolist() == ref.tolist()


def test_linears_that_do_not_concatenate_stay_apart() -> None:
    a, b = nn.Linear(8, 4), nn.Linear(8, 4, bias=False)
    assert fuse.concat_linears([a, b]) is None  # one with a bias, one without
    c = nn.Linear(8, 4).to(torch.bfloat16)
    assert fuse.concat_linears([a, c]) is None  # two dtypes
    merged = fuse.concat_linears([a, nn.Linear(8, 6)])
    assert isinstance(merged, nn.Linear) and merged.out_features == 10


def _engine_tokens(fuse_on: bool, **kw: object) -> dict[str, list[int]]:
    model = tiny_model("llama", seed=3)
    engine = LLMEngine(model, None, engine_settings(model, fuse_projections=fuse_on, **kw), "t")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    subs = [
        Submission(f"r{i}", [(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)], greedy, "batch", i)
        for i in range(5)
    ]
    return {rid: r.token_ids for (rid, _), r in run_engine(engine, subs).items()}


@pytest.mark.parametrize("cpu_kernels", ["off", "auto"])
def test_engine_answers_do_not_change_with_fusion(cpu_kernels: str) -> None:
    assert _engine_tokens(True, cpu_kernels=cpu_kernels) == _engine_tokens(
        False, cpu_kernels=cpu_kernels
    )


def test_block_layers_concatenate_row_for_row() -> None:
    k = kernels.load("auto", "cpu", "float32")
    if k is None or not quant.kernel_serves(k, torch.float32, torch.device("cpu")):
        pytest.skip("Strait's block kernel needs AVX2")
    torch.manual_seed(0)
    layers = []
    for n in (128, 64, 64):
        w = torch.randn(n, 96)
        layers.append(quant.BlockLinear(int4_blocks(w, 32), torch.randn(n), k))
    merged = fuse.concat_linears(layers)
    assert isinstance(merged, quant.BlockLinear) and merged.out_features == 256
    x = torch.randn(3, 96)
    want = torch.cat([layer(x) for layer in layers], dim=-1)
    assert torch.equal(merged(x), want)  # the same bits: each row's sum is the same chain
    odd = quant.BlockLinear(int4_blocks(torch.randn(40, 96), 32), None, k)
    assert fuse.concat_linears([odd, layers[1]]) is None  # 40 rows pad their last panel group
