"""``python -m splitserve.components.policy [CONFIGS_DIR]``: rewrite the shipped policy JSON Schema."""

import sys
from pathlib import Path

from .schema import SCHEMA_FILE, export_schema

print(export_schema(Path(sys.argv[1] if len(sys.argv) > 1 else "configs") / "schemas"
                    / SCHEMA_FILE))
