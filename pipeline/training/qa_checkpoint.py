"""Where an answer-model training run starts and what it leaves to resume from: the shipped
snapshot's place, train.init's snapshot (checked before anything is written, then loaded into the
freshly built model) and the checkpoint --resume continues from. Kept apart from the trainer
(pipeline/training/qa_vlm.py) so the scoring command (qa_eval) and the benchmarks load the same way."""
from __future__ import annotations

from pathlib import Path

import torch

from arr_coc._validate import ConfigError

SHIPPED_NAME = "arrcoc-synth-qa"
SHIPPED_NAMES = (SHIPPED_NAME,)


def shipped_dir() -> Path:
    from pipeline.vlm.loading import SHIPPED
    return SHIPPED[SHIPPED_NAME]


def resume_found(out_dir: str | Path, resume: bool) -> bool:
    return resume and (Path(out_dir) / "checkpoint.pt").exists()


def init_root(snapshot: str | Path) -> Path:
    """train.init's snapshot directory (a path, or a shipped name), else a one-line ConfigError."""
    root = Path(snapshot)
    if not root.is_dir():
        from pipeline.vlm.loading import SHIPPED
        root = SHIPPED.get(str(snapshot), root)
    if not (root.is_dir() and any(root.glob("*.safetensors")) and (root / "config.json").is_file()):
        raise ConfigError(f"train.init={snapshot}: no *.safetensors snapshot there (a snapshot directory, "
                          f"e.g. a finished run's OUT_DIR/snapshot, or a shipped name: {', '.join(SHIPPED_NAMES)})")
    return root


def start_from(model, snapshot: str | Path) -> None:
    """Load a snapshot's weights (train.init: a directory or a shipped name) into the freshly built
    model: the same model fields, else a ConfigError naming the first tensor that differs."""
    root = init_root(snapshot)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = type(model).from_pretrained(root, dtype=torch.float32)
    state, own = loaded.state_dict(), model.state_dict()
    for name, tensor in own.items():
        got = state.get(name)
        if got is None or tuple(got.shape) != tuple(tensor.shape):
            found = "missing" if got is None else f"shape {tuple(got.shape)}"
            raise ConfigError(f"train.init={snapshot}: {name} is {found}, the model fields give "
                              f"{tuple(tensor.shape)} (set model.* as that snapshot was trained)")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name])


def save_checkpoint(path: Path, model, aux_head, opt, step: int, history: list, train_s: float, config: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "aux_head": aux_head.state_dict(), "optimizer": opt.state_dict(),
                "step": step, "history": history, "train_s": train_s, "config": config}, tmp)
    tmp.replace(path)
