"""live.warm_vlm: the decoders live answering needs exist before the first answer."""
from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import PipelineConfig
from pipeline.core.live_stages import LiveOptions, warm_vlm
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.vlm.model import AnswerRequest


def window(vlm, frames: int, height: int, width: int, retention: float, seed: int) -> AnswerRequest:
    """A window whose keep maps hold what fraction mode keeps: round(retention * cells) per frame."""
    rng = np.random.default_rng(seed)
    gh, gw = vlm.geometry.grid(height, width)
    k = round(retention * gh * gw)
    keep = np.zeros((frames, gh * gw), dtype=np.int64)
    for t in range(frames):
        keep[t, rng.choice(gh * gw, size=k, replace=False)] = 1
    rgb = rng.integers(0, 255, (frames, height, width, 3), dtype=np.uint8)
    return AnswerRequest("s", rgb, keep.reshape(frames, gh, gw), "what moves?", 0.0, 1.0)


@pytest.mark.parametrize("size", [(96, 128), (120, 200)])
def test_answers_after_warm_up_create_no_decoder(size):
    vlm = build_tiny_vlm("qwen2_vl")
    cfg, options = PipelineConfig(), LiveOptions(every_s=2.0)
    frames = round(options.every_s * cfg.vlm.fps)
    warm_vlm(vlm, "what moves?", [size], cfg, options)
    warmed = dict(vlm.counters)
    assert warmed["decoders"] >= 1
    for batch in range(1, vlm.config.max_batch + 1):
        requests = [window(vlm, frames, *size, cfg.model.attending.retention, seed=10 * batch + i)
                    for i in range(batch)]
        assert len(vlm.answer(requests)) == batch
    assert vlm.counters["decoders"] == warmed["decoders"] and vlm.counters["evicted"] == 0
