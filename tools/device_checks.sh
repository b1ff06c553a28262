#!/usr/bin/env bash
# Every CUDA check of the project in one run, for a GPU machine lent for a few minutes (the device tool):
# the tests marked `gpu` (the chat model's cached decode in bf16, CUDA graphs = eager over the block tables, the
# prefix cache with graphs; int8 weights with graphs; the decision scorer's whole-prompt and tail graphs and shared-prefix passes), then the chat engine's
# benchmark and the decision batch timings (bench.decision_batches, the synthetic scorer's model, with and
# without tail graphs) on the device.
#
# The device image has torch, transformers, safetensors, tiktoken, pytest and numpy but not this project's
# other imports (msgspec, llguidance; flash-linear-attention for the decision model's kernels), and its
# transformers or pydantic may be missing or too old; carry them as wheels, made here once (they land in .whl/,
# which git ignores):
#
#     bash tools/device_checks.sh --wheels          # here, with network: downloads them into .whl/
#
# then on the device machine (the tool's `run`, carry [".whl"]):
#
#     bash tools/device_checks.sh [quick]           # writes its logs to $OUT (or ./device-out)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=(--python-version 3.12 --implementation cp --platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
if [[ "${1:-}" == "--wheels" ]]; then
  set -e
  get() { python3 -m pip download -q --no-deps --only-binary=:all: "${PY[@]}" -d "$@"; }
  get .whl msgspec==0.23.0 llguidance==1.9.1 rustbpe==0.1.0 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2
  get .whl/hf transformers==5.23.0 huggingface_hub==2.4.0 typer==0.29.2 tokenizers==0.23.3 hf-xet==1.8.0
  get .whl/pydantic pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing_extensions==4.16.0
  exit 0
fi
out="${OUT:-device-out}"
mkdir -p "$out"
site=/tmp/site
install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $site "$@"; }
if compgen -G ".whl/*.whl" >/dev/null; then
  install .whl/*.whl || exit 1
  export PYTHONPATH=$site
  # the image's own transformers and pydantic when they are recent enough, else the carried ones
  python3 -c "import transformers; transformers.Qwen3_5ForCausalLM" 2>/dev/null || install .whl/hf/*.whl
  python3 -c "import pydantic; assert pydantic.VERSION >= '2.10'" 2>/dev/null || install .whl/pydantic/*.whl
fi
export PYTHONUNBUFFERED=1
# causal-conv1d does not build there: its torch fallback is slower but exact (the gpu tests and timings say so)
export STARTLUX_ALLOW_SLOW=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__,
'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
status=0
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decision.py tests/test_decision_prefix.py \
  tests/test_chat_model.py tests/test_chat_engine.py tests/test_chat_prefix_cache.py tests/test_small_linear.py 2>&1 \
  | tee "$out/gpu-tests.log" || status=1
timeout 150 python3 -m bench.decision_batches --device cuda --repeats 4 --tail-graphs both --json "$out/decision-batches.json" 2>&1 \
  | grep -v "^\[transformers\]" | tee "$out/decision-batches.log" || status=1
if [[ "${1:-}" != "quick" ]]; then
  timeout 150 python3 -m bench.engine --device cuda --streams 1 32 128 --archs nanochat nanochat-current \
    --json "$out/bench-engine-cuda.json" 2>&1 | tee "$out/bench-engine-cuda.log" || status=1
fi
exit $status
