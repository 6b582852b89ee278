"""The Python API: `Pipeline`, a typed front to the runners that the command line calls too.

    from pipeline import Pipeline

    pipe = Pipeline(vlm="tiny-random", device="cpu")
    result = pipe.answer("video.mp4", "What is moving?")          # VideoAnswers, no store written
    for frame in pipe.allocations("video.mp4", "What is moving?"):
        print(frame.pts, frame.tokens_kept, frame.scene_change)    # FrameAllocation per frame
    pipe.run("video.mp4", "What is moving?", out="video.zarr")     # the store `run` writes

A Pipeline holds one configuration (the same dataclasses, YAML files and dotted keys as the
command line's `--config` and `--set`) and loads its VLM once, on first use, for every call.
Every call goes through the same code as the corresponding command: runners/run.py (run, answer,
allocations), runners/live.py, runners/batch.py and runners/ray_batch.py.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, TextIO, get_args

from arr_coc._validate import ConfigError, check_choice

from .config import PipelineConfig, validate_every

if TYPE_CHECKING:
    from .runners.batch import BatchSummary
    from .runners.live import LiveResult
    from .runners.run import AllocationStream, RunResult

Device = Literal["auto", "cuda", "cpu"]
Decoder = Literal["pyav", "decord", "nvdec"]
Dataset = Literal["msrvtt"]
Task = Literal["qa", "caption"]
Transport = Literal["tcp", "udp"]


@dataclass(frozen=True)
class Answer:
    """The VLM's answer for one window of the video."""

    text: str
    t_start: float        # the window of video it covers (s)
    t_end: float
    question: str
    tokens_kept: int      # visual tokens sent to the VLM (in the final pass)
    tokens_full: int      # visual tokens a stock VLM would have been sent
    latency_s: float      # window end -> answer ready
    passes: int = 1       # answering passes (vlm.tempering: one per budget tried)
    tokens_spent: int | None = None   # visual tokens over all passes (None: tokens_kept, one pass)
    confidence: float = float("nan")  # of the answer's first token (vlm.tempering.confidence)
    no_answer: str = ""   # why `text` is no answer: empty, or not one the model gives ("": an answer)

    def __post_init__(self) -> None:
        if self.tokens_spent is None:
            object.__setattr__(self, "tokens_spent", self.tokens_kept)


@dataclass(frozen=True)
class VideoAnswers:
    """What `Pipeline.answer` returns: one Answer per window (one for the whole video unless
    `every` is set), and where the run's store went (None: none was written)."""

    stream_id: str
    question: str
    answers: tuple[Answer, ...]
    frames: int                   # frames allocated
    grid: tuple[int, int]         # the allocation grid (gh, gw): one cell per VLM token
    store: Path | str | None
    notes: tuple[str, ...] = ()   # e.g. tiny-random's "answers are meaningless"

    @property
    def text(self) -> str:
        """The answers' texts, one line per window."""
        return "\n".join(a.text for a in self.answers)

    @property
    def tokens_kept(self) -> int:
        return sum(a.tokens_kept for a in self.answers)

    @property
    def tokens_full(self) -> int:
        return sum(a.tokens_full for a in self.answers)

    @property
    def tokens_spent(self) -> int:
        return sum(a.tokens_spent for a in self.answers)


class Pipeline:
    """ARR-COC video question answering with one configuration.

    vlm:       HF id, local snapshot path, arrcoc-synth-qa, tiny-random (random weights: smoke
               tests) or none (allocation only); None: the config's (default none)
    device:    auto, cuda or cpu; None: the config's (default auto)
    decoder:   pyav, decord or nvdec (the GPU's decoders; decode.fallback: pyav where they cannot
               be used); None: the config's (default pyav)
    every:     one answer per window of this many seconds; None: the config's (default: one
               answer for the whole video)
    config:    a YAML file (configs/*.yaml) or a PipelineConfig; None: the defaults
    overrides: {dotted key: value}, the keys of `--set` (e.g. {"model.attending.retention": 0.1});
               values are used as they are, not parsed
    query_encoder: question -> (384,) tensor, used instead of all-MiniLM-L6-v2 to encode the
               question ARR-COC attends to (e.g. where its wheel is not installed); None: MiniLM

    Precedence as on the command line: config <- overrides <- the arguments above. Bad values
    raise ConfigError (a ValueError) naming the value and the allowed ones.
    """

    def __init__(self, *, vlm: str | None = None, device: Device | None = None, decoder: Decoder | None = None,
                 every: float | None = None, config: str | os.PathLike | PipelineConfig | None = None,
                 overrides: Mapping[str, Any] | None = None,
                 query_encoder: Callable[[str], Any] | None = None) -> None:
        from .configio import from_mapping, load_config, set_value, to_dict

        if vlm is not None and not (isinstance(vlm, str) and vlm.strip()):
            raise ConfigError(f"vlm must be an HF id, a local path, arrcoc-synth-qa, tiny-random or none, got {vlm!r}")
        if device is not None:
            check_choice("device", device, get_args(Device))
        if decoder is not None:
            check_choice("decoder", decoder, get_args(Decoder))
        if every is not None:
            validate_every(every, name="every")
        if query_encoder is not None and not callable(query_encoder):
            raise ConfigError(f"query_encoder must be a callable (question -> (384,) tensor) or None, "
                              f"got {type(query_encoder).__name__}")
        self._query_encoder = query_encoder
        if overrides is not None and not isinstance(overrides, Mapping):
            raise ConfigError(f"overrides must be a mapping of dotted keys to values, got {type(overrides).__name__}")
        values = dict(overrides or {})
        for key, value in (("runtime.vlm", vlm), ("runtime.device", device), ("decode.decoder", decoder),
                           ("runtime.every_s", every)):
            if value is not None:
                values[key] = value
        if isinstance(config, PipelineConfig):
            data = to_dict(config)
            for key, value in values.items():
                set_value(data, key, value)
            self._config = from_mapping(PipelineConfig, data)
        elif config is None or isinstance(config, (str, os.PathLike)):
            self._config = load_config(PipelineConfig, config, None, values)
        else:
            raise ConfigError(f"config must be a YAML path or a PipelineConfig, got {type(config).__name__}")
        self._vlm: Any = None
        self._vlm_loaded = False
        self._vlm_lock = threading.Lock()

    @property
    def config(self) -> PipelineConfig:
        """The validated configuration every call runs with."""
        return self._config

    def __repr__(self) -> str:
        rt = self._config.runtime
        return f"Pipeline(vlm={rt.vlm!r}, device={rt.device!r}, decoder={self._config.decode.decoder!r})"

    def run(self, video: str | os.PathLike, question: str, *, out: str | os.PathLike | None = None,
            overlay: str | os.PathLike | None = None, progress: bool | None = False) -> RunResult:
        """Process one video file into a store, as `python -m pipeline run` does: per-frame
        allocations and the answers. out: the store (default: <video stem>.zarr in the working
        directory; a path or an fsspec URL); overlay: also render the homunculus over the video
        (.mp4); progress: a progress bar on stderr (None: on a terminal). Returns the run's
        summary (runners.run.RunResult)."""
        from sinks import store_location

        from .runners.run import run_video

        _check_question(question)
        store = store_location(out) if out is not None else Path(f"{Path(video).stem}.zarr")
        return run_video(video, question, store, self._config, overlay_path=overlay, progress=progress,
                         vlm_factory=self._load_vlm, query_embedding=self._query(question))

    def answer(self, video: str | os.PathLike, question: str, *,
               out: str | os.PathLike | None = None) -> VideoAnswers:
        """Answer a question about one video file. No store is written unless `out` names one."""
        from sinks import store_location

        from .runners.run import run_video

        _check_question(question)
        if self._config.runtime.vlm == "none":
            raise ConfigError("answer() needs a VLM, and this Pipeline has vlm='none' (allocation only); "
                              "pass vlm=ID|PATH|arrcoc-synth-qa|tiny-random, or use allocations() or run()")
        result = run_video(video, question, None if out is None else store_location(out), self._config,
                           progress=False, vlm_factory=self._load_vlm, query_embedding=self._query(question))
        answers = tuple(Answer(text=a.text, t_start=a.t_start, t_end=a.t_end, question=a.question,
                               tokens_kept=a.tokens_kept, tokens_full=a.tokens_full, latency_s=a.latency_s,
                               passes=a.passes, tokens_spent=a.tokens_spent, confidence=a.confidence,
                               no_answer=a.no_answer)
                        for a in result.answers)
        return VideoAnswers(stream_id=result.stream_id, question=question, answers=answers, frames=result.frames,
                            grid=result.grid, store=result.out, notes=tuple(result.notes))

    def allocations(self, video: str | os.PathLike, question: str, *,
                    out: str | os.PathLike | None = None) -> AllocationStream:
        """Iterate a video's per-frame allocations (FrameAllocation: pts, frame_index, relevance and
        tokens maps, scene_change) as the graph makes them. No store unless `out` names one. With
        a VLM, answers are made too (`.result.answers` once the iteration ended).

        Returns once the models are loaded and the video opened (errors there are raised here);
        close() it, or use it in a `with` block, to stop early."""
        from sinks import store_location

        from .runners.run import AllocationStream

        _check_question(question)
        return AllocationStream(video, question, self._config, out=None if out is None else store_location(out),
                                vlm_factory=self._load_vlm, query_embedding=self._query(question))

    def live(self, sources: str | Sequence[str], question: str, *, out: str | os.PathLike = "live.zarr",
             on_scene_change: bool = False, duration: float | None = None, realtime: bool = False,
             transport: Transport = "tcp", timeout: float = 5.0, buffer: int = 16,
             max_reconnects: int | None = None, metrics_every: float = 5.0, answers_out: TextIO | None = None,
             stop: threading.Event | None = None, vlm_process: bool = False, stagger: bool = True,
             decode_threads: int = 2, capture_processes: int | None = None) -> LiveResult:
        """Answer a question continuously over live sources, as `python -m pipeline live` does:
        one answer every `every` seconds (2 unless set) or at each scene change, until `duration`
        ends, the sources end, `stop` is set or Ctrl-C. sources: camera index, device, rtsp(s):// or
        http(s):// URL, or a file with realtime=True. Answers go to the store and, as JSON lines, to
        `answers_out`. vlm_process: the VLM runs in a process of its own, loaded there (this
        Pipeline's loaded VLM, if any, is not used). stagger (default on): the streams' answer times
        spread over the period (LiveOptions.stagger), so streams started together do not queue
        behind each other. decode_threads: FFmpeg's decoding threads per network stream
        (LiveConfig.decode_threads, default 2; 0: FFmpeg's choice). With decoder nvdec, network
        streams and realtime files decode on the GPU (decode.fallback as for files); cameras
        (OpenCV) and decord's choice decode as before. capture_processes N > 0: the sources are
        captured in N worker processes (LiveConfig.capture_processes; PyAV only), 0: in threads here,
        None (default): 4 processes from 16 sources on, threads below."""
        from sinks import store_location
        from sources.live import LiveConfig

        from .core.live_stages import LiveOptions
        from .runners.live import run_live

        _check_question(question)
        specs = [sources] if isinstance(sources, str) else list(sources)
        if not specs or not all(isinstance(s, str) for s in specs):
            raise ConfigError(f"sources must be a source string or a list of them, got {sources!r}")
        check_choice("transport", transport, get_args(Transport))
        decode = self._config.decode
        live = LiveConfig(transport=transport, open_timeout_s=timeout, read_timeout_s=timeout,
                          max_reconnects=max_reconnects, buffer_frames=buffer, realtime=realtime,
                          decode_threads=decode_threads, decoder="nvdec" if decode.decoder == "nvdec" else "pyav",
                          fallback=decode.fallback, capture_processes=capture_processes)
        every = self._config.runtime.every_s
        options = LiveOptions(every_s=2.0 if every is None else every, on_scene_change=on_scene_change,
                              duration_s=duration, metrics_every_s=metrics_every, vlm_process=vlm_process,
                              stagger=stagger)
        return run_live(specs, question, store_location(out), self._config, live=live, options=options,
                        answers_out=answers_out, stop=stop, vlm=None if vlm_process else self._load_vlm(),
                        query_embedding=self._query(question))

    def batch(self, root: str | os.PathLike, *, dataset: Dataset = "msrvtt", split: str = "test", task: Task = "qa",
              videos: str | os.PathLike | None = None, limit: int | None = None, shard: str | None = None,
              out: str | os.PathLike | None = None, ray: str | None = None, workers: int | None = None,
              in_flight: int | None = None, videos_per_task: int | None = None, stock_tokens: bool = False,
              progress: bool | None = False, vlm_server: str | None = None, overwrite: bool = False,
              per_gpu: int = 1, actor_env: dict[str, str] | None = None) -> BatchSummary:
        """Answer every question of a dataset split, as `python -m pipeline batch` does: resumable
        (complete videos are skipped; a store answered with other settings is refused, `overwrite`
        starts it afresh: runners/settings.py), locally or on Ray Data (ray: 'auto', 'local' or an address).
        shard: 'i/n', every n-th video from the i-th; out: default <dataset>_<split>.zarr;
        stock_tokens: send every visual token (the baseline); vlm_server: the socket of a shared
        VLM process to answer with instead of loading one (`batch --processes` starts it and sets
        its key in the environment: pipeline/vlm/server.py); per_gpu: Ray actors on each GPU (1/per_gpu
        of it each), actor_env: variables they start with (an MPS daemon's: runners/ray_batch.py)."""
        from sources.msrvtt import load_msrvtt

        from .runners.batch import IN_FLIGHT, VideoAnswerer, default_out, make_plan, parse_shard, run_batch

        check_choice("dataset", dataset, get_args(Dataset))
        check_choice("task", task, get_args(Task))
        data = load_msrvtt(root, split, task=task, videos_dir=videos)
        plan = make_plan(data, limit=limit, shard=parse_shard(shard))
        out = out if out is not None else default_out(dataset, split)
        in_flight = IN_FLIGHT if in_flight is None else in_flight
        if ray is not None and vlm_server is not None:
            raise ConfigError("a shared VLM process (vlm_server) serves the local path; Ray actors load their own")
        if overwrite and shard is not None:
            raise ConfigError("--overwrite with --shard would delete the other shards' answers: start the store "
                              "afresh once (without --shard), then run the shards")
        if ray is None and self._config.decode.decoder == "nvdec" and not self._config.decode.fallback:
            # no GPU or no PyNvVideoCodec here: one error now, not every video skipped as unreadable
            from sources.nvdec import check_available
            check_available("--decoder nvdec")
        # the settings check (or the fresh start) before any model loads
        VideoAnswerer.create_store(self._config, out, stock=stock_tokens, overwrite=overwrite)
        if ray is not None:
            from .runners.ray_batch import run_ray_batch
            return run_ray_batch(plan, out, self._config, address=ray, stock=stock_tokens, workers=workers,
                                 progress=progress, in_flight=in_flight, videos_per_task=videos_per_task,
                                 query_encoder=self._query_encoder, per_gpu=per_gpu, actor_env=actor_env)
        if per_gpu != 1 or actor_env:
            raise ConfigError("per_gpu and actor_env place Ray actors: they need ray (batch --ray)")
        if videos_per_task is not None:
            raise ConfigError("--videos-per-task is for --ray runs (actor calls); the local path streams its videos")
        server = None
        if vlm_server is not None:
            from .vlm.server import ServerAddress
            server = ServerAddress.from_env(vlm_server)
        return run_batch(plan, out, self._config, stock=stock_tokens, progress=progress, in_flight=in_flight,
                         vlm_factory=self._load_vlm, query_encoder=self._query_encoder, vlm_server=server)

    def _query(self, question: str) -> Any:
        """The query_encoder's vector of `question` (checked by the runner), None: MiniLM's."""
        return None if self._query_encoder is None else self._query_encoder(question)

    def _load_vlm(self, device: Any = None) -> Any:
        """The VLM runtime.vlm names, loaded on first use and kept (None for 'none')."""
        from .core.setup import runtime_device
        from .vlm.loading import load_answerer

        with self._vlm_lock:
            if not self._vlm_loaded:
                device = runtime_device(self._config) if device is None else device
                self._vlm = load_answerer(self._config, device)
                self._vlm_loaded = True
            return self._vlm


def _check_question(question: Any) -> None:
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"question must be a non-empty string, got {question!r}")
    try:
        question.encode("utf-8")
    except UnicodeEncodeError:    # a lone surrogate: bytes that are not UTF-8 on a command line
        raise ConfigError(f"question {question!r} is not text: it holds a character no encoding takes "
                          f"(bytes that are not UTF-8 in the command line?)") from None
