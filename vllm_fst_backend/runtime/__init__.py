"""Stage 3: the per-request matcher (every decoding step)."""

from .matcher import FstMatcher

__all__ = ["FstMatcher"]
