"""Why an answer-model snapshot fails the question families it fails, on val clips of the training renderers.

    python benchmarks/diagnose_answer_model.py [--snapshot arrcoc-synth-qa] [--clips 150] [--out FILE.json]

Four measurements (the held-out renderer is never drawn):

- answers: per family accuracy, the answer and prediction counts (is it saying the prior?), exists
  split by kind (yes / a colour the clip has in another shape / a colour it lacks), relation by word;
- resolution: on train clips at the 8 x 8 grid of a 224 x 224 frame, how often two objects of a count
  question touch one token cell, both cover a quarter of one, and have their box centres in one;
- tower probes: linear probes (fitted on 2/3 of the clips' tokens, scored on the rest) of each
  merged token's colour and its object's shape (pipeline/training/qa_data's targets);
- LM probes: ridge probes of the LM's state where the first answer token is predicted (after each
  layer), of the named objects' centres (relation questions: both; one-object questions: one) and of
  the shapes of the question's colour (exists); R^2 <= 0 means the state holds nothing of it.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import write_result  # noqa: E402
from evaluation.renderers import MultiRendererClips  # noqa: E402
from evaluation.scenes import COLORS  # noqa: E402
from evaluation.synth_qa import SPLIT_SEEDS  # noqa: E402
from pipeline.configio import load_config  # noqa: E402
from pipeline.training import qa_targets as qt  # noqa: E402
from pipeline.training.qa_eval import ValData  # noqa: E402
from pipeline.training.qa_forward import IGNORE, QAForward  # noqa: E402
from pipeline.training.qa_checkpoint import init_root, start_from  # noqa: E402
from pipeline.training.qa_vlm import QAVLMConfig, build, clip_source, step_data  # noqa: E402

RENDERERS = ("shapes", "photo", "busy")
RELATION_WORDS = ("left of", "right of", "above", "below")


def answers(snapshot: str, clips: int) -> dict:
    from pipeline.vlm.loading import load_vlm
    from pipeline.vlm_config import VLMConfig

    make = MultiRendererClips(RENDERERS)
    seeds = list(range(SPLIT_SEEDS["val"].start, SPLIT_SEEDS["val"].start + clips))
    data = ValData(make, seeds, 2.0)
    vlm = load_vlm(snapshot, device="cpu", config=VLMConfig(cuda_graphs=False, max_new_tokens=8, dtype="float32"))
    tally: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    truth: dict[str, Counter] = defaultdict(Counter)
    said: dict[str, Counter] = defaultdict(Counter)
    for i, seed in enumerate(seeds):
        clip, objects = data[i], make(seed, split="val").objects
        for qa, r in zip(clip.qas, vlm.answer_questions(clip.frames, None, [qa.question for qa in clip.qas])):
            keys = [qa.family]
            if qa.family == "exists":
                color = qt.question_color(qa.question)
                keys.append("exists: " + ("yes" if qa.answer == "yes" else "no, colour present"
                                          if any(o[0] == color for o in objects) else "no, colour absent"))
            elif qa.family == "relation":
                keys.append(f"relation: {next(w for w in RELATION_WORDS if f' {w} ' in qa.question)}, {qa.answer}")
            for k in keys:
                tally[k][0] += int(r.text == qa.answer)
                tally[k][1] += 1
            truth[qa.family][qa.answer] += 1
            said[qa.family][r.text] += 1
    return {"clips": clips, "accuracy": {k: {"accuracy": round(c / n, 3), "questions": n}
                                         for k, (c, n) in sorted(tally.items())},
            "answers": {f: {"truth": dict(truth[f].most_common()), "said": dict(said[f].most_common())}
                        for f in sorted(truth)}}


def resolution(clips: int) -> dict:
    make = MultiRendererClips(RENDERERS)
    stats = Counter()
    for seed in range(SPLIT_SEEDS["train"].start + 200_000, SPLIT_SEEDS["train"].start + 200_000 + clips):
        clip = make(seed)
        size = clip.frames.shape[1:3]
        for qa in clip.qas:
            if qa.family not in ("count", "count_color"):
                continue
            both = np.nonzero((clip.boxes[list(qa.names), :, 0] >= 0).all(0))[0]
            if not len(both):
                continue
            boxes = clip.boxes[list(qa.names), both[0]]                             # (k, 4): one frame
            touch = qt._cover(boxes, size, (8, 8)) > 0                              # (k, 8, 8)
            quarter = qt._cover(boxes, size, (8, 8)) >= qt.EVIDENCE_SHARE
            centres = qt._centre_cells(boxes, size, (8, 8))
            pairs = [(a, b) for a in range(len(boxes)) for b in range(a + 1, len(boxes))]
            stats[qa.family] += 1
            for what, cells in (("two objects touch one cell", touch), ("two centres share a cell", centres),
                                ("two objects cover a quarter of one cell", quarter)):
                stats[f"{qa.family}: {what}"] += any((cells[a] & cells[b]).any() for a, b in pairs)
    return dict(stats)


def _features(snapshot: str, clips: int):

    # the model fields the snapshot was trained with (rope_theta above all: positions are the point)
    trained = json.loads((init_root(snapshot) / "training_summary.json").read_text())["config"]["model"]
    cfg = load_config(QAVLMConfig, None, ["data.renderers=[shapes, photo, busy]", "train.workers=0",
                                          "train.resize_prob=0", "drop.p_all=1.0", "train.views_per_question=1",
                                          "data.extra_questions=[relation=2, exists=2]", "drop.curriculum_steps=0"],
                      values={f"model.{k}": v for k, v in trained.items()})
    model, tokenizer, preprocessor = build(cfg, torch.device("cpu"))
    start_from(model, snapshot)
    model.eval()
    forward = QAForward(model, tokenizer, preprocessor)
    data = step_data(cfg, clip_source(cfg))
    tokens, colors, shapes, states, facts, families = [], [], [], [], [], []
    for seed in range(SPLIT_SEEDS["train"].start + 300_000, SPLIT_SEEDS["train"].start + 300_000 + clips):
        s = data.sample(seed)
        with torch.no_grad():
            merged = forward.vision([s])[0]
            batch = forward.batch([s], [merged])
            out = forward.lm(inputs_embeds=batch.embeds, position_ids=batch.positions, use_cache=False,
                             output_hidden_states=True)
        first = (batch.labels != IGNORE).int().argmax(1)
        tokens.append(merged.reshape(-1, merged.shape[-1]).numpy())
        colors.append(s.colors.ravel())
        shapes.append(s.shapes.ravel())
        states.append(np.stack([h[torch.arange(len(first)), first].numpy() for h in out.hidden_states], 1))
        facts.append(s.facts)
        families += s.families
    return (np.concatenate(tokens), np.concatenate(colors), np.concatenate(shapes), np.concatenate(states),
            np.concatenate(facts), np.array(families))


def _linear_probe(x: np.ndarray, y: np.ndarray, classes: int) -> float:
    cut = int(len(x) * 2 / 3)
    mu, sd = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    z = torch.tensor((x - mu) / sd, dtype=torch.float32)
    t = torch.tensor(y, dtype=torch.long)
    head = torch.nn.Linear(z.shape[1], classes)
    opt = torch.optim.Adam(head.parameters(), 1e-2)
    for _ in range(300):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(head(z[:cut]), t[:cut]).backward()
        opt.step()
    with torch.no_grad():
        return round(float((head(z[cut:]).argmax(-1) == t[cut:]).float().mean()), 3)


def _ridge(x: np.ndarray, y: np.ndarray, lam: float = 30.0) -> np.ndarray:
    """Fitted on the first 70%, -> the rest's predictions."""
    cut = int(len(x) * 0.7)
    mu, sd = x[:cut].mean(0), x[:cut].std(0) + 1e-6
    z = np.concatenate([(x - mu) / sd, np.ones((len(x), 1))], 1)
    w = np.linalg.solve(z[:cut].T @ z[:cut] + lam * np.eye(z.shape[1]), z[:cut].T @ y[:cut])
    return z[cut:] @ w


def probes(snapshot: str, clips: int) -> dict:
    tokens, colors, shapes, states, facts, families = _features(snapshot, clips)
    on_object = colors < len(COLORS)
    known = (shapes >= 0) & (shapes < 4)
    tower = {"colour, every token": _linear_probe(tokens, colors, len(COLORS) + 1),
             "colour, object tokens": _linear_probe(tokens[on_object], colors[on_object], len(COLORS) + 1),
             "shape, object tokens": _linear_probe(tokens[known], shapes[known], 4),
             "shape, majority": round(float(np.bincount(shapes[known]).max() / known.sum()), 3)}
    lm: dict[str, dict] = {}
    one = ("where", "shape", "color_at", "shape_at", "moves", "direction")
    for name, rows, cols in (("relation: centres (y, x) of both objects", families == "relation", [0, 1, 2, 3]),
                             ("one object: its centre (y, x)", np.isin(families, one), [0, 1])):
        rows = rows & ~np.isnan(facts[:, cols]).any(1)
        target = facts[rows][:, cols]
        rest = target[int(len(target) * 0.7):]
        lm[name] = {f"layer {k}": np.round(1 - ((_ridge(states[rows, k], target) - rest) ** 2).sum(0)
                                           / ((rest - rest.mean(0)) ** 2).sum(0), 2).tolist()
                    for k in range(states.shape[1])}
        lm[name]["views"] = int(rows.sum())
    rows = (families == "exists") & ~np.isnan(facts[:, 4])
    target = facts[rows][:, 4:] > 0.5
    rest = target[int(len(target) * 0.7):]
    lm["exists: the colour's shapes (accuracy per shape)"] = {
        f"layer {k}": np.round(((_ridge(states[rows, k], target.astype(float)) > 0.5) == rest).mean(0), 2).tolist()
        for k in range(states.shape[1])}
    lm["exists: the colour's shapes (accuracy per shape)"]["majority"] = \
        np.round(np.maximum(rest.mean(0), 1 - rest.mean(0)), 2).tolist()
    return {"tower": tower, "lm at the answer position (R^2 per coordinate)": lm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", default="arrcoc-synth-qa", help="snapshot directory or shipped name")
    ap.add_argument("--clips", type=int, default=150, help="clips per measurement (default 150)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    torch.manual_seed(0)
    result = {"benchmark": "diagnose_answer_model", "snapshot": args.snapshot, "device": "cpu",
              "answers": answers(args.snapshot, args.clips), "resolution": resolution(args.clips),
              **probes(args.snapshot, args.clips)}
    if args.out:
        write_result(result, args.out)
    else:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
