"""ARR-COC weights as safetensors: the trained checkpoint shipped in the package, and any other.

A weights spec is "default" (arr_coc/weights/default.safetensors, trained by
`python -m pipeline train --config configs/train_default.yaml`), "none" (the documented initial
values, untrained) or a path. A checkpoint must match the model exactly (every key, every
shape): a model that runs with some of its layers at their untrained initial values would allocate
tokens in a way nobody trained, so a misfit is an error naming the tensors, never a partial load.
The default checkpoint fits the default architecture with 384-d MiniLM queries, which is what the
pipeline always feeds ARR-COC, whatever VLM answers.

The one place this package reads or writes files: `ARRCOC.from_pretrained` and training need it,
and the pipeline's `runtime.model_weights` means the same specs.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn

from ._validate import ConfigError

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "default.safetensors"
# named checkpoints shipped with the package: "default" (trained on generated scenes, any VLM) and
# "synth-qa" (relevance on the QA renderers' training clips, configs/train_renderers.yaml, then trained
# through arrcoc-synth-qa's answers, configs/train_renderers_vlm_qa.yaml: benchmarks/gpu/train_arrcoc.sh)
NAMED_WEIGHTS = {"default": DEFAULT_WEIGHTS, "synth-qa": DEFAULT_WEIGHTS.with_name("synth-qa.safetensors")}


def resolve_weights(spec: str | os.PathLike, name: str = "weights", also: tuple[str, ...] = ()) -> Path | None:
    """"default" | "synth-qa" | "none" | a path -> the file to load, or None for the initial values.
    name: what the caller calls the spec in its errors (e.g. runtime.model_weights); also: the
    caller's own names its errors list as allowed too (the pipeline's "auto", resolved before)."""
    if isinstance(spec, str) and spec == "none":
        return None
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"{name} must be 'default', 'none' or a .safetensors path, got {spec!r}")
    path = NAMED_WEIGHTS[spec] if isinstance(spec, str) and spec in NAMED_WEIGHTS else Path(spec)
    if not path.is_file():
        raise ConfigError(f"{name}={str(spec)!r}: no such file {path}; "
                          f"allowed: {', '.join((*also, *NAMED_WEIGHTS))}, none or a .safetensors path")
    return path


def save_weights(model: nn.Module, path: str | Path, metadata: dict[str, str] | None = None,
                 extra: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the model's parameters and buffers (+ extra tensors, e.g. optimizer state)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    tensors.update({k: v.detach().cpu().contiguous() for k, v in (extra or {}).items()})
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata=metadata or {})
    tmp.chmod(0o644)  # shipped as package data: readable by every user
    tmp.replace(path)  # a crash mid-write never leaves a half checkpoint behind
    return path


def read_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except Exception as e:  # safetensors raises several types for a damaged header
        raise ConfigError(f"{path} is not a readable safetensors checkpoint ({str(e).splitlines()[0]})") from None
    return tensors, metadata


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load a checkpoint into model; any missing, unexpected or shape-mismatched key is a
    ConfigError naming them (optimizer state, "optim.*", is not the model's and is skipped)."""
    tensors, _ = read_weights(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    mismatched = sorted(k for k in own if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape))
    unexpected = sorted(k for k in tensors if k not in own and not k.startswith("optim."))
    if missing or mismatched or unexpected:
        parts = []
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatches (" + ", ".join(
                f"{k} is {tuple(tensors[k].shape)} in the file, {tuple(own[k].shape)} in the model"
                for k in mismatched[:_NAMED]) + _more(mismatched) + ")")
        if missing:
            parts.append(f"{len(missing)} missing keys ({', '.join(missing[:_NAMED])}{_more(missing)})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys ({', '.join(unexpected[:_NAMED])}{_more(unexpected)})")
        raise ConfigError(f"checkpoint {path} does not match the model: {'; '.join(parts)}")
    model.load_state_dict({k: tensors[k] for k in own}, strict=True)


_NAMED = 4   # tensors a misfit error names per kind


def _more(keys: list[str]) -> str:
    return f" and {len(keys) - _NAMED} more" if len(keys) > _NAMED else ""


def load_pretrained(model: nn.Module, spec: str | os.PathLike, name: str = "weights",
                    also: tuple[str, ...] = ()) -> None:
    """Apply a weights spec to a freshly built model. Every spec must fit exactly: the shipped
    default fits the default architecture with 384-d (MiniLM) queries; for another architecture
    or query width, train a checkpoint for it or start from "none". also: as resolve_weights."""
    path = resolve_weights(spec, name, also)
    if path is None:
        return
    try:
        load_weights(model, path)
    except ConfigError as e:
        if isinstance(spec, str) and spec == "default":
            raise ConfigError(f"{name}=default: the shipped checkpoint fits the default architecture with "
                              f"384-d MiniLM queries, not this model ({e}); use {name}=none or a checkpoint "
                              f"trained for it") from None
        raise
