"""The type of the root conftest's ``run_example`` fixture (examples/ scripts run once each)."""

from __future__ import annotations

import subprocess
from typing import Callable

RunExample = Callable[[str], "subprocess.CompletedProcess[str]"]
