"""``load_vlm(spec)``: the built-in tiny-random model, a shipped snapshot by name, a local snapshot
directory, or a Hub id."""
from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pipeline.runtime.cuda import resolve_device
from pipeline.vlm import qwen3_vl
from pipeline.vlm.builtin import FAMILIES, build_model, build_tokenizer, model_class, tiny_config
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.model import VLM
from pipeline.vlm.preprocess import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, VideoPreprocessor

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig

TINY_SPECS = {"tiny-random": "qwen2_vl", "tiny-random-qwen2_5_vl": "qwen2_5_vl", "tiny-random-qwen3_vl": "qwen3_vl"}
# Snapshots shipped inside the package, loaded by name through the very path of a user's local
# snapshot (_load_pretrained): `arrcoc-synth-qa` is the small Qwen2-VL trained on generated video QA
# (pipeline.training.qa_vlm), meaningful on generated scenes only.
SHIPPED_DIR = Path(__file__).resolve().parent / "weights"
SHIPPED = {"arrcoc-synth-qa": SHIPPED_DIR / "arrcoc-synth-qa"}
TINY_WARNING = "tiny-random is a built-in random model for smoke tests: its answers are meaningless"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# How long to wait for the Hub before deciding it cannot be reached: Hugging Face's own client
# retries a refused connection 5 times over ~25 s, logging each retry.
HUB_TIMEOUT_S = 3.0


class VLMLoadError(RuntimeError):
    """The VLM spec cannot be loaded. The message is one line, fit for the CLI."""


def load_answerer(cfg: PipelineConfig, device: torch.device) -> VLM | None:
    """The VLM named by runtime.vlm, or None for allocation only."""
    if cfg.runtime.vlm == "none":
        return None
    # bf16 matrix products are slow on CPUs; there the VLM runs in float32
    dtype = "float32" if device.type == "cpu" else cfg.vlm.dtype
    return load_vlm(cfg.runtime.vlm, device=device, dtype=dtype, config=cfg.vlm)


def load_vlm(spec: str, *, device: str | torch.device = "auto", dtype: str | torch.dtype | None = None,
             config: VLMConfig | None = None, local_files_only: bool = False) -> VLM:
    """``spec``: "tiny-random" (or "tiny-random-qwen2_5_vl"), a shipped snapshot's name (SHIPPED), a local
    snapshot dir, or a Hub id such as "Qwen/Qwen2-VL-2B-Instruct". ``dtype`` defaults to ``config.dtype``."""
    config = config or VLMConfig()
    device = resolve_device(device)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype or config.dtype]
    if spec in TINY_SPECS:
        return build_tiny_vlm(TINY_SPECS[spec], device=device, dtype=torch_dtype, config=config)
    return _load_pretrained(shipped_path(spec) or spec, device, torch_dtype, config, local_files_only)


def shipped_path(spec: str) -> str | None:
    """The directory of the shipped snapshot named `spec`, None when `spec` names none."""
    if spec not in SHIPPED:
        return None
    root = SHIPPED[spec]
    if not (root / "config.json").is_file():
        raise VLMLoadError(f"the shipped VLM {spec!r} is missing from this installation (expected a snapshot "
                           f"in {root}); train and export it with python -m pipeline.training.qa_vlm --export-shipped")
    return str(root)


def build_tiny_vlm(family: str = "qwen2_vl", *, device="cpu", dtype=torch.float32,
                   config: VLMConfig | None = None) -> VLM:
    tokenizer = build_tokenizer()
    model_config = qwen3_vl.tiny_config(tokenizer) if family == "qwen3_vl" else tiny_config(family, tokenizer)
    model = build_model(model_config, device=device, dtype=dtype)
    return _wrap(model, tokenizer, family, f"tiny-random ({family})", config or VLMConfig(), {}, TINY_WARNING)


def _looks_like_path(spec: str) -> bool:
    return spec.startswith((".", "/", "~")) or spec.count("/") != 1 or Path(spec).expanduser().exists()


def _load_pretrained(spec: str, device, dtype, config: VLMConfig, local_files_only: bool) -> VLM:
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import cached_file

    is_path = _looks_like_path(spec)
    if is_path:
        _check_snapshot_dir(spec)
    elif not local_files_only:
        local_files_only = _hub_or_cache(spec)
    try:
        model_config = AutoConfig.from_pretrained(spec, local_files_only=local_files_only)
    except Exception as e:  # hub/network/parse errors of every kind become one line
        if is_path:
            raise VLMLoadError(f"{spec!r} is not a Qwen2-VL-family snapshot: its config.json does not load "
                               f"({str(e).splitlines()[0]})") from None
        raise VLMLoadError(f"VLM {spec!r} was not found on the Hugging Face Hub or in the local cache "
                           f"(offline? pass a local snapshot directory instead)") from None
    family = getattr(model_config, "model_type", None)
    _check_family(spec, family)
    try:
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=local_files_only)
        model = model_class(family).from_pretrained(spec, dtype=dtype, local_files_only=local_files_only).to(device)
    except Exception as e:
        raise VLMLoadError(f"cannot load VLM {spec!r}: {str(e).splitlines()[0]}") from None
    # The processor configs are read as plain JSON: preprocessing runs on the device in our own code,
    # so HF's (torchvision-based) processor classes are not needed at run time.
    processor_cfg = {}
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        path = cached_file(spec, name, local_files_only=local_files_only, _raise_exceptions_for_missing_entries=False)
        if path is not None:
            processor_cfg = {**json.loads(Path(path).read_text()), **processor_cfg}
    return _wrap(model, tokenizer, family, spec, config, processor_cfg, None)


def _hub_or_cache(spec: str) -> bool:
    """Whether Hub id `spec` must come from the local cache alone (the Hub cannot be reached now).
    Decided in seconds, before Hugging Face's client would retry for half a minute: a model that
    is neither cached nor reachable is one VLMLoadError at once."""
    from huggingface_hub import constants, try_to_load_from_cache

    unreachable = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _unreachable(constants.ENDPOINT)
    if unreachable is None:
        return False
    try:
        cached = isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except ValueError:  # not a valid repo id: the normal path names the problem
        cached = False
    if not cached:
        raise VLMLoadError(f"VLM {spec!r} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                           f"the hub ({constants.ENDPOINT}) cannot be reached: {unreachable}; connect to the "
                           f"network or pass a local snapshot directory")
    return True


def _unreachable(endpoint: str) -> str | None:
    """Why the Hub at `endpoint` cannot be reached within HUB_TIMEOUT_S, or None when it answers
    (any HTTP status counts: the server is there). Honours the same proxy variables as the Hub client."""
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as e:
        reason = e.reason
        if isinstance(reason, (socket.timeout, TimeoutError)):
            return f"no answer within {HUB_TIMEOUT_S:g} s"
        return (getattr(reason, "strerror", None) or str(reason)).lower()
    except (socket.timeout, TimeoutError):
        return f"no answer within {HUB_TIMEOUT_S:g} s"
    except (OSError, ValueError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _check_snapshot_dir(spec: str) -> None:
    root = Path(spec).expanduser()
    if not root.exists():
        raise VLMLoadError(f"VLM path {spec!r} does not exist")
    if not root.is_dir():
        raise VLMLoadError(f"VLM path {spec!r} is not a directory (expected a Hugging Face snapshot)")
    if not (root / "config.json").is_file():
        raise VLMLoadError(f"{spec!r} is not a Qwen2-VL-family snapshot: it has no config.json")
    try:
        family = json.loads((root / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        raise VLMLoadError(f"{spec!r} is not a Qwen2-VL-family snapshot: config.json is not a JSON object") from None
    _check_family(spec, family)


def _check_family(spec: str, family) -> None:
    if family not in FAMILIES + qwen3_vl.FAMILIES:
        raise VLMLoadError(f"{spec!r} is not a Qwen2-VL-family snapshot (model_type={family!r}); "
                           f"supported: {', '.join(FAMILIES + qwen3_vl.FAMILIES)}")


def _wrap(model, tokenizer, family, name, config: VLMConfig, processor_cfg: dict, warning) -> VLM:
    """The answering VLM over a loaded model: the fast engine, or for Qwen3-VL-MoE transformers' own
    forward (pipeline.vlm.hf_forward), with its processor's normalisation where the snapshot names none."""
    if family in qwen3_vl.FAMILIES:
        processor_cfg = {**qwen3_vl.PROCESSOR_DEFAULTS, **processor_cfg}
    vision = model.config.vision_config
    # A snapshot's processor caps the frame size: a model trained at small frames (arrcoc-synth-qa)
    # sees them at that size whatever vlm.max_pixels asks; Qwen's own caps (12.8M px images, 602k
    # px video frames) lie far above the default 448 x 448, so they change nothing there.
    max_pixels = min(config.max_pixels, snapshot_max_pixels(processor_cfg) or config.max_pixels)
    geometry = VLMGeometry(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                           temporal_patch_size=vision.temporal_patch_size,
                           min_pixels=min(config.min_pixels, max_pixels), max_pixels=max_pixels)
    preprocessor = VideoPreprocessor(geometry, tuple(processor_cfg.get("image_mean", OPENAI_CLIP_MEAN)),
                                     tuple(processor_cfg.get("image_std", OPENAI_CLIP_STD)),
                                     float(processor_cfg.get("rescale_factor", 1 / 255)),
                                     int(processor_cfg.get("resample", 3)))
    if family in qwen3_vl.FALLBACK_FAMILIES:                      # Qwen3-VL-MoE: no fast engine for its experts
        from pipeline.vlm.hf_forward import HFForwardVLM
        return HFForwardVLM(model, tokenizer, family=family, name=name, config=config, preprocessor=preprocessor,
                            warning=warning)
    return VLM(model, tokenizer, family=family, name=name, config=config, preprocessor=preprocessor,
               warning=warning)


def snapshot_max_pixels(processor_cfg: dict) -> int | None:
    """The most pixels per frame a snapshot's processor config allows: its "max_pixels", else its
    "size": {"longest_edge"} (how transformers 5 writes the same limit); None when it sets neither."""
    value = processor_cfg.get("max_pixels")
    if value is None and isinstance(processor_cfg.get("size"), dict):
        value = processor_cfg["size"].get("longest_edge")
    return int(value) if value is not None else None
