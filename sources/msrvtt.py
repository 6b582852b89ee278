"""MSR-VTT readers: MSRVTT-QA as released, the zero-shot video-LLM QA layout, and caption annotations.

Layouts (ROOT is what the user passes as --root):
  MSRVTT-QA release   ROOT/{train,val,test}_qa.json: [{answer, category_id, id, question, video_id}],
                      video_id an int N naming the file video<N>.mp4
  zero-shot layout    ROOT/test_q.json [{video_name, question_id, question}] + ROOT/test_a.json
                      [{answer, type, question_id}] (the Video-ChatGPT / Video-LLaVA evaluation files)
  captions            ROOT/videodatainfo.json (or train_val_/test_videodatainfo.json):
                      {videos: [{video_id, split, ...}], sentences: [{video_id, caption, sen_id}]}
Videos are found under the first of VIDEO_DIRS that exists (or an explicit videos directory).

Every error names the file and says what is wrong with it (SourceError, one line). A question
whose text is not a string (JSON null, a number) is skipped with one warning naming the file and
the question ids, so it is never asked as the text "None".
"""
from __future__ import annotations

import json
import re
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Literal

from sources.errors import SourceError

SPLITS = ("train", "val", "test")
Layout = Literal["msrvtt-qa", "zero-shot", "captions"]
Task = Literal["qa", "caption"]
TASKS = ("qa", "caption")
CAPTION_PROMPT = "Describe the video in one sentence."
# MSRVTT-QA's category_id: the question word the generator used (Xu et al., MM 2017)
CATEGORIES = ("what", "who", "how", "when", "where")
VIDEO_DIRS = ("videos/all", "videos", "video", "TestVideo", "TrainValVideo", "MSRVTT/videos/all", ".")
VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".webm", ".mov")
# MSR-VTT's caption files call the validation split "validate"
CAPTION_SPLIT_NAMES = {"train": "train", "val": "validate", "test": "test"}


@dataclass(frozen=True)
class Question:
    question_id: str        # as released (MSRVTT-QA ints are kept as their decimal string)
    video_id: str           # the stream id: "video<N>"
    question: str
    answer: str             # ground truth
    type: str               # question type (what/who/how/when/where, or the layout's own label)
    references: tuple[str, ...] = ()  # further accepted answers (the other captions of a video)

    def __post_init__(self) -> None:
        if not self.question.strip():
            raise ValueError(f"question {self.question_id} of {self.video_id} is empty")


@dataclass(frozen=True)
class VideoWork:
    """One unit of the work plan: a video and every question asked about it."""
    video_id: str
    path: Path | None       # None when the file is missing (reported and skipped)
    questions: tuple[Question, ...]


@dataclass(frozen=True)
class Dataset:
    root: Path
    split: str
    layout: Layout
    annotation: Path        # the question file (zero-shot: test_q.json; captions: videodatainfo)
    videos_dir: Path
    questions: tuple[Question, ...]
    skipped: tuple[str, ...] = ()  # ids of the questions left out: their text was not a string

    def videos(self) -> list[VideoWork]:
        """Questions grouped by video, in video-number order (stable across runs and workers)."""
        groups: "OrderedDict[str, list[Question]]" = OrderedDict()
        for q in sorted(self.questions, key=lambda q: (video_number(q.video_id), q.video_id)):
            groups.setdefault(q.video_id, []).append(q)
        return [VideoWork(vid, find_video(self.videos_dir, vid), tuple(qs)) for vid, qs in groups.items()]

    def by_id(self) -> dict[str, Question]:
        return {q.question_id: q for q in self.questions}


def video_number(video_id: str) -> int:
    m = re.search(r"(\d+)$", video_id)
    return int(m.group(1)) if m else -1


def stream_id_of(video_id: Any) -> str:
    """MSRVTT-QA stores 7010; the files and every other layout say "video7010"."""
    if isinstance(video_id, bool):
        raise ValueError(f"video id must be an int or a string, got {video_id!r}")
    if isinstance(video_id, int):
        return f"video{video_id}"
    if isinstance(video_id, str) and video_id.strip():
        text = Path(video_id.strip()).stem
        return f"video{text}" if text.isdigit() else text
    raise ValueError(f"video id must be an int or a non-empty string, got {video_id!r}")


def load_json(path: Path) -> Any:
    if not path.is_file():
        raise SourceError(f"annotation file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise SourceError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise SourceError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def _records(path: Path, data: Any, required: Iterable[str]) -> list[dict]:
    required = tuple(required)
    if not isinstance(data, list):
        raise SourceError(f"{path} must hold a JSON list of records with keys {', '.join(required)}; "
                          f"got a {type(data).__name__}")
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise SourceError(f"{path}: record {i} is a {type(rec).__name__}, expected an object")
        missing = [k for k in required if k not in rec]
        if missing:
            raise SourceError(f"{path}: record {i} lacks {', '.join(missing)} (has "
                              f"{', '.join(sorted(rec)) or 'nothing'})")
    return data


def _category(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(CATEGORIES):
        return CATEGORIES[value]
    return str(value)


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise SourceError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    return split


def detect_layout(root: Path, split: str) -> tuple[Layout, Path]:
    qa = root / f"{split}_qa.json"
    zq, za = root / f"{split}_q.json", root / f"{split}_a.json"
    if qa.is_file():
        return "msrvtt-qa", qa
    if zq.is_file() or za.is_file():
        if not za.is_file():
            raise SourceError(f"annotation file not found: {za} (the answers beside {zq.name})")
        if not zq.is_file():
            raise SourceError(f"annotation file not found: {zq} (the questions beside {za.name})")
        return "zero-shot", zq
    raise SourceError(f"no MSR-VTT-QA annotations for split {split!r} in {root}: expected {qa.name} "
                      f"(MSRVTT-QA release) or {zq.name} + {za.name} (zero-shot video-LLM layout)")


def load_msrvtt_qa(root: str | Path, split: str = "test", *, videos_dir: str | Path | None = None) -> Dataset:
    """Read the questions of one split in whichever layout ROOT holds."""
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"dataset root {root} is not a directory")
    check_split(split)
    layout, annotation = detect_layout(root, split)
    if layout == "msrvtt-qa":
        questions, skipped = _read_release(annotation)
    else:
        questions, skipped = _read_zero_shot(annotation, root / f"{split}_a.json")
    ids = [q.question_id for q in questions]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise SourceError(f"{annotation}: question id {dup} appears more than once")
    return Dataset(root, split, layout, annotation, resolve_videos_dir(root, videos_dir), tuple(questions),
                   tuple(skipped))


def _warn_skipped(path: Path, skipped: list[tuple[str, Any]]) -> list[str]:
    """One warning for every question of `path` left out because its text is not a string."""
    if skipped:
        shown = ", ".join(f"{qid} ({'null' if text is None else type(text).__name__})" for qid, text in skipped[:10])
        more = f" and {len(skipped) - 10} more" if len(skipped) > 10 else ""
        warnings.warn(f"{path}: skipped {len(skipped)} question(s) whose text is not a string: "
                      f"id {shown}{more}", stacklevel=4)
    return [qid for qid, _ in skipped]


def _read_release(path: Path) -> tuple[list[Question], list[str]]:
    out, skipped = [], []
    for i, r in enumerate(_records(path, load_json(path), ("answer", "category_id", "id", "question", "video_id"))):
        if not isinstance(r["question"], str):
            skipped.append((str(r["id"]), r["question"]))
            continue
        try:
            out.append(Question(str(r["id"]), stream_id_of(r["video_id"]), r["question"], str(r["answer"]),
                                _category(r["category_id"])))
        except ValueError as e:
            raise SourceError(f"{path}: record {i}: {e}") from None
    return out, _warn_skipped(path, skipped)


def _read_zero_shot(q_path: Path, a_path: Path) -> tuple[list[Question], list[str]]:
    questions = _records(q_path, load_json(q_path), ("video_name", "question_id", "question"))
    answers = _records(a_path, load_json(a_path), ("answer", "question_id"))
    by_id = {str(a["question_id"]): a for a in answers}
    if len(questions) != len(answers):
        raise SourceError(f"{q_path.name} has {len(questions)} questions but {a_path.name} has {len(answers)} "
                          f"answers (in {q_path.parent})")
    out, skipped = [], []
    for i, r in enumerate(questions):
        qid = str(r["question_id"])
        a = by_id.get(qid)
        if a is None:
            raise SourceError(f"{a_path}: no answer for question_id {qid} of {q_path.name}")
        if not isinstance(r["question"], str):
            skipped.append((qid, r["question"]))
            continue
        try:
            out.append(Question(qid, stream_id_of(r["video_name"]), r["question"], str(a["answer"]),
                                _category(a.get("type", "unknown"))))
        except ValueError as e:
            raise SourceError(f"{q_path}: record {i}: {e}") from None
    return out, _warn_skipped(q_path, skipped)


def resolve_videos_dir(root: Path, videos_dir: str | Path | None) -> Path:
    if videos_dir is not None:
        videos_dir = Path(videos_dir)
        if not videos_dir.is_dir():
            raise SourceError(f"videos directory {videos_dir} is not a directory")
        return videos_dir
    for name in VIDEO_DIRS:
        d = root / name
        if d.is_dir() and any(d.glob("video*.*")):
            return d
    return root / "videos"  # nothing found: every video is reported missing there


def find_video(videos_dir: Path, video_id: str) -> Path | None:
    for ext in VIDEO_EXTENSIONS:
        path = videos_dir / f"{video_id}{ext}"
        if path.is_file():
            return path
    return None


@dataclass(frozen=True)
class CaptionVideo:
    video_id: str
    split: str
    captions: tuple[str, ...]


def load_msrvtt_captions(root: str | Path, split: str = "test", *, with_path: bool = False):
    """MSR-VTT caption annotations (`videodatainfo` format) of one split, in video-number order."""
    root = Path(root)
    check_split(split)
    names = ("videodatainfo.json", "test_videodatainfo.json" if split == "test" else "train_val_videodatainfo.json",
             "annotation/MSR_VTT.json")
    path = next((root / n for n in names if (root / n).is_file()), None)
    if path is None:
        raise SourceError(f"no MSR-VTT caption annotations in {root}: expected one of {', '.join(names)}")
    data = load_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("videos"), list) or not isinstance(data.get("sentences"),
                                                                                                list):
        raise SourceError(f"{path} must be an object with 'videos' and 'sentences' lists (videodatainfo format)")
    videos = _records(path, data["videos"], ("video_id",))
    sentences = _records(path, data["sentences"], ("video_id", "caption"))
    wanted = CAPTION_SPLIT_NAMES[split]
    caps: dict[str, list[str]] = {}
    for s in sentences:
        caps.setdefault(str(s["video_id"]), []).append(str(s["caption"]))
    out = [CaptionVideo(stream_id_of(v["video_id"]), wanted, tuple(caps.get(str(v["video_id"]), ())))
           for v in videos if v.get("split", wanted) == wanted]
    out = sorted(out, key=lambda v: video_number(v.video_id))
    return (out, path) if with_path else out


def load_msrvtt(root: str | Path, split: str = "test", *, task: Task = "qa",
                videos_dir: str | Path | None = None) -> Dataset:
    """The work of one split: its QA pairs, or (task "caption") one caption prompt per video whose
    ground truth is the video's first caption and the rest its references."""
    if task not in TASKS:
        raise SourceError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")
    if task == "qa":
        return load_msrvtt_qa(root, split, videos_dir=videos_dir)
    root = Path(root)
    if not root.is_dir():
        raise SourceError(f"dataset root {root} is not a directory")
    videos, path = load_msrvtt_captions(root, split, with_path=True)
    questions = tuple(Question(f"{v.video_id}_caption", v.video_id, CAPTION_PROMPT, v.captions[0], "caption",
                               v.captions[1:]) for v in videos if v.captions)
    return Dataset(root, split, "captions", path, resolve_videos_dir(root, videos_dir), questions)
