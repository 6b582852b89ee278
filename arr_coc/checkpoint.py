"""ARR-COC weights as safetensors: the trained checkpoint shipped in the package, and any other.

A weights spec is "default" (arr_coc/weights/default.safetensors, trained by
`python -m pipeline train --config configs/train_default.yaml`), "none" (the documented initial
values, untrained) or a path. A path must match the model exactly (every key, every shape). The
default checkpoint was trained with 384-d MiniLM queries; with a VLM whose embeddings have another
width the query-facing layers cannot take it, so they keep their initial values and the caller
gets a warning naming them.

The one place this package reads or writes files: `ARRCOC.from_pretrained` and training need it,
and the pipeline's `runtime.model_weights` means the same specs.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn as nn

from ._validate import ConfigError

DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "default.safetensors"


def resolve_weights(spec: str | os.PathLike, name: str = "weights") -> Path | None:
    """"default" | "none" | a path -> the file to load, or None for the initial values.
    name: what the caller calls the spec in its errors (e.g. runtime.model_weights)."""
    if isinstance(spec, str) and spec == "none":
        return None
    if not isinstance(spec, (str, os.PathLike)):
        raise ConfigError(f"{name} must be 'default', 'none' or a .safetensors path, got {spec!r}")
    path = DEFAULT_WEIGHTS if isinstance(spec, str) and spec == "default" else Path(spec)
    if not path.is_file():
        raise ConfigError(f"{name}={str(spec)!r}: no such file {path}; "
                          "allowed: default, none or a .safetensors path")
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


def load_weights(model: nn.Module, path: str | Path, *, partial: bool = False) -> list[str]:
    """Load a checkpoint into model. Returns the model keys that kept their initial values.

    partial=False: any missing, unexpected or shape-mismatched key is a ConfigError naming them.
    partial=True: load every key that fits; the rest keep their initial values (returned).
    """
    tensors, _ = read_weights(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(tensors))
    mismatched = sorted(k for k in own if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape))
    unexpected = sorted(k for k in tensors if k not in own and not k.startswith("optim."))
    if not partial and (missing or mismatched or unexpected):
        parts = []
        if mismatched:
            k = mismatched[0]
            parts.append(f"{len(mismatched)} shape mismatches (first: {k} is {tuple(tensors[k].shape)} in the "
                         f"file, {tuple(own[k].shape)} in the model)")
        if missing:
            parts.append(f"{len(missing)} missing keys (first: {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys (first: {unexpected[0]})")
        raise ConfigError(f"checkpoint {path} does not match the model: {'; '.join(parts)}")
    fit = {k: tensors[k] for k in own if k in tensors and k not in mismatched}
    model.load_state_dict(fit, strict=False)
    return missing + mismatched


def load_pretrained(model: nn.Module, spec: str | os.PathLike, name: str = "weights") -> list[str]:
    """Apply a weights spec to a freshly built model; returns the keys left at their initial values.

    An explicit path must fit exactly. The shipped default fits the default architecture with
    384-d MiniLM queries; where the model differs (a VLM's embedding width, another balancer kind),
    the parts that fit are loaded and a one-line warning names how many tensors kept their
    initial values, since an allocation from an untrained query projection is not the trained one.
    """
    path = resolve_weights(spec, name)
    if path is None:
        return []
    skipped = load_weights(model, path, partial=isinstance(spec, str) and spec == "default")
    if skipped:
        warnings.warn(f"the default ARR-COC checkpoint was trained for 384-d MiniLM queries and the default "
                      f"architecture; {len(skipped)} tensors that do not fit this model keep their untrained "
                      f"initial values (first: {skipped[0]})", stacklevel=3)
    return skipped
