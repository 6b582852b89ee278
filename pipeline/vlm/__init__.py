"""VLM stage: answer questions about a window of frames from only the visual tokens ARR-COC kept.

The names below are imported on first use (PEP 562): the model code imports transformers, which
commands that never load a VLM, `--help` included, do without. The configuration
(pipeline/vlm_config.py) and the requests the engine answers (pipeline/runtime/requests.py) live
below this package, so the configs and the graph never import the engine.
"""
from __future__ import annotations

from arr_coc._lazy import lazy_exports

_HOMES = {"VLMGeometry": "geometry", "VLMLoadError": "loading", "load_vlm": "loading", "VLM": "model",
          "KeptFeatures": "kept_vision"}
__all__ = list(_HOMES)


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
