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
    from ._validate import ConfigError as ConfigError
    from .attending import AttendingConfig as AttendingConfig, TokenAllocator as TokenAllocator
    from .balancing import (
        AdaptiveTensionBalancer as AdaptiveTensionBalancer,
        BalancingConfig as BalancingConfig,
        TensionBalancer as TensionBalancer,
    )
    from .knowing import Knowing as Knowing, KnowingConfig as KnowingConfig
    from .model import ARRCOC as ARRCOC, Allocation as Allocation, ARRCOCConfig as ARRCOCConfig
    from .realizing import (
        RealizingConfig as RealizingConfig,
        StreamState as StreamState,
        TemporalRelevanceRealizer as TemporalRelevanceRealizer,
    )
    from .texture import CHANNELS as CHANNELS, TextureConfig as TextureConfig, TextureExtractor as TextureExtractor


__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
