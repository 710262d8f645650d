"""Replay a request trace against an OpenAI-compatible frontend (thin wrapper).

The implementation lives in :mod:`splitserve.bench.replay` (also behind ``dynamo bench
run``); this script keeps the old entry point and re-exports every name of that module,
so ``import trace_replay as tr; tr.prepare(...)`` keeps working.

    python benchmarks/trace_replay.py --url http://127.0.0.1:8000 \\
        --trace ../shared/traces/mooncake_fast25_conversation_trace.jsonl \\
        --duration-s 60 --token-scale 16 --output-scale 4 --slo ttft=1000,tpot=50 \\
        --out replay.json
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from splitserve.bench import replay as _impl
except ModuleNotFoundError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from splitserve.bench import replay as _impl

globals().update({k: v for k, v in vars(_impl).items()
                  if not (k.startswith("__") and k.endswith("__"))})

if __name__ == "__main__":
    _impl.main()
