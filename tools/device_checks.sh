#!/usr/bin/env bash
# Every CUDA check of the project in one run, for a GPU machine lent for a few minutes (the device tool):
# the tests marked `gpu` (the chat model's cached decode in bf16, CUDA graphs = eager over the block tables, the
# prefix cache with graphs, the decision scorer's graphs), then the chat engine's benchmark on the device.
#
# The device image has torch, transformers, safetensors, tiktoken, pytest and numpy but not this project's
# other imports that the chat core needs (msgspec, llguidance); carry them as wheels, made here once (they land
# in .whl/, which git ignores):
#
#     bash tools/device_checks.sh --wheels          # here, with network: downloads them into .whl/
#
# then on the device machine (the tool's `run`, carry [".whl"]):
#
#     bash tools/device_checks.sh                   # writes its logs to $OUT (or ./device-out)
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="msgspec==0.23.0 llguidance==1.9.1"
if [[ "${1:-}" == "--wheels" ]]; then
  for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 \
      --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .whl "$w" || exit 1
  done
  exit 0
fi
out="${OUT:-device-out}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
status=0
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_chat_model.py tests/test_chat_engine.py \
  tests/test_chat_prefix_cache.py 2>&1 | tee "$out/gpu-tests.log" || status=1
timeout 240 python3 -m bench.engine --device cuda --streams 1 32 128 --archs nanochat nanochat-current \
  --json "$out/bench-engine-cuda.json" 2>&1 | tee "$out/bench-engine-cuda.log" || status=1
exit $status
