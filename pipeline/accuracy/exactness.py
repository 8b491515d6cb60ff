"""Which variants compute the model's own answers: exact ones may win by default; an inexact one only when
params.yaml says `serve.allow_quantized: true` (selection holds it back, the benchmark measures it briefly).

One rule for both stages: a quantized variant (int8 weights or activations), or a float variant within its
tolerance whose task answers (labels, order, entities) still differ from eager's (pipeline/accuracy/answers.py).
"""
from __future__ import annotations

from typing import Optional

QUANTIZED = ("onnx-int8-dynamic", "onnx-int8-static", "int8")
OPT_IN = "serve.allow_quantized: true"     # the params.yaml line that lets an inexact variant win


def inexact_because(variant: str, answers: Optional[dict]) -> Optional[str]:
    """Why the variant is not exact (None when it is); `answers` is its conversion's verification.answers."""
    if variant in QUANTIZED:
        return "quantized: its answers move beyond the float tolerances"
    if (answers or {}).get("exact") is False:
        reason = answers.get("reason") or "its answers differ from eager's"
        return f"within its float tolerance, but {reason}"
    return None
