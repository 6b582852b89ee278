"""Where ARR-COC's tokens go for a question that names one object, asked alone: with the question
against without it (a zero query vector), on a renderer split written by bench_accuracy --make
(e.g. `--renderer photo`: objects composited onto real photographs).

    python benchmarks/named_object_sheet.py --root data/photo100 [--retention 0.1] [--questions 200]
        [--sheet docs/named_object_tokens.jpg] [--sheet-rows 6] [--out results.json]

bench_accuracy's `named_object_share` reads batch stores, where ARR-COC attends to all of a clip's
questions at once; here each one-object question is run by itself through the Python API
(`Pipeline.allocations`, no VLM: the allocation does not depend on it), so the share is that
question's. Per question: the share of the frame's kept tokens on the named object's cells
(benchmarks/named_objects.object_cells), over the frames that show it, with and without the
question; `area_share` is what a selection blind to the object keeps there on average.

The sheet (only with --sheet) shows one frame per question: the object's box in yellow, kept cells
tinted (left: without the question, right: with it), the question and both shares underneath.
Nothing is written into tracked files unless --sheet or --out names one.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.named_objects import load_annotations, object_cells  # noqa: E402

TILE_H = 168
BAND = 40


def _zero_query(question: str):
    import torch
    return torch.zeros(384)


def question_run(pipeline, video: Path, question: str, boxes: list, size: tuple[int, int], fps: float) -> dict:
    """The allocation of one question over one clip: per frame that shows the object, its share of the
    frame's tokens and of the cells, the frame where the object holds the most tokens, and every
    frame's kept cells (the sheet draws the other run's cells at that frame without a second run)."""
    on_tokens, all_tokens, cells, frames, best, kept = 0.0, 0.0, 0, 0, None, {}
    with pipeline.allocations(str(video), question) as stream:
        for a in stream:
            tokens = np.asarray(a.tokens, np.float64)
            kept[int(a.frame_index)] = tokens > 0
            box = boxes[min(len(boxes) - 1, int(round(float(a.pts) * fps)))]
            if box is None:
                continue
            mask = object_cells(tuple(box), size, tokens.shape)
            on, total = float(tokens[mask].sum()), float(tokens.sum())
            on_tokens, all_tokens = on_tokens + on, all_tokens + total
            cells, frames = cells + int(mask.sum()), frames + 1
            if best is None or on > best[0]:
                best = (on, int(a.frame_index), tokens > 0, tuple(box))
    return {"frames": frames, "token_share": on_tokens / all_tokens if all_tokens > 0 else None,
            "area_share": cells / (frames * mask.size) if frames else None, "best": best, "kept": kept}


def _frame(video: Path, index: int) -> np.ndarray:
    import av
    with av.open(str(video)) as c:
        for i, f in enumerate(c.decode(video=0)):
            if i == index:
                return f.to_ndarray(format="rgb24")
    raise ValueError(f"{video}: no frame {index}")


def _tile(frame: np.ndarray, kept: np.ndarray, box: tuple[int, int, int, int]) -> np.ndarray:
    import cv2
    H, W = frame.shape[:2]
    gh, gw = kept.shape
    out = frame.astype(np.float32)
    ys, xs = np.linspace(0, H, gh + 1).round().astype(int), np.linspace(0, W, gw + 1).round().astype(int)
    dim = np.full((H, W), 0.35, np.float32)
    for i in range(gh):
        for j in range(gw):
            if kept[i, j]:
                dim[ys[i]:ys[i + 1], xs[j]:xs[j + 1]] = 1.0
    out = (out * dim[..., None]).clip(0, 255).astype(np.uint8)
    for i in range(gh):
        for j in range(gw):
            if kept[i, j]:
                cv2.rectangle(out, (int(xs[j]), int(ys[i])), (int(xs[j + 1]) - 1, int(ys[i + 1]) - 1), (0, 220, 255), 1)
    y0, x0, y1, x1 = box
    cv2.rectangle(out, (int(x0), int(y0)), (int(x1), int(y1)), (255, 230, 0), 2)
    scale = TILE_H / H
    return cv2.resize(out, (int(round(W * scale)), TILE_H), interpolation=cv2.INTER_AREA)


def sheet(rows: list[dict]) -> np.ndarray:
    import cv2
    blocks = []
    for r in rows:
        left, right = r["tiles"]
        gap = np.full((TILE_H, 6, 3), 255, np.uint8)
        pair = np.concatenate([left, gap, right], axis=1)
        band = np.full((BAND, pair.shape[1], 3), 255, np.uint8)
        cv2.putText(band, r["question"][:56], (4, 15), cv2.FONT_HERSHEY_SIMPLEX, 0.42, (0, 0, 0), 1, cv2.LINE_AA)
        text = f"share on it: {r['noquery']:.2f} without, {r['query']:.2f} with (area {r['area']:.2f})"
        cv2.putText(band, text, (4, 33), cv2.FONT_HERSHEY_SIMPLEX, 0.38, (60, 60, 60), 1, cv2.LINE_AA)
        blocks.append(np.concatenate([pair, band], axis=0))
    width = max(b.shape[1] for b in blocks)
    blocks = [np.pad(b, ((0, 8), (0, width - b.shape[1]), (0, 0)), constant_values=255) for b in blocks]
    head = np.full((24, width, 3), 255, np.uint8)
    cv2.putText(head, "ARR-COC: left without the question, right with it",
                (4, 16), cv2.FONT_HERSHEY_SIMPLEX, 0.42, (0, 0, 0), 1, cv2.LINE_AA)
    return np.concatenate([head, *blocks], axis=0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True, help="a renderer split (bench_accuracy --make --renderer)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--retention", type=float, default=0.1)
    ap.add_argument("--questions", type=int, default=200, help="at most this many one-object questions")
    ap.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override (as --set of the CLI), e.g. runtime.model_weights=PATH")
    ap.add_argument("--sheet", type=Path, help="write the contact sheet here (.jpg / .png)")
    ap.add_argument("--sheet-rows", type=int, default=6, help="questions on the sheet (distinct clips)")
    ap.add_argument("--out", type=Path, help="write the result JSON here")
    args = ap.parse_args(argv)
    if not 0 < args.retention <= 1:
        ap.error(f"--retention {args.retention}: must be in (0, 1]")
    found = load_annotations(args.root, args.split)
    if found is None:
        print(f"error: {args.root} has no {args.split}_tracks.json: write it with bench_accuracy.py --make N "
              f"--renderer NAME", file=sys.stderr)
        return 2
    records, videos = found

    import yaml

    from pipeline.api import Pipeline

    overrides = {"model.attending.retention": args.retention, "decode.fps": 2.0}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item}: expected KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    with_q = Pipeline(vlm="none", device=args.device, overrides=overrides)       # MiniLM encodes the question
    without = Pipeline(vlm="none", device=args.device, overrides=overrides, query_encoder=_zero_query)
    chosen = [r for r in records.values() if r.get("one_object")][:args.questions]
    rows, started, shown = [], time.perf_counter(), set()
    import warnings

    from tqdm import tqdm
    for r in tqdm(chosen, desc="questions", unit="q", mininterval=5.0):
        video = videos[str(r["video_id"])]
        path = args.root / "videos" / f"video{r['video_id']}.mp4"
        boxes = video["tracks"][r["objects"][0]]["boxes"]
        size = tuple(video["size"])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = question_run(with_q, path, r["question"], boxes, size, video["fps"])
            n = question_run(without, path, r["question"], boxes, size, video["fps"])
        if q["token_share"] is None or n["token_share"] is None:
            continue
        row = {"id": r["id"], "video_id": r["video_id"], "type": r.get("category_id"), "question": r["question"],
               "query": q["token_share"], "noquery": n["token_share"], "area": q["area_share"]}
        if args.sheet and len(shown) < args.sheet_rows and r["video_id"] not in shown and q["best"] is not None:
            shown.add(r["video_id"])
            _, index, kept_q, box = q["best"]
            frame = _frame(path, index)
            kept_n = n["kept"][index]
            row["tiles"] = (_tile(frame, kept_n, box), _tile(frame, kept_q, box))
        rows.append(row)
    if not rows:
        print("error: no one-object question with its object shown in the split", file=sys.stderr)
        return 1
    qs, ns, areas = (np.array([r[k] for r in rows]) for k in ("query", "noquery", "area"))
    by_type: dict[str, list[dict]] = {}
    for r in rows:
        by_type.setdefault(str(r["type"]), []).append(r)
    result = {
        "benchmark": "named_object_sheet", "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "root": str(args.root), "retention": args.retention, "questions": len(rows),
        "token_share_with_question": round(float(qs.mean()), 4),
        "token_share_without_question": round(float(ns.mean()), 4),
        "area_share": round(float(areas.mean()), 4),
        "questions_where_the_question_raised_the_share": int((qs > ns).sum()),
        "questions_where_it_lowered_it": int((qs < ns).sum()),
        "by_type": {t: {"questions": len(v), "with": round(float(np.mean([x["query"] for x in v])), 4),
                        "without": round(float(np.mean([x["noquery"] for x in v])), 4)} for t, v in by_type.items()},
        "wall_s": round(time.perf_counter() - started, 1),
        "per_question": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "tiles"}
                         for r in rows],
    }
    print(f"{len(rows)} questions naming one object, retention {args.retention:g}: share of kept tokens on it "
          f"{result['token_share_without_question']:.3f} without the question, "
          f"{result['token_share_with_question']:.3f} with it (its cells: {result['area_share']:.3f}); "
          f"higher with the question on {result['questions_where_the_question_raised_the_share']}, "
          f"lower on {result['questions_where_it_lowered_it']}")
    for t, v in sorted(result["by_type"].items()):
        print(f"  {t:12s} {v['questions']:4d}  without {v['without']:.3f}  with {v['with']:.3f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    if args.sheet:
        import cv2
        tiles = [r for r in rows if "tiles" in r]
        image = sheet(tiles)
        cv2.imwrite(str(args.sheet), image[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, 88])
        print(f"sheet: {args.sheet} ({len(tiles)} questions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
