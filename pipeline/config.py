"""The whole run's configuration: the ARR-COC model plus decode, VLM, runtime and output settings.

Loaded from YAML (configs/*.yaml) onto these dataclasses; `--set a.b=v` overrides any field and
the CLI's own flags (--device, --decoder, --vlm, ...) are shorthands for such overrides.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from arr_coc._validate import ConfigError, check_int, check_range
from arr_coc.model import ARRCOCConfig

from .vlm_config import VLMConfig


# An answer period (`--every`, runtime.every_s, POST /v1/streams' `every`) is at least one frame
# interval: a window shorter than that holds no frame of its own. Without the source's frame rate,
# the bound is one frame at 1000 fps, the highest rate a source may declare (sources/live.py); at
# most a day, so that due times stay exact floats and window arithmetic cannot overflow.
EVERY_MIN_S = 1e-3
EVERY_MAX_S = 86_400.0


def validate_every(every_s: object, fps: float | None = None, *, name: str = "every") -> float:
    """`every_s` as a float if it is an answer period in [EVERY_MIN_S, EVERY_MAX_S] and, with the
    source's frame rate `fps` known, at least one frame interval (1 / fps); else ConfigError, one
    line naming `name`, the value and the allowed range."""
    if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not math.isfinite(every_s):
        raise ConfigError(f"{name} must be a finite number of seconds, got {every_s!r}")
    low = EVERY_MIN_S if fps is None or not fps > 0 else max(EVERY_MIN_S, 1.0 / fps)
    if not low <= every_s <= EVERY_MAX_S:
        frame = f" (one frame at {fps:g} fps)" if low > EVERY_MIN_S else " (one frame at 1000 fps)"
        raise ConfigError(f"{name}={every_s!r} s is out of range: an answer period is at least {low:.4g} s"
                          f"{frame} and at most {EVERY_MAX_S:g} s (a day)")
    return float(every_s)


@dataclass(frozen=True)
class DecodeConfig:
    # nvdec: the GPU's video decoders (sources/nvdec.py); frames stay on the GPU. Decodes in this
    # process, in threads (`process` does not apply: CUDA frames do not fit shared memory cheaply)
    decoder: Literal["pyav", "decord", "nvdec"] = "pyav"
    # with decoder nvdec: an input NVDEC cannot decode (no GPU or PyNvVideoCodec, AV1 on a GPU
    # without it, 10-bit, 4:4:4) decodes with pyav after one warning naming why, instead of failing
    fallback: bool = False
    fps: float | None = None          # sample frames at this rate (None: every frame)
    start_s: float = 0.0
    end_s: float | None = None
    max_frames: int | None = None
    # decode in a worker process: the GIL-heavy stages cannot starve it (file inputs)
    process: bool = True
    # decoding threads per video (0: the decoder's choice, up to 16 with FFmpeg); several videos in
    # flight, or several Ray actors on one host, each run their own decoder
    threads: int = 0
    # refuse videos whose frames have more pixels than this (DCI 8K; None: no limit): one line, not
    # an out-of-memory kill
    max_pixels: int | None = 8192 * 4320
    # shared memory for the decode worker's frame slots (MiB): large frames get fewer slots and
    # fewer frames per slot, not more memory
    shared_mb: int = 1024

    def __post_init__(self) -> None:
        if self.fps is not None:
            check_range("decode.fps", self.fps, 0.0, 1000.0, lo_open=True)
        check_range("decode.start_s", self.start_s, 0.0, None)
        if self.end_s is not None:
            check_range("decode.end_s", self.end_s, self.start_s, None, lo_open=True)
        if self.max_frames is not None:
            check_range("decode.max_frames", self.max_frames, 1, None)
        check_int("decode.threads", self.threads)
        check_range("decode.threads", self.threads, 0, 256)
        if self.max_pixels is not None:
            check_int("decode.max_pixels", self.max_pixels)
            check_range("decode.max_pixels", self.max_pixels, 1, None)
        if not isinstance(self.fallback, bool):
            raise ConfigError(f"decode.fallback must be true or false, got {self.fallback!r}")
        check_int("decode.shared_mb", self.shared_mb)
        check_range("decode.shared_mb", self.shared_mb, 16, 1 << 20)


# ARR-COC weights trained for a shipped answer model (runtime.model_weights "auto"): arrcoc-synth-qa's
# synth-qa were trained on its renderers' clips through its answers (docs/training.md)
PAIRED_WEIGHTS = {"arrcoc-synth-qa": "synth-qa"}


@dataclass(frozen=True)
class RuntimeConfig:
    device: Literal["auto", "cuda", "cpu"] = "auto"
    vlm: str = "none"                 # HF id, local snapshot path, "tiny-random" or "none"
    every_s: float | None = None      # one answer per window of this many seconds (None: whole video)
    batch_size: int = 16              # frames per batch through the GPU stages
    queue_capacity: int = 4           # batches buffered between two stages
    cuda_graphs: bool = True          # replay full batches of the front end as CUDA graphs (GPU only)
    # ARR-COC weights: "auto" (the weights trained for the answering VLM, PAIRED_WEIGHTS; else "default"),
    # "default" (shipped, trained on generated scenes for any VLM), "synth-qa", "none" (initial values) or a path
    model_weights: str = "auto"
    # how a thread waiting for the GPU waits (pipeline/runtime/cuda.py set_cuda_wait): "block" sleeps
    # until the GPU is done; "auto" is CUDA's own choice, which spins a core per waiting thread
    # while the process has fewer CUDA contexts than CPUs
    cuda_wait: Literal["block", "auto"] = "block"

    def __post_init__(self) -> None:
        if self.every_s is not None:
            validate_every(self.every_s, name="runtime.every_s")
        check_range("runtime.batch_size", self.batch_size, 1, 4096)
        check_range("runtime.queue_capacity", self.queue_capacity, 1, 1024)
        if not self.vlm.strip():
            raise ConfigError("runtime.vlm must not be empty; use 'none' for allocation only")

    @property
    def arrcoc_weights(self) -> str:
        """runtime.model_weights with "auto" resolved for runtime.vlm."""
        if self.model_weights == "auto":
            return PAIRED_WEIGHTS.get(self.vlm, "default")
        return self.model_weights


@dataclass(frozen=True)
class OutputConfig:
    chunk_frames: int = 64            # zarr chunk length along time; a crash loses at most one

    def __post_init__(self) -> None:
        check_range("output.chunk_frames", self.chunk_frames, 1, 100_000)


@dataclass(frozen=True)
class PipelineConfig:
    model: ARRCOCConfig = field(default_factory=ARRCOCConfig)
    vlm: VLMConfig = field(default_factory=VLMConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        # pass 1 keeps candidate_factor times the retention as pass 2's candidates (pipeline/budget.py,
        # BudgetPlan.pass1): more than every cell would leave pass 2 a smaller share than asked
        a, v = self.model.attending, self.vlm
        if v.pass2 != "off" and not v.tempering.ladder and a.selection == "fraction" \
                and a.retention * v.candidate_factor > 1.0 + 1e-9:
            raise ConfigError(f"model.attending.retention={a.retention} times vlm.candidate_factor="
                              f"{v.candidate_factor} is more than every cell: pass 1 cannot keep that many "
                              f"candidates; lower vlm.candidate_factor to at most {1.0 / a.retention:.4g}")
