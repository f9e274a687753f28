"""`import prefixcache.ray`: the Ray Data recipe's import path (the class lives in api/ray.py)."""

from .api.ray import Classify

__all__ = ["Classify"]
