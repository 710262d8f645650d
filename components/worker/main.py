"""Worker process: `python -m splitserve.components.worker.main --config FILE`: the
aggregated shell (``agg.py``) around the section's engine."""

from splitserve.contracts.kit.component import run

from .entry import role_main

main = role_main("agg")

if __name__ == "__main__":
    run(main)
