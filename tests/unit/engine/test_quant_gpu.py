"""Weight formats on CUDA: the same ``Blocks`` served by torch's weight-only kernels (tinygemm
int4, int8) with bf16 activations, and a quantised tiny model's greedy output through the
engine equal to its own ``generate``. Marked ``gpu``: they run where CUDA is (never in CI)."""

from __future__ import annotations

import pytest
import torch

from bench.support.tiny_models import tiny_model
from libs.engine import quant
from libs.engine.engine import LLMEngine
from libs.protocol import SamplingParams
from libs.settings import EngineSettings
from tests.unit.engine.helpers import Submission, engine_settings, reference_greedy, run_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(("bits", "k"), [(4, 512), (4, 96), (8, 96)])
def test_cuda_layers_compute_their_blocks(bits: int, k: int) -> None:
    torch.manual_seed(0)
    n = 64
    w = torch.randn(n, k)
    blocks = quant.int4.int4_blocks(w, 32) if bits == 4 else quant.int8.int8_blocks(w)
    layer = quant.serve.make_linear(blocks, None, None, torch.device("cuda"))
    x = torch.randn(5, k, device="cuda")
    ref = x.bfloat16().float() @ blocks.dequantized().cuda().t()
    y = layer(x)
    assert y.shape == (5, n) and y.is_cuda
    assert torch.allclose(y.float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_cuda_engine_greedy_equals_generate_of_the_format(quantization: str) -> None:
    model = tiny_model("llama").cuda()
    quant.quantize_model(model, "", EngineSettings(quantization=quantization, device="cuda"))
    prompts = [[5, 17, 3, 200, 9, 41, 8], [1, 2, 3], list(range(30, 70))]
    refs = [reference_greedy(model, p, 8) for p in prompts]
    # A float32 model (dtype "auto" would be bfloat16 on CUDA, its KV cache with it).
    settings = engine_settings(model, device="cuda", dtype="float32", quantization=quantization)
    engine = LLMEngine(model, None, settings, "tiny")
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    subs = [Submission(f"r{i}", p, greedy, arrive_at_step=i) for i, p in enumerate(prompts)]
    results = run_engine(engine, subs)
    for i in range(len(prompts)):
        assert results[(f"r{i}", 0)].token_ids == refs[i]
