"""How many examples a property test tries: its budget, scaled by the environment's
``REWARD_SUPERVISOR_EXAMPLES`` (default 1). ``./dev test`` runs the full budget on the
default interpreter and a quarter of it on each other promised Python: what the properties
check is our logic, which does not change with the interpreter, and their examples are most
of the CPU a run spends (the CI budget is 15 minutes on two cores)."""

from __future__ import annotations

import os
from typing import Final

SCALE: Final = float(os.environ.get("REWARD_SUPERVISOR_EXAMPLES", "1"))


def examples(budget: int) -> int:
    """``budget`` scaled by SCALE, never below 10."""
    return max(10, round(budget * SCALE))
