"""DecodeWorker process: `python -m splitserve.components.worker.decode_main --config FILE`:
the decode shell (``decode.py``) around the section's engine."""

from splitserve.contracts.kit.component import run

from .entry import role_main

main = role_main("decode")

if __name__ == "__main__":
    run(main)
