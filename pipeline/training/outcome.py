"""Outcome training: ARR-COC rewarded by the answers its hard selections get from a frozen VLM.

    python -m pipeline.training.outcome --config configs/train_outcome.yaml [--set key=value ...]
                                        [--resume] [--export PATH]

The original design's last stage (seed Part 45's "train on the answers"): the soft answer-loss
fine-tune (train_vlm.py) scales every token by a differentiable keep weight, which the pipeline never
does; here the selection is the pipeline's own kind, hard. Per step, for every question of
`clips_per_step` generated clips (training renderers only, renderer_data.py):

  1. ARR-COC realizes relevance over the frames the VLM sees (its fps), the question as query;
  2. `samples` selections are drawn from it (selection.py: exactly the allocator's budget of cells
     in every frame, Plackett-Luce with logits relevance / temperature, Gumbel-top-k);
  3. the frozen VLM reads each selection's kept tokens, with the prompt, positions and selection of
     the pipeline (qa_forward.QAForward); the reward is 1 when greedy decoding gives exactly the
     answer, i.e. when every answer token and <|im_end|> is the argmax after the right prefix;
  4. REINFORCE on the selections' log-probabilities, with GRPO's group baseline (the mean reward of
     the question's samples) by default.

Validation answers held-apart val clips with ARR-COC's deterministic hard allocation (what the
pipeline keeps) and logs the exact-match accuracy, first with the starting weights. Writes
OUT_DIR/last.safetensors (weights, optimizer, step; `--resume` continues) every checkpoint_every
steps, and OUT_DIR/model.safetensors at the end: the format `runtime.model_weights=PATH` loads.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch

from arr_coc._validate import ConfigError, check_choice, check_range
from arr_coc.model import ARRCOC, ARRCOCConfig
from arr_coc.attending import AttendingConfig

from .query_table import check_queries
from .selection import Advantage, policy_loss, sample_selection

QAItem = tuple[np.ndarray, list[tuple[str, str]]]    # frames the VLM sees (T, H, W, 3), [(question, answer)]


@dataclass(frozen=True)
class OutcomeData:
    renderers: tuple[str, ...] = ("shapes", "photo", "busy")    # training renderers (the held-out one is refused)
    clips: int = 512              # training clips, cycled through in a fixed shuffled order
    first_seed: int = 700_000     # train-split seeds of those clips (the relevance stages use others)
    val_clips: int = 48           # val-split clips the deterministic hard selection is scored on
    workers: int = 0              # processes drawing clips (0: here)

    def __post_init__(self) -> None:
        check_range("data.clips", self.clips, 1, 100_000)
        check_range("data.first_seed", self.first_seed, 0, 1_000_000 - self.clips)
        check_range("data.val_clips", self.val_clips, 0, 100_000)
        check_range("data.workers", self.workers, 0, 256)
        from evaluation.renderers import MultiRendererClips
        try:
            MultiRendererClips(tuple(self.renderers))
        except ValueError as e:
            raise ConfigError(f"data.renderers={list(self.renderers)}: {e}") from None


@dataclass(frozen=True)
class OutcomeTrain:
    steps: int = 300
    clips_per_step: int = 8
    samples: int = 8              # selections drawn per question (GRPO's group)
    temperature: float = 0.1      # Plackett-Luce logits = relevance / temperature
    advantage: Advantage = "group"
    lr: float = 3e-4
    grad_clip: float = 1.0        # 0: none
    params: tuple[str, ...] = ()  # parameter-name prefixes to train; (): all
    seed: int = 0
    val_every: int = 50           # 0: validate only at the start and the end
    log_every: int = 10
    checkpoint_every: int = 50
    time_limit_s: float = 0.0     # stop (checkpoint, export) after this long; 0: no limit

    def __post_init__(self) -> None:
        check_range("train.steps", self.steps, 0, 10_000_000)
        check_range("train.clips_per_step", self.clips_per_step, 1, 10_000)
        check_range("train.samples", self.samples, 1, 1024)
        check_range("train.temperature", self.temperature, 1e-3, 100.0)
        check_choice("train.advantage", self.advantage, ("group", "group_norm", "none"))
        check_range("train.lr", self.lr, 0.0, 1.0, lo_open=True)
        check_range("train.grad_clip", self.grad_clip, 0.0, None)
        for name in ("val_every", "log_every", "checkpoint_every"):
            check_range(f"train.{name}", getattr(self, name), 0, 10_000_000)
        check_range("train.time_limit_s", self.time_limit_s, 0.0, None)
        if self.samples < 2 and self.advantage != "none":
            raise ConfigError(f"train.samples={self.samples}: a group baseline needs at least 2 samples "
                              f"(or train.advantage=none)")


@dataclass(frozen=True)
class OutcomeConfig:
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    vlm: str = "arrcoc-synth-qa"  # the frozen VLM that answers: a shipped name or a snapshot directory
    init: str = "synth-qa"        # ARR-COC weights to start from: default, synth-qa, none or a path
    queries: str = "minilm"       # question vectors: the MiniLM encoder or a query table (query_table.py)
    out_dir: str = "runs/train_outcome"
    model: ARRCOCConfig = field(default_factory=lambda: ARRCOCConfig(attending=AttendingConfig(retention=0.1)))
    data: OutcomeData = field(default_factory=OutcomeData)
    train: OutcomeTrain = field(default_factory=OutcomeTrain)

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("cpu", "cuda", "auto"))
        check_queries(self.queries)
        if self.model.attending.pooled_share:
            raise ConfigError("model.attending.pooled_share must be 0 for outcome training: it samples full "
                              "tokens only")


# ---------------------------------------------------------------- the answerer
class VLMAnswerer:
    """ClipSamples -> per view whether greedy decoding gives exactly the answer (one batched forward,
    teacher-forced: the answer is decoded iff each of its tokens is the argmax after the right prefix)."""

    def __init__(self, vlm) -> None:
        from .qa_forward import QAForward

        self.geometry, self.fps = vlm.geometry, vlm.config.fps
        self.forward = QAForward(vlm.model, vlm.tokenizer, vlm.preprocessor)

    @torch.no_grad()
    def __call__(self, samples: list) -> torch.Tensor:
        from .qa_forward import IGNORE

        merged = self.forward.vision(samples)
        batch = self.forward.batch(samples, merged)
        logits, targets = self.forward.logits(batch)
        wrong = (logits.argmax(-1) != targets).long()                          # (answer tokens,)
        view = (batch.labels != IGNORE).nonzero()[:, 0]                         # row-major, as logits
        per_view = torch.zeros(batch.labels.shape[0], dtype=torch.long, device=wrong.device)
        return per_view.index_add_(0, view, wrong) == 0                         # (V,) bool


def clip_sample(frames: np.ndarray, questions: list[str], answers: list[str], keeps: list[np.ndarray]):
    """The answerer's input: one clip's views, each a question with its own LOD map (T, gh, gw)."""
    from .qa_data import ClipSample

    colors = np.zeros((1, 1, 1), np.int8)     # only QAForward's training heads read token colours
    return ClipSample(frames, questions, answers, ["outcome"] * len(questions), keeps, colors)


# ---------------------------------------------------------------- one step
@dataclass
class Prepared:
    """A clip ready for ARR-COC: its texture and its questions' vectors."""
    frames: np.ndarray
    texture: object                         # arr_coc.texture.Texture of the VLM's frames
    questions: list[str]
    answers: list[str]
    queries: torch.Tensor                   # (Q, Dq)


def prepare(model: ARRCOC, item: QAItem, embed: Callable[[str], torch.Tensor], grid, device) -> Prepared:
    frames, qas = item
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).to(device)   # (T, 3, H, W)
    with torch.no_grad():
        texture = model.extract(x, None, grid)
    queries = torch.stack([embed(q).reshape(-1) for q, _ in qas]) if qas else torch.zeros(0, model.query_dim)
    return Prepared(frames, texture, [q for q, _ in qas], [a for _, a in qas], queries.to(device))


def sample_step(model: ARRCOC, clips: list[Prepared], answerer, t: OutcomeTrain,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """-> (policy loss, stats) of one step: `samples` selections per question, rewarded by the answerer."""
    log_probs, samples = [], []
    for c in clips:
        keeps, views_q, views_a = [], [], []
        for q, (question, answer) in enumerate(zip(c.questions, c.answers)):
            realized, _, _ = model.realized(c.texture, c.queries[q])
            T, gh, gw = realized.relevance.shape
            available = realized.available.reshape(T, -1)                        # (T, N)
            budget = model.allocator.frame_budget(available.sum(-1))             # (T,)
            keep, log_prob = sample_selection(realized.relevance.reshape(T, -1) / t.temperature, available,
                                              budget, t.samples, generator)      # (G, T, N), (G,)
            log_probs.append(log_prob)
            keeps.append(keep.view(t.samples, T, gh, gw).to(torch.int8))
            views_q += [question] * t.samples
            views_a += [answer] * t.samples
        if views_q:   # one copy to the host per clip
            samples.append(clip_sample(c.frames, views_q, views_a, list(torch.cat(keeps).cpu().numpy())))
    if not log_probs:
        raise ValueError("no questions in this step's clips")
    rewards = answerer(samples).to(log_probs[0].device).float().view(len(log_probs), t.samples)   # (Q, G)
    log_prob = torch.stack(log_probs)                                                            # (Q, G)
    loss = policy_loss(log_prob, rewards, t.advantage)
    solved = ((rewards > 0).any(1) & (rewards < 1).any(1)).float().mean()
    return loss, {"reward": float(rewards.mean()), "mixed_groups": float(solved), "questions": len(log_probs)}


@torch.no_grad()
def hard_accuracy(model: ARRCOC, clips: list[Prepared], answerer, every_token: bool = False) -> float:
    """Exact-match accuracy with ARR-COC's deterministic hard allocation (every token: the VLM's own)."""
    samples, n = [], 0
    for c in clips:
        keeps = []
        for q in range(len(c.questions)):
            if every_token:
                keeps.append(np.ones(c.texture.data.shape[:1] + c.texture.data.shape[2:], np.int8))
            else:
                allocation, _, _ = model.realize(c.texture, c.queries[q])
                keeps.append(allocation.lod.cpu().numpy())
        if keeps:
            samples.append(clip_sample(c.frames, c.questions, c.answers, keeps))
            n += len(keeps)
    return float(answerer(samples).float().mean()) if n else float("nan")


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


# ---------------------------------------------------------------- the loop
def render_items(cfg: OutcomeConfig, vlm_fps: float) -> tuple[list[QAItem], list[QAItem]]:
    """(training clips, val clips) of the training renderers, as the VLM sees them."""
    from evaluation.synth_qa import SPLIT_SEEDS
    from .renderer_data import RendererScenes, qa_views, render_scenes

    d = cfg.data
    source = RendererScenes(d.renderers)
    train = render_scenes(source, range(d.first_seed, d.first_seed + d.clips), "train", d.workers)
    first_val = SPLIT_SEEDS["val"].start + d.first_seed
    val = render_scenes(source, range(first_val, first_val + d.val_clips), "val", d.workers)
    return qa_views(train, vlm_fps), qa_views(val, vlm_fps)


def _order(n: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]))
    return torch.randperm(n, generator=g).tolist()


def train(cfg: OutcomeConfig, *, resume: bool = False, export: str | Path | None = None, log=print,
          answerer=None, items: tuple[list[QAItem], list[QAItem]] | None = None,
          embed: Callable[[str], torch.Tensor] | None = None) -> dict:
    """Run outcome training; -> {"weights": path, "history": rows}. answerer / items / embed replace
    the VLM, the rendered clips and the query encoder (the tests' toy task); by default they come
    from cfg. Writes only under cfg.out_dir, and a copy of the final weights to `export`."""
    from arr_coc.checkpoint import load_pretrained, load_weights, read_weights, save_weights
    from ..runtime.cuda import resolve_device
    from .train import QueryEmbedder, finish, optimizer_tensors, restore_optimizer

    t = cfg.train
    torch.manual_seed(t.seed)
    device = resolve_device(cfg.device)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if items is None:            # drawn in forked processes: before anything touches the GPU
        from pipeline.vlm_config import VLMConfig
        items = render_items(cfg, VLMConfig().fps if answerer is None else answerer.fps)   # load_vlm's vlm.fps
    if answerer is None:
        from ..vlm.loading import load_vlm
        vlm = load_vlm(cfg.vlm, device=device, dtype="float32")
        for p in vlm.model.parameters():
            p.requires_grad_(False)
        answerer = VLMAnswerer(vlm)
    if embed is None:
        embed = QueryEmbedder(device, cfg.queries)
    query_dim = embed("a").reshape(-1).shape[0]
    model = ARRCOC(cfg.model, query_dim=query_dim)
    if cfg.init != "none":
        load_pretrained(model, cfg.init, "init")
    model = model.to(device).train()
    H, W = items[0][0][0].shape[1:3]
    grid = answerer.geometry.grid(H, W)
    train_clips = [prepare(model, it, embed, answerer.geometry.grid(*it[0].shape[1:3]), device) for it in items[0]]
    val_clips = [prepare(model, it, embed, answerer.geometry.grid(*it[0].shape[1:3]), device) for it in items[1]]
    log(f"data: {len(train_clips)} clips ({sum(len(c.questions) for c in train_clips)} questions), "
        f"{len(val_clips)} val clips, grid {grid} ({time.perf_counter() - t0:.1f}s)")
    prefixes = t.params or ("",)
    params = [p for n, p in model.named_parameters() if any(n.startswith(pre) for pre in prefixes)]
    if not params:
        raise ConfigError(f"train.params {list(prefixes)} match no parameter of the model")
    opt = torch.optim.Adam(params, lr=t.lr)
    start, history = 0, []
    last = out / "last.safetensors"
    if resume and last.is_file():
        tensors, meta = read_weights(last)
        load_weights(model, last)
        restore_optimizer(opt, tensors)
        start, history = int(meta["step"]), json.loads(meta.get("history", "[]"))
        log(f"resumed from {last} at step {start}")

    def validate(step: int) -> None:
        if not val_clips:
            return
        model.eval()
        acc = float(np.mean([hard_accuracy(model, chunk, answerer) for chunk in _chunks(val_clips, t.clips_per_step)]))
        row = {"step": step, "val_hard_accuracy": round(acc, 4)}
        if step == 0:
            row["val_every_token_accuracy"] = round(float(np.mean(
                [hard_accuracy(model, chunk, answerer, every_token=True)
                 for chunk in _chunks(val_clips, t.clips_per_step)])), 4)
        model.train()
        history.append(row)
        log(json.dumps(row))

    def checkpoint(step: int) -> None:
        save_weights(model, last, {"step": str(step), "history": json.dumps(history)}, extra=optimizer_tensors(opt))

    if start == 0:
        validate(0)
    generator = torch.Generator(device=device).manual_seed(t.seed)
    per_epoch = max(1, len(train_clips) // t.clips_per_step)
    window, tick, step = [], time.perf_counter(), start
    for step in range(start, t.steps):
        if t.time_limit_s and time.perf_counter() - t0 > t.time_limit_s:
            log(f"time limit {t.time_limit_s:g}s reached at step {step}: stopping (--resume continues)")
            break
        epoch, k = divmod(step, per_epoch)
        order = _order(len(train_clips), t.seed, epoch)[k * t.clips_per_step:(k + 1) * t.clips_per_step]
        loss, stats = sample_step(model, [train_clips[i] for i in order], answerer, t, generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if t.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        window.append({"loss": float(loss.detach()), **stats})
        done = step + 1
        if t.log_every and (done % t.log_every == 0 or done == t.steps):
            now = time.perf_counter()
            row = {"step": done, **{k: round(float(np.mean([w[k] for w in window])), 4) for k in window[0]},
                   "steps_per_s": round(len(window) / (now - tick), 3), "elapsed_s": round(now - t0, 1)}
            history.append(row)
            log(json.dumps(row))
            window, tick = [], now
        if t.val_every and done % t.val_every == 0 and done != t.steps:
            validate(done)
        if t.checkpoint_every and done % t.checkpoint_every == 0:
            checkpoint(done)
    else:
        step = t.steps
    if step > start:
        validate(step)
    checkpoint(step)
    return finish(model, cfg, grid, history, out, export, log, t0)


def compare(cfg: OutcomeConfig, specs: list[str], *, log=print) -> dict:
    """Exact-match accuracy on cfg's val clips of each ARR-COC weights spec's deterministic hard
    selection at model.attending.retention, and of every token (the VLM alone): one table for the
    shipped and the trained weights."""
    from dataclasses import replace

    from arr_coc.checkpoint import load_pretrained
    from pipeline.vlm_config import VLMConfig
    from ..runtime.cuda import resolve_device
    from ..vlm.loading import load_vlm
    from .train import QueryEmbedder

    device = resolve_device(cfg.device)
    _, items = render_items(replace(cfg, data=replace(cfg.data, clips=1)), VLMConfig().fps)
    if not items:
        raise ConfigError("data.val_clips is 0: nothing to compare on")
    answerer = VLMAnswerer(load_vlm(cfg.vlm, device=device, dtype="float32"))
    embed = QueryEmbedder(device, cfg.queries)
    models = []
    for spec in specs:
        model = ARRCOC(cfg.model, query_dim=embed("a").shape[-1])
        load_pretrained(model, spec, "--compare")
        models.append(model.to(device).eval())
    # texture extraction has no parameters: one preparation serves every model
    clips = [prepare(models[0], it, embed, answerer.geometry.grid(*it[0].shape[1:3]), device) for it in items]
    chunks = _chunks(clips, cfg.train.clips_per_step)
    every = float(np.mean([hard_accuracy(models[0], c, answerer, every_token=True) for c in chunks]))
    table = {"val_clips": len(clips), "questions": sum(len(c.questions) for c in clips),
             "retention": cfg.model.attending.retention, "vlm": cfg.vlm, "every_token": round(every, 4),
             "hard_selection": {}}
    for spec, model in zip(specs, models):
        table["hard_selection"][spec] = round(float(np.mean([hard_accuracy(model, c, answerer) for c in chunks])), 4)
        log(f"{spec}: {table['hard_selection'][spec]}")
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.training.outcome",
                                description="outcome training: ARR-COC's hard selections rewarded by a frozen "
                                            "VLM's exact-match answers (policy gradient)")
    p.add_argument("--config", required=True, help="YAML config (configs/train_outcome.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.add_argument("--resume", action="store_true", help="continue from OUT_DIR/last.safetensors when it exists")
    p.add_argument("--export", metavar="PATH", help="also write the final weights here (runtime.model_weights=PATH)")
    p.add_argument("--compare", metavar="SPEC,SPEC", help="train nothing: print the val clips' exact-match accuracy "
                                                         "of these ARR-COC weights (default, synth-qa, paths)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from pipeline.configio import load_config
    from pipeline.vlm.loading import VLMLoadError

    from transformers.utils import logging as hf_logging

    args = parse_args(argv)
    hf_logging.disable_progress_bar()
    try:
        cfg = load_config(OutcomeConfig, args.config, args.set)
        if args.compare:
            specs = [s.strip() for s in args.compare.split(",") if s.strip()]
            print(json.dumps(compare(cfg, specs, log=lambda s: print(s, file=sys.stderr, flush=True)), indent=1))
            return 0
        result = train(cfg, resume=args.resume, export=args.export, log=lambda s: print(s, file=sys.stderr, flush=True))
    except (ConfigError, VLMLoadError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: OUT_DIR/last.safetensors holds the last checkpoint (--resume continues)", file=sys.stderr)
        return 130
    print(json.dumps({"weights": str(result["weights"]), "final": result["history"][-1] if result["history"] else {}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
