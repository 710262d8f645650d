"""PrefillWorker process: `python -m splitserve.components.worker.prefill_main --config FILE`:
the prefill shell (``prefill.py``) around the section's engine."""

from splitserve.contracts.kit.component import run

from .entry import role_main

main = role_main("prefill")

if __name__ == "__main__":
    run(main)
