"""Train `arrcoc-synth-qa`: a small Qwen2-VL (the real architecture, HF transformers) learnt from
scratch on generated video QA (evaluation/synth_qa.py), robust to missing visual tokens.

    python -m pipeline.training.qa_vlm --config configs/qa_vlm.yaml [--out-dir DIR] [--set key=value ...]
                                       [--resume] [--export-shipped]

The model sees exactly what the pipeline gives it at inference (qa_data, qa_forward): frames
sampled at vlm.fps, the pipeline's preprocessing at `model.max_pixels` (stored in the snapshot's
processor config, which caps the frames when the snapshot is loaded), the chat prompt, kept tokens
at their M-RoPE positions, under keep maps of many selection policies. Training writes only under
--out-dir: checkpoint.pt (resumable with --resume), snapshot/ (a Hugging Face snapshot, loadable
by load_vlm like any local Qwen2-VL) and history.json; --export-shipped then copies snapshot/ to
pipeline/vlm/weights/arrcoc-synth-qa, which `--vlm arrcoc-synth-qa` loads. Validation answers the
val split through the pipeline's own answer path (load_vlm on the exported snapshot,
VLM.answer_questions) and scores exact match per question family. On CUDA the step runs in bf16
autocast (float32 weights and optimizer); on CPU in float32.

model.arch=qwen3_vl trains a small Qwen3-VL instead (configs/qa_vlm_qwen3.yaml; not shipped): 16 px
patches, DeepStack from the vision blocks model.deepstack, a timestamp per frame group, its input
cut from the pipeline's own video prompt (qa_forward), each view's empty frame groups kept or
dropped as drop.empty_frame_groups says; its snapshot loads as a local Qwen3-VL (--vlm DIR).

Learning from scratch, a model sat at the answer priors for its first 1300 steps (every family at
chance): nothing told its attention which of ~200 visual tokens mattered. Two things get it
grounding (qa_data): a curriculum whose first steps keep only the salient cells, and a per-token
colour loss through a linear head on the vision tower (training only, not in the snapshot). That
model still answered no question naming an object (where, shape, direction at chance): per-token
shape and motion targets on the same head, and a probe on the LM's hidden state of each visual
token naming its 3x3 region (M-RoPE positions shape attention, never a token's value), gave it
those (docs/performance.md has the training arms). Where the clips carry their objects' boxes (the
renderers'), three more targets come from them (qa_targets): object-centre tokens on the tower's
head (counting), the tokens of every object an answer depends on for the grounding loss (and, in
a share of dropped views, kept), and a probe on the LM's state where it answers reading the named
objects' centres and the question colour's shapes (relation, exists); data.extra_questions and
train.family_views give chosen families more questions and views (configs/qa_vlm_stage4.yaml).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from arr_coc._validate import ConfigError, check_choice, check_int, check_range
from pipeline.training.qa_data import MOTIONS, POLICIES, DropSpec, StepData
from pipeline.training.qa_checkpoint import (SHIPPED_NAME, init_root, resume_found, save_checkpoint,
                                             shipped_dir, start_from)
from pipeline.training.qa_eval import ValData, export_snapshot, validate
from pipeline.training.qa_targets import FACTS
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm import hf
from evaluation.scenes import COLORS, SHAPES

ARCHS = ("qwen2_vl", "qwen3_vl")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = "qwen2_vl"            # qwen2_vl (14 px patches) or qwen3_vl (16 px, DeepStack, timestamped groups)
    hidden: int = 384                 # LM width (also the vision merger's output)
    intermediate: int = 1024
    layers: int = 5
    heads: int = 6
    kv_heads: int = 2
    vision_depth: int = 4
    vision_dim: int = 256
    vision_heads: int = 4
    vision_mlp_ratio: int = 4
    rope_theta: float = 1e6           # the LM's M-RoPE base (Qwen2-VL's 1e6 barely turns the w axis on small grids)
    max_pixels: int = 224 * 224       # frames are resized into this many pixels (saved in the snapshot)
    fps: float = VLMConfig.fps        # frames per second the VLM sees: the pipeline's vlm.fps
    deepstack: tuple[int, ...] = (1, 2)   # qwen3_vl: the vision blocks whose features DeepStack adds to the LM

    def __post_init__(self) -> None:
        check_choice("model.arch", self.arch, ARCHS)
        for b in self.deepstack if self.arch == "qwen3_vl" else ():
            check_int("model.deepstack", b)
            check_range("model.deepstack", b, 0, self.vision_depth - 1)
        if self.arch == "qwen3_vl" and len(self.deepstack) > self.layers:
            raise ConfigError(f"model.deepstack={list(self.deepstack)} feeds more LM layers than "
                              f"model.layers={self.layers}")
        for name, lo, hi in (("hidden", 16, 4096), ("intermediate", 16, 16384), ("layers", 1, 64), ("heads", 1, 64),
                             ("kv_heads", 1, 64), ("vision_depth", 1, 64), ("vision_dim", 16, 4096),
                             ("vision_heads", 1, 64), ("vision_mlp_ratio", 1, 8), ("max_pixels", 56 * 56, 4096 * 4096)):
            check_int(f"model.{name}", getattr(self, name))
            check_range(f"model.{name}", getattr(self, name), lo, hi)
        if self.hidden % self.heads or (self.hidden // self.heads) % 8:
            raise ConfigError(f"model.hidden={self.hidden} must split into model.heads={self.heads} heads of a "
                              f"multiple of 8 dimensions")
        if self.heads % self.kv_heads:
            raise ConfigError(f"model.kv_heads={self.kv_heads} must divide model.heads={self.heads}")
        if self.vision_dim % self.vision_heads:
            raise ConfigError(f"model.vision_dim={self.vision_dim} must divide into "
                              f"model.vision_heads={self.vision_heads} heads")
        check_range("model.fps", self.fps, 0.0, 240.0, lo_open=True)
        check_range("model.rope_theta", self.rope_theta, 1.0, 1e9)


@dataclass(frozen=True)
class DropConfig:
    keep_min: float = 0.05            # keep ratios are drawn log-uniformly from [keep_min, keep_max]
    keep_max: float = 1.0
    p_all: float = 0.2                # share of questions asked with every visual token
    policies: tuple[str, ...] = POLICIES
    curriculum_steps: int = 600       # the first steps keep only salient cells (qa_data's curriculum)
    curriculum_keep: tuple[float, float] = (0.1, 0.35)   # their keep ratios (log-uniform)
    empty_frame_groups: str = "mix"   # qwen3_vl: a frame group with no kept token keeps its timestamp, drops
                                      # it, or each view draws one (mix: the model learns both vlm settings)
    keep_evidence: float = 0.0        # share of dropped views that keep every cell of their answer's objects

    def __post_init__(self) -> None:
        check_range("drop.keep_min", self.keep_min, 0.0, 1.0, lo_open=True)
        check_range("drop.keep_max", self.keep_max, self.keep_min, 1.0)
        check_range("drop.p_all", self.p_all, 0.0, 1.0)
        if not self.policies:
            raise ConfigError(f"drop.policies is empty; allowed: {', '.join(POLICIES)}")
        for p in self.policies:
            check_choice("drop.policies", p, POLICIES)
        check_int("drop.curriculum_steps", self.curriculum_steps)
        check_range("drop.curriculum_steps", self.curriculum_steps, 0, 10**7)
        lo, hi = self.curriculum_keep
        check_range("drop.curriculum_keep", lo, 0.0, 1.0, lo_open=True)
        check_range("drop.curriculum_keep", hi, lo, 1.0)
        check_choice("drop.empty_frame_groups", self.empty_frame_groups, ("keep", "drop", "mix"))
        check_range("drop.keep_evidence", self.keep_evidence, 0.0, 1.0)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1200
    clips_per_step: int = 24
    views_per_question: int = 2       # each question asked this many times per step, each with its own keep map
    lr: float = 1e-3
    min_lr_ratio: float = 0.05        # cosine decay to lr * this
    warmup_steps: int = 100
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    aux_weight: float = 1.0           # weight of the token-colour loss (0: none)
    aux_shape_weight: float = 0.0     # weight of the token-shape loss (0: none)
    aux_motion_weight: float = 0.0    # weight of the token-motion loss (0: none)
    aux_region_weight: float = 0.0    # weight of the LM probe's token-region loss (0: none)
    aux_region_layer: int = 2         # the LM layer whose output the region probe reads
    aux_ground_weight: float = 0.0    # weight of the grounding loss on the question's attention (0: none)
    aux_ground_layer: int = 4         # the LM layer (0-based) whose attention it shapes: pass 2 reads it
    aux_centre_weight: float = 0.0    # weight of the token object-centre loss on the vision head (0: none)
    aux_facts_weight: float = 0.0     # weight of the question-facts probe's loss (qa_targets; 0: none)
    aux_facts_layer: int = 4          # the LM layer whose output at the answer position the facts probe reads
    family_views: tuple[str, ...] = ()   # "family=N": N views per question of that family (else views_per_question)
    init: str = ""                    # a snapshot (same model fields) to start from, e.g. the shipped one
    seed: int = 0                     # model init and keep maps
    first_seed: int = 0               # clip seeds of step s: first_seed + s * clips_per_step + i (train split)
    workers: int = 12                 # data processes (0: in the training process)
    jpeg_prob: float = 0.5            # share of clips JPEG-compressed, as a decoded video is
    jpeg_quality: tuple[int, int] = (60, 95)
    resize_prob: float = 0.5          # share of clips resized to another shape (other token grids)
    aspect: tuple[float, float] = (0.75, 1.34)   # width / height of a resized clip, log-uniform
    area: tuple[float, float] = (0.6, 1.6)       # its area relative to the clip's
    device: str = "auto"
    checkpoint_every: int = 500
    time_limit_s: float = 0.0         # >0: stop after this long, checkpointed (continue with --resume)
    stop_step: int = 0                # >0: the run ends after this step; the schedule still spans steps

    def __post_init__(self) -> None:
        for name in ("steps", "clips_per_step", "views_per_question", "warmup_steps", "seed", "first_seed",
                     "workers", "checkpoint_every"):
            check_int(f"train.{name}", getattr(self, name))
        check_range("train.steps", self.steps, 1, 10**7)
        check_range("train.clips_per_step", self.clips_per_step, 1, 4096)
        check_range("train.views_per_question", self.views_per_question, 1, 16)
        check_range("train.lr", self.lr, 0.0, 1.0, lo_open=True)
        check_range("train.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_range("train.warmup_steps", self.warmup_steps, 0, self.steps)
        check_range("train.weight_decay", self.weight_decay, 0.0, 1.0)
        check_range("train.grad_clip", self.grad_clip, 0.0, 1e6, lo_open=True)
        check_range("train.aux_weight", self.aux_weight, 0.0, 100.0)
        check_range("train.aux_shape_weight", self.aux_shape_weight, 0.0, 100.0)
        check_range("train.aux_motion_weight", self.aux_motion_weight, 0.0, 100.0)
        check_range("train.aux_region_weight", self.aux_region_weight, 0.0, 100.0)
        check_int("train.aux_region_layer", self.aux_region_layer)
        check_range("train.aux_region_layer", self.aux_region_layer, 1, 64)
        check_range("train.aux_ground_weight", self.aux_ground_weight, 0.0, 100.0)
        check_int("train.aux_ground_layer", self.aux_ground_layer)
        check_range("train.aux_ground_layer", self.aux_ground_layer, 0, 63)
        check_range("train.aux_centre_weight", self.aux_centre_weight, 0.0, 100.0)
        check_range("train.aux_facts_weight", self.aux_facts_weight, 0.0, 100.0)
        check_int("train.aux_facts_layer", self.aux_facts_layer)
        check_range("train.aux_facts_layer", self.aux_facts_layer, 1, 64)
        family_counts("train.family_views", self.family_views, 1, 16)
        if not isinstance(self.init, str):
            raise ConfigError(f"Invalid train.init ({self.init!r}): must be a snapshot directory or empty")
        check_range("train.seed", self.seed, 0, 2**32 - 1)
        check_range("train.first_seed", self.first_seed, 0, 2**62)
        check_range("train.workers", self.workers, 0, 256)
        check_range("train.jpeg_prob", self.jpeg_prob, 0.0, 1.0)
        for q in self.jpeg_quality:
            check_int("train.jpeg_quality", q)
            check_range("train.jpeg_quality", q, 1, 100)
        if self.jpeg_quality[0] > self.jpeg_quality[1]:
            raise ConfigError(f"train.jpeg_quality={list(self.jpeg_quality)} must be [low, high] with low <= high")
        check_range("train.resize_prob", self.resize_prob, 0.0, 1.0)
        for name in ("aspect", "area"):
            lo, hi = getattr(self, name)
            check_range(f"train.{name}", lo, 0.1, 10.0)
            check_range(f"train.{name}", hi, lo, 10.0)
        check_choice("train.device", self.device, ("auto", "cuda", "cpu"))
        check_range("train.checkpoint_every", self.checkpoint_every, 1, 10**7)
        check_range("train.time_limit_s", self.time_limit_s, 0.0, 10**7)
        check_int("train.stop_step", self.stop_step)
        check_range("train.stop_step", self.stop_step, 0, self.steps)


@dataclass(frozen=True)
class ValConfig:
    clips: int = 200                  # the final validation's clips
    periodic_clips: int = 50          # the first this many of them (at most all) at each periodic validation
    first_seed: int = 1_000_000       # val clips make_qa_clip(first_seed + i, split="val"): the val split's
                                      # first seeds (evaluation.synth_qa.SPLIT_SEEDS), as write_split's
    every: int = 450                  # steps between periodic validations
    final_keep_ratios: tuple[float, ...] = (1.0, 0.25)   # the final validation also at random keep maps

    def __post_init__(self) -> None:
        for name in ("clips", "periodic_clips", "first_seed", "every"):
            check_int(f"val.{name}", getattr(self, name))
        check_range("val.clips", self.clips, 0, 10**6)
        check_range("val.periodic_clips", self.periodic_clips, 0, 10**6)
        check_range("val.first_seed", self.first_seed, 0, 2**62)
        check_range("val.every", self.every, 1, 10**7)
        for r in self.final_keep_ratios:
            check_range("val.final_keep_ratios", r, 0.0, 1.0, lo_open=True)


@dataclass(frozen=True)
class DataConfig:
    # the renderers of evaluation/renderers.py training and validation draw from (clip seed s from
    # renderers[s % n]); empty: the original generator's clips and seven families (the shipped model's)
    renderers: tuple[str, ...] = ()
    leave_out: str = ""               # leave-one-renderer-out: also keep this one out of training
    # "family=N": training clips of the renderers also ask up to N more questions of that family
    # (evaluation.questions.more_questions); validation and test clips never
    extra_questions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        from evaluation.renderers import HELD_OUT, RENDERERS
        for r in (*self.renderers, *((self.leave_out,) if self.leave_out else ())):
            check_choice("data.renderers", r, RENDERERS)
        if HELD_OUT in self.renderers:
            raise ConfigError(f"data.renderers names {HELD_OUT!r}, the held-out renderer: it is never trained "
                              f"or tuned on (evaluate on it with bench_accuracy --held-out)")
        if self.renderers and not self.training:
            raise ConfigError(f"data.leave_out={self.leave_out} leaves no renderer of {list(self.renderers)}")
        if family_counts("data.extra_questions", self.extra_questions, 0, 8) and not self.renderers:
            raise ConfigError("data.extra_questions needs data.renderers (the original generator's clips have none)")

    @property
    def training(self) -> tuple[str, ...]:
        return tuple(r for r in self.renderers if r != self.leave_out)


def family_counts(name: str, entries: tuple[str, ...], lo: int, hi: int) -> dict[str, int]:
    """("relation=3", ...) -> {"relation": 3}, each family once with a count in [lo, hi], else a ConfigError."""
    from evaluation.shapes_qa import ALL_FAMILIES
    out: dict[str, int] = {}
    for entry in entries:
        family, sep, count = str(entry).partition("=")
        if not sep or not count.strip().isdigit():
            raise ConfigError(f"{name}: {entry!r} is not family=N")
        check_choice(name, family.strip(), ALL_FAMILIES)
        if family.strip() in out:
            raise ConfigError(f"{name} names {family.strip()} twice")
        check_range(f"{name}[{family.strip()}]", int(count), lo, hi)
        out[family.strip()] = int(count)
    return out


@dataclass(frozen=True)
class QAVLMConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    drop: DropConfig = field(default_factory=DropConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    val: ValConfig = field(default_factory=ValConfig)
    data: DataConfig = field(default_factory=DataConfig)


def clip_source(cfg: QAVLMConfig) -> Callable:
    """make_clip(seed, split=...) of training and validation: data.renderers' clips, or the original generator's."""
    if cfg.data.renderers:
        from evaluation.renderers import MultiRendererClips
        return MultiRendererClips(cfg.data.training, extra=family_counts("data.extra_questions",
                                                                        cfg.data.extra_questions, 0, 8))
    from evaluation.synth_qa import make_qa_clip
    return make_qa_clip


# ---- model, data ----
def build(cfg: QAVLMConfig, device: torch.device):
    """-> (model float32 on device, tokenizer with the chat template, the pipeline's preprocessor)."""
    from pipeline.vlm.builtin import CHAT_TEMPLATE, build_model, build_tokenizer, small_config

    tokenizer = build_tokenizer("english")
    tokenizer.chat_template = CHAT_TEMPLATE
    m = cfg.model
    if m.arch == "qwen3_vl":
        from pipeline.vlm import qwen3_vl
        # the learned position grid: one entry per patch of a square frame (interpolated to any other)
        side = max(2, round(math.sqrt(m.max_pixels) / geometry(cfg).patch_size))
        config = qwen3_vl.small_config(tokenizer, hidden=m.hidden, intermediate=m.intermediate, layers=m.layers,
                                       heads=m.heads, kv_heads=m.kv_heads, vision_depth=m.vision_depth,
                                       vision_dim=m.vision_dim, vision_heads=m.vision_heads,
                                       vision_mlp_ratio=m.vision_mlp_ratio, rope_theta=m.rope_theta,
                                       deepstack=m.deepstack, position_side=side)
    else:
        config = small_config(tokenizer, hidden=m.hidden, intermediate=m.intermediate, layers=m.layers, heads=m.heads,
                              kv_heads=m.kv_heads, vision_depth=m.vision_depth, vision_dim=m.vision_dim,
                              vision_heads=m.vision_heads, vision_mlp_ratio=m.vision_mlp_ratio,
                              rope_theta=m.rope_theta)
    model = build_model(config, device=device, dtype=torch.float32, seed=cfg.train.seed)
    return model, tokenizer, video_preprocessor(cfg)


def geometry(cfg: QAVLMConfig) -> VLMGeometry:
    """The grid the pipeline gives this model: its max_pixels, the pipeline's min_pixels below it
    (Qwen3-VL: 16 px patches, 32 px tokens)."""
    patch = 16 if cfg.model.arch == "qwen3_vl" else 14
    return VLMGeometry(patch_size=patch, min_pixels=min(VLMConfig.min_pixels, cfg.model.max_pixels),
                       max_pixels=cfg.model.max_pixels)


def video_preprocessor(cfg: QAVLMConfig) -> VideoPreprocessor:
    """The pipeline's preprocessing of this model (Qwen3-VL normalises with mean = std = 0.5)."""
    if cfg.model.arch == "qwen3_vl":
        from pipeline.vlm.qwen3_vl import PROCESSOR_DEFAULTS as d
        return VideoPreprocessor(geometry(cfg), tuple(d["image_mean"]), tuple(d["image_std"]))
    return VideoPreprocessor(geometry(cfg))


def step_data(cfg: QAVLMConfig, make_clip: Callable, rank: int = 0, world: int = 1) -> StepData:
    d, t = cfg.drop, cfg.train
    return StepData(make_clip, geometry(cfg), clips_per_step=t.clips_per_step, views_per_question=t.views_per_question,
                    vlm_fps=cfg.model.fps, drop=DropSpec(d.keep_min, d.keep_max, d.p_all, d.policies),
                    jpeg_prob=t.jpeg_prob, jpeg_quality=t.jpeg_quality, resize_prob=t.resize_prob, aspect=t.aspect,
                    area=t.area, seed=t.seed, first_seed=t.first_seed, steps=t.steps,
                    curriculum_steps=d.curriculum_steps,
                    curriculum=DropSpec(d.curriculum_keep[0], d.curriculum_keep[1], 0.0, ("salient",)),
                    rank=rank, world=world, family_views=family_counts("train.family_views", t.family_views, 1, 16),
                    keep_evidence=d.keep_evidence)


def _identity(x: Any) -> Any:
    return x


def _worker_init(_: int) -> None:
    import cv2
    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def loader(dataset, indices, workers: int):
    """Items of `dataset` at `indices`, in order, made by `workers` processes (0: here)."""
    if workers == 0:
        return (dataset[i] for i in indices)
    return iter(torch.utils.data.DataLoader(dataset, batch_size=None, sampler=list(indices), num_workers=workers,
                                            collate_fn=_identity, prefetch_factor=4, worker_init_fn=_worker_init))


# ---- training ----
def lr_at(step: int, t: TrainConfig) -> float:
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(model, t: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over `model` (a module or a ModuleList of them): weight decay on matrices, not on
    embeddings, norms and biases."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=t.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train(cfg: QAVLMConfig, out_dir: str | Path, *, resume: bool = False, export_shipped: bool = False,
          make_clip: Callable | None = None, command: str = "", log: Callable[[str], None] = print) -> dict:
    """Train (or continue with resume), validate, export out_dir/snapshot; -> the training summary."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from pipeline.training.qa_forward import QAForward
    from pipeline.vlm.loading import resolve_device

    from pipeline.training import distributed

    if make_clip is None:
        make_clip = clip_source(cfg)
    hf_logging.disable_progress_bar()       # save / load bars at every validation
    if cfg.train.init and not resume_found(out_dir, resume):
        init_root(cfg.train.init)                       # before anything is written
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ranks, device = distributed.setup(resolve_device(cfg.train.device))
    if cfg.train.clips_per_step % ranks.world:
        raise ConfigError(f"train.clips_per_step={cfg.train.clips_per_step} must split evenly over "
                          f"{ranks.world} processes")
    if not ranks.main:
        log = _quiet
    torch.manual_seed(cfg.train.seed)
    model, tokenizer, preprocessor = build(cfg, device)
    model.train()
    # the vision tower has no dropout or normalization statistics: eval() only routes its attention
    # through the pipeline's batched kernel (one SDPA call per layer instead of one per frame pair)
    hf.vision_tower(model).eval()
    # the token-colour head: training only, never exported
    t = cfg.train
    if t.aux_region_weight and t.aux_region_layer > cfg.model.layers:
        raise ConfigError(f"train.aux_region_layer={t.aux_region_layer} "
                          f"must be at most model.layers={cfg.model.layers}")
    if t.aux_facts_weight and t.aux_facts_layer > cfg.model.layers:
        raise ConfigError(f"train.aux_facts_layer={t.aux_facts_layer} must be at most model.layers={cfg.model.layers}")
    if t.aux_ground_weight and t.aux_ground_layer >= cfg.model.layers:
        raise ConfigError(f"train.aux_ground_layer={t.aux_ground_layer} must be below model.layers={cfg.model.layers}")
    if t.init and not resume_found(out_dir, resume):
        start_from(model, t.init)
        log(f"started from {t.init}")
    aux_classes = (len(COLORS) + 1 + (len(SHAPES) + 1 if t.aux_shape_weight else 0)
                   + (len(MOTIONS) if t.aux_motion_weight else 0) + (2 if t.aux_centre_weight else 0))
    # the training-only heads: token colour / shape / motion / centre on the vision tower, region and
    # question facts on the LM
    aux_head = torch.nn.ModuleList([torch.nn.Linear(cfg.model.hidden, aux_classes, device=device),
                                    torch.nn.Linear(cfg.model.hidden, 9, device=device),
                                    torch.nn.Linear(cfg.model.hidden, FACTS, device=device)])
    forward = QAForward(model, tokenizer, preprocessor, aux_head[0], t.aux_weight, t.aux_shape_weight,
                        t.aux_motion_weight, aux_head[1] if t.aux_region_weight else None, t.aux_region_weight,
                        t.aux_region_layer, ground_weight=t.aux_ground_weight, ground_layer=t.aux_ground_layer,
                        fps=cfg.model.fps, empty_groups=cfg.drop.empty_frame_groups, seed=cfg.train.seed,
                        centre_weight=t.aux_centre_weight, facts_head=aux_head[2], facts_weight=t.aux_facts_weight,
                        facts_layer=t.aux_facts_layer)
    opt = optimizer(torch.nn.ModuleList([model, aux_head]), cfg.train, device)
    config_dict = _to_dict(cfg)
    start, history, train_s = 0, [], 0.0
    ckpt = out / "checkpoint.pt"
    if resume and ckpt.exists():
        state = torch.load(ckpt, map_location=device, weights_only=False)
        if state["config"]["model"] != config_dict["model"] or state["config"]["train"]["seed"] != cfg.train.seed:
            raise ConfigError(f"{ckpt} was trained with another model or seed; pass another --out-dir")
        model.load_state_dict(state["model"])
        aux_head.load_state_dict(state["aux_head"])
        opt.load_state_dict(state["optimizer"])
        start, history, train_s = state["step"], state["history"], state["train_s"]
        log(f"resumed at step {start} ({train_s:.0f} s trained)")
    step_forward = distributed.wrap(torch.nn.ModuleList([model, aux_head]), forward, ranks, device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters ({n_params * 2 / 2**20:.1f} MiB in bf16) on {_device_name(device)}"
        + (f", {ranks.world} data-parallel processes" if ranks.distributed else ""))
    seeds = list(range(cfg.val.first_seed, cfg.val.first_seed + cfg.val.clips)) if ranks.main else []
    val_clips = list(loader(ValData(make_clip, seeds, cfg.model.fps), range(len(seeds)), cfg.train.workers))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    snapshot = out / "snapshot"

    # the layer pass 2 reads (pipeline/vlm/passes.py): the one whose attention the grounding loss shaped
    extra = {"arrcoc_pass2_layers": t.aux_ground_layer} if t.aux_ground_weight else {}

    def export(summary: dict) -> Path:
        return export_snapshot(model, tokenizer, preprocessor, cfg.model.fps, snapshot, summary, extra)

    steps = t.stop_step or t.steps                    # where this run ends; lr_at spans t.steps
    began = time.perf_counter()
    bar = tqdm(total=steps, initial=start, desc="qa_vlm", mininterval=10.0, file=sys.stdout, disable=not ranks.main)
    done, stopped_early, waited = start, False, 0.0
    data = loader(step_data(cfg, make_clip, ranks.rank, ranks.world), range(start, steps), t.workers)
    for step in range(start, steps):
        tick = time.perf_counter()
        samples = next(data)
        waited += time.perf_counter() - tick
        for group in opt.param_groups:
            group["lr"] = lr_at(step, t)
        with autocast:
            loss, stats = step_forward(samples)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *aux_head.parameters()], t.grad_clip)
        opt.step()
        done = step + 1
        bar.update(1)
        if done % 25 == 0 or done == steps:
            bar.set_postfix(loss=f"{stats['answer_loss'].item():.3f}", acc=f"{stats['answer_acc'].item():.2f}",
                            aux=f"{stats['aux'].item():.3f}",
                            kept=f"{stats['kept']:.2f}", lr=f"{lr_at(step, t):.1e}",
                            data_wait=f"{waited / (time.perf_counter() - began):.0%}", refresh=False)
        elapsed = train_s + time.perf_counter() - began
        if ranks.main and done % cfg.val.every == 0 and done < steps and cfg.val.periodic_clips:
            acc = validate(export({}), val_clips[:cfg.val.periodic_clips], device)
            history.append({"step": done, "train_s": round(elapsed, 1), **acc})
            log(f"\nstep {done}: val {acc['keep_1']}")
        if ranks.main and (done % t.checkpoint_every == 0 or done == steps):
            save_checkpoint(ckpt, model, aux_head, opt, done, history, elapsed, config_dict)
        over = bool(t.time_limit_s and elapsed > t.time_limit_s and done < steps)
        if t.time_limit_s and ranks.distributed:            # every rank stops at the same step
            over = distributed.any_rank(over, device)
        if over:
            if ranks.main:
                save_checkpoint(ckpt, model, aux_head, opt, done, history, elapsed, config_dict)
            log(f"\ntime limit reached at step {done}: checkpointed, continue with --resume")
            stopped_early = True
            break
    bar.close()
    run_s = time.perf_counter() - began
    if done > start:
        memory = ""
        if device.type == "cuda":
            memory = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"
        log(f"{done - start} steps in {run_s:.0f} s: {(done - start) / run_s:.2f} steps/s, "
            f"{waited / run_s:.0%} of it waiting for data{memory}")
    train_s = train_s + run_s
    in_sync = distributed.check_in_sync(model, ranks)            # every rank: a collective
    distributed.teardown(ranks)
    if not ranks.main:
        return {"rank": ranks.rank, "steps": done, "fingerprints": in_sync}
    final = validate(export({}), val_clips, device, cfg.val.final_keep_ratios) if val_clips else {}
    summary = {"name": SHIPPED_NAME, "complete": not stopped_early and done >= steps, "steps": done,
               "train_s": round(train_s, 1), "device": _device_name(device), "parameters": n_params,
               "command": command, "config": config_dict, "val_clips": cfg.val.clips, "val": final,
               "history": history, "processes": ranks.world, "rank_fingerprints": in_sync}
    export(summary)
    (out / "history.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"val after {done} steps ({train_s:.0f} s): {json.dumps(final)}")
    if export_shipped:
        if not summary["complete"]:
            raise ConfigError("training stopped before its last step (train.stop_step or train.steps); "
                              "--export-shipped needs a finished run (continue it with --resume)")
        target = shipped_dir()
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(snapshot, target)
        log(f"exported to {target}")
    return summary


def _quiet(_: str) -> None:
    """The log of ranks other than 0."""


def _to_dict(cfg: QAVLMConfig) -> dict:
    from pipeline.configio import to_dict
    return to_dict(cfg)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ---- command line ----
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.training.qa_vlm",
                                description="train the small Qwen2-VL arrcoc-synth-qa on generated video QA")
    p.add_argument("--config", help="YAML config (configs/qa_vlm.yaml)")
    p.add_argument("--out-dir", default="runs/qa_vlm",
                   help="where checkpoints and the snapshot go (default: %(default)s)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/checkpoint.pt when it exists")
    p.add_argument("--export-shipped", action="store_true",
                   help=f"copy the finished snapshot to the shipped pipeline/vlm/weights/{SHIPPED_NAME}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from pipeline.configio import load_config

    args = parse_args(argv)
    try:
        cfg = load_config(QAVLMConfig, args.config, args.set)
        train(cfg, args.out_dir, resume=args.resume, export_shipped=args.export_shipped,
              command=" ".join(["python -m pipeline.training.qa_vlm", *(argv if argv is not None else sys.argv[1:])]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        print(f"error: {e} (the training needs evaluation/synth_qa.py and the packages of pyproject.toml)",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
