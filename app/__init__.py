"""The training application: a plain PyTorch loop in the DeepSpeed engine."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

REPO = Path(__file__).resolve().parent.parent
"""The checkout this package runs from."""


def child_pythonpath(env: Mapping[str, str] = os.environ) -> str:
    """PYTHONPATH for a child Python that imports this checkout: the checkout first, then the
    caller's own entries (packages installed with `pip --target` on a bare GPU image, say)."""
    return os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
