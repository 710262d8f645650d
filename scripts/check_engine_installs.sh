#!/usr/bin/env bash
# Resolves this project's install in each engine's environment without installing or
# downloading any wheel (pip --dry-run reads package metadata only), so a dependency pin
# that fights an engine's torch or CUDA stack fails here instead of on a GPU machine.
#
#   scripts/check_engine_installs.sh            # cpu, sglang and vllm, about 2 minutes
#   scripts/check_engine_installs.sh trtllm     # also TensorRT-LLM (needs pypi.nvidia.com)
#
# pip runs --isolated: a machine's own pip config (constraint files, extra indexes) must
# not decide whether the public install resolves.  Each resolution's report (what would
# be installed) is written to $REPORT_DIR (default: a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-.venv/bin/python}"
REPORT_DIR="${REPORT_DIR:-$(mktemp -d)}"
engines=(cpu sglang vllm "$@")
status=0

resolve() {  # name, then pip install arguments
    local name="$1"; shift
    local t0=$SECONDS
    if "$PY" -m pip --isolated install --dry-run --ignore-installed --quiet \
            --report "$REPORT_DIR/$name.json" "$@" >"$REPORT_DIR/$name.log" 2>&1; then
        echo "ok    $name ($((SECONDS - t0)) s): $("$PY" - "$REPORT_DIR/$name.json" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
pins = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
print(", ".join(f"{k} {pins[k]}" for k in ("torch", "triton", "sglang", "vllm", "tensorrt-llm",
                                           "nixl", "nixl-cu12", "nixl-cu13") if k in pins))
PY
)"
    else
        echo "FAIL  $name ($((SECONDS - t0)) s): see $REPORT_DIR/$name.log"
        grep -A8 "conflict is caused by" "$REPORT_DIR/$name.log" || tail -5 "$REPORT_DIR/$name.log"
        status=1
    fi
}

for engine in "${engines[@]}"; do
    case "$engine" in
        # The CPU torch wheel (2.13.0+cpu, no triton pin) is not on PyPI: it comes from
        # CPU_TORCH_FIND_LINKS, else the find-links pip is configured with (where
        # scripts/setup.sh found it), else PyTorch's CPU index.
        cpu) links="${CPU_TORCH_FIND_LINKS:-$("$PY" -m pip config get global.find-links \
                                             2>/dev/null || true)}"
             if [ -n "$links" ]; then
                 args=(); for l in $links; do args+=(--find-links "$l"); done
                 resolve cpu ".[dev,cpu]" "${args[@]}"
             else
                 resolve cpu ".[dev,cpu]" --extra-index-url https://download.pytorch.org/whl/cpu
             fi ;;
        sglang) resolve sglang ".[sglang]" ;;
        vllm) resolve vllm ".[vllm]" ;;   # vLLM's CUDA build, all from PyPI
        trtllm) resolve trtllm ".[trtllm]" --extra-index-url https://pypi.nvidia.com ;;
        *) echo "unknown engine $engine (cpu, sglang, vllm, trtllm)"; exit 2 ;;
    esac
done
exit $status
