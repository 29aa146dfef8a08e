"""Where a bench's results go: bench/results/<name>.json and .md, and the table printed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write(out: Path, name: str, results: dict[str, Any], table: str) -> None:
    """Write ``results`` as out/<name>.json and ``table`` as out/<name>.md; print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (out / f"{name}.md").write_text(table + "\n")
    print(table)
