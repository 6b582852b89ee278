"""`python -m pipeline train --config configs/train_*.yaml`: learn where to look.

The seeds' curriculum (Parts 29, 44, 45), on generated scenes with exact ground truth
(evaluation/scenes.py), each stage training the parameters it names:
  grounding  the participatory scorer: cells of the named object couple to the query
  static     knowing + balancer + allocator on still frames, through the soft budget
  temporal   decay and motion boost (and the rest, gently) on video: tokens stay on the target
             while it moves and do not flicker inside a shot
  hard       everything, on tiny peripheral and low-contrast targets mixed with normal scenes
  vlm        with a VLM loaded: the VLM's answer loss, VLM frozen (pipeline/training/train_vlm.py)
Training is soft (the allocator's differentiable budget), inference hard (seed Part 44).
Queries are embedded by all-MiniLM-L6-v2, as the pipeline embeds them whatever VLM answers (a
loaded VLM serves the answer loss only). Texture extraction has no parameters, so every frame's
texture is computed once.
Checkpoints are safetensors (model + optimizer state + position), written every epoch; `--resume`
continues from the last one and reproduces the uninterrupted run.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from arr_coc._validate import ConfigError, check_choice, check_range
from evaluation.metrics import box_coverage, share_inside
from arr_coc.model import ARRCOC, ARRCOCConfig
from arr_coc.realizing import StreamState
from arr_coc.texture import Texture

StageName = Literal["grounding", "static", "temporal", "hard", "vlm", "vlm_qa"]
# Parameter-name prefixes each stage trains by default ("" = all).
STAGE_PARAMS = {"grounding": ("knowing.participatory",), "static": ("knowing", "balancer", "allocator"),
                "temporal": ("",), "hard": ("",), "vlm": ("",), "vlm_qa": ("",)}
VLM_STAGES = ("vlm", "vlm_qa")


@dataclass(frozen=True)
class StageConfig:
    name: StageName = "static"
    epochs: int = 10
    lr: float = 3e-3
    batch_size: int = 64          # examples per step (clips: one clip per step)
    params: tuple[str, ...] = ()  # parameter-name prefixes to train; () = the stage's default
    coherence_weight: float = 0.5  # temporal: weight of in-shot flicker (1 - cosine of soft maps)

    def __post_init__(self) -> None:
        check_choice("stage.name", self.name, STAGE_PARAMS)
        check_range("stage.epochs", self.epochs, 0, 10_000)
        check_range("stage.lr", self.lr, 0.0, 1.0, lo_open=True)
        check_range("stage.batch_size", self.batch_size, 1, 100_000)
        check_range("stage.coherence_weight", self.coherence_weight, 0.0, None)


@dataclass(frozen=True)
class DataConfig:
    size: int = 224               # square frames; the grid is the VLM merged-token grid of this size
    scenes: int = 256             # still scenes (each object of each scene is queried)
    hard_scenes: int = 128        # tiny-periphery + low-contrast scenes for the hard stage
    clips: int = 12               # video clips for the temporal stage
    clip_shots: int = 3
    val_scenes: int = 32          # held-out still scenes for the per-epoch val_token_share
    seed: int = 1                 # training data; benchmarks/bench_quality.py uses other seeds
    qa_clips: int = 64            # vlm_qa stage: generated video-QA clips (evaluation/synth_qa.py train split)
    qa_first_seed: int = 500_000  # their seeds (train split; arrcoc-synth-qa itself saw seeds below 48000)
    # "scenes": still scenes and clips of evaluation/scenes.py, vlm_qa on the original QA generator;
    # "renderers": every stage but hard on clips of the QA renderers (renderer_data.py): questions
    # of every family, grounded on the objects they name, on photographs and busy backgrounds too
    source: Literal["scenes", "renderers"] = "scenes"
    renderers: tuple[str, ...] = ("shapes", "photo", "busy")   # training renderers (the held-out one is refused)
    render_clips: int = 256       # renderer clips of the still stages (and the temporal stage's source)
    render_first_seed: int = 400_000
    frames_per_clip: int = 2      # still frames taken from each of them
    workers: int = 0              # processes drawing renderer clips (0: here)

    def __post_init__(self) -> None:
        check_range("data.size", self.size, 56, 1024)
        check_choice("data.source", self.source, ("scenes", "renderers"))
        check_range("data.render_clips", self.render_clips, 1, 100_000)
        check_range("data.render_first_seed", self.render_first_seed, 0, 1_000_000 - self.render_clips)
        check_range("data.frames_per_clip", self.frames_per_clip, 1, 64)
        check_range("data.workers", self.workers, 0, 256)
        if self.source == "renderers":
            from evaluation.renderers import MultiRendererClips
            try:
                MultiRendererClips(tuple(self.renderers))
            except ValueError as e:
                raise ConfigError(f"data.renderers={list(self.renderers)}: {e}") from None
        for name in ("scenes", "hard_scenes", "clips", "clip_shots"):
            check_range(f"data.{name}", getattr(self, name), 1, 100_000)
        check_range("data.val_scenes", self.val_scenes, 1, 100_000)
        check_range("data.qa_clips", self.qa_clips, 1, 100_000)
        check_range("data.qa_first_seed", self.qa_first_seed, 0, 1_000_000 - self.qa_clips)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    vlm: str = "none"             # a VLM spec for the vlm stages' answer loss ("none": no such stage)
    init: str = "none"            # start from these weights: "none", "default" (the shipped ones) or a path
    out_dir: str = "runs/train"   # everything training writes goes under here
    queries: str = "minilm"       # question vectors: the MiniLM encoder, or a query table (training/query_table.py)
    time_limit_s: float = 0.0     # stop after this long (checkpoint, export), 0: no limit
    model: ARRCOCConfig = field(default_factory=ARRCOCConfig)
    data: DataConfig = field(default_factory=DataConfig)
    stages: tuple[StageConfig, ...] = (
        StageConfig("grounding", 12), StageConfig("static", 10), StageConfig("temporal", 4, lr=1e-2, batch_size=1),
        StageConfig("hard", 6, lr=1e-3))

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("cpu", "cuda", "auto"))
        check_range("time_limit_s", self.time_limit_s, 0.0, None)
        from .query_table import check_queries
        check_queries(self.queries)
        if not self.stages:
            raise ConfigError("stages must list at least one stage")
        for s in self.stages:
            if s.name in VLM_STAGES and self.vlm == "none":
                raise ConfigError(f"stage '{s.name}' needs a VLM: set vlm to tiny-random, arrcoc-synth-qa, an HF id "
                                  f"or a path")


# ---------------------------------------------------------------- data
@dataclass
class Examples:
    """Still-frame examples: a texture row, a query and the named object's box coverage."""
    texture: Texture               # (S, C, gh, gw) one row per scene
    scene: torch.Tensor            # (E,) row of texture
    query: torch.Tensor            # (E, L, Dq)
    query_mask: torch.Tensor       # (E, L) bool
    coverage: torch.Tensor         # (E, gh, gw)

    def __len__(self) -> int:
        return int(self.scene.shape[0])


class QueryEmbedder:
    """Question -> (1, 384) MiniLM sentence vector (one query token) + mask, as the pipeline's queries;
    table: "minilm" (the encoder) or the path of a query table holding the same vectors."""

    def __init__(self, device: torch.device | str = "cpu", table: str = "minilm") -> None:
        self.device, self.cache = torch.device(device), {}
        if table == "minilm":
            from ..core.query import sentence_encoder
            self.encoder = sentence_encoder(str(self.device))
        else:
            from .query_table import QueryTable
            self.encoder = QueryTable(table, self.device)

    def __call__(self, text: str) -> torch.Tensor:
        if text not in self.cache:
            self.cache[text] = self.encoder.encode(text)[None].to(self.device)  # (1, 384)
        return self.cache[text]

    def batch(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embs = [self(t) for t in texts]
        L = max(e.shape[0] for e in embs)
        q = torch.zeros(len(embs), L, embs[0].shape[1], device=self.device)   # (E, L, Dq)
        mask = torch.zeros(len(embs), L, dtype=torch.bool, device=self.device)
        for i, e in enumerate(embs):
            q[i, :e.shape[0]], mask[i, :e.shape[0]] = e, True
        return q, mask


def frames_tensor(frames: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).to(device)  # (T, 3, H, W)


@torch.no_grad()
def still_textures(model: ARRCOC, images: np.ndarray, grid: tuple[int, int], device: torch.device,
                   chunk: int = 64) -> Texture:
    """Textures of unrelated still frames (no history), computed in chunks."""
    parts = [model.texture(frames_tensor(images[i:i + chunk], device), None, grid)
             for i in range(0, len(images), chunk)]
    return Texture(*(torch.cat([getattr(p, f) for p in parts]) for f in
                     ("data", "flow", "motion", "residual", "cell_rgb", "has_prev")))


def scene_examples(model: ARRCOC, scenes, embed: QueryEmbedder, grid, device, every_object: bool = True) -> Examples:
    """One example per (scene, object): the query naming that object and its box."""
    images = np.stack([s.image for s in scenes])
    H, W = images.shape[1:3]
    texture = still_textures(model, images, grid, device)
    rows, texts, boxes = [], [], []
    for i, s in enumerate(scenes):
        for o in range(len(s.objects)) if every_object else (s.target,):
            rows.append(i)
            texts.append(s.queries[o])
            boxes.append(s.objects[o].box)
    q, mask = embed.batch(texts)
    cov = box_coverage(torch.tensor(boxes, device=device), (H, W), grid)
    return Examples(texture, torch.tensor(rows, device=device), q, mask, cov)


def renderer_examples(model: ARRCOC, scenes: list, frames_per_clip: int, seed: int, embed: QueryEmbedder,
                      grid, device) -> Examples:
    """One example per (frame, question naming objects visible in it) of rendered QA clips: the
    question and the cells its objects cover (renderer_data.still_items)."""
    from .renderer_data import still_items, union_coverage

    frames, items = still_items(scenes, frames_per_clip, seed)
    if not items:
        raise ConfigError("the rendered clips have no question naming a visible object: draw more clips")
    texture = still_textures(model, frames, grid, device)
    q, mask = embed.batch([it.question for it in items])
    cov = union_coverage(items, frames.shape[1:3], grid, device)
    return Examples(texture, torch.tensor([it.frame for it in items], device=device), q, mask, cov)


def take(texture: Texture, index: torch.Tensor) -> Texture:
    return Texture(*(getattr(texture, f)[index] for f in ("data", "flow", "motion", "residual", "cell_rgb",
                                                          "has_prev")))


# ---------------------------------------------------------------- forward passes
def still_forward(model: ARRCOC, texture: Texture, query: torch.Tensor, query_mask: torch.Tensor | None):
    """ARR-COC on B unrelated still frames, each with its own query (B, L, Dq) -> (scores, balanced, allotment).

    Same path as ARRCOC.realize; frames without history are each a new scene to the realizer,
    so its warped cache is empty and every cell is available: the frames stay independent.
    """
    x = texture.data.index_select(1, model._knowing_index)               # (B, C-1, gh, gw)
    scores = model.knowing(x, query, query_mask)
    w = query_mask.unsqueeze(-1).to(query.dtype)                         # (B, L, 1)
    pooled = (query * w).sum(1) / w.sum(1).clamp_min(1.0)                # (B, Dq)
    balanced = model.balancer(scores, pooled)
    realized, _ = model.realizer(balanced.relevance, texture, StreamState())
    allotment = model.allocator(realized.relevance, realized.available)
    return scores, balanced, realized.relevance, allotment


def balanced_bce(p: torch.Tensor, coverage: torch.Tensor) -> torch.Tensor:
    """BCE of a [0, 1] map against the box coverage, inside and outside weighted equally."""
    p = p.flatten(1).clamp(1e-6, 1 - 1e-6)
    c = coverage.flatten(1)
    inside = -(c * torch.log(p)).sum(1) / c.sum(1).clamp_min(1e-6)
    outside = -((1 - c) * torch.log(1 - p)).sum(1) / (1 - c).sum(1).clamp_min(1e-6)
    return (0.5 * (inside + outside)).mean()


def still_loss(model: ARRCOC, ex: Examples, idx: torch.Tensor, stage: str):
    tex = take(ex.texture, ex.scene[idx])
    scores, balanced, relevance, allot = still_forward(model, tex, ex.query[idx], ex.query_mask[idx])
    cov = ex.coverage[idx]
    grounding = balanced_bce(scores.coupling, cov) + (1 - share_inside(scores.coupling, cov)).mean()
    if stage == "grounding":
        return grounding, balanced.tensions
    soft_share = share_inside(allot.soft, cov).mean()
    mass_share = share_inside(relevance, cov).mean()
    return (1 - soft_share) + 0.5 * (1 - mass_share) + 0.2 * grounding, balanced.tensions


@dataclass
class ClipData:
    texture: Texture
    query: torch.Tensor            # (L, Dq)
    query_mask: torch.Tensor       # (L,)
    coverage: torch.Tensor         # (T, gh, gw), zeros where the target has no box
    has_box: torch.Tensor          # (T,) bool
    same_shot: torch.Tensor        # (T - 1,) bool, frame t and t + 1 in the same shot


def clip_data(model: ARRCOC, clip, embed: QueryEmbedder, grid, device) -> ClipData:
    with torch.no_grad():
        texture = model.extract(frames_tensor(clip.frames, device), None, grid)
    T, H, W = clip.frames.shape[:3]
    boxes = torch.tensor([b if b is not None else (0, 0, 0, 0) for b in clip.boxes], device=device)
    shot = torch.tensor(clip.shot, device=device)
    q, mask = embed.batch([clip.query])
    return ClipData(texture, q[0], mask[0], box_coverage(boxes, (H, W), grid),
                    torch.tensor([b is not None for b in clip.boxes], device=device),
                    (shot[1:] == shot[:-1]) & (shot[1:] >= 0))


def clip_loss(model: ARRCOC, c: ClipData, coherence_weight: float):
    allocation, _, _ = model.realize(c.texture, c.query, None, query_mask=c.query_mask)
    soft = allocation.soft                                                # (T, gh, gw)
    share = share_inside(soft[c.has_box], c.coverage[c.has_box]).mean()
    flicker = (1 - _soft_cosine(soft))[c.same_shot].mean()
    return (1 - share) + coherence_weight * flicker, allocation.tensions


def _soft_cosine(maps: torch.Tensor) -> torch.Tensor:
    """Differentiable consecutive_cosine: (T, gh, gw) -> (T - 1,)."""
    v = maps.flatten(1)
    return F.cosine_similarity(v[:-1], v[1:], dim=1, eps=1e-8)


# ---------------------------------------------------------------- logging + checkpoints
@torch.no_grad()
def learned_values(model: ARRCOC, tensions: dict[str, torch.Tensor]) -> dict[str, float]:
    """The seed checklist: tensions, allocation steepness, temporal decay, motion boost."""
    out = {f"tension_{k}": round(float(v.detach().float().mean()), 4) for k, v in tensions.items()}
    alloc = model.allocator
    if hasattr(alloc, "steepness_raw"):
        out["steepness"] = round(float(F.softplus(alloc.steepness_raw)), 4)
    out["offset"] = round(float(alloc.offset), 4)
    out["decay"] = round(float(model.realizer.decay), 4)
    out["motion_boost"] = round(float(model.realizer.motion_boost), 4)
    return out


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out[f"optim.{i}.{name}"] = torch.as_tensor(value).clone()
    return out


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if key.startswith("optim."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = value
    sd["state"] = state
    opt.load_state_dict(sd)


# ---------------------------------------------------------------- the loop
def select_params(model: ARRCOC, stage: StageConfig) -> list[torch.nn.Parameter]:
    prefixes = stage.params or STAGE_PARAMS[stage.name]
    params = [p for n, p in model.named_parameters() if any(n.startswith(pre) for pre in prefixes)]
    if not params:
        raise ConfigError(f"stage {stage.name}: params {list(prefixes)} match no parameter of the model")
    return params


def _order(n: int, seed: int, stage: int, epoch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, stage, epoch]).generate_state(1)[0]))
    return torch.randperm(n, generator=g)


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool | None = None, log=print,
          export: str | Path | None = None) -> dict:
    """Run the curriculum; returns {"weights": path, "history": [per-epoch rows]}. Writes only
    under cfg.out_dir, and a copy of the final weights to `export` when given (the shipped
    checkpoint is replaced only on request: `train --export-shipped`)."""
    from tqdm import tqdm

    from arr_coc.checkpoint import load_weights, read_weights, save_weights
    from ..runtime.cuda import resolve_device
    from ..vlm.geometry import VLMGeometry

    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rendered = _render(cfg)         # in forked processes: before anything touches the GPU
    vlm = None
    if cfg.vlm != "none":
        from ..vlm import load_vlm
        vlm = load_vlm(cfg.vlm, device=device, dtype="float32")
        for p in vlm.model.parameters():
            p.requires_grad_(False)
    embed = QueryEmbedder(device, cfg.queries)
    query_dim = embed("a").shape[-1]
    model = ARRCOC(cfg.model, query_dim=query_dim)
    if cfg.init != "none":
        from arr_coc.checkpoint import load_pretrained
        load_pretrained(model, cfg.init, "init")
    model = model.to(device)
    size = (cfg.data.size, cfg.data.size)
    grid = (vlm.geometry if vlm is not None else VLMGeometry(max_pixels=size[0] * size[1])).grid(*size)

    still, hard, clips, vlm_scenes, qa_clips, val = _stage_data(cfg, model, vlm, embed, grid, device, rendered)
    log(f"data ({cfg.data.source}): {len(still)} still examples, {0 if hard is None else len(hard)} hard, "
        f"{len(clips)} clips, {len(qa_clips)} QA clips, grid {grid}, query_dim {query_dim} "
        f"({time.perf_counter() - t0:.1f}s)")

    start_stage, start_epoch, history = 0, 0, []
    last = out / "last.safetensors"
    resumed_tensors = None
    if resume and last.is_file():
        resumed_tensors, meta = read_weights(last)
        load_weights(model, last)
        start_stage, start_epoch = int(meta["stage"]), int(meta["epoch"]) + 1
        history = json.loads(meta.get("history", "[]"))
        log(f"resumed from {last}: stage {start_stage} epoch {start_epoch}")

    for si, stage in enumerate(cfg.stages):
        if si < start_stage:
            continue
        params = select_params(model, stage)
        opt = torch.optim.Adam(params, lr=stage.lr)
        first_epoch = start_epoch if si == start_stage else 0
        if resumed_tensors is not None and si == start_stage and first_epoch > 0:
            restore_optimizer(opt, resumed_tensors)
        for epoch in range(first_epoch, stage.epochs):
            model.train()
            losses, tensions = [], {}
            steps = _steps(stage, still, hard, clips, qa_clips if stage.name == "vlm_qa" else vlm_scenes,
                           cfg.seed, si, epoch)
            bar = tqdm(steps, desc=f"{stage.name} {epoch + 1}/{stage.epochs}", leave=False, file=sys.stderr,
                       disable=(not sys.stderr.isatty()) if progress is None else not progress)
            for kind, data, idx in bar:
                if cfg.time_limit_s and time.perf_counter() - t0 > cfg.time_limit_s:
                    break
                if kind == "clip":
                    loss, tensions = clip_loss(model, data, stage.coherence_weight)
                elif kind == "vlm":
                    from .train_vlm import vlm_step_loss
                    loss, tensions = vlm_step_loss(model, vlm, data, idx, embed)
                elif kind == "vlm_qa":
                    from .train_vlm import qa_step_loss
                    loss, tensions = qa_step_loss(model, vlm, data, idx, embed)
                else:
                    loss, tensions = still_loss(model, data, idx, stage.name)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
                bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if not losses:          # the time limit fell before this epoch's first step
                break
            row = {"stage": stage.name, "epoch": epoch + 1, "loss": round(float(np.mean(losses)), 5),
                   "val_token_share": round(validate(model, val), 4), **learned_values(model, tensions)}
            history.append(row)
            log(json.dumps(row))
            save_weights(model, last, {"stage": str(si), "epoch": str(epoch), "history": json.dumps(history)},
                         extra=optimizer_tensors(opt))
            if cfg.time_limit_s and time.perf_counter() - t0 > cfg.time_limit_s:
                break
        if cfg.time_limit_s and time.perf_counter() - t0 > cfg.time_limit_s:
            log(f"time limit {cfg.time_limit_s:g}s reached in stage {stage.name}: stopping (--resume continues)")
            break
    return finish(model, cfg, grid, history, out, export, log, t0)


def finish(model: ARRCOC, cfg, grid, history: list, out: Path, export, log, t0: float) -> dict:
    """Write the trained weights as the pipeline loads them (out/model.safetensors, and a copy to
    `export` when given) with the config and history; -> {"weights": path, "history": rows}."""
    from arr_coc.checkpoint import save_weights

    meta = {"format": "arr-coc-weights/1", "query_dim": str(model.query_dim), "grid": json.dumps(list(grid)),
            "query_encoder": "all-MiniLM-L6-v2",
            "train_config": json.dumps(_plain(cfg)), "history": json.dumps(history)}
    final = save_weights(model, out / "model.safetensors", meta)
    if export is not None:
        save_weights(model, export, meta)
        log(f"exported {export}")
    log(f"done in {time.perf_counter() - t0:.1f}s: {final}")
    return {"weights": final, "history": history}


def _render(cfg: TrainConfig) -> dict[str, list]:
    """With data.source renderers: the QAScenes of the still stages ("train"), of vlm_qa ("qa") and
    of validation ("val"), drawn in data.workers processes; {} with source scenes."""
    d = cfg.data
    if d.source != "renderers":
        return {}
    from evaluation.synth_qa import SPLIT_SEEDS
    from .renderer_data import RendererScenes, render_scenes

    source = RendererScenes(d.renderers)
    names = {s.name for s in cfg.stages}
    first_val = SPLIT_SEEDS["val"].start + d.render_first_seed
    still = bool(names & {"grounding", "static", "temporal", "hard"})
    return {"train": render_scenes(source, range(d.render_first_seed, d.render_first_seed + d.render_clips),
                                   "train", d.workers) if still else [],
            "qa": render_scenes(source, range(d.qa_first_seed, d.qa_first_seed + d.qa_clips), "train",
                                d.workers) if "vlm_qa" in names else [],
            "val": render_scenes(source, range(first_val, first_val + d.val_scenes), "val", d.workers)}


def _stage_data(cfg: TrainConfig, model: ARRCOC, vlm, embed: QueryEmbedder, grid, device, rendered: dict):
    """-> (still, hard, clips, vlm_scenes, qa_clips, val): the data of the stages cfg lists."""
    from evaluation.scenes import make_clips, make_scenes

    d = cfg.data
    names = {s.name for s in cfg.stages}
    size = (d.size, d.size)
    hard, clips, vlm_scenes, qa_clips = None, [], [], []
    if "hard" in names:
        hard_scenes = make_scenes(d.seed + 1, d.hard_scenes, size, kinds=("tiny_periphery", "low_contrast", "normal"))
        hard = scene_examples(model, hard_scenes, embed, grid, device)
    if "vlm" in names:
        vlm_scenes = make_scenes(d.seed + 4, d.scenes, size)
    if d.source == "scenes":
        still = scene_examples(model, make_scenes(d.seed, d.scenes, size), embed, grid, device)
        if "temporal" in names:
            clips = [clip_data(model, c, embed, grid, device) for c in make_clips(d.seed + 2, d.clips, size,
                                                                                  shots=d.clip_shots)]
        if "vlm_qa" in names:
            from .train_vlm import qa_clips as make_qa_clips
            qa_clips = make_qa_clips(range(d.qa_first_seed, d.qa_first_seed + d.qa_clips), vlm.config.fps)
        val = scene_examples(model, make_scenes(d.seed + 3, d.val_scenes, size), embed, grid, device,
                             every_object=False)
        return still, hard, clips, vlm_scenes, qa_clips, val

    from .renderer_data import qa_views, track_clips

    scenes = rendered["train"]
    still = renderer_examples(model, scenes, d.frames_per_clip, d.seed, embed, grid, device) if scenes else \
        _empty_examples(model, grid, device)
    if "temporal" in names:
        clips = [clip_data(model, c, embed, grid, device) for c in track_clips(scenes, d.seed + 2)[:d.clips]]
    if "vlm_qa" in names:
        qa_clips = qa_views(rendered["qa"], vlm.config.fps)
    val = renderer_examples(model, rendered["val"], 1, d.seed + 3, embed, grid, device)
    return still, hard, clips, vlm_scenes, qa_clips, val


def _empty_examples(model: ARRCOC, grid, device) -> Examples:
    """No still examples (only the vlm stages run): a zero-row Examples of the right shapes."""
    texture = still_textures(model, np.zeros((1, 56, 56, 3), np.uint8), grid, device)
    q = torch.zeros(0, 1, model.query_dim, device=device)
    return Examples(texture, torch.zeros(0, dtype=torch.long, device=device), q,
                    torch.zeros(0, 1, dtype=torch.bool, device=device), torch.zeros(0, *grid, device=device))


def _steps(stage: StageConfig, still: Examples, hard: Examples | None, clips: list[ClipData], vlm_scenes: list,
           seed: int, si: int, epoch: int):
    if stage.name == "temporal":
        return [("clip", clips[int(i)], None) for i in _order(len(clips), seed, si, epoch)]
    data = still
    if stage.name == "hard" and len(still):
        data = _concat(hard, still)
    elif stage.name == "hard":
        data = hard
    if stage.name in VLM_STAGES:
        order = _order(len(vlm_scenes), seed, si, epoch)
        return [(stage.name, vlm_scenes, order[i:i + stage.batch_size])
                for i in range(0, len(order), stage.batch_size)]
    order = _order(len(data), seed, si, epoch)
    return [("still", data, order[i:i + stage.batch_size]) for i in range(0, len(order), stage.batch_size)]


def _concat(a: Examples, b: Examples) -> Examples:
    n = a.texture.data.shape[0]
    texture = Texture(*(torch.cat([getattr(a.texture, f), getattr(b.texture, f)])
                        for f in ("data", "flow", "motion", "residual", "cell_rgb", "has_prev")))
    L = max(a.query.shape[1], b.query.shape[1])
    pad = lambda q: F.pad(q, (0, 0, 0, L - q.shape[1]))  # noqa: E731
    padm = lambda m: F.pad(m, (0, L - m.shape[1]), value=False)  # noqa: E731
    return Examples(texture, torch.cat([a.scene, b.scene + n]), torch.cat([pad(a.query), pad(b.query)]),
                    torch.cat([padm(a.query_mask), padm(b.query_mask)]), torch.cat([a.coverage, b.coverage]))


@torch.no_grad()
def validate(model: ARRCOC, val: Examples) -> float:
    """Mean hard-token share inside the target box on held-out still scenes."""
    model.eval()
    _, _, _, allot = still_forward(model, take(val.texture, val.scene), val.query, val.query_mask)
    model.train()
    return float(share_inside(allot.tokens.float(), val.coverage).mean())


def _plain(cfg) -> dict:
    from ..configio import to_dict
    return to_dict(cfg)
