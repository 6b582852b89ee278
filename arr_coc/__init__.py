"""ARR-COC relevance realization for streams of frames (pure torch).

    import arr_coc
    model = arr_coc.ARRCOC.from_pretrained()             # the trained checkpoint shipped here
    allocation, state = model(frames, query, grid=(gh, gw))

The names below are imported on first use (PEP 562), so that `arr_coc._validate`, which every
config imports, does not import torch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

_HOMES = {
    "ARRCOC": "model", "ARRCOCConfig": "model", "Allocation": "model",
    "StreamState": "realizing", "ConfigError": "_validate",
    "TextureConfig": "texture", "KnowingConfig": "knowing", "BalancingConfig": "balancing",
    "AttendingConfig": "attending", "RealizingConfig": "realizing",
    "TextureExtractor": "texture", "Knowing": "knowing", "TensionBalancer": "balancing",
    "AdaptiveTensionBalancer": "balancing", "TokenAllocator": "attending",
    "TemporalRelevanceRealizer": "realizing", "CHANNELS": "texture",
}
__all__ = list(_HOMES)

if TYPE_CHECKING:
    from ._validate import ConfigError
    from .attending import AttendingConfig, TokenAllocator
    from .balancing import AdaptiveTensionBalancer, BalancingConfig, TensionBalancer
    from .knowing import Knowing, KnowingConfig
    from .model import ARRCOC, Allocation, ARRCOCConfig
    from .realizing import RealizingConfig, StreamState, TemporalRelevanceRealizer
    from .texture import CHANNELS, TextureConfig, TextureExtractor


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
