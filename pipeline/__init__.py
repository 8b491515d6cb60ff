"""Model-optimization build pipeline for TorchServe (see README.md)."""
