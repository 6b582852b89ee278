"""The QA renderers: deterministic, their objects visible where their ground truth says, the
region question families answered by that ground truth, the held-out renderer kept out."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from evaluation import draw
from evaluation.questions import RELATIONS
from evaluation.renderers import (HELD_OUT, RENDERERS, HeldOutError, MultiRendererClips, scene, training_renderers,
                                  video_id)
from evaluation.scenes import COLORS
from evaluation.synth_qa import ALL_FAMILIES, ANSWER_WORDS, COUNT_WORDS, REGION_FAMILIES, SPLIT_SEEDS

RECIPE_RENDERERS = [r for r in RENDERERS if r != "shapes"]
SEEDS = range(SPLIT_SEEDS["test"].start, SPLIT_SEEDS["test"].start + 8)


@functools.lru_cache(maxsize=None)
def cached(renderer: str, seed: int, draw_objects: bool = True):
    return scene(renderer, seed, split="test", evaluation=True, draw_objects=draw_objects)


class TestRenderers:
    @pytest.mark.parametrize("renderer", RENDERERS)
    def test_deterministic_and_seed_dependent(self, renderer):
        a, b = cached(renderer, SEEDS[0]), scene(renderer, SEEDS[0], split="test", evaluation=True)
        assert np.array_equal(a.clip.frames, b.clip.frames) and a.clip.qas == b.clip.qas
        assert not np.array_equal(a.clip.frames[0], cached(renderer, SEEDS[1]).clip.frames[0])

    @pytest.mark.parametrize("renderer", RECIPE_RENDERERS)
    def test_objects_appear_inside_their_boxes_only(self, renderer):
        for seed in SEEDS[:5]:
            sc, bare = cached(renderer, seed), cached(renderer, seed, False)
            diff = np.abs(sc.clip.frames.astype(np.int16) - bare.clip.frames.astype(np.int16)).max(-1)  # (T, H, W)
            H, W = diff.shape[1:]
            covered = np.zeros(diff.shape, bool)
            for t in sc.tracks:
                for f, box in enumerate(t.boxes):
                    if box is None:
                        continue
                    y0, x0, y1, x1 = max(0, box[0]), max(0, box[1]), min(H, box[2]), min(W, box[3])
                    assert (y1 - y0) * (x1 - x0) >= 0.9 * (box[2] - box[0]) * (box[3] - box[1]), "object out of view"
                    assert (diff[f, y0:y1, x0:x1] > 40).mean() > 0.15, (renderer, seed, t.color, t.shape, f)
                    m = max(4, (box[2] - box[0]) // 4)          # shadow, ring, antialiasing, codec bleed
                    covered[f, max(0, y0 - m):y1 + m, max(0, x0 - m):x1 + m] = True
            assert diff[~covered].mean() < 2.0, (renderer, seed)

    @pytest.mark.parametrize("renderer", RECIPE_RENDERERS)
    def test_colour_recoverable_from_the_pixels(self, renderer):
        """The changed pixels inside an object's box are nearest its colour (of the answer colours)."""
        palette = np.array(list(COLORS.values()), np.float32)
        right = total = 0
        for seed in SEEDS:
            sc, bare = cached(renderer, seed), cached(renderer, seed, False)
            for t in sc.tracks:
                f = next(i for i, b in enumerate(t.boxes) if b is not None)
                y0, x0, y1, x1 = t.boxes[f]
                crop = sc.clip.frames[f, max(0, y0):y1, max(0, x0):x1].astype(np.float32)
                changed = np.abs(crop - bare.clip.frames[f, max(0, y0):y1, max(0, x0):x1]).max(-1) > 40
                rgb = np.median(crop[changed], axis=0)
                seen = list(COLORS)[int(np.linalg.norm(palette - rgb, axis=1).argmin())]
                right += seen == t.color
                total += 1
        assert right >= 0.9 * total, (renderer, right, total)

    def test_object_counts_and_renderers_differ(self):
        counts = {r: [len(cached(r, s).tracks) for s in SEEDS] for r in RECIPE_RENDERERS}
        assert all(1 <= n <= 8 for c in counts.values() for n in c)
        assert max(max(c) for c in counts.values()) > 5            # more objects than the shapes renderer draws
        means = {r: cached(r, SEEDS[0]).clip.frames.astype(np.float32).std() for r in RENDERERS}
        assert means["busy"] > means["shapes"]                     # busy: the saturated, high-contrast one

    def test_photos_are_bundled(self):
        for name in draw.PHOTOS:
            image = draw.photo(name)
            assert image.dtype == np.uint8 and image.ndim == 3 and min(image.shape[:2]) >= 256
        with pytest.raises(ValueError, match="Invalid photo"):
            draw.photo("bikes.mp4")


class TestQuestions:
    def test_every_family_asked_with_vocabulary_answers(self):
        qas = [qa for r in RENDERERS for s in SEEDS for qa in cached(r, s).clip.qas]
        assert {qa.family for qa in qas} == set(ALL_FAMILIES)
        assert {qa.answer for qa in qas} <= set(ANSWER_WORDS)
        assert any(qa.one_object for qa in qas) and any(not qa.one_object for qa in qas)
        for r in RENDERERS:
            assert REGION_FAMILIES[0] in {qa.family for s in SEEDS for qa in cached(r, s).clip.qas} or r == "shapes"

    @pytest.mark.parametrize("renderer", RENDERERS)
    def test_answers_follow_the_tracks(self, renderer):
        for seed in SEEDS:
            sc = cached(renderer, seed)
            tracks = sc.tracks
            for qa in sc.clip.qas:
                named = [tracks[i] for i in qa.names]
                assert all(0 <= i < len(tracks) for i in qa.names)
                if qa.family == "count":
                    assert qa.answer == COUNT_WORDS[len(tracks) - 2] and len(named) == len(tracks)
                elif qa.family == "count_color":
                    color = qa.question.split()[2]
                    assert qa.answer == COUNT_WORDS[sum(t.color == color for t in tracks) - 2]
                    assert {t.color for t in named} == {color}
                elif qa.family in ("color_at", "color_last", "color_moving", "color_after_cut"):
                    assert qa.one_object and qa.answer == named[0].color
                elif qa.family in ("shape_at", "shape"):
                    assert qa.one_object and qa.answer == named[0].shape
                elif qa.family == "moves":
                    assert qa.answer == ("yes" if named[0].travel != (0, 0) else "no")
                elif qa.family == "color_last":
                    first = [next(f for f, b in enumerate(t.boxes) if b is not None) for t in tracks]
                    assert first[qa.names[0]] == max(first) and sorted(first)[-2] < max(first)
                elif qa.family == "relation":
                    a, b = named
                    rel = next(r for r in RELATIONS if f" {r} " in qa.question)
                    axis, sign = RELATIONS[rel]
                    holds = all((bb[axis] >= ba[axis + 2]) if sign == -1 else (ba[axis] >= bb[axis + 2])
                                for ba, bb in zip(a.boxes, b.boxes) if ba is not None and bb is not None)
                    assert qa.answer == ("yes" if holds else "no"), (renderer, seed, qa)
                    assert not qa.one_object


class TestHeldOut:
    def test_held_out_renderer_only_for_evaluation_of_its_test_split(self):
        with pytest.raises(HeldOutError):
            scene(HELD_OUT, 0, split="train")
        with pytest.raises(HeldOutError):
            scene(HELD_OUT, SPLIT_SEEDS["val"].start, split="val", evaluation=True)
        with pytest.raises(HeldOutError):
            scene(HELD_OUT, SPLIT_SEEDS["test"].start, split="test")
        assert scene(HELD_OUT, SPLIT_SEEDS["test"].start, split="test", evaluation=True).clip.qas

    def test_training_renderers_and_clip_source(self):
        assert HELD_OUT not in training_renderers() and set(training_renderers()) == set(RENDERERS) - {HELD_OUT}
        assert training_renderers("photo") == tuple(r for r in RENDERERS if r not in (HELD_OUT, "photo"))
        with pytest.raises(HeldOutError):
            MultiRendererClips(RENDERERS)
        with pytest.raises(ValueError, match="Invalid renderer"):
            MultiRendererClips(("nope",))
        source = MultiRendererClips(("shapes", "photo"))
        assert source(0).frames.std() != source(1).frames.std()
        assert scene("shapes", 0).clip.frames.tobytes() == source(0).frames.tobytes()

    def test_video_ids_do_not_collide(self):
        ids = {video_id(r, s) for r in RENDERERS for s in (0, SPLIT_SEEDS["test"].stop - 1)}
        assert len(ids) == 2 * len(RENDERERS)


def test_contact_sheet_one_row_a_renderer(tmp_path, capsys):
    from evaluation.contact_sheet import LABEL, TILE, main, sheet

    image = sheet(clips=1)
    assert image.shape[0] == len(RENDERERS) * (LABEL + TILE + 6) and image.dtype == np.uint8
    assert main(["--out", str(tmp_path / "s.jpg"), "--clips", "1"]) == 0 and (tmp_path / "s.jpg").stat().st_size > 0
    assert main(["--out", str(tmp_path / "t.jpg"), "--clips", "0"]) == 2 and not (tmp_path / "t.jpg").exists()


def test_shapes_renderer_keeps_the_original_clips_and_questions():
    """The shipped model learnt make_qa_clip's clips: the shapes renderer draws them unchanged and only
    adds region questions after the original ones."""
    from evaluation.synth_qa import FAMILIES, make_qa_clip
    for seed in SEEDS[:4]:
        original, sc = make_qa_clip(seed, split="test"), cached("shapes", seed)
        assert np.array_equal(original.frames, sc.clip.frames)
        assert sc.clip.qas[:len(original.qas)] == original.qas
        assert all(qa.family in REGION_FAMILIES for qa in sc.clip.qas[len(original.qas):])
        assert all(qa.family in FAMILIES for qa in original.qas)
