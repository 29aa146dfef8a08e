"""phi4: a local math solver on Phi-4-mini-reasoning, resident in a background daemon."""

from __future__ import annotations

__version__ = "0.1.0"
