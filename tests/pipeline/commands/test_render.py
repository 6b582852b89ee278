"""`render STORE --stream ID --video VIDEO`: a store's token maps over its video, labelled, with a
legend; the frames matched by frame_index; and bad input."""
from __future__ import annotations

import re
from pathlib import Path

import av
import cv2
import numpy as np
import pytest

from pipeline.commands.cli import main
from pipeline.runners.render import render_store
from sinks import ZarrStore, read_stream
from sinks.overlay import CUT_COLOUR, FrameLabel, label_frame, legend_strip, render_homunculus
from sources import open_video
from sources.synthetic import Shot, render_clip, write_video

H, W, GRID = 48, 64, (3, 4)
VIDEO_FRAMES = 12
ROWS = np.arange(0, VIDEO_FRAMES, 2)    # the store holds every other frame (as with decode.fps)
CUT_ROW = 3                             # frame 6


@pytest.fixture(scope="module")
def video(tmp_path_factory: pytest.TempPathFactory) -> Path:
    clip = render_clip([Shot("moving_object", VIDEO_FRAMES, speed=2.0)], height=H, width=W, seed=9)
    return write_video(tmp_path_factory.mktemp("render") / "clip.mp4", clip.frames, fps=10)


@pytest.fixture(scope="module")
def decoded(video: Path) -> list[np.ndarray]:
    with open_video(video) as source:
        return [f.rgb for f in source]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, video: Path) -> Path:
    path = tmp_path_factory.mktemp("render_store") / "s.zarr"
    writer = ZarrStore.open(path, config={}).stream("clip", source=str(video), query="q", fps=5.0, width=W, height=H,
                                                    grid=GRID, vlm="none")
    n = len(ROWS)
    tokens = np.zeros((n, *GRID), np.int32)
    for k in range(n):
        tokens[k].flat[: k + 1] = 1 + k % 2            # k + 1 cells kept; 1 or 2 tokens each
    scene_change = np.zeros(n, bool)
    scene_change[[0, CUT_ROW]] = True
    writer.append(pts=ROWS / 10.0, frame_index=ROWS, relevance=np.linspace(0, 1, n * 12).reshape(n, *GRID),
                  tokens=tokens, scene_change=scene_change, motion=np.zeros(n))
    writer.close(complete=True)
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def expected_tile(decoded: list[np.ndarray], data: dict, row: int, colour_by: str = "tokens",
                  cuts: tuple[int, ...] | None = None, since: int | None = None) -> np.ndarray:
    """The tile of stored row `row`; cuts: the frames of the scene changes it stands for (default:
    its own frame's, if it is one, or with `since` those of rows since..row)."""
    if since is not None:
        cuts = tuple(int(data["frame_index"][k]) for k in range(since, row + 1) if data["scene_change"][k])
    tokens = data["tokens"][row]
    relevance = data["relevance"][row].astype(np.float32) if colour_by == "relevance" else None
    tile = render_homunculus(decoded[int(data["frame_index"][row])], tokens, relevance,
                             token_scale=float(data["tokens"].max()))
    own = bool(data["scene_change"][row])
    cuts = ((int(data["frame_index"][row]),) if own else ()) if cuts is None else cuts
    label = FrameLabel(float(data["pts"][row]), int(data["frame_index"][row]), int(tokens.sum()), tokens.size,
                       own, cuts=cuts, unchanged=int(tokens.sum()) == 0 and not own)
    return label_frame(tile, label)


class TestContactSheet:
    @pytest.mark.parametrize("colour_by", ["tokens", "relevance"])
    def test_tiles_are_the_stored_frames_labelled_with_a_legend(self, capsys, tmp_path, store, video, decoded,
                                                                colour_by):
        out = tmp_path / "sheet.png"
        code, stdout, err = run(capsys, "render", store, "--stream", "clip", "--video", video, "--contact-sheet", out,
                                "--tiles", "6", "--columns", "3", "--color", colour_by)
        assert code == 0, err
        assert '"frames": 6' in stdout
        sheet = cv2.imread(str(out))[..., ::-1]
        data = read_stream(store, "clip")
        gap = 4
        legend = legend_strip(3 * (W + gap) + gap, colour_by=colour_by, token_scale=2.0, scale=0.3)
        assert sheet.shape == (2 * (H + gap) + gap + len(legend), 3 * (W + gap) + gap, 3)
        np.testing.assert_array_equal(sheet[-len(legend):], legend)
        for k in range(6):                    # PNG is lossless: each tile is exactly its overlay
            y, x = gap + (k // 3) * (H + gap), gap + (k % 3) * (W + gap)
            np.testing.assert_array_equal(sheet[y:y + H, x:x + W], expected_tile(decoded, data, k, colour_by))

    def test_tiles_spread_over_the_stream(self, capsys, tmp_path, store, video, decoded):
        out = tmp_path / "three.png"
        assert run(capsys, "render", store, "--stream", "clip", "--video", video, "--contact-sheet", out,
                   "--tiles", "3")[0] == 0
        sheet = cv2.imread(str(out))[..., ::-1]
        data = read_stream(store, "clip")
        # rows 0, 2.5 -> 2, 5 of 6; the cut at row 3 (frame 6) falls between tiles: the tile after it names it
        for tile, (row, cuts) in enumerate([(0, (0,)), (2, ()), (5, (2 * CUT_ROW,))]):
            x = 4 + tile * (W + 4)
            np.testing.assert_array_equal(sheet[4:4 + H, x:x + W], expected_tile(decoded, data, row, cuts=cuts))

    def test_a_frame_without_tokens_says_it_was_unchanged(self, capsys, tmp_path, video, decoded):
        """0 of N tokens after a frame the VLM saw: nothing changed, the earlier tokens serve; the
        label says so instead of a bare "0/12 tokens"."""
        path = tmp_path / "s.zarr"
        writer = ZarrStore.open(path, config={}).stream("clip", source=str(video), query="q", fps=5.0, width=W,
                                                        height=H, grid=GRID, vlm="none")
        tokens = np.zeros((2, *GRID), np.int32)
        tokens[0] = 1
        writer.append(pts=[0.0, 0.2], frame_index=[0, 2], relevance=np.full((2, *GRID), 0.5), tokens=tokens,
                      scene_change=[True, False], motion=np.zeros(2))
        writer.close(complete=True)
        out = tmp_path / "sheet.png"
        assert run(capsys, "render", path, "--stream", "clip", "--video", video, "--contact-sheet", out)[0] == 0
        sheet = cv2.imread(str(out))[..., ::-1]
        data = read_stream(path, "clip")
        tile = render_homunculus(decoded[2], tokens[1], token_scale=1.0)
        want = label_frame(tile, FrameLabel(0.2, 2, 0, 12, unchanged=True))
        assert FrameLabel(0.2, 2, 0, 12, unchanged=True).lines()[-1] == "unchanged: reused"
        np.testing.assert_array_equal(sheet[4:4 + H, 8 + W:8 + 2 * W], want)
        assert data["tokens"][1].sum() == 0


class TestOverlay:
    def test_every_stored_frame_with_labels_legend_and_cut_marks(self, capsys, tmp_path, store, video):
        out = tmp_path / "overlay.mp4"
        code, stdout, err = run(capsys, "render", store, "--stream", "clip", "--video", video, "--out", out)
        assert code == 0, err
        with av.open(str(out)) as container:
            stream = container.streams.video[0]
            assert stream.average_rate == 5                    # the stream's rate, not the video's
            frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
        assert len(frames) == len(ROWS)
        legend = legend_strip(W, colour_by="tokens", token_scale=2.0, scale=0.3)
        assert frames[0].shape == (H + len(legend) + (H + len(legend)) % 2, W, 3)
        strip = frames[1][H:H + len(legend)].astype(float)
        assert np.abs(strip - legend.astype(float)).mean() < 6      # the legend, through lossy H.264
        cyan = np.array(CUT_COLOUR, float)
        # the scene-change border: frames 0 and 3 have it, the others do not
        edge = [np.abs(f[H // 2, 0].astype(float) - cyan).max() for f in frames]
        assert edge[0] < 40 and edge[CUT_ROW] < 40
        assert all(e > 60 for k, e in enumerate(edge) if k not in (0, CUT_ROW))


def test_a_run_store_renders_its_sampled_frames(capsys, tmp_path, video, decoded):
    """The store `run` writes at a lower frame rate holds frame indices 0, 2, 4, ...: render finds them."""
    from pipeline import Pipeline

    store = tmp_path / "run.zarr"
    Pipeline(device="cpu", overrides={"decode.fps": 5.0, "runtime.batch_size": 4}).run(video, "q", out=store)
    data = read_stream(store, "clip")
    assert data["frame_index"].tolist() == ROWS.tolist()
    result = render_store(store, "clip", video, sheet=tmp_path / "run.png", tiles=2, columns=2)
    sheet = cv2.imread(str(result.out))[..., ::-1]
    np.testing.assert_array_equal(sheet[4:4 + H, 4 + W + 4:4 + 2 * W + 4], expected_tile(decoded, data, 5, since=1))


class TestBadInput:
    @pytest.mark.parametrize("case, args, message", [
        ("missing store", ["{tmp}/nope.zarr", "--stream", "clip", "--video", "{video}", "--out", "{tmp}/o.mp4"],
         "nope.zarr is not a zarr store"),
        ("unknown stream", ["{store}", "--stream", "other", "--video", "{video}", "--out", "{tmp}/o.mp4"],
         "stream 'other' not found in .*; streams: clip"),
        ("missing video", ["{store}", "--stream", "clip", "--video", "{tmp}/nope.mp4", "--out", "{tmp}/o.mp4"],
         "nope.mp4: no such file"),
        ("another video's size", ["{store}", "--stream", "clip", "--video", "{big}", "--out", "{tmp}/o.mp4"],
         r"big.mp4 is 96x64 but stream 'clip' of .* was made from a 64x48 video"),
        ("too short a video", ["{store}", "--stream", "clip", "--video", "{short}", "--out", "{tmp}/o.mp4"],
         r"short.mp4 has no frame 6, which stream 'clip' of .* holds"),
        ("sheet not png", ["{store}", "--stream", "clip", "--video", "{video}", "--contact-sheet", "{tmp}/s.jpg"],
         r"the contact sheet must end in .png, got '.*s.jpg'"),
        ("overlay suffix", ["{store}", "--stream", "clip", "--video", "{video}", "--out", "{tmp}/o.gif"],
         r"the overlay video must end in .mp4, .mkv, .mov"),
        ("both outputs", ["{store}", "--stream", "clip", "--video", "{video}", "--out", "{tmp}/o.mp4",
                          "--contact-sheet", "{tmp}/s.png"], "not allowed with argument"),
        ("no output", ["{store}", "--stream", "clip", "--video", "{video}"],
         "one of the arguments --out --contact-sheet is required"),
        ("no stream", ["{store}", "--video", "{video}", "--out", "{tmp}/o.mp4"], "required: --stream"),
        ("bad colour", ["{store}", "--stream", "clip", "--video", "{video}", "--out", "{tmp}/o.mp4", "--color", "hue"],
         "invalid choice: 'hue'"),
        ("no tiles", ["{store}", "--stream", "clip", "--video", "{video}", "--contact-sheet", "{tmp}/s.png",
                      "--tiles", "0"], "tiles must be an integer >= 1, got 0"),
    ])
    def test_one_line_exit_2_and_nothing_written(self, capsys, tmp_path, store, video, case, args, message):
        big = write_video(tmp_path / "big.mp4", np.zeros((2, 64, 96, 3), np.uint8), fps=10)
        short = write_video(tmp_path / "short.mp4", np.zeros((5, H, W, 3), np.uint8), fps=10)
        subs = dict(tmp=tmp_path, store=store, video=video, big=big, short=short)
        code, out, err = run(capsys, "render", *[a.format(**subs) for a in args])
        assert code == 2, (case, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and re.search(message, lines[0]), (case, err)
        assert "Traceback" not in err
        assert not any(p.suffix in (".mp4", ".png", ".jpg", ".gif") and p.stem in ("o",
                                                                                   "s") for p in tmp_path.iterdir())
