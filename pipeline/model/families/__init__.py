"""Model families: one registered class per task family (see base.py)."""
from pipeline.model.families import image_classification, tensor, text_embedding, text_heads  # noqa: F401  (each registers its family)
from pipeline.model.families.base import REGISTRY, Family, family_for, register  # noqa: F401
