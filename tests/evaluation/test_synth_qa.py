"""evaluation.synth_qa: every answer checked against the rendered pixels (or the scene description),
never against the generator's own answer functions; the splits, the files and determinism."""
from __future__ import annotations

import json
from functools import lru_cache

import numpy as np
import pytest
from scipy import ndimage

from sources import open_video
from sources.msrvtt import load_msrvtt
from evaluation.scenes import COLORS
from evaluation.synth_qa import (ANSWER_WORDS, FAMILIES, SPLIT_SEEDS, QAClip, main, make_qa_clip, make_qa_scene,
                              write_split)

WHEEL = (25, 25, 25)                 # scenes.paint draws a car's wheels in this grey
NAMES = {rgb: name for name, rgb in COLORS.items()}
REGIONS = [["top left", "top center", "top right"], ["middle left", "center", "middle right"],
           ["bottom left", "bottom center", "bottom right"]]
SEEDS = {split: [SPLIT_SEEDS[split].start + 7919 * i for i in range(36)] for split in ("train", "test")}


@lru_cache(maxsize=None)
def scene(seed: int, split: str):
    return make_qa_scene(seed, split=split)


def all_scenes():
    return [(scene(s, split), split) for split, seeds in SEEDS.items() for s in seeds]


def blobs(frame: np.ndarray) -> dict[tuple[int, int, int], np.ndarray]:
    """Flat-coloured regions (objects are painted in one colour; the background has grain):
    colour -> mask of its largest connected region."""
    rgb = frame.astype(np.int32)
    packed = (rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2]               # (H, W) one int per colour
    c = packed[1:-1, 1:-1]
    interior = (c == packed[:-2, 1:-1]) & (c == packed[2:, 1:-1]) & (c == packed[1:-1, :-2]) & (c == packed[1:-1, 2:])
    values, counts = np.unique(c[interior], return_counts=True)
    out = {}
    for value in values[counts >= 6].tolist():
        colour = (value >> 16, (value >> 8) & 255, value & 255)
        if colour == WHEEL:
            continue
        labels, k = ndimage.label(packed == value)
        sizes = np.bincount(labels.ravel())[1:]
        out[colour] = labels == 1 + int(np.argmax(sizes))
    return out


def bbox(mask: np.ndarray) -> tuple[int, int, int, int]:
    ys, xs = np.nonzero(mask)
    return int(ys.min()), int(xs.min()), int(ys.max()) + 1, int(xs.max()) + 1


def colour_name(rgb: tuple[int, int, int], frame: np.ndarray, mask: np.ndarray) -> str:
    """The named colour of a blob; a low-contrast blob (40% colour, 60% surround) is un-blended
    with the mean of a ring of background around it."""
    if rgb in NAMES:
        return NAMES[rgb]
    y0, x0, y1, x1 = bbox(mask)
    pad = max(3, (y1 - y0) // 3)
    ring = np.zeros_like(mask)
    ring[max(0, y0 - pad):y1 + pad, max(0, x0 - pad):x1 + pad] = True
    ring &= ~ndimage.binary_dilation(mask, iterations=2) & ~(frame == WHEEL).all(-1)
    surround = frame[ring].astype(np.float64).mean(0)
    estimate = (np.array(rgb) - 0.6 * surround) / 0.4
    return min(COLORS, key=lambda name: np.linalg.norm(estimate - np.array(COLORS[name])))


def shape_name(frame: np.ndarray, mask: np.ndarray) -> str:
    y0, x0, y1, x1 = bbox(mask)
    if (frame[y0:y1, x0:x1] == WHEEL).all(-1).any():
        return "car"
    fill = mask[y0:y1, x0:x1].mean()
    return "square" if fill > 0.93 else "triangle" if fill < 0.65 else "circle"


def named_blobs(frame: np.ndarray) -> dict[str, np.ndarray]:
    return {colour_name(rgb, frame, m): m for rgb, m in blobs(frame).items()}


@lru_cache(maxsize=None)
def frame_blobs(seed: int, split: str, t: int) -> dict[str, np.ndarray]:
    return named_blobs(scene(seed, split).clip.frames[t])


def steady_frames(sc) -> list[int]:
    """Frames shown outside any transition (fades dim every colour)."""
    return [t for t, s in enumerate(sc.shot) if s >= 0]


def qas_of(family: str):
    out = [(sc, split, qa) for sc, split in all_scenes() for qa in sc.clip.qas if qa.family == family]
    assert len(out) >= 8, f"only {len(out)} {family} questions in the sample"
    return out


class TestAnswersAgainstPixels:
    def test_color_moving_is_the_colour_frame_differencing_finds(self):
        for sc, split, qa in qas_of("color_moving"):
            frames, moving = sc.clip.frames, set()
            for t in range(len(frames) - 1):
                if sc.shot[t] < 0 or sc.shot[t] != sc.shot[t + 1]:
                    continue
                changed = (frames[t] != frames[t + 1]).any(-1)
                for name, m in frame_blobs(sc.clip.seed, split, t + 1).items():
                    if (m & changed).sum() > 3:
                        moving.add(name)
            assert moving == {qa.answer}, (sc.clip.seed, split, qa, moving)

    def test_where_is_the_region_of_the_named_objects_centre(self):
        for sc, split, qa in qas_of("where"):
            color, shape = qa.question.rstrip("?").split()[-2:]
            H, W = sc.clip.frames.shape[1:3]
            seen = set()
            for t in steady_frames(sc):
                m = frame_blobs(sc.clip.seed, split, t).get(color)
                if m is None:
                    continue
                assert shape_name(sc.clip.frames[t], m) == shape
                y0, x0, y1, x1 = bbox(m)
                cy, cx = (y0 + y1) / 2 / H, (x0 + x1) / 2 / W
                # plain to see: the centre is not on a region border
                assert min(abs(c - b) for c in (cy, cx) for b in (1 / 3, 2 / 3)) > 0.02, (sc.clip.seed, qa, t)
                seen.add(REGIONS[int(cy * 3)][int(cx * 3)])
            assert seen == {qa.answer}, (sc.clip.seed, split, qa, seen)

    def test_shape_is_the_outline_of_the_named_colour(self):
        for sc, split, qa in qas_of("shape"):
            color = qa.question.split()[-2]
            shapes = {shape_name(sc.clip.frames[t], m) for t in steady_frames(sc)[::4]
                      for name, m in frame_blobs(sc.clip.seed, split, t).items() if name == color}
            assert shapes == {qa.answer}, (sc.clip.seed, split, qa, shapes)

    def test_count_is_the_number_of_coloured_blobs(self):
        words = {"two": 2, "three": 3, "four": 4, "five": 5}
        for sc, split, qa in qas_of("count"):
            for t in steady_frames(sc)[::5]:
                assert len(blobs(sc.clip.frames[t])) == words[qa.answer], (sc.clip.seed, split, t, qa)

    def test_exists_matches_the_blobs_shown(self):
        answers = []
        for sc, split, qa in qas_of("exists"):
            article_free = qa.question.rstrip("?").split()
            color, shape = article_free[-2:]
            shown = {(name, shape_name(sc.clip.frames[t], m)) for t in steady_frames(sc)[::3]
                     for name, m in frame_blobs(sc.clip.seed, split, t).items()}
            assert qa.answer == ("yes" if (color, shape) in shown else "no"), (sc.clip.seed, split, qa, shown)
            answers.append(qa.answer)
        assert 0.35 <= answers.count("yes") / len(answers) <= 0.65

    def test_color_after_cut_is_the_colour_after_the_largest_frame_difference(self):
        for sc, split, qa in qas_of("color_after_cut"):
            f = sc.clip.frames.astype(np.int16)
            diff = np.abs(f[1:] - f[:-1]).mean((1, 2, 3))          # (T - 1,) frame t -> t + 1
            cut = int(np.argmax(diff)) + 1
            assert [t.start for t in sc.transitions] == [cut]       # exactly one transition, this hard cut
            assert diff[cut - 1] > 2 * np.delete(diff, cut - 1).max()
            before, after = frame_blobs(sc.clip.seed, split, cut - 1), frame_blobs(sc.clip.seed, split, cut)
            assert list(after) == [qa.answer] and len(before) == 1 and qa.answer not in before, (sc.clip.seed, qa)

    def test_direction_is_the_centroid_motion(self):
        for sc, split, qa in qas_of("direction"):
            color, shape = qa.question.rstrip("?").split()[-3:-1]       # "... the <color> <shape> move(ing)?"
            centres = []
            for t in steady_frames(sc):
                m = frame_blobs(sc.clip.seed, split, t).get(color)
                if m is not None:
                    assert shape_name(sc.clip.frames[t], m) == shape
                    centres.append(ndimage.center_of_mass(m))
            (dy, dx) = np.subtract(centres[-1], centres[0])
            seen = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert seen == qa.answer and max(abs(dx), abs(dy)) > 20, (sc.clip.seed, split, qa, dy, dx)


class TestDataset:
    def test_families_answers_and_phrasings(self):
        qas = [qa for sc, _ in all_scenes() for qa in sc.clip.qas]
        assert {qa.family for qa in qas} == set(FAMILIES)
        assert {qa.answer for qa in qas} <= set(ANSWER_WORDS) and list(ANSWER_WORDS) == sorted(set(ANSWER_WORDS))
        questions = {qa.question for qa in qas}
        for phrasing in ("What color is the moving object?", "How many objects are there?",
                         "What color is the object after the cut?"):
            assert phrasing in questions
        for pattern in ("Where is the {} {}?", "What shape is the {} object?", "Is there {} {} {}?",
                        "Which way does the {} {} move?"):
            head, tail = pattern.split("{}")[0], pattern.split("{}")[-1]
            assert any(q.startswith(head) and q.endswith(tail) for q in questions), pattern
        assert "Is there an orange" in " ".join(questions) and "Is there a orange" not in " ".join(questions)
        for sc, _ in all_scenes():  # one question per family and clip, so a text never repeats in a video
            assert len({qa.family for qa in sc.clip.qas}) == len(sc.clip.qas)

    def test_visual_conditions_all_occur(self):
        scenes = [sc for sc, _ in all_scenes()]
        assert {m for sc in scenes for m in sc.motions} == {"static", "moving", "pan"}
        assert {t.kind for sc in scenes for t in sc.transitions} == {"cut", "dissolve", "fade"}
        assert {sc.kind for sc in scenes} == {"normal", "tiny_periphery", "low_contrast"}

    def test_test_split_differs_in_size_length_and_background(self):
        train = [scene(s, "train").clip.frames for s in SEEDS["train"]]
        test = [scene(s, "test").clip.frames for s in SEEDS["test"]]
        assert {f.shape[1:3] for f in train} == {(224, 224)}
        assert len({f.shape[1:3] for f in test}) >= 3
        assert max(len(f) for f in test) > max(len(f) for f in train)
        # busier backgrounds: more colour variation across the first frame
        spread = lambda frames: np.median([f[0].reshape(-1, 3).std(0).mean() for f in frames])  # noqa: E731
        assert spread(test) > 1.2 * spread(train)


class TestSeedsAndDeterminism:
    def test_split_seed_ranges_are_disjoint(self):
        ranges = list(SPLIT_SEEDS.values())
        for i, a in enumerate(ranges):
            for b in ranges[i + 1:]:
                assert a.stop <= b.start or b.stop <= a.start

    @pytest.mark.parametrize("split,seed", [("val", 0), ("test", SPLIT_SEEDS["val"].start), ("train", -1),
                                            ("train", SPLIT_SEEDS["train"].stop)])
    def test_a_seed_of_another_split_is_refused(self, split, seed):
        with pytest.raises(ValueError, match=f"seed {seed} is outside the {split} split's seeds"):
            make_qa_clip(seed, split=split)

    def test_unknown_split(self):
        with pytest.raises(ValueError, match=r"Invalid split \('dev'\). Supported values are train, val, test"):
            make_qa_clip(0, split="dev")

    @pytest.mark.parametrize("split", ["train", "test"])
    def test_same_seed_same_clip(self, split):
        seed = SEEDS[split][3]
        a, b = make_qa_clip(seed, split=split), scene(seed, split).clip
        assert isinstance(a, QAClip) and a.seed == seed and a.fps == b.fps and a.qas == b.qas
        assert np.array_equal(a.frames, b.frames) and a.frames.dtype == np.uint8
        other = make_qa_clip(seed + 1, split=split)
        assert other.frames.shape != a.frames.shape or not np.array_equal(other.frames, a.frames)


class TestWriteSplit:
    def test_msrvtt_reads_it_and_the_videos_decode(self, tmp_path):
        path = write_split(tmp_path, "test", 3)
        assert path == tmp_path / "test_qa.json"
        seeds = range(SPLIT_SEEDS["test"].start, SPLIT_SEEDS["test"].start + 3)
        clips = {f"video{s}": make_qa_clip(s, split="test") for s in seeds}
        ds = load_msrvtt(tmp_path, "test")
        assert ds.layout == "msrvtt-qa" and [w.video_id for w in ds.videos()] == list(clips)
        for work in ds.videos():
            clip = clips[work.video_id]
            assert [(q.question, q.answer, q.type) for q in work.questions] == \
                   [(qa.question, qa.answer, qa.family) for qa in clip.qas]   # the family is the question type
            with open_video(work.path) as video:
                frames = np.stack([f.rgb for f in video])
            assert frames.shape == clip.frames.shape
            assert np.abs(frames.astype(np.int16) - clip.frames).mean() < 4   # crf 18: close to the render
        assert len({q.question_id for q in ds.questions}) == len(ds.questions)

    def test_first_seed_and_split_ranges(self, tmp_path):
        val = SPLIT_SEEDS["val"]
        write_split(tmp_path, "val", 2, first_seed=val.start + 10)
        records = json.loads((tmp_path / "val_qa.json").read_text())
        assert {r["video_id"] for r in records} == {val.start + 10, val.start + 11}
        with pytest.raises(ValueError, match="outside the val split's seeds"):
            write_split(tmp_path, "val", 2, first_seed=val.stop - 1)
        with pytest.raises(ValueError, match="count must be a positive int, got 0"):
            write_split(tmp_path, "val", 0)


class TestMain:
    def test_writes_the_splits(self, tmp_path, capsys):
        assert main(["--root", str(tmp_path), "--splits", "val,test", "--count", "1", "2", "--quiet"]) == 0
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("val: 1 clips") and out[1].startswith("test: 2 clips")
        assert len(list((tmp_path / "videos").glob("video*.mp4"))) == 3

    @pytest.mark.parametrize("argv,message", [
        (["--splits", "dev"], "unknown split 'dev' in --splits; allowed: train, val, test"),
        (["--splits", "val,val"], "--splits names a split twice"),
        (["--splits", "val,test", "--count", "1", "2", "3"], "--count has 3 numbers for 2 splits"),
        (["--splits", "val", "--count", "0"], "--count 0 for val: must be in 1..1000000"),
        (["--count", "x"], "argument --count: invalid int value: 'x'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ])
    def test_bad_arguments_exit_2_with_one_line(self, tmp_path, capsys, argv, message):
        assert main(["--root", str(tmp_path / "ds"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err
        assert not (tmp_path / "ds").exists()

    def test_root_that_is_a_file(self, tmp_path, capsys):
        (tmp_path / "f").write_text("")
        assert main(["--root", str(tmp_path / "f")]) == 2
        assert "exists and is not a directory" in capsys.readouterr().err
