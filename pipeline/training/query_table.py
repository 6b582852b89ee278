"""Every question ARR-COC's training can draw, embedded once: training without the MiniLM encoder.

The generated questions come from fixed templates (evaluation.shapes_qa.TEMPLATES, evaluation.questions'
region families, evaluation.scenes' object queries) over fixed words (colours, shapes, regions,
relations), so the set of texts is finite (a few thousand). `build` embeds them all with the encoder
the pipeline uses (pipeline.core.query, all-MiniLM-L6-v2) into one safetensors file; a training
config's `queries: PATH` then reads vectors from it (QueryTable), so a machine without the encoder's
package trains on exactly the vectors the pipeline feeds ARR-COC at run time.

    python -m pipeline.training.query_table --out runs/query_table.safetensors
"""
from __future__ import annotations

import argparse
import itertools
import json
import string
import sys
from pathlib import Path

import torch

from arr_coc._validate import ConfigError

ENCODER = "all-MiniLM-L6-v2"


def question_texts() -> list[str]:
    """Every question and query text the generators can produce, sorted, plus "a" (the probe
    train.py embeds for the query width)."""
    from evaluation.questions import RELATIONS, REGION_TEMPLATES
    from evaluation.scenes import COLORS, SHAPES, TEMPLATES as SCENE_TEMPLATES
    from evaluation.shapes_qa import TEMPLATES, WHERE_ANSWERS, article

    values = {"color": list(COLORS), "shape": list(SHAPES), "where": list(WHERE_ANSWERS), "rel": list(RELATIONS),
              "color2": list(COLORS), "shape2": list(SHAPES), "size": ["small", "large"]}
    templates = [*SCENE_TEMPLATES, *(t for ts in TEMPLATES.values() for t in ts),
                 *(t for ts in REGION_TEMPLATES.values() for t in ts)]
    texts = {"a"}
    for template in templates:
        names = sorted({f for _, f, _, _ in string.Formatter().parse(template) if f and f != "a"})
        for combo in itertools.product(*(values[n] for n in names)):
            fields = dict(zip(names, combo))
            fields["a"] = article(fields.get("color") or "x")
            texts.add(template.format(**fields))
    return sorted(texts)


def build(out: str | Path, device: str = "cpu", batch: int = 256) -> Path:
    """Embed question_texts() with the pipeline's query encoder into `out` (float32 (N, 384))."""
    from safetensors.torch import save_file

    from ..core.query import sentence_encoder

    texts = question_texts()
    encoder = sentence_encoder(device)
    vectors = torch.cat([encoder.encode_many(texts[i:i + batch]).cpu() for i in range(0, len(texts), batch)])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"embeddings": vectors.contiguous()}, str(out),
              metadata={"texts": json.dumps(texts), "encoder": ENCODER})
    return out


def check_queries(spec: str) -> None:
    """A config's `queries`: "minilm" or the path of an existing table (checked before any work)."""
    if spec != "minilm" and not Path(spec).is_file():
        raise ConfigError(f"queries={spec!r}: no such file; use minilm or build a table with "
                          f"python -m pipeline.training.query_table --out {spec}")


class QueryTable:
    """text -> (1, D) vector from a file `build` wrote; a text outside it is a ConfigError."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu") -> None:
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"queries={str(path)!r}: no such file; build it with "
                              f"python -m pipeline.training.query_table --out {path}")
        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = f.metadata() or {}
                vectors = f.get_tensor("embeddings")
            texts = json.loads(meta["texts"])
        except Exception as e:  # a damaged or foreign file: one line
            raise ConfigError(f"queries={str(path)!r} is not a query table ({str(e).splitlines()[0]})") from None
        if meta.get("encoder") != ENCODER or len(texts) != vectors.shape[0]:
            raise ConfigError(f"queries={str(path)!r} holds {meta.get('encoder')!r} vectors for "
                              f"{len(texts)} texts; expected {ENCODER} vectors, one per text")
        self.vectors = vectors.float().to(device)                 # (N, D)
        self.rows = {t: i for i, t in enumerate(texts)}

    def encode(self, text: str) -> torch.Tensor:
        """(D,) the text's vector."""
        row = self.rows.get(text)
        if row is None:
            raise ConfigError(f"question {text!r} is not in the query table {self.path}; rebuild it with "
                              f"python -m pipeline.training.query_table --out {self.path}")
        return self.vectors[row]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.training.query_table",
                                description="embed every generated question for training without MiniLM")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    args = p.parse_args(argv)
    try:
        path = build(args.out)
    except (OSError, RuntimeError) as e:   # a full disk, the encoder's package missing (QueryEncoderError)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{len(question_texts())} questions -> {path} ({path.stat().st_size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
