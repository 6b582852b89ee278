"""Validation and export of the video-QA VLM: answers through the pipeline's own path, and the
Hugging Face snapshot that path loads.

    python -m pipeline.training.qa_eval SNAPSHOT [--held-out | --renderers in-distribution|NAME,...]
                                        [--split test] [--clips 100] [--device auto] [--out FILE.json]

scores a snapshot (a directory or a shipped name) on generated clips exactly as validation does:
clip k of the split is the split's first seed + k from renderers[seed % n] (the clips
`bench_accuracy --make N --renderer ...` writes), every token, the frames as rendered. It needs
neither PyAV nor zarr; bench_accuracy's stock row answers the same clips after a video codec.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline.training.qa_data import cell_colors, keep_map, vlm_frame_indices
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.preprocess import VideoPreprocessor


@dataclass
class ValClip:
    frames: np.ndarray                # (T, H, W, 3) uint8, the frames the VLM sees
    qas: tuple


class ValData:
    """Map-style dataset of validation (or test) clips, sampled as the pipeline samples frames."""

    def __init__(self, make_clip: Callable, seeds: list[int], vlm_fps: float, split: str = "val") -> None:
        self.make_clip, self.seeds, self.vlm_fps, self.split = make_clip, seeds, vlm_fps, split

    def __len__(self) -> int:
        return len(self.seeds)

    def __getitem__(self, i: int) -> ValClip:
        clip = self.make_clip(self.seeds[i], split=self.split)
        frames = clip.frames[vlm_frame_indices(len(clip.frames), clip.fps, self.vlm_fps)]
        return ValClip(np.ascontiguousarray(frames), tuple(clip.qas))


def evaluate(vlm, clips: list[ValClip], keep_ratio: float = 1.0, seed: int = 0) -> dict[str, list[int]]:
    """{family: [correct, asked]} answering every question of `clips` with vlm.answer_questions (all
    tokens at keep_ratio 1, else random cells at that ratio); exact match of the decoded answer."""
    tally: dict[str, list[int]] = {}
    for i, clip in enumerate(clips):
        keep = None
        if keep_ratio < 1.0:
            rng = np.random.default_rng([seed, i])
            keep = keep_map("random", cell_colors(clip.frames, vlm.geometry.grid(*clip.frames.shape[1:3])),
                            keep_ratio, rng)
        results = vlm.answer_questions(clip.frames, keep, [qa.question for qa in clip.qas])
        for qa, r in zip(clip.qas, results):
            t = tally.setdefault(qa.family, [0, 0])
            t[0] += int(r.text == qa.answer)
            t[1] += 1
    return tally


def accuracy(tally: dict[str, list[int]]) -> dict[str, float]:
    """Per family and "overall" (mean over questions) accuracy of an evaluate() tally."""
    acc = {f: round(c / n, 4) for f, (c, n) in sorted(tally.items())}
    asked = sum(n for _, n in tally.values())
    acc["overall"] = round(sum(c for c, _ in tally.values()) / asked, 4) if asked else 0.0
    return acc


def validate(snapshot: Path, clips: list[ValClip], device: torch.device,
             ratios: tuple[float, ...] = (1.0,)) -> dict[str, dict[str, float]]:
    """Load the exported snapshot as a user's local snapshot is loaded, answer the val clips."""
    from pipeline.vlm.loading import load_vlm

    dtype = "bfloat16" if device.type == "cuda" else "float32"
    vlm = load_vlm(str(snapshot), device=device, config=VLMConfig(cuda_graphs=False, max_new_tokens=8, dtype=dtype))
    return {f"keep_{r:g}": accuracy(evaluate(vlm, clips, r)) for r in ratios}


def export_snapshot(model, tokenizer, preprocessor: VideoPreprocessor, fps: float, root: Path, summary: dict,
                    config_extra: dict | None = None) -> Path:
    """A Hugging Face snapshot of the model in bf16: config (plus config_extra's fields),
    weights, tokenizer (+ chat template), processor configs with this model's frame size
    (the preprocessor's), the training summary and the answers it was trained to give (answer_words.json)."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    snap = copy.deepcopy(model).to(torch.bfloat16)
    for key, value in (config_extra or {}).items():
        setattr(snap.config, key, value)
    snap.save_pretrained(root)
    tokenizer.save_pretrained(root)
    g = preprocessor.geometry
    processor = {"min_pixels": g.min_pixels, "max_pixels": g.max_pixels,
                 "size": {"shortest_edge": g.min_pixels, "longest_edge": g.max_pixels},
                 "patch_size": g.patch_size, "temporal_patch_size": g.temporal_patch_size, "merge_size": g.merge_size,
                 "image_mean": list(preprocessor.image_mean), "image_std": list(preprocessor.image_std),
                 "rescale_factor": 1 / 255,
                 "resample": 3, "do_resize": True, "do_rescale": True, "do_normalize": True,
                 "do_convert_rgb": True, "processor_class": "Qwen2VLProcessor"}
    (root / "preprocessor_config.json").write_text(json.dumps(
        {**processor, "image_processor_type": "Qwen2VLImageProcessor"}, indent=2) + "\n")
    (root / "video_preprocessor_config.json").write_text(json.dumps(
        {**processor, "video_processor_type": "Qwen2VLVideoProcessor", "fps": fps}, indent=2) + "\n")
    (root / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    # every answer the model was trained to give: anything else it says is shown as no answer
    from evaluation.synth_qa import ANSWER_WORDS

    from pipeline.runtime.answer_words import WORDS_FILE
    (root / WORDS_FILE).write_text(json.dumps(list(ANSWER_WORDS), indent=1) + "\n")
    return root


def _clip_source(renderers: str, held_out: bool) -> tuple[Callable, str]:
    """make_clip(seed, split=...) of the renderers asked for, and their names."""
    from evaluation.renderers import HELD_OUT, MultiRendererClips, scene, training_renderers

    if held_out:
        return (lambda seed, split="test": scene(HELD_OUT, seed, split=split, evaluation=True).clip), HELD_OUT
    names = training_renderers() if renderers == "in-distribution" else tuple(r.strip() for r in renderers.split(","))
    return MultiRendererClips(names), ",".join(names)


def main(argv: list[str] | None = None) -> int:
    from evaluation.renderers import HeldOutError
    from evaluation.synth_qa import SPLIT_SEEDS
    from pipeline.vlm.loading import resolve_device

    p = argparse.ArgumentParser(prog="python -m pipeline.training.qa_eval",
                                description="accuracy of a video-QA snapshot on generated clips (every token)")
    p.add_argument("snapshot", help="snapshot directory or shipped name (arrcoc-synth-qa)")
    p.add_argument("--renderers", default="in-distribution",
                   help="comma-separated renderers, or in-distribution: every training renderer (default)")
    p.add_argument("--held-out", action="store_true", help="the held-out renderer (its test split only)")
    p.add_argument("--split", default="test", choices=("val", "test"))
    p.add_argument("--clips", type=int, default=100)
    p.add_argument("--fps", type=float, default=VLMConfig.fps, help="frames per second the VLM sees")
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--out", help="write the result JSON here")
    args = p.parse_args(argv)
    if args.held_out and args.split != "test":
        print("error: the held-out renderer has only a test split, for evaluation", file=sys.stderr)
        return 2
    if not 1 <= args.clips <= 100_000:
        print(f"error: --clips {args.clips} is out of range; allowed: [1, 100000]", file=sys.stderr)
        return 2
    from pipeline.training.qa_checkpoint import SHIPPED_NAMES, shipped_dir
    snapshot = shipped_dir() if args.snapshot in SHIPPED_NAMES else Path(args.snapshot)
    if not (snapshot / "config.json").is_file():
        print(f"error: {args.snapshot}: no snapshot there (config.json missing)", file=sys.stderr)
        return 2
    try:
        make_clip, names = _clip_source(args.renderers, args.held_out)
    except (ValueError, HeldOutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    first = SPLIT_SEEDS[args.split].start
    data = ValData(make_clip, list(range(first, first + args.clips)), args.fps, split=args.split)
    clips = [data[i] for i in range(len(data))]
    device = resolve_device(args.device)
    result = {"snapshot": str(args.snapshot), "renderers": names, "split": args.split, "clips": len(clips),
              "questions": sum(len(c.qas) for c in clips), "device": str(device),
              **validate(snapshot, clips, torch.device(device))}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
