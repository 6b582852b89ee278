"""Generated data in MSR-VTT's layouts, for tests and benchmarks (no dataset can be downloaded there).

write_fixture writes videos with a cut and annotations that sources.msrvtt reads back exactly as it
reads the real releases.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from sources.msrvtt import CAPTION_SPLIT_NAMES, CATEGORIES, Layout, Question

FIXTURE_QUESTIONS = (("what is moving across the screen?", "square", 0), ("who is in the video?", "nobody", 1),
                     ("how does the camera move?", "pan", 2), ("when does the scene change?", "middle", 3),
                     ("where is the object?", "center", 4))


def write_fixture(root: str | Path, *, layout: Layout = "msrvtt-qa", split: str = "test", videos: int = 3,
                  questions_per_video: int = 2, first_video: int = 7010, seconds: float = 1.0, fps: int = 10,
                  height: int = 64, width: int = 96, videos_subdir: str = "videos/all",
                  seed: int = 0, unique: int | None = None, progress: bool = False) -> list[Question]:
    """Write generated videos (video<N>.mp4, each with a cut) and annotations in `layout` under root.
    Returns the questions written. Real layouts exactly: the release's int ids, the zero-shot files'
    string ids, and a videodatainfo file with three captions per video. unique: render only the
    first `unique` clips; each later video v is a hard link to (else a copy of) clip v % unique,
    under its own name and with its own questions (long benchmark runs without the rendering time).
    progress: a bar on stderr while the clips are written (a benchmark's thousand clips take minutes)."""
    from sources.synthetic import Shot, render_clip, write_video   # looked up per call (tests count renders)

    if unique is not None and (isinstance(unique, bool) or not isinstance(unique, int) or unique < 1):
        raise ValueError(f"Invalid unique ({unique!r}): must be an integer >= 1")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    frames = max(2, int(round(seconds * fps)))
    questions: list[Question] = []
    release, zero_q, zero_a, vids, sentences = [], [], [], [], []
    from tqdm import tqdm

    for v in tqdm(range(videos), desc="writing clips", unit="clip", disable=not progress, mininterval=5.0):
        n = first_video + v
        path = root / videos_subdir / f"video{n}.mp4"
        if unique is None or v < unique:
            clip = render_clip([Shot("moving_object", frames // 2), Shot("pan", frames - frames // 2)],
                               height=height, width=width, seed=seed + n)
            write_video(path, clip.frames, fps=fps)
        else:
            source = root / videos_subdir / f"video{first_video + v % unique}.mp4"
            path.unlink(missing_ok=True)
            try:
                path.hardlink_to(source)
            except OSError:                                              # a file system without links
                shutil.copyfile(source, path)
        vids.append({"category": v % 20, "url": "", "video_id": f"video{n}", "start time": 0.0,
                     "end time": seconds, "split": CAPTION_SPLIT_NAMES[split], "id": n})
        for c in range(3):
            sentences.append({"caption": f"a square moves then the camera pans {c}", "video_id": f"video{n}",
                              "sen_id": 3 * n + c})
        for k in range(questions_per_video):
            text, answer, category = FIXTURE_QUESTIONS[(v + k) % len(FIXTURE_QUESTIONS)]
            qid = 100_000 + n * 100 + k
            if layout == "zero-shot":
                qid_s = f"v_video{n}_{k}"
                zero_q.append({"video_name": f"video{n}", "question_id": qid_s, "question": text})
                zero_a.append({"answer": answer, "type": category, "question_id": qid_s})
                questions.append(Question(qid_s, f"video{n}", text, answer, CATEGORIES[category]))
            else:
                release.append({"answer": answer, "category_id": category, "id": qid, "question": text,
                                "video_id": n})
                questions.append(Question(str(qid), f"video{n}", text, answer, CATEGORIES[category]))
    if layout == "msrvtt-qa":
        (root / f"{split}_qa.json").write_text(json.dumps(release))
    elif layout == "zero-shot":
        (root / f"{split}_q.json").write_text(json.dumps(zero_q))
        (root / f"{split}_a.json").write_text(json.dumps(zero_a))
    elif layout == "captions":
        (root / "videodatainfo.json").write_text(json.dumps({"info": {}, "videos": vids, "sentences": sentences}))
    else:
        raise ValueError(f"Invalid layout ({layout!r}). Supported values are msrvtt-qa, zero-shot, captions.")
    return questions
