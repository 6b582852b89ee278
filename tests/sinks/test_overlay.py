"""Homunculus overlay: rendering, labels and legend, H.264 mp4 via PyAV, PNG contact sheet."""
from __future__ import annotations

import av
import cv2
import numpy as np
import pytest

from sinks.overlay import (ALPHA, CUT_COLOUR, DROP_DIM, OUTLINE, FrameLabel, OverlayWriter, colormap, contact_sheet,
                           label_frame, legend_strip, render_homunculus)
from sinks.zarr_store import SinkError

GRAY = 128


def gray_frame(h: int, w: int) -> np.ndarray:
    return np.full((h, w, 3), GRAY, np.uint8)


def half_kept(gh: int = 4, gw: int = 6) -> np.ndarray:
    tokens = np.zeros((gh, gw), np.int32)
    tokens[:, : gw // 2] = 1  # left half kept, right half dropped
    return tokens


def decode(path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


class TestRender:
    def test_kept_tinted_and_outlined_dropped_darkened(self):
        out = render_homunculus(gray_frame(48, 72), half_kept())  # cells are 12 x 12 pixels
        kept_inside, dropped_inside = out[14:22, 14:22], out[14:22, 50:58]
        assert np.all(dropped_inside == int(DROP_DIM * GRAY)) and dropped_inside.max() < GRAY // 2
        assert not np.array_equal(kept_inside[0, 0], [GRAY] * 3)  # tinted by the colour map
        assert np.all(kept_inside == kept_inside[0, 0])
        assert np.all(out[12, 0:36] == OUTLINE) and np.all(out[0:48, 11] == OUTLINE)  # kept cell edges
        assert not np.any(np.all(out[:, 36:] == OUTLINE, axis=-1))  # dropped cells are not outlined

    def test_heat_follows_relevance_or_tokens(self):
        tokens = np.ones((1, 2), np.int32)
        low_high = render_homunculus(gray_frame(10, 20), tokens, np.array([[0.0, 1.0]]))
        assert np.abs(low_high[5, 4].astype(int) - low_high[5, 14].astype(int)).sum() > 100
        by_tokens = render_homunculus(gray_frame(10, 20), np.array([[1, 4]]))
        assert not np.array_equal(by_tokens[5, 4], by_tokens[5, 14])

    def test_relevance_is_a_heat_map_of_every_cell_with_the_kept_ones_outlined(self):
        """--color relevance shows the whole relevance map: a dropped cell is coloured by its
        relevance like a kept one (not darkened), only the outline tells them apart."""
        relevance = np.zeros((4, 6), np.float32)
        relevance[:, 3:] = 1.0                                     # the dropped half is the relevant one
        out = render_homunculus(gray_frame(48, 72), half_kept(), relevance)
        dropped_inside = out[14:22, 50:58].astype(float)
        want = (1 - ALPHA) * GRAY + ALPHA * colormap(np.array(1.0)).astype(float)
        assert np.abs(dropped_inside - want).max() <= 1
        assert not np.any(np.all(out[:, 37:] == OUTLINE, axis=-1)) and np.all(out[12, 0:36] == OUTLINE)

    def test_colormap_is_ordered_dark_to_bright(self):
        lum = colormap(np.linspace(0, 1, 11)).astype(float) @ [0.299, 0.587, 0.114]  # (11,)
        assert np.all(np.diff(lum) > 0)

    def test_shape_checks(self):
        with pytest.raises(ValueError, match="relevance must have the shape of tokens"):
            render_homunculus(gray_frame(8, 8), np.ones((2, 2)), np.ones((2, 3)))
        with pytest.raises(ValueError, match="rgb must be uint8"):
            render_homunculus(np.zeros((8, 8, 3), np.float32), np.ones((2, 2)))


class TestOverlayWriter:
    @pytest.mark.parametrize("h, w", [(48, 72), (47, 71)])
    def test_decodable_mp4_with_frame_count_size_and_visible_cells(self, tmp_path, h, w):
        path = tmp_path / "overlay.mp4"
        with OverlayWriter(path, fps=12, width=w, height=h) as overlay:
            for _ in range(12):
                overlay.write(gray_frame(h, w), half_kept())
        assert overlay.frames == 12
        frames = decode(path)
        assert len(frames) == 12
        assert frames[0].shape == (h + h % 2, w + w % 2, 3)  # odd sides padded to even for yuv420p
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and stream.average_rate == 12
        last = frames[-1].astype(float)
        kept, dropped = last[14:22, 14:22], last[14:22, 50:58]
        assert abs(dropped.mean() - DROP_DIM * GRAY) < 6 and dropped.mean() < GRAY / 2  # darkened, via lossy H.264
        assert kept.mean() - dropped.mean() > 30
        assert np.abs(kept.mean(axis=(0, 1)) - GRAY).max() > 20    # tinted away from the gray frame

    def test_rejects_wrong_frame_and_write_after_close(self, tmp_path):
        overlay = OverlayWriter(tmp_path / "o.mp4", fps=10, width=32, height=16)
        with pytest.raises(ValueError, match=r"rgb must have shape \(16, 32, 3\)"):
            overlay.write(gray_frame(32, 16), np.ones((2, 4)))
        overlay.write(gray_frame(16, 32), np.ones((2, 4)))
        overlay.close()
        with pytest.raises(SinkError, match="already closed"):
            overlay.write(gray_frame(16, 32), np.ones((2, 4)))
        assert len(decode(tmp_path / "o.mp4")) == 1

    def test_unwritable_path(self, tmp_path):
        with pytest.raises(SinkError, match="cannot write the overlay video .*missing_dir"):
            OverlayWriter(tmp_path / "missing_dir" / "o.mp4", fps=10, width=32, height=16)

    def test_bad_fps(self, tmp_path):
        with pytest.raises(ValueError, match="fps must be a number > 0, got 0"):
            OverlayWriter(tmp_path / "o.mp4", fps=0, width=32, height=16)


class TestContactSheet:
    def test_png_grid_dimensions_and_tiles(self, tmp_path):
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 256, size=(5, 30, 40, 3), dtype=np.uint8)
        tokens = rng.integers(0, 4, size=(5, 3, 4))
        path = contact_sheet(frames, tokens, tmp_path / "sheet.png", columns=2, gap=4)
        sheet = cv2.imread(str(path))[..., ::-1]  # BGR -> RGB
        assert sheet.shape == (3 * (30 + 4) + 4, 2 * (40 + 4) + 4, 3)
        scale = float(tokens.max())
        # PNG is lossless: the tile of frame 3 (row 1, column 1) is exactly its overlay
        y, x = 4 + 1 * 34, 4 + 1 * 44
        np.testing.assert_array_equal(sheet[y:y + 30, x:x + 40],
                                      render_homunculus(frames[3], tokens[3], token_scale=scale))
        assert np.all(sheet[:4] == 24) and np.all(sheet[-34:, 48:] == 24)  # gaps, empty last slot

    def test_bad_paths(self, tmp_path):
        frames, tokens = np.zeros((1, 8, 8, 3), np.uint8), np.ones((1, 2, 2))
        with pytest.raises(ValueError, match="must end in .png"):
            contact_sheet(frames, tokens, tmp_path / "sheet.jpg")
        with pytest.raises(SinkError, match="cannot write the contact sheet"):
            contact_sheet(frames, tokens, tmp_path / "missing_dir" / "sheet.png")


class TestLabelsAndLegend:
    def test_label_darkens_its_box_and_writes_in_it(self):
        image = gray_frame(96, 128)
        label_frame(image, FrameLabel(pts_s=1.25, frame_index=31, tokens_kept=12, tokens_full=35))
        box = image[:20, :50]
        assert box.min() < GRAY * 0.4 and box.max() > 200     # darkened, with white text
        assert np.all(image[40:, :] == GRAY)                  # nothing drawn outside the corner
        assert np.all(image[:, -30:] == GRAY)                 # no scene-change tag
        assert FrameLabel(1.25, 31, 12, 35).lines() == ("1.25 s  #31", "12/35 tokens")

    def test_scene_change_gets_a_border_and_a_tag(self):
        image = label_frame(gray_frame(96, 128), FrameLabel(0.0, 0, 1, 35, scene_change=True))
        cut = np.array(CUT_COLOUR, np.uint8)
        assert np.all(image[-1] == cut) and np.all(image[:, 0] == cut) and np.all(image[:, -1] == cut)
        assert np.all(image[3, -12] == cut)                   # the tag's box, top right
        assert np.all(image[60, 64] == GRAY)

    @pytest.mark.parametrize("colour_by, token_scale", [("tokens", 1.0), ("tokens", 3.0), ("tokens", 40.0),
                                                        ("relevance", 1.0)])
    def test_legend_shows_the_colours_the_render_uses(self, colour_by, token_scale):
        strip = legend_strip(320, colour_by=colour_by, token_scale=token_scale)
        assert strip.shape[1] == 320 and strip.dtype == np.uint8 and 20 <= strip.shape[0] <= 80
        colours = {tuple(c) for c in strip.reshape(-1, 3)}
        top = tuple(colormap(np.array(1.0)))                  # the colour of the most tokens / relevance 1
        assert top in colours
        # tokens: the dropped-cell swatch; relevance colours every cell, dropped ones too: none
        assert ((int(DROP_DIM * 128),) * 3 in colours) == (colour_by == "tokens")
        if colour_by == "tokens" and token_scale == 3.0:      # one swatch per count
            for k in (1, 2):
                assert tuple(colormap(np.array(k / 3.0))) in colours

    @pytest.mark.parametrize("scene_change, cuts, tag", [
        (False, (), None), (True, (5,), "CUT"), (False, (3,), "CUT #3"), (True, (3, 5), "CUT #3"),
        (False, (1, 2, 3, 4), "CUTS #1 #2 +2")])
    def test_a_tile_names_the_cuts_it_stands_for(self, scene_change, cuts, tag):
        label = FrameLabel(0.5, 5, 1, 12, scene_change, cuts=cuts)
        assert label.cut_tag() == tag
        image = label_frame(gray_frame(60, 200), label)
        assert np.all(image[30, 0] == CUT_COLOUR) == (tag is not None)     # the border

    def test_legend_rejects_an_unknown_colouring(self):
        with pytest.raises(ValueError, match=r"Invalid colour_by \('hue'\). Supported values are relevance, tokens."):
            legend_strip(100, colour_by="hue")


class TestWriterOptions:
    def test_legend_makes_the_video_taller_and_colours_by_tokens(self, tmp_path):
        path = tmp_path / "legend.mp4"
        strip = legend_strip(72, colour_by="tokens", token_scale=2.0, scale=0.3)
        with OverlayWriter(path, fps=10, width=72, height=48, colour_by="tokens", token_scale=2.0,
                           legend=True) as overlay:
            overlay.write(gray_frame(48, 72), half_kept(), np.zeros((4, 6)), label=FrameLabel(0.0, 0, 12, 24))
        frame = decode(path)[0]
        height = 48 + len(strip)
        assert frame.shape == (height + height % 2, 72, 3)
        assert np.abs(frame[48:48 + len(strip)].astype(float) - strip).mean() < 6
        # tokens 1 of scale 2: the middle of the colour map, not relevance 0's black
        kept = frame[30:34, 14:22].reshape(-1, 3).mean(0)
        expected = (1 - ALPHA) * GRAY + ALPHA * colormap(np.array(0.5)).astype(float)
        assert np.abs(kept - expected).max() < 12

    @pytest.mark.parametrize("kwargs, message", [
        (dict(colour_by="hue"), r"Invalid colour_by \('hue'\)"),
        (dict(token_scale=0), "token_scale must be a number > 0 or None, got 0"),
        (dict(colour_by="tokens", legend=True), "a legend for colour_by='tokens' needs a fixed token_scale"),
    ])
    def test_bad_options(self, tmp_path, kwargs, message):
        with pytest.raises(ValueError, match=message):
            OverlayWriter(tmp_path / "o.mp4", fps=10, width=32, height=16, **kwargs)

    def test_unknown_container_is_a_sink_error(self, tmp_path):
        with pytest.raises(SinkError, match="cannot write the overlay video .*o.nope"):
            OverlayWriter(tmp_path / "o.nope", fps=10, width=32, height=16)

    def test_contact_sheet_labels_must_match_the_frames(self, tmp_path):
        frames, tokens = np.zeros((2, 8, 8, 3), np.uint8), np.ones((2, 2, 2))
        with pytest.raises(ValueError, match=r"labels must hold one FrameLabel per frame \(2\), got 1"):
            contact_sheet(frames, tokens, tmp_path / "s.png", labels=[FrameLabel(0.0, 0, 4, 4)])
