"""How much measuring a variant gets: benchmark effort goes where the decision is.

A variant that is not exact (pipeline/accuracy/exactness.py) cannot win while serve.allow_quantized is
false; its figures only show what opting in would give. With `benchmark.inexact: brief` it gets the two
required rounds (the first sweeps the sizes, the second re-measures them within a quarter of
benchmark.budget_s) and no start from disk; every other variant the full measurement. The record says
which, and why (`effort`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.accuracy.exactness import OPT_IN, inexact_because
from pipeline.measure.runner import read_conversion

BRIEF_BUDGET_SHARE = 0.25


@dataclass(frozen=True)
class Effort:
    level: str                      # full | brief
    why: Optional[str]
    settings: object                # the BenchmarkSettings the variant is measured with

    def as_dict(self) -> dict:
        s = self.settings
        return {"level": self.level, "why": self.why, "cold_runs": s.cold_runs, "steady_runs": s.steady_runs,
                "budget_s": s.budget_s, "from_disk": s.from_disk}


def _answers(model_dir: Path) -> Optional[dict]:
    doc = read_conversion(model_dir)[0]      # none: benchmark_or_record records the variant as skipped
    return ((doc or {}).get("verification") or {}).get("answers")


def effort_for(model_dir, variant: str, settings) -> Effort:
    """The effort `variant` (converted in `model_dir`) is measured with under `settings`."""
    why = inexact_because(variant, _answers(model_dir))
    if why is None or settings.inexact == "full":
        return Effort("full", None, settings)
    brief = dataclasses.replace(settings, cold_runs=2, steady_runs=2, from_disk=False,
                                budget_s=round(settings.budget_s * BRIEF_BUDGET_SHARE, 2))
    return Effort("brief", f"{why}; it cannot win without `{OPT_IN}`, so it is measured in 2 rounds, no start "
                           f"from disk (benchmark.inexact: brief; full measures it as every other variant)", brief)
