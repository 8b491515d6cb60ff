"""How recorded figures are rounded: one rule for every record the pipeline writes."""
from __future__ import annotations

from typing import Optional


def rounded(x: Optional[float], digits: int = 3) -> Optional[float]:
    """`x` as a float rounded to `digits` decimals; None stays None (a figure not measured)."""
    return None if x is None else round(float(x), digits)
