"""The live stages: the VLM stage's answer windows around an outage (a gap), and warm_vlm (the
decoders live answering needs exist before the first answer)."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from arr_coc.attending import retained_tokens
from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from pipeline.core.live_stages import LiveBatch, LiveOptions, LiveVLMStage, warm_vlm
from pipeline.core.items import AllocationBatch, AnswerItem
from pipeline.vlm.loading import build_tiny_vlm
from pipeline.runtime.requests import AnswerRequest, AnswerResult
from sources.frame import Frame
from sources.live import Gap


class RecordingBatcher:
    """Answers at once; keeps the requests."""

    def __init__(self) -> None:
        self.requests: list[AnswerRequest] = []

    def submit(self, request: AnswerRequest) -> Future:
        self.requests.append(request)
        future: Future = Future()
        future.set_result(AnswerResult(text="a", tokens_kept=1, tokens_full=4, latency_s=0.0))
        return future


def live_batch(pts: list[float], first_index: int, gap: Gap | None = None,
               cuts: list[bool] | None = None, sid: str = "s") -> AllocationBatch:
    """Frames whose pixels hold their index, all sampled for the VLM; relevance index / 1000."""
    frames = [Frame(sid, first_index + k, t, np.full((4, 4, 3), first_index + k, np.uint8), arrival_s=t)
              for k, t in enumerate(pts)]
    cuts = cuts or [False] * len(frames)
    relevance = torch.arange(first_index, first_index + len(frames)).float()[:, None, None].expand(-1, 2, 2) / 1000
    allocation = SimpleNamespace(lod=torch.ones(len(frames), 2, 2, dtype=torch.int8), relevance=relevance,
                                 scene_change=torch.tensor(cuts))
    batch = LiveBatch(sid, frames, torch.zeros(len(frames), 4, 4, 3, dtype=torch.uint8), gap=gap)
    return AllocationBatch(batch, allocation, None)


def answer_frames(request: AnswerRequest) -> list[int]:
    return [int(f[0, 0, 0]) for f in request.frames]


class TestWindowAfterAGap:
    """Frames from before an outage describe what was in view then, not now: the window starts over
    at the first frame after the gap, and so does the answer schedule."""

    BEFORE = [k / 10 for k in range(10)]                     # 0.0 - 0.9 s
    AFTER = [1.3 + k / 10 for k in range(13)]                # 1.3 - 2.5 s, after 0.4 s without frames
    GAP = Gap("s", 0.9, 1.3, 0.9, 1.3, "the stream ended (server closed or stalled)")

    def run(self, options: LiveOptions, cuts_after: list[bool] | None = None) -> list[AnswerRequest]:
        batcher = RecordingBatcher()
        stage = LiveVLMStage(batcher, "what is there?", options)
        batches = [live_batch(self.BEFORE, 0), live_batch(self.AFTER, 10, self.GAP, cuts_after)]
        out = [x for b in batches for x in stage.process(b)] + list(stage.finish())
        assert len([x for x in out if isinstance(x, AnswerItem)]) == len(batcher.requests)
        return batcher.requests

    def test_every_window_starts_after_the_gap(self):
        requests = self.run(LiveOptions(every_s=1.0))
        # due one --every after the first frame after the gap (1.3 + 1.0), not at 1.0 (the old schedule);
        # at the end, the frames since (2.4, 2.5) are the last, partial window
        assert [(r.t_start, r.t_end) for r in requests] == [(pytest.approx(1.3), pytest.approx(2.3)),
                                                            (pytest.approx(2.4), pytest.approx(2.5))]
        assert answer_frames(requests[0]) == list(range(10, 21)) and answer_frames(requests[1]) == [21, 22]
        # pass 1's relevance travels with its frames (tempering ranks by it)
        assert requests[0].scores.shape == requests[0].keep.shape
        np.testing.assert_allclose(requests[0].scores[:, 0, 0] * 1000, range(10, 21), atol=1e-3)

    def test_a_cut_right_after_the_gap_sees_no_frame_from_before(self):
        cuts = [True] + [False] * 12                         # the first frame after a gap is a new fixation
        requests = self.run(LiveOptions(every_s=1.0, on_scene_change=True), cuts)
        assert len(requests) == 1 and answer_frames(requests[0]) == [10]


def window(vlm, frames: int, height: int, width: int, retention: float, seed: int) -> AnswerRequest:
    """A window whose keep maps hold what fraction mode keeps: retained_tokens(cells, retention) a frame."""
    rng = np.random.default_rng(seed)
    gh, gw = vlm.geometry.grid(height, width)
    k = retained_tokens(gh * gw, retention)
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


def still_batch(pts: list[float], cuts: list[bool] | None = None, gap: Gap | None = None) -> AllocationBatch:
    """Frames of one unchanging 56x56 view (a 2x2 VLM grid), every cell kept."""
    rgb = np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    frames = [Frame("s", round(t * 4), t, rgb, arrival_s=t) for t in pts]
    cuts = cuts or [False] * len(frames)
    allocation = SimpleNamespace(lod=torch.ones(len(frames), 2, 2, dtype=torch.int8),
                                 relevance=torch.rand(len(frames), 2, 2),
                                 scene_change=torch.tensor(cuts))
    return AllocationBatch(LiveBatch("s", frames, torch.zeros(len(frames), 56, 56, 3, dtype=torch.uint8), gap=gap),
                           allocation, None)


class TestFeatureReuse:
    """Each request names its stream and whether a scene change or a gap came since the stream's last
    one; with vlm.encode: kept the VLM encodes only what changed since."""

    SECONDS = [[k / 4 for k in range(5)], [1 + k / 4 for k in range(1, 5)], [2 + k / 4 for k in range(1, 7)]]

    def test_requests_carry_the_stream_and_its_cuts(self):
        batcher = RecordingBatcher()
        stage = LiveVLMStage(batcher, "what is there?", LiveOptions(every_s=1.0))
        cuts = [[True] + [False] * 4, [False] * 4, [False, True] + [False] * 4]
        for pts, c in zip(self.SECONDS, cuts):
            list(stage.process(still_batch(pts, c)))
        assert [(r.reuse_key, r.scene_change) for r in batcher.requests] == [("s", True), ("s", False), ("s", True)]

    def test_a_still_view_is_encoded_once_through_the_batcher(self):
        from pipeline.vlm.batcher import VLMBatcher
        from pipeline.vlm_config import VLMConfig

        vlm = build_tiny_vlm("qwen2_vl", config=VLMConfig(encode="kept", max_new_tokens=4))
        stage = LiveVLMStage(VLMBatcher(vlm, max_wait_s=0.0), "what is there?", LiveOptions(every_s=1.0))
        answers, counts = [], []
        gap = Gap("s", 2.0, 2.25, 2.0, 2.25, "the stream ended (server closed or stalled)")
        for pts, g in zip(self.SECONDS, [None, None, gap]):
            out = list(stage.process(still_batch(pts, gap=g))) + list(stage.finish())  # finish: the answer is back
            answers += [x.text for x in out if isinstance(x, AnswerItem)]
            counts.append(dict(vlm.kept_encoder.counters))
        stage.close()
        # 5 frames (3 pairs) of 4 cells, then 5 frames of the same view: all reused; after the gap
        # (the window starts over: due 1 s after 2.25 s) all anew, and the last partial window (the
        # frame at 3.5 s, asked by finish) of the same view reused
        assert [c["cells_encoded"] for c in counts] == [12, 12, 24]
        assert [c["cells_reused"] for c in counts] == [0, 12, 16]
        assert len(answers) == 4 and answers[0] == answers[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.cuda
def test_live_windows_reach_a_gpu_vlm_pinned():
    batcher = RecordingBatcher()
    batcher.vlm = SimpleNamespace(device=torch.device("cuda"))
    stage = LiveVLMStage(batcher, "what is there?", LiveOptions(every_s=1.0))
    list(stage.process(live_batch([k / 10 for k in range(15)], 0))) + list(stage.finish())
    frames = batcher.requests[0].frames
    assert isinstance(frames, torch.Tensor) and frames.is_pinned()
    assert answer_frames(batcher.requests[0]) == list(range(len(frames)))


def test_live_windows_reach_a_cpu_vlm_as_numpy():
    batcher = RecordingBatcher()
    batcher.vlm = SimpleNamespace(device=torch.device("cpu"))
    stage = LiveVLMStage(batcher, "what is there?", LiveOptions(every_s=1.0))
    list(stage.process(live_batch([k / 10 for k in range(15)], 0))) + list(stage.finish())
    assert isinstance(batcher.requests[0].frames, np.ndarray)
    assert answer_frames(batcher.requests[0]) == list(range(len(batcher.requests[0].frames)))


class TestStagger:
    """LiveOptions.stagger: streams that start together answer at spread-out times, each still every
    `every_s`; without it their windows all fall due at once (one batch queues behind another)."""

    STREAMS = ["a", "b", "c", "d"]

    def answer_times(self, stagger: bool, seconds: float = 6.0, gap_at: float | None = None,
                     vlm_fps: float | None = None) -> dict[str, list[float]]:
        batcher = RecordingBatcher()
        stage = LiveVLMStage(batcher, "what is there?", LiveOptions(every_s=1.0, stagger=stagger), vlm_fps=vlm_fps)
        pts = [k / 10 for k in range(int(seconds * 10))]
        for start in range(0, len(pts), 5):                                 # batches of 5 frames, streams interleaved
            for sid in self.STREAMS:
                chunk = pts[start:start + 5]
                gap = None
                if gap_at is not None and sid == "b" and chunk[0] == gap_at:
                    gap = Gap(sid, gap_at - 0.1, gap_at, gap_at - 0.1, gap_at, "test outage")
                list(stage.process(live_batch(chunk, start, gap=gap, sid=sid)))
        times: dict[str, list[float]] = {sid: [] for sid in self.STREAMS}
        for r in batcher.requests:
            times[r.stream_id].append(round(r.t_end, 3))
        return times

    def test_without_stagger_every_stream_falls_due_at_once(self):
        times = self.answer_times(stagger=False)
        assert len({tuple(t) for t in times.values()}) == 1

    def test_with_stagger_first_answers_spread_over_the_period(self):
        times = self.answer_times(stagger=True)
        firsts = [t[0] for t in times.values()]
        assert len(set(firsts)) == len(self.STREAMS)                          # no two together
        assert all(1.0 <= f < 2.0 for f in firsts)                            # within one extra period
        for t in times.values():                                              # then every second
            assert np.allclose(np.diff(t), 1.0, atol=0.11)

    def test_a_stream_keeps_its_phase_after_a_gap(self):
        # b's phase is 0.618 of a period: answers at 1.7, 2.7, ... (the first frame at or after 1.618);
        # after an outage ending at 3.0 its schedule restarts from there with the same phase
        assert self.answer_times(stagger=True)["b"] == [1.7, 2.7, 3.7, 4.7, 5.7]
        assert self.answer_times(stagger=True, gap_at=3.0)["b"] == [1.7, 2.7, 4.7, 5.7]

    def test_with_the_vlm_rate_phases_fall_on_its_frames(self):
        # 4 VLM frames a second (every 0.25 s from 0): four slots, one stream each, round robin
        times = self.answer_times(stagger=True, vlm_fps=4.0)
        assert [t[0] for t in times.values()] == [1.0, 1.3, 1.5, 1.8]         # 1.25 / 1.75: next 10 fps frame
        five = TestStagger()
        five.STREAMS = ["a", "b", "c", "d", "e"]
        assert five.answer_times(stagger=True, vlm_fps=4.0)["e"][0] == 1.0    # slot 0 again

    def test_stagger_is_checked(self):
        from arr_coc._validate import ConfigError
        with pytest.raises(ConfigError, match="stagger must be true or false"):
            LiveOptions(stagger="yes")


def test_warm_up_spans_one_kept_token_to_the_allocators_two_frame_share():
    """warm_vlm prepares prefixes from one kept token (the allocator may keep less than a frame's
    share) up to the largest window: 2 s at 2 fps and a frame more (its ends may both fall on a
    frame: 5 frames, 3 pairs), each pair keeping two frames' share of what the allocator keeps of
    one frame (10 cells at retention 0.25: retained_tokens' 3, half up, not round()'s 2: 6 a
    pair), plus a timestamp's tokens a pair: 3 x (6 + 10) = 48 (round() would give 42)."""
    asked, warmed = [], []
    geometry = SimpleNamespace(grid=lambda height, width: (2, 5), temporal_patch_size=2)
    vlm = SimpleNamespace(geometry=geometry, config=SimpleNamespace(max_batch=1),
                          prefix_length=lambda question, kept: asked.append(kept) or kept,
                          warm_up=lambda sizes, lengths, **kw: warmed.append((sizes, lengths, kw)))
    cfg = load_config(PipelineConfig, None, ["model.attending.retention=0.25", "vlm.fps=2.0"])
    warm_vlm(vlm, "what moves?", [(56, 140)], cfg, LiveOptions(every_s=2.0))    # 4 frames: 2 pairs
    assert asked == [1, 48]
    assert warmed == [([1], [1, 48], {"frame_sizes": [(56, 140)], "window_frames": 5})]


class TestAnswerPeriod:
    """The next due time is computed, not stepped one period at a time: a tiny period (or a VLM far
    behind) costs one step a frame, and the schedule stays on its grid."""

    def test_a_frame_far_past_the_due_time_is_one_step(self):
        import threading

        batcher = RecordingBatcher()
        stage = LiveVLMStage(batcher, "q", LiveOptions(every_s=1e-3, stagger=False))
        done = threading.Event()

        def feed():
            stage.process(live_batch([0.0], 0))
            stage.process(live_batch([1e9], 1))     # 10^12 periods later: stepping would never end
            done.set()
        threading.Thread(target=feed, daemon=True).start()
        assert done.wait(10.0), "the VLM stage did not finish one frame"
        due = stage.windows["s"].next_due
        assert 1e9 < due <= 1e9 + 1e-3 + 1e-6 and len(batcher.requests) == 1

    @pytest.mark.parametrize("due, pts, every, expected", [
        (1.0, 0.5, 1.0, 1.0),            # not due yet: unchanged
        (1.0, 1.0, 1.0, 2.0),            # due exactly on the grid: the next point
        (1.0, 3.5, 1.0, 4.0),            # periods missed while the VLM answered are skipped
        (0.3, 0.3, 0.1, 0.4),
    ])
    def test_next_due_stays_on_the_grid(self, due, pts, every, expected):
        from pipeline.core.live_stages import next_due_after
        assert next_due_after(due, pts, every) == pytest.approx(expected)

    @pytest.mark.parametrize("every", [1e-20, 0.0, -1.0, float("nan"), float("inf"), 1e308, True])
    def test_options_refuse_periods_that_mean_nothing(self, every):
        from arr_coc._validate import ConfigError
        with pytest.raises(ConfigError, match="--every"):
            LiveOptions(every_s=every)

    @pytest.mark.parametrize("duration", [float("nan"), float("inf")])
    def test_options_refuse_a_duration_that_is_not_finite(self, duration):
        from arr_coc._validate import ConfigError
        with pytest.raises(ConfigError, match="--duration"):
            LiveOptions(duration_s=duration)
