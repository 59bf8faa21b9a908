#!/usr/bin/env bash
# One call on a lent GPU (docs/performance.md, "CUDA"): the gpu tests, then bench.gpu_step.
# From the repository root, with the wheels the engine needs in .whl/ and the model's
# config.json in .gpu/smollm2/ (random weights of its shapes: the real weights are over the
# machine's 64 MiB transfer; a step's time does not depend on their values):
#
#   bash bench/gpu_step.sh                          # on the GPU machine ($OUT: where logs go)
#   bash bench/gpu_step.sh --device cpu --tiny --streams 1 3 --max-tokens 8   # dry run here
#
# Arguments go to bench.gpu_step. Budget: ~2 min of tests, then the bench's own --budget-s.
# Preparing the two folders here (both git-ignored through .git/info/exclude; the device call
# carries them: carry [".whl", ".gpu"]): the packages the engine imports that the GPU image
# lacks, at the versions .venv holds, and the model's config:
#
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .whl $(.venv/bin/python -m pip freeze | grep -iE \
#     '^(msgspec|pydantic|pydantic[-_]core|pydantic[-_]settings|annotated[-_]types|typing[-_]inspection|python[-_]dotenv)==')
#   mkdir -p .gpu/smollm2 && cp .strait/models/smollm2-135m-instruct/config.json .gpu/smollm2/
set -uo pipefail
OUT=${OUT:-/tmp/gpu_step}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
PY=python3
[ -x .venv/bin/python ] && [ "${1:-}" = "--device" ] && PY=.venv/bin/python
if ls .whl/*.whl >/dev/null 2>&1 && [ "$PY" = python3 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,clocks.mem,power.draw \
    --format=csv 2>/dev/null | tee "$OUT/nvidia-smi.txt"
$PY -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "cuda", torch.cuda.is_available())'
# The gpu tests, and the graphs' CPU tests, whose Triton ones run on the device there.
echo "== pytest (gpu tests, test_cuda_graphs.py)"
timeout 120 $PY -m pytest tests/unit/engine/test_cuda_graphs_gpu.py tests/unit/engine/test_quant_gpu.py \
    tests/unit/engine/test_cuda_graphs.py -q -p no:cacheprovider -o addopts="" -ra \
    2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
echo "== bench.gpu_step"
MODEL=(--model-dir .gpu/smollm2 --random-weights)
[[ " $* " == *" --tiny "* ]] && MODEL=()
timeout 380 $PY -m bench.gpu_step "${MODEL[@]}" --out "$OUT/gpu_step.json" "$@" \
    2>&1 | grep -v -i "warn" | tee "$OUT/gpu_step.log"
