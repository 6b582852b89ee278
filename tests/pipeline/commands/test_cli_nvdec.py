"""`run --decoder nvdec`: one clear line where NVDEC cannot be used, the fallback, and (through a
double of sources.nvdec's decoder, frames as tensors) the whole graph on GPU-decoded frames."""
from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest
import torch

from pipeline.commands.cli import main
from sinks import read_stream
from sources import NvdecFallbackWarning, nvdec
from sources.synthetic import Shot, render_clip, write_video


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    frames = render_clip([Shot("moving_object", 20, speed=2.0), Shot("pan", 20)], height=144, width=192, seed=11).frames
    return write_video(tmp_path_factory.mktemp("nvdec_cli") / "clip.mp4", frames, fps=25)


class NV12Decoder:
    """NvdecDecoder's double: FFmpeg's decoder given each packet's bytes and pts, its frames
    repacked as NV12 tensors (H * 3 / 2, W)."""

    stream, ordered = None, False

    def __init__(self, name: str, codec: str, gpu_id: int | None = None) -> None:
        self.context = av.CodecContext.create(codec, "r")

    def decode(self, packet):
        data = None
        if packet is not None:
            data = av.Packet(bytes(packet))
            data.pts = packet.pts
        return [(f.pts, torch.from_numpy(f.reformat(format="nv12").to_ndarray())) for f in self.context.decode(data)]

    def close(self) -> None:
        pass


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without a GPU")
def test_nvdec_without_a_gpu_is_one_error_line(capsys, tmp_path, clip):
    out = tmp_path / "out.zarr"
    code, _, stderr = run_cli(capsys, "run", str(clip), "--query", "q", "--out", str(out), "--decoder", "nvdec")
    assert code == 2
    assert stderr.strip().splitlines() == [f"error: {clip}: decoder=nvdec cannot be used: no CUDA GPU is available"]
    assert not out.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback without a GPU")
def test_fallback_warns_once_and_decodes_with_pyav(capsys, tmp_path, clip):
    out = tmp_path / "out.zarr"
    with pytest.warns(NvdecFallbackWarning) as caught:
        code, _, stderr = run_cli(capsys, "run", str(clip), "--query", "q", "--out", str(out), "--decoder", "nvdec",
                                  "--set", "decode.fallback=true", "--device", "cpu")
    assert code == 0, stderr
    assert [str(w.message) for w in caught if w.category is NvdecFallbackWarning] == [
        f"{clip}: decoding with pyav: nvdec cannot be used (no CUDA GPU is available)"]
    assert read_stream(out, "clip")["attrs"]["complete"] is True


def test_gpu_decoded_frames_run_the_whole_graph(capsys, tmp_path, clip, monkeypatch):
    """Frames held as tensors (as NVDEC's are) give the store PyAV's frames give, within the colour
    conversion's rounding."""
    monkeypatch.setattr(nvdec, "check_available", lambda name: None)
    monkeypatch.setattr(nvdec, "open_decoder", NV12Decoder)
    stores = {}
    for decoder in ("pyav", "nvdec"):
        stores[decoder] = tmp_path / f"{decoder}.zarr"
        code, _, stderr = run_cli(capsys, "run", str(clip), "--query", "where is the red square?", "--out",
                                  str(stores[decoder]), "--decoder", decoder, "--device", "cpu",
                                  "--set", "runtime.batch_size=8")
        assert code == 0, stderr
    ref, got = read_stream(stores["pyav"], "clip"), read_stream(stores["nvdec"], "clip")
    assert got["attrs"]["complete"] is True
    assert got["frame_index"].tolist() == ref["frame_index"].tolist() == list(range(40))
    assert np.allclose(got["pts"], ref["pts"])
    assert got["scene_change"].tolist() == ref["scene_change"].tolist()
    assert np.abs(got["relevance"].astype(float) - ref["relevance"].astype(float)).mean() < 0.02
