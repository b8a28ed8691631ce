"""aoed: an auto-tuning daemon for ONNX models, and the tuning engine it hosts."""

from __future__ import annotations

import importlib.metadata

try:
    __version__ = importlib.metadata.version("aoed")
except importlib.metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
