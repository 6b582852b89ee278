"""VLM stage: answer questions about a window of frames from only the visual tokens ARR-COC kept.

The names below are imported on first use (PEP 562): `pipeline.vlm_config` is read by every
command's configuration, and importing the model code with it would import transformers (about
2.4 s) for commands that never load a VLM, `--help` included.
"""
from __future__ import annotations

from arr_coc._lazy import lazy_exports

_HOMES = {"VLMGeometry": "geometry", "VLMLoadError": "loading", "load_vlm": "loading", "VLM": "model",
          "KeptFeatures": "kept_vision"}
__all__ = list(_HOMES)


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
