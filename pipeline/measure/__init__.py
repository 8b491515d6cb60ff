"""Measuring variants: cold load in fresh processes, steady-state latency/throughput, statistics.

Kept light on import (no numpy/torch at package level) so the cold-load child process
(`python -m pipeline.measure.child`) pays nothing for it.
"""
