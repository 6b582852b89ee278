"""The stages of the offline graph: the VLM stage's answer windows (on CPU, with a recording VLM),
and on GPU runs, frames decoded in the worker going from its page-locked slots straight to the
device (YUV planes converted there) and giving the same store as the host path."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pipeline.config import PipelineConfig
from pipeline.configio import load_config
from pipeline.runners.run import run_video
from pipeline.runtime.cuda import pins_frames, window_frames
from pipeline.core.items import AllocationBatch, AnswerItem, FrameBatch, FrameRef
from pipeline.core.stages import DecodeStage, VLMStage
from pipeline.runtime.requests import AnswerResult
from sinks import read_stream
from sources.frame import Frame
from sources.synthetic import Shot, render_clip, write_video

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class RecordingVLM:
    """Answers every request with its frame count, and keeps the requests."""

    def __init__(self) -> None:
        self.requests = []

    def answer(self, requests):
        self.requests += requests
        return [AnswerResult(text=str(len(r.frames)), tokens_kept=1, tokens_full=4, latency_s=0.0) for r in requests]

    def frames(self, k: int) -> list[int]:
        """Which frames (by index: each frame's pixels hold its index) the k-th request carried."""
        return [int(f[0, 0, 0]) + 256 * int(f[0, 0, 1]) for f in self.requests[k].frames]


def allocations(indices: list[int], fps: float = 10.0, pts: list[float] | None = None) -> AllocationBatch:
    """A batch of frames whose pixels hold their index (red + 256 green), every one sampled for the VLM."""
    pts = [i / fps for i in indices] if pts is None else pts
    frames = [Frame("s", i, t, np.broadcast_to(np.array([i % 256, i // 256, 0], np.uint8), (4, 4, 3)))
              for i, t in zip(indices, pts)]
    relevance = torch.tensor(indices, dtype=torch.float64)[:, None, None].expand(-1, 2, 2) / 10000  # index / 1e4
    allocation = SimpleNamespace(lod=torch.ones(len(frames), 2, 2, dtype=torch.int8), relevance=relevance)
    return AllocationBatch(FrameBatch("s", frames, torch.zeros(len(frames), 4, 4, 3, dtype=torch.uint8)),
                           allocation, None, vlm_frames=[True] * len(frames))


def run_stage(stage: VLMStage, batches: list[AllocationBatch]) -> list[AnswerItem]:
    out = [x for b in batches for x in stage.process(b)] + list(stage.finish())
    return [x for x in out if isinstance(x, AnswerItem)]


class TestVLMWindows:
    def test_windows_follow_a_fixed_grid(self):
        vlm = RecordingVLM()
        answers = run_stage(VLMStage(vlm, "q", every_s=1.0), [allocations(list(range(i, i + 5))) for i in range(0, 25,
                                                                                                                5)])
        assert [(a.t_start, a.t_end) for a in answers] == [(0.0, 1.0), (1.0, 2.0), (2.0, 2.4)]
        assert [vlm.frames(k) for k in range(3)] == [list(range(0, 10)), list(range(10, 20)), list(range(20, 25))]

    def test_after_a_jump_in_pts_the_window_is_the_one_the_frame_falls_in(self):
        # frames 0.0-1.9 s, then nothing until 4.3 s: the next window is [4, 5), not [2, 3) or [4.3, 5.3)
        vlm = RecordingVLM()
        before = allocations(list(range(20)))
        after = allocations(list(range(20, 35)), pts=[4.3 + k / 10 for k in range(15)])
        answers = run_stage(VLMStage(vlm, "q", every_s=1.0), [before, after])
        assert [(a.t_start, a.t_end) for a in answers] == [(0.0, 1.0), (1.0, 2.0), (4.0, 5.0),
                                                            (5.0, pytest.approx(5.7))]
        assert vlm.frames(2) == list(range(20, 27)) and vlm.frames(3) == list(range(27, 35))

    @pytest.mark.parametrize("max_frames", [4, 5, 256])
    def test_a_long_window_keeps_an_even_spread_of_all_of_it(self, max_frames):
        vlm = RecordingVLM()
        n = 1200                                        # 10 min at the VLM's 2 fps, answered at the end
        answers = run_stage(VLMStage(vlm, "q", every_s=None, max_frames=max_frames),
                            [allocations(list(range(i, i + 8)), fps=2.0) for i in range(0, n, 8)])
        assert len(answers) == 1 and answers[0].t_start == 0.0 and answers[0].t_end == (n - 1) / 2
        indices = np.array(vlm.frames(0))
        assert max_frames // 2 < len(indices) <= max_frames
        # pass 1's relevance is kept and thinned with its frames
        np.testing.assert_allclose(vlm.requests[0].scores[:, 0, 0] * 10000, indices, atol=1e-3)
        steps = np.diff(indices)
        assert indices[0] == 0 and len(set(steps.tolist())) == 1      # evenly spaced from the window's start
        assert n - indices[-1] <= steps[0]                            # ... to its end


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    clip = render_clip([Shot("moving_object", 30, speed=3.0), Shot("pan", 30)], height=144, width=256, seed=2)
    return write_video(tmp_path_factory.mktemp("dev") / "clip.mp4", clip.frames, fps=25), clip


def run(path, out, process: bool, decoder: str = "pyav"):
    cfg = load_config(PipelineConfig, None, ["runtime.device=cuda", "runtime.vlm=none", "runtime.batch_size=8",
                                             f"decode.process={str(process).lower()}", f"decode.decoder={decoder}"])
    query = torch.nn.functional.normalize(torch.randn(384, generator=torch.Generator().manual_seed(0)), dim=0)
    graphs = []
    result = run_video(path, "where is the square?", out, cfg, progress=False, query_embedding=query,
                       on_graph=graphs.append)
    return result, graphs[0].stages[0], read_stream(out, result.stream_id)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("decoder", ["pyav", pytest.param("decord", marks=pytest.mark.skipif(
    importlib.util.find_spec("decord") is None, reason="needs decord"))])
def test_device_path_matches_the_host_path(clip, tmp_path, decoder):
    path, _ = clip
    host, _, ref = run(path, tmp_path / "host.zarr", process=False, decoder=decoder)
    dev, dev_stage, got = run(path, tmp_path / "dev.zarr", process=True, decoder=decoder)
    assert isinstance(dev_stage, DecodeStage) and dev_stage.device is not None
    assert (dev_stage.source.yuv is not None) == (decoder == "pyav")  # decord hands over RGB
    assert dev_stage._registered is None                                # unregistered at close
    assert host.frames == dev.frames == 60 and dev.complete
    assert np.array_equal(got["frame_index"], ref["frame_index"]) and np.allclose(got["pts"], ref["pts"])
    assert np.array_equal(got["scene_change"], ref["scene_change"])
    assert np.flatnonzero(got["scene_change"])[1:].tolist() == [30]
    # YUV converted on the GPU differs from swscale by <= 2 levels: relevance barely moves
    assert np.abs(got["relevance"].astype(float) - ref["relevance"].astype(float)).mean() < 0.02
    assert (got["tokens"] == ref["tokens"]).mean() > 0.95


@cuda
@pytest.mark.cuda
def test_device_batches_carry_frame_refs(clip):
    from pipeline.core.items import RunStatus
    from sources.process import ProcessSource

    path, _ = clip
    with ProcessSource(path, batch_size=16, slots=3, device_color=True) as source:
        stage = DecodeStage(source, 16, pin=True, status=RunStatus(), device=torch.device("cuda"))
        batches = list(stage.produce())
        stage.close()
    assert [b.frames_count for b in batches] == [16, 16, 16, 12]
    assert all(isinstance(f, FrameRef) for b in batches for f in b.frames)
    assert all(b.pixels.is_cuda and b.pixels.shape[1:] == (144, 256, 3) for b in batches)


class TestWindowHandOver:
    """An answer window reaches an in-process VLM on a GPU stacked in page-locked memory (its upload
    then needs no host copy first); any other VLM gets a numpy array, as before."""

    def test_which_vlms_get_pinned_windows(self):
        assert pins_frames(SimpleNamespace(device=torch.device("cuda")))
        assert pins_frames(SimpleNamespace(device=torch.device("cuda", 0)))
        assert not pins_frames(SimpleNamespace(device=torch.device("cpu")))
        assert not pins_frames(SimpleNamespace())            # a VLM in its own process (vlm/remote.py)
        assert not pins_frames(None)                         # a batcher without a VLM (tests)

    def test_a_cpu_vlm_gets_a_numpy_window(self):
        vlm = RecordingVLM()
        vlm.device = torch.device("cpu")
        run_stage(VLMStage(vlm, "q", every_s=1.0), [allocations(list(range(12)))])
        frames = vlm.requests[0].frames
        assert isinstance(frames, np.ndarray) and frames.shape == (10, 4, 4, 3)
        assert vlm.frames(0) == list(range(10))

    def test_window_frames_equals_stacking(self):
        arrays = [np.random.default_rng(i).integers(0, 255, (5, 7, 3), dtype=np.uint8) for i in range(4)]
        out = window_frames(arrays, False)
        assert isinstance(out, np.ndarray) and np.array_equal(out, np.stack(arrays))

    @cuda
    @pytest.mark.cuda
    def test_a_gpu_vlm_gets_the_window_pinned(self):
        vlm = RecordingVLM()
        vlm.device = torch.device("cuda")
        run_stage(VLMStage(vlm, "q", every_s=1.0), [allocations(list(range(12)))])
        frames = vlm.requests[0].frames
        assert isinstance(frames, torch.Tensor) and frames.is_pinned() and frames.dtype == torch.uint8
        assert vlm.frames(0) == list(range(10))
        arrays = [np.full((5, 7, 3), i, np.uint8) for i in range(3)]
        pinned = window_frames(arrays, True)
        assert pinned.is_pinned() and np.array_equal(pinned.numpy(), np.stack(arrays))


class QuestionsVLM(RecordingVLM):
    """A batch VLM: records answer_windows' frames and answers each question with the frame count."""

    def answer_windows(self, jobs):
        self.windows = getattr(self, "windows", []) + [job.frames for job in jobs]
        return [[AnswerResult(text=str(len(job.frames)), tokens_kept=1, tokens_full=4, latency_s=0.0)
                 for _ in job.questions] for job in jobs]


class TestBatchQuestionsWindow:
    """runners.batch.QuestionsStage hands a video's frames over as VLMStage does its windows."""

    @staticmethod
    def answer(device: str):
        """A one-question video of 6 frames through QuestionsStage with a VLM on `device` and a keep
        policy that records the type of frames it gets -> (the frames the VLM got, the stage, its
        finish() output, the policy's frame types)."""
        from pipeline.runners.batch import QuestionsStage
        from sources.msrvtt import Question, VideoWork
        vlm = QuestionsVLM()
        vlm.device = torch.device(device)
        seen = []
        work = VideoWork("v", None, (Question("1", "v", "what is it?", "x", "what"),))
        stage = QuestionsStage(vlm, work, keep_policy=lambda frames, keep: seen.append(type(frames)) or keep)
        list(stage.process(allocations(list(range(6)))))
        finished = list(stage.finish())
        return vlm.windows[0], stage, finished, seen

    def test_a_cpu_vlm_gets_a_numpy_video(self):
        frames, stage, finished, seen = self.answer("cpu")
        assert len(finished) == 1 and stage.answered == 1
        assert isinstance(frames, np.ndarray) and frames.shape == (6, 4, 4, 3)
        assert seen == [np.ndarray]                                           # keep policies take numpy

    @cuda
    @pytest.mark.cuda
    def test_a_gpu_vlm_gets_the_video_pinned(self):
        frames, _, _, seen = self.answer("cuda")
        assert isinstance(frames, torch.Tensor) and frames.is_pinned() and tuple(frames.shape) == (6, 4, 4, 3)
        assert seen == [np.ndarray]
