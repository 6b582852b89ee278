"""Accuracy against visual tokens: ARR-COC and query-agnostic baselines through one VLM and one code path.

On the held-out test split of the generated video-QA dataset (evaluation/synth_qa.py, MSRVTT-QA
layout), every row runs `batch` (pipeline/runners/batch.py: decode -> front end -> the VLM answers
all of a clip's questions from one keep map) and `eval` (pipeline/runners/evaluate.py) exactly as
the CLI does; only the keep map's source differs per policy:

    stock            every visual token
    uniform          whole frame pairs, evenly spaced, to the same token count
    random           the same number of random cells per frame pair
    evs              vLLM's efficient video sampling: temporal difference of the VLM's tokens
    fastvid          FastVID-style dynamic segments + density-peak tokens (evaluation/baselines.py)
    arrcoc-noquery   ARR-COC with a zero query vector: saliency, motion, cuts, redundancy only
    arrcoc           ARR-COC with the question

So `python -m pipeline batch --dataset msrvtt --root ROOT --vlm arrcoc-synth-qa --set
model.attending.retention=R` followed by `eval` prints the `arrcoc` row's accuracy at R.

Variants of the ARR-COC row (--variants), each through its own VLM with these settings:

    pass2            vlm.pass2=attention: ARR-COC keeps 3x the budget as candidates, the VLM's own
                     attention from the question picks the budget among them (pipeline/vlm/passes.py)
    kept             vlm.encode=kept, vlm.kept_context=0: the vision tower encodes only the kept
                     cells' patches (the default adds a ring of one cell as context)
    all              vlm.encode=all: the vision tower encodes every patch, the tokens are picked after
    drop             vlm.empty_frame_groups=drop (Qwen3-VL): a frame group left with no kept token
                     loses its timestamp and markers (the ARR-COC row keeps them, the default)
    kept-drop        kept and drop together: with the rows above, keep vs drop at context 0 and 1
    finetuned        ARR-COC with the weights --arrcoc-weights names (configs/train_vlm_qa.yaml
                     fine-tunes the shipped ones through arrcoc-synth-qa's answer loss)
    tempering        the budget ladder --ladder: answer at its first rung, again at the next while
                     the first answer token's confidence is below the threshold, which is calibrated
                     on the validation split (--val-root; eval --calibrate's rule, over the first
                     pass's answers) unless --threshold gives it; one row, its tokens are every
                     pass's (tokens_spent). --rank allocation: each rung answers from ARR-COC's own
                     allocation at that rung; relevance: the same share of every frame pair's tokens,
                     the best rated first (both pass 2 off); attention: pass 2's (vlm.pass2=attention).
                     --fallback: which pass answers when none is confident (vlm.tempering.fallback);
                     --confidence / --probe: the confidence measure (vlm.tempering.confidence; probe:
                     the learned one, its file from benchmarks/fit_probe.py);
                     --precision / --escalate: the calibration rule

    python benchmarks/bench_accuracy.py --root data/synthqa --make 200 --vlm arrcoc-synth-qa
    python benchmarks/bench_accuracy.py --root data/qa_photo --renderer photo ...   # another renderer
    python benchmarks/bench_accuracy.py --root data/qa_held_out --held-out ...      # the held-out renderer

--renderer NAME writes ROOT's clips with that renderer of evaluation/renderers.py (every question
family, the region ones included) and adds, per row, accuracy over the questions that name exactly
one object and the rest (`names_one_object`), and on ARR-COC's rows the named object's share of the
kept tokens against its share of the cells (`named_object_share`, benchmarks/named_objects.py).
`--renderer in-distribution` is every training renderer (clip k from the (k mod n)-th): the
in-distribution test split. --held-out is --renderer of the held-out renderer (its test split;
tempering's --val-root split then comes from the training renderers).
    python benchmarks/bench_accuracy.py --quick                    # CPU smoke: tiny-random, 3 clips

Accuracy is exact match (eval's normalisation), overall and per question family, with the mean
visual tokens sent per clip. --ttft adds each policy's time to first token for one clip (the
selection's own cost, then the VLM's prefill and first token), on the device used.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import device_name, write_result  # noqa: E402
from pipeline.config import PipelineConfig  # noqa: E402
from pipeline.configio import load_config  # noqa: E402
from pipeline.core.setup import resolve_device  # noqa: E402
from pipeline.vlm.loading import load_answerer  # noqa: E402
from evaluation.baselines import NEEDS_FEATURES, baseline_keep  # noqa: E402
from pipeline.vlm_config import TemperingConfig  # noqa: E402

POLICIES = ("stock", "uniform", "random", "evs", "fastvid", "arrcoc-noquery", "arrcoc")
VARIANTS: dict[str, tuple[str, ...]] = {"pass2": ("vlm.pass2=attention",),
                                        "kept": ("vlm.encode=kept", "vlm.kept_context=0"),
                                        "all": ("vlm.encode=all",), "tempering": (),
                                        "drop": ("vlm.empty_frame_groups=drop",),
                                        "kept-drop": ("vlm.encode=kept", "vlm.kept_context=0",
                                                      "vlm.empty_frame_groups=drop")}
LADDER = (0.05, 0.1, 0.25)
RETENTIONS = (1.0, 0.5, 0.25, 0.1, 0.05)
# the families whose question names one object (by colour and shape): where query-awareness counts
ONE_OBJECT = ("where", "shape", "exists", "direction")


def ensure_split(root: Path, count: int, split: str = "test", renderer: str | None = None) -> None:
    """Write `count` clips of `split` under root unless it has them: the original generator's, or
    `renderer`'s (evaluation/renderers.py; comma-separated names share the clips; the held-out one
    for evaluation, its test split only: a validation split for it comes from the training
    renderers, which it must not tune on)."""
    if (root / f"{split}_qa.json").exists():
        return
    if renderer is None:
        print(f"generating {count} {split} clips (original generator) under {root}", file=sys.stderr)
        from evaluation.synth_qa import write_split
        write_split(root, split, count, progress=sys.stderr.isatty())
        return
    from evaluation.renderers import HELD_OUT, training_renderers, write_renderer_split
    held_out = renderer == HELD_OUT
    renderers = training_renderers() if held_out and split != "test" else tuple(renderer.split(","))
    print(f"generating {count} {split} clips ({','.join(renderers)}) under {root}", file=sys.stderr)
    write_renderer_split(root, split, count, renderers, evaluation=held_out and split == "test",  # type: ignore[arg-type]
                         progress=sys.stderr.isatty())


def tempering_overrides(ladder: tuple[float, ...], threshold: float | None = None, passes: int | None = None,
                        rank: str | None = None, fallback: str | None = None, confidence: str | None = None,
                        probe: Path | None = None) -> list[str]:
    """The tempering variant's settings; rank attention turns pass 2 on, relevance (or None: the
    config's default rank) leaves it as configured."""
    out = [*VARIANTS["tempering"], f"vlm.tempering.ladder=[{','.join(f'{r:g}' for r in ladder)}]",
           f"vlm.tempering.max_passes={passes or len(ladder)}"]
    if rank is not None:
        out += [f"vlm.tempering.rank={rank}"] + (["vlm.pass2=attention"] if rank == "attention" else ["vlm.pass2=off"])
    if fallback is not None:
        out.append(f"vlm.tempering.fallback={fallback}")
    if confidence is not None:
        out.append(f"vlm.tempering.confidence={confidence}")
    if probe is not None:
        out.append(f"vlm.tempering.probe={probe}")
    return out + ([f"vlm.tempering.threshold={threshold:g}"] if threshold is not None else [])


def keep_policy(policy: str, retention: float, vlm: Any) -> Callable[[np.ndarray, np.ndarray], np.ndarray] | None:
    """(frames (T, H, W, 3), ARR-COC's lod (T, gh, gw)) -> the keep map the VLM gets; None: ARR-COC's."""
    if policy not in ("uniform", "random", "evs", "fastvid"):
        return None

    def keep(frames: np.ndarray, lod: np.ndarray) -> np.ndarray:
        grid = lod.shape[1:]
        merged = None
        if policy in NEEDS_FEATURES:
            merged = vlm.visual_tokens(frames).unflatten(1, grid)              # (T', gh, gw, D)
        seed = int(np.asarray(frames[0], np.uint8).sum()) % (2**31)             # a clip's own, reproducible
        return baseline_keep(policy, frames, retention, grid=grid, merged=merged, seed=seed)
    return keep


def row_config(base: PipelineConfig, policy: str, retention: float) -> PipelineConfig:
    attending = replace(base.model.attending, retention=retention)
    return replace(base, model=replace(base.model, attending=attending))


def run_row(policy: str, retention: float, plan, dataset, base: PipelineConfig, vlm, workdir: Path,
            query_encoder, variant: str = "", annotations=None) -> dict[str, Any]:
    cfg = row_config(base, policy, retention)
    label = f"{policy}+{variant}" if variant else policy
    store = workdir / f"{label}_{retention:g}_{dataset.split}.zarr"
    kwargs: dict[str, Any] = dict(stock=policy == "stock", progress=False, vlm_factory=lambda device: vlm,
                                  keep_policy=keep_policy(policy, retention, vlm))
    if policy == "arrcoc-noquery":
        kwargs["query_encoder"] = lambda question: torch.zeros(384)
    elif query_encoder is not None:
        kwargs["query_encoder"] = query_encoder
    from pipeline.runners.batch import run_batch
    from pipeline.runners.evaluate import evaluate

    start = time.perf_counter()
    summary = run_batch(plan, store, cfg, **kwargs)
    scored = evaluate(store, dataset)
    report = scored.to_dict()
    by_type = report["accuracy_by_type"]
    one = [by_type[t] for t in ONE_OBJECT if t in by_type]
    n_one = sum(v["questions"] for v in one)
    return {"policy": label, "retention": retention, "accuracy": report["accuracy"],
            "questions": report["questions"], "answered": report["answered"],
            "one_object_accuracy": round(sum(v["accuracy"] * v["questions"] for v in one) / n_one,
                                         6) if n_one else None,
            "accuracy_by_family": {t: v["accuracy"] for t, v in by_type.items()},
            "mean_tokens_kept": report["tokens"]["mean_kept_per_video"],
            "mean_tokens_full": report["tokens"]["mean_full_per_video"],
            "mean_tokens_spent": report["tokens"]["mean_spent_per_video"],
            "kept_over_full": report["tokens"]["kept_over_full"],
            "spent_over_full": report["tokens"]["spent_over_full"],
            "mean_passes": round(statistics.fmean(_passes(store)), 4),
            "wall_s": round(time.perf_counter() - start, 2), "videos": summary.videos, "_report": scored,
            **_named(scored, store, label, annotations)}


def _named(report, store: Path, label: str, annotations) -> dict[str, Any]:
    """On a renderer split: accuracy over the questions naming one object and the rest, and on
    ARR-COC's single-pass rows the named object's share of the kept tokens
    (benchmarks/named_objects.py): there the store's tokens are the ones the VLM got (pass 2 and
    tempering pick among or beyond them, and the store keeps pass 1's allocation)."""
    if annotations is None:
        return {}
    from benchmarks.named_objects import breakdown, named_share
    records, videos = annotations
    out: dict[str, Any] = {"names_one_object": breakdown(report, records)}
    if label in ("arrcoc", "arrcoc-noquery"):
        out["named_object_share"] = named_share(store, records, videos)
    return out


def _passes(store: Path) -> list[float]:
    from sinks import ZarrStore
    z = ZarrStore.open(store, mode="r")
    return [float(p) for sid in z.stream_ids() for p in z.read(sid)["answers"]["passes"].tolist()] or [1.0]


def ttft_window(plan, fps: float) -> tuple[np.ndarray, str]:
    """The plan's first clip as the VLM samples it (frames (T, H, W, 3) uint8 at `fps`) and its
    first question: the window --ttft times."""
    from sources import open_video

    work = plan[0]
    with open_video(work.path, fps=fps) as source:
        frames = np.stack([f.rgb for f in source])
    return frames, work.questions[0].question


def save_window(path: Path, frames: np.ndarray, question: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, frames=frames, question=np.array(question))


def load_window(path: Path) -> tuple[np.ndarray, str]:
    try:
        with np.load(path) as data:
            frames, question = data["frames"], str(data["question"])
    except (OSError, KeyError, ValueError) as e:
        raise SystemExit(f"bench_accuracy: --ttft-window {path}: not a window file written by "
                         f"--save-ttft-window ({e})") from None
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise SystemExit(f"bench_accuracy: --ttft-window {path}: frames must be (T, H, W, 3) uint8, "
                         f"got {frames.shape} {frames.dtype}")
    return frames, question


def ttft_rows(policies, retentions, window: tuple[np.ndarray, str], base: PipelineConfig, device: torch.device,
              reps: int = 5, variants: dict[str, tuple[Any, list[float]]] | None = None) -> list[dict]:
    """Per policy and retention, on one window (frames at the VLM's fps and a question, as
    ttft_window gives them): the selection's own cost, then the VLM's answer up to its first token
    (vision, selection, pass 2 and every tempering pass included; median of reps after a warm-up).
    variants: label -> (a VLM answering one token with the variant's settings, its retentions)."""
    from arr_coc.model import ARRCOC
    from pipeline.core.setup import build_model
    from pipeline.runtime.requests import AnswerRequest

    vlm = load_answerer(replace(base, vlm=replace(base.vlm, max_new_tokens=1)), device)
    frames, question = window
    grid = vlm.geometry.grid(*frames.shape[1:3])
    rows = []

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn) -> tuple[float, Any]:
        times, out = [], None
        for _ in range(reps + 1):
            sync()
            t = time.perf_counter()
            out = fn()
            sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:]), out

    jobs = [(r, policies, "", vlm) for r in retentions]
    for label, (variant_vlm, variant_retentions) in (variants or {}).items():
        jobs += [(r, ("arrcoc",), label, variant_vlm) for r in variant_retentions]
    for retention, job_policies, variant, answerer in jobs:
        cfg = replace(row_config(base, "arrcoc", retention), vlm=answerer.config)
        model: ARRCOC = build_model(cfg, device, answering=True)             # pass 2: its candidates
        video = torch.as_tensor(frames, device=device).permute(0, 3, 1, 2)      # (T, 3, H, W)
        query = torch.zeros(384, device=device)

        def arrcoc_lod(q=query, model=model, video=video):    # bound now: called in this iteration
            allocation, _, _ = model.realize(model.extract(video, None, grid), q)
            return allocation.lod.cpu().numpy(), allocation.relevance.float().cpu().numpy()
        with torch.inference_mode():
            for policy in job_policies:
                if policy == "stock" and retention != retentions[0]:
                    continue
                scores = None                                                  # pass 1's relevance: ARR-COC's rows
                if policy in ("arrcoc", "arrcoc-noquery"):
                    select_s, (keep, scores) = timed(arrcoc_lod)
                elif policy == "stock":
                    select_s, keep = 0.0, None
                else:
                    merged = vlm.visual_tokens(frames).unflatten(1, grid) if policy in NEEDS_FEATURES else None
                    select_s, keep = timed(lambda policy=policy, retention=retention, merged=merged: baseline_keep(
                        policy, frames, retention, grid=grid, merged=merged))
                request = AnswerRequest("ttft", frames, keep, question, 0.0, len(frames) / base.vlm.fps, scores=scores)
                answer_s, _ = timed(lambda answerer=answerer, request=request: answerer.answer([request]))
                rows.append({"policy": f"{policy}+{variant}" if variant else policy,
                             "retention": 1.0 if policy == "stock" else retention,
                             "select_ms": round(select_s * 1e3, 3), "vlm_first_token_ms": round(answer_s * 1e3, 3),
                             "ttft_ms": round((select_s + answer_s) * 1e3, 3)})
    stock = next((r["ttft_ms"] for r in rows if r["policy"] == "stock"), None)
    for r in rows:
        r["ttft_x_stock"] = round(stock / r["ttft_ms"], 3) if stock else None
    return rows


def run_config(args, *overrides: str) -> PipelineConfig:
    """The pipeline config of every row: the VLM and device asked for, the front end at the VLM's
    2 fps, the run's --set overrides, then a variant's own."""
    return load_config(PipelineConfig, None, [f"runtime.vlm={args.vlm}", f"runtime.device={args.device}",
                                             "decode.fps=2", *args.overrides, *overrides])


def calibrate_on_val(args, ladder: tuple[float, ...], workdir: Path, query_encoder, device: torch.device,
                     result: dict) -> float:
    """Tempering's threshold: the tempering variant answers the validation split with threshold 0,
    so every answer comes from its first pass exactly as tempering's first pass makes it (the same
    candidates and ranking), and eval --calibrate's rule picks the confidence that best separates
    its right answers from its wrong ones."""
    from pipeline.runners.batch import make_plan
    from pipeline.runners.evaluate import calibrate_threshold
    from sources.msrvtt import load_msrvtt

    ensure_split(args.val_root, args.val_make, "val", args.renderer)
    val = load_msrvtt(args.val_root, "val")
    cfg = run_config(args, *tempering_overrides(ladder, 0.0, rank=args.rank, fallback=args.fallback,
                                                confidence=args.confidence, probe=args.probe))
    row = run_row("arrcoc", ladder[-1], make_plan(val, limit=args.limit), val, cfg, load_answerer(cfg, device),
                  workdir, query_encoder, "tempering-calibration")
    calibration = calibrate_threshold(row.pop("_report"), precision=args.precision, escalate=args.escalate)
    calibration.update(split="val", clips=row["videos"], first_rung_accuracy=row["accuracy"])
    result["tempering_calibration"] = calibration
    print(f"tempering threshold {calibration['threshold']:g} calibrated on {calibration['answers']} val answers",
          file=sys.stderr)
    return calibration["threshold"]


def print_table(rows: list[dict]) -> None:
    families = sorted({f for r in rows for f in r["accuracy_by_family"]})
    head = ["policy", "retention", "accuracy", "one_object", "names_one", "named_share", "tokens_kept", *families]
    print("  ".join(f"{h:>15}" for h in head))
    for r in rows:
        names_one = (r.get("names_one_object") or {}).get("one_object", {}).get("accuracy")
        share = (r.get("named_object_share") or {}).get("token_share")
        cells = [r["policy"], f"{r['retention']:g}", f"{r['accuracy']:.3f}",
                 "-" if r["one_object_accuracy"] is None else f"{r['one_object_accuracy']:.3f}",
                 "-" if names_one is None else f"{names_one:.3f}", "-" if share is None else f"{share:.3f}",
                 "-" if r["mean_tokens_kept"] is None else f"{r['mean_tokens_kept']:.1f}",
                 *(f"{r['accuracy_by_family'].get(f, float('nan')):.3f}" for f in families)]
        print("  ".join(f"{c:>15}" for c in cells))


def check_variant_settings(ap, args, variants: list[str], retentions: list[float]) -> None:
    """Every variant row's config at each of its retentions is valid, checked before any row runs
    (pass 2 at a retention above 1 / vlm.candidate_factor has fewer cells than candidates)."""
    from arr_coc._validate import ConfigError
    chosen = [float(r) for r in args.variant_retentions.split(",") if r] if args.variant_retentions else retentions
    for variant in variants:
        if variant in ("tempering", "finetuned"):
            continue
        for retention in chosen:
            try:
                row_config(run_config(args, *VARIANTS[variant]), "arrcoc", retention)
            except ConfigError as e:
                ap.error(f"variant {variant} at retention {retention:g}: {e} (choose --variant-retentions)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, help="dataset root (test_qa.json + videos/); generated with --make")
    ap.add_argument("--make", type=int, default=200, help="test clips to generate when ROOT has none (default 200)")
    ap.add_argument("--renderer", help="generate ROOT's clips with this renderer (evaluation/renderers.py; several "
                                       "comma-separated, or in-distribution: every training renderer; default: "
                                       "the original generator's seven families); adds the names-one-object "
                                       "breakdown and the named object's share of ARR-COC's tokens")
    ap.add_argument("--held-out", action="store_true", help="the held-out renderer's test split (--renderer HELD_OUT)")
    ap.add_argument("--vlm", default="arrcoc-synth-qa", help="VLM spec (default: arrcoc-synth-qa)")
    ap.add_argument("--limit", type=int, help="only the first N clips")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--retentions", help=f"comma-separated (default: {','.join(f'{r:g}' for r in RETENTIONS)}; "
                                          f"--quick: 1,0.25)")
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every row (as --set of the CLI)")
    ap.add_argument("--query-embeddings", type=Path,
                    help="a .pt {question: (384,) tensor} of MiniLM embeddings (machines without MiniLM)")
    ap.add_argument("--variants", default="", help=f"ARR-COC variants to add rows for: {', '.join(VARIANTS)}")
    ap.add_argument("--arrcoc-weights", type=Path, help="also rows of ARR-COC with these weights (variant "
                                                         "'finetuned', e.g. configs/train_vlm_qa.yaml's result)")
    ap.add_argument("--variant-retentions", help="the variants' retentions (default: --retentions)")
    ap.add_argument("--ladder", default=",".join(f"{r:g}" for r in LADDER),
                    help="tempering's budget ladder (default: %(default)s)")
    ap.add_argument("--rank", choices=("allocation", "relevance", "attention"),
                    help="tempering's ranking of each rung's tokens (default: vlm.tempering.rank's default)")
    ap.add_argument("--fallback", choices=("last", "most_confident"),
                    help="tempering's answer when no pass is confident (default: vlm.tempering.fallback's)")
    ap.add_argument("--confidence", choices=("margin", "entropy", "answer", "coverage", "probe"),
                    help="tempering's confidence measure (default: vlm.tempering.confidence's)")
    ap.add_argument("--probe", type=Path, help="with --confidence probe: the probe file (benchmarks/fit_probe.py's)")
    ap.add_argument("--threshold", type=float, help="tempering's confidence threshold (default: calibrated on "
                                                    "--val-root)")
    ap.add_argument("--precision", type=float,
                    help="calibrate the threshold as the lowest whose accepted first-pass answers on the "
                         "validation split are right this often (eval --calibrate's precision rule, e.g. the "
                         "top rung's own validation accuracy); default: the threshold that best separates "
                         "right answers from wrong ones")
    ap.add_argument("--escalate", type=float,
                    help="calibrate the threshold as a token budget: at most this share of the validation "
                         "split's first-pass answers (the least confident) is asked again")
    ap.add_argument("--hold-share", action="store_true",
                    help="with --escalate: tempering also holds that share while it answers "
                         "(vlm.tempering.escalate; the calibrated threshold decides its first answers)")
    ap.add_argument("--val-root", type=Path, help="validation split root for the tempering threshold "
                                                  "(generated with --val-make clips when it has none)")
    ap.add_argument("--val-make", type=int, default=100, help="validation clips to generate (default 100)")
    ap.add_argument("--ttft", action="store_true", help="also time each policy's time to first token")
    ap.add_argument("--ttft-only", action="store_true", help="only the time to first token (no accuracy rows; "
                                                             "tempering then needs --threshold)")
    ap.add_argument("--ttft-window", type=Path,
                    help="time --ttft on this window file (--save-ttft-window's) instead of the split's first "
                         "clip: with --ttft-only no split is read, so neither PyAV nor zarr is needed")
    ap.add_argument("--save-ttft-window", type=Path, help="write the split's first clip and question as --ttft "
                                                          "times them, for --ttft-window elsewhere")
    ap.add_argument("--quick", action="store_true", help="CPU smoke: tiny-random, 3 clips, 2 retentions")
    ap.add_argument("--out", type=Path, help="JSON result (default: print only)")
    args = ap.parse_args(argv)
    if args.quick:
        args.vlm, args.limit, args.make = "tiny-random", args.limit or 3, 3
    from evaluation.renderers import HELD_OUT, RENDERERS, training_renderers
    if args.held_out:
        if args.renderer not in (None, HELD_OUT):
            ap.error(f"--held-out is --renderer {HELD_OUT}; drop --renderer {args.renderer}")
        args.renderer = HELD_OUT
    if args.renderer == "in-distribution":
        args.renderer = ",".join(training_renderers())
    for name in (args.renderer or "").split(",") if args.renderer else ():
        if name not in RENDERERS:
            ap.error(f"unknown renderer {name!r}; choose from {', '.join(RENDERERS)} or in-distribution")
        if name == HELD_OUT and args.renderer != HELD_OUT:
            ap.error(f"{HELD_OUT} is the held-out renderer: evaluate it alone (--held-out)")
    if args.retentions is None:
        args.retentions = "1,0.25" if args.quick else ",".join(f"{r:g}" for r in RETENTIONS)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    retentions = [float(r) for r in args.retentions.split(",") if r]
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    ladder = tuple(float(r) for r in args.ladder.split(",") if r)
    args.rank = args.rank or TemperingConfig().rank                       # explicit: it decides vlm.pass2
    if args.arrcoc_weights is not None:
        if not args.arrcoc_weights.is_file():
            ap.error(f"--arrcoc-weights {args.arrcoc_weights}: no such file")
        variants.append("finetuned")
    args.ttft = args.ttft or args.ttft_only
    if args.ttft_only and "tempering" in variants and args.threshold is None:
        ap.error("--ttft-only with the tempering variant needs --threshold (no split is answered to calibrate it)")
    if "tempering" in variants and args.threshold is None and args.val_root is None:
        ap.error("the tempering variant needs --threshold or --val-root (the split its threshold is calibrated on)")
    if args.hold_share and args.escalate is None:
        ap.error("--hold-share holds the --escalate share: give it")
    if args.ttft_window is not None and not args.ttft_window.is_file():
        ap.error(f"--ttft-window {args.ttft_window}: no such file")
    check_variant_settings(ap, args, variants, retentions)
    workdir = Path(tempfile.mkdtemp(prefix="bench_accuracy_"))
    plan, dataset, window, annotations = [], None, None, None
    if args.ttft_window is not None:
        window = load_window(args.ttft_window)
    if not (args.ttft_only and window is not None):                      # the split: accuracy rows, or its window
        from pipeline.runners.batch import make_plan
        from sources.msrvtt import load_msrvtt

        root = args.root or workdir / "data"
        ensure_split(root, args.make, "test", args.renderer)
        dataset = load_msrvtt(root, "test")
        from benchmarks.named_objects import load_annotations
        annotations = load_annotations(root, "test")
        plan = make_plan(dataset, limit=args.limit)
    base = run_config(args)
    if args.save_ttft_window is not None:
        window = ttft_window(plan, base.vlm.fps)                         # --ttft times this same window
        save_window(args.save_ttft_window, *window)
        print(f"wrote {args.save_ttft_window}", file=sys.stderr)
    device = resolve_device(args.device)
    vlm = None if args.ttft_only else load_answerer(base, device)          # --ttft-only: ttft_rows loads its own
    query_encoder = None
    if args.query_embeddings is not None:
        table = torch.load(args.query_embeddings)
        query_encoder = lambda question: table[question]  # noqa: E731
    rows: list[dict] = []
    result = {"benchmark": "bench_accuracy", "command": " ".join(["python", *sys.argv]), "device": str(device),
              "device_name": device_name(device), "vlm": args.vlm, "clips": len(plan), "renderer": args.renderer,
              "questions": sum(len(w.questions) for w in plan), "one_object_families": list(ONE_OBJECT), "rows": rows}
    def add(row: dict) -> None:
        row.pop("_report", None)
        print(f"{row['policy']:>18} {row['retention']:>5g}  accuracy {row['accuracy']:.3f}  "
              f"tokens {row['mean_tokens_kept']} (spent {row['mean_tokens_spent']})", file=sys.stderr)
        rows.append(row)
        result["rows"] = rows
        if args.out:                                        # after every row: a cut-short run keeps its rows
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2) + "\n")

    for policy in policies if not args.ttft_only else ():
        for retention in ([1.0] if policy == "stock" else retentions):
            add(run_row(policy, retention, plan, dataset, base, vlm, workdir, query_encoder, annotations=annotations))
    variant_vlms: dict[str, tuple[Any, list[float]]] = {}
    for variant in variants:
        overrides = (list(VARIANTS[variant]) if variant != "finetuned"
                     else [f"runtime.model_weights={args.arrcoc_weights}"])
        variant_retentions = [float(r) for r in args.variant_retentions.split(",") if r] \
            if args.variant_retentions else retentions
        if variant == "tempering":
            threshold = args.threshold
            if threshold is None:
                threshold = calibrate_on_val(args, ladder, workdir, query_encoder, device, result)
            overrides = tempering_overrides(ladder, threshold, rank=args.rank, fallback=args.fallback,
                                            confidence=args.confidence, probe=args.probe)
            if args.hold_share:
                overrides.append(f"vlm.tempering.escalate={args.escalate:g}")
            variant_retentions = [ladder[-1]]                # the ladder replaces the retention
        cfg = run_config(args, *overrides)
        if not args.ttft_only:
            variant_vlm = load_answerer(cfg, device)
            for retention in variant_retentions:
                add(run_row("arrcoc", retention, plan, dataset, cfg, variant_vlm, workdir, query_encoder, variant,
                            annotations))
            del variant_vlm
        result.setdefault("variants", {})[variant] = overrides
        if args.ttft:
            ttft_cfg = replace(cfg.vlm, max_new_tokens=1)
            variant_vlms[variant] = (load_answerer(replace(cfg, vlm=ttft_cfg), device), variant_retentions)
    if rows:
        print_table(rows)
    if args.ttft:
        result["ttft"] = ttft_rows(policies, retentions, window or ttft_window(plan, base.vlm.fps), base, device,
                                   variants=variant_vlms)
        for r in result["ttft"]:
            print(f"ttft {r['policy']:>15} {r['retention']:>5g}  select {r['select_ms']:.2f} ms  "
                  f"total {r['ttft_ms']:.2f} ms  x{r['ttft_x_stock']}")
    if args.out:
        write_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
