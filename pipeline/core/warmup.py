"""Warm-up: every CUDA-graph shape a run's answers will replay, captured before its first frame.

A capture costs a few hundred ms and holds CAPTURE_LOCK (the stages' page-locked allocations wait
for it); met mid-run, it lands on the answers waiting behind it (live: the first 10-30 s answered
several times slower than the steady state, docs/performance.md). So live, batch and serve call
`warm_up` during setup, with what they know of the answers to come: the frame sizes, the most
frames of a window, the batch sizes (1..vlm.max_batch) and the retentions in use (each tempering
rung). What cannot be known exactly is covered by the buckets the engine pads to:

- the vision tower: every padded kept shape up to all the cells of a full batch (or, encode: all,
  every temporal bucket), VisionEncoder.warm_up;
- prefill and decode: the prefix lengths of windows of 1..all their frame pairs at each retention
  (the allocator keeps between one and two frames' share of the cells per pair, a partial window
  fewer pairs), each 64-token bucket of them, at every batch bucket (DecoderPool.warm_up).

Off CUDA nothing is captured, but the graph caches record the shapes they are asked for
(runtime.cuda.LEDGER): a CPU run with warm-up on tells which shapes a GPU run would capture late.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

from arr_coc.attending import retained_tokens
from arr_coc.lod import token_frames

from ..budget import BudgetPlan
from ..config import PipelineConfig
from ..runtime.cuda import LEDGER

log = logging.getLogger("pipeline.warmup")
LENGTH_STEP = 64          # prefill.PREFILL_BUCKET: a prefix length per bucket is enough
TIMESTAMP_TOKENS = 10     # Qwen3-VL: a frame group's "<12.5 seconds>" (digit by digit) and its two markers


@dataclass(frozen=True)
class WarmUpReport:
    graphs: int            # CUDA graphs captured (0 off CUDA)
    shapes: int            # graph shapes met (captured, or off CUDA planned)
    seconds: float

    def line(self) -> str:
        return f"warm-up: {self.graphs} graphs ({self.shapes} shapes) in {self.seconds:.1f} s"


def prefix_lengths(vlm: Any, question: str, sizes: list[tuple[int, int]], window_frames: int,
                   retentions: tuple[float, ...], any_size: bool = False) -> list[int]:
    """The prefix lengths answers over windows of up to window_frames frames of these sizes may
    have, one per LENGTH_STEP bucket: windows of 1..all their frame pairs (a live stream's first,
    staggered window and a file's last are shorter), from one kept token up to each pair keeping
    two frames' share of the cells at each retention, plus TIMESTAMP_TOKENS a pair at the top
    (Qwen3-VL's timestamps, which VLM.prefix_length does not count).
    any_size: the sizes bound the frames' (smaller frames keep fewer)."""
    g = vlm.geometry
    pairs = token_frames(window_frames, g.temporal_patch_size)
    lengths = set()
    for (height, width), retention in itertools.product(sizes, retentions):
        gh, gw = g.grid(height, width)
        per_frame = max(1, retained_tokens(gh * gw, retention))         # the allocator's budget of a frame
        top = pairs * (min(gh * gw, 2 * per_frame) + TIMESTAMP_TOKENS)
        # from one kept token, not one frame's share: the allocator may keep fewer, and a window
        # alone in its batch then prefills a short prefix (an H200, 32 live streams: one 64-token
        # prefill captured after the first frame when this started at a frame's share)
        for kept in [*range(1, top, LENGTH_STEP), top]:
            lengths.add(vlm.prefix_length(question, kept))
    return sorted(lengths)


def largest_frame(vlm: Any) -> tuple[int, int]:
    """(height, width) of the largest frame the VLM takes whole (vlm.max_pixels, square): its grid
    bounds every video's, so its shapes cover those of any size (kept_graph.warm_keys)."""
    side = int(vlm.config.max_pixels ** 0.5)
    return side, side


def warm_up_any(vlm: Any, cfg: PipelineConfig, window_frames: int) -> WarmUpReport:
    """warm_up for videos of sizes not known ahead (serve, batch): windows of up to window_frames
    frames of any size the VLM takes, prefixes of every length bucket up to what the largest keeps
    but at most vlm.graph_prefill_max_tokens (longer prefills run eagerly; their decoders, each a
    large KV cache, would crowd each other out of vlm.kv_cache_gib: they are made when first met),
    an empty question (questions add their own tokens: a long one may still meet a new bucket)."""
    return warm_up(vlm, "", [largest_frame(vlm)], cfg, window_frames, any_size=True)


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... and max_batch: one of each batch bucket (prefill.batch_bucket) up to max_batch."""
    return sorted({1 << i for i in range(max_batch.bit_length())} | {max_batch})


def warm_up(vlm: Any, question: str, sizes: list[tuple[int, int]], cfg: PipelineConfig,
            window_frames: int, max_batch: int | None = None, any_size: bool = False) -> WarmUpReport:
    """Capture (on CUDA; elsewhere record) the graphs answers about windows of up to window_frames
    frames of these (height, width) sizes will replay, for batches of 1..max_batch (default
    vlm.max_batch) requests asking `question`. Logs and returns what it took."""
    started, t0 = time.perf_counter(), LEDGER.mark("warm-up")
    retentions = BudgetPlan.of(cfg.vlm).rungs or (cfg.model.attending.retention,)
    largest = vlm.config.max_batch if max_batch is None else max_batch
    lengths = prefix_lengths(vlm, question, sizes, window_frames, retentions, any_size)
    if any_size:
        lengths = [n for n in lengths if n <= vlm.config.graph_prefill_max_tokens] or lengths[:1]
    vlm.warm_up(batch_sizes(largest), lengths, frame_sizes=sorted(set(sizes)), window_frames=window_frames)
    report = WarmUpReport(graphs=len(LEDGER.entries(t0, "capture")), shapes=len(LEDGER.entries(t0, "shape")),
                          seconds=time.perf_counter() - started)
    log.info(report.line())
    return report
