"""`import prefixcache.ray`: the Ray Data recipes' import path: `Classify` (the batch tool's records,
from api/ray.py) and `Decide` (the decisions server's responses, from serve/raydata.py)."""

from .api.ray import Classify
from .serve.raydata import Decide

__all__ = ["Classify", "Decide"]
