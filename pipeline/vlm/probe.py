"""A learned confidence for tempering (vlm.tempering.confidence: probe): a logistic regression that
predicts, from the first answer token's distribution, whether the answer at the ladder's first
rung should be asked again: it is wrong, or (what benchmarks/fit_probe.py fits by default) it is
wrong and the ladder's top rung answers it right.

The margin alone is about as high on the shipped QA model's wrong answers as on its right ones;
the shape of the rest of the distribution (how the runner-up and the tail share what the top
token leaves) tells more (README, tempering). The probe reads a summary of the first token's
distribution that every VLM has, whatever its vocabulary:

    features (F = 9):  the 5 largest probabilities, sorted; margin (p1 - p2); 1 - entropy / log V;
                       the 2 largest log-probabilities
    P(ask again) = sigmoid(features @ weight + bias)

and costs a top-k and a dot product per answer. Its confidence is 1 - P(ask again), in [0, 1] like
the other measures, so pipeline.vlm.tempering.calibrate sets its threshold the same way.

fit_probe fits it on answers whose correctness is known (a split that is neither the validation
split its threshold is calibrated on nor a test split); benchmarks/fit_probe.py collects those
answers by running tempering's first rung over a split and writes the probe file
(vlm.tempering.probe names it).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from arr_coc._validate import ConfigError

FORMAT = "arrcoc-tempering-probe/1"
TOP_K = 5
FEATURES = (*(f"p{i + 1}" for i in range(TOP_K)), "margin", "certainty", "logp1", "logp2")


def probe_features(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) logits of the first generated token -> (B, F) float32 features (FEATURES, at
    temperature 1), defined for any vocabulary of V >= TOP_K tokens."""
    if logits.dim() != 2 or logits.shape[1] < TOP_K:
        raise ValueError(f"logits must be (B, V) with V >= {TOP_K}, got {tuple(logits.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)                        # (B, V)
    top = logp.topk(TOP_K, dim=-1).values                                   # (B, k) sorted
    p = top.exp()
    entropy = -(logp.exp() * logp).sum(-1, keepdim=True)                    # (B, 1) nats
    certainty = 1.0 - entropy / math.log(logits.shape[1])
    return torch.cat([p, p[:, :1] - p[:, 1:2], certainty, top[:, :2]], dim=-1)   # (B, F)


@dataclass(frozen=True)
class Probe:
    """weight (F,) float32 and bias: P(ask again) = sigmoid(probe_features(logits) @ weight + bias).
    fitted_on: free-form provenance (what answers, which target) kept in the file."""
    weight: torch.Tensor
    bias: float
    fitted_on: dict

    def __post_init__(self) -> None:
        if not isinstance(self.weight, torch.Tensor) or self.weight.shape != (len(FEATURES),):
            raise ValueError(f"Probe.weight must be a ({len(FEATURES)},) tensor (one per feature), got "
                             f"{getattr(self.weight, 'shape', self.weight)!r}")
        if not torch.isfinite(self.weight).all() or not math.isfinite(self.bias):
            raise ValueError("Probe weight and bias must be finite")

    def confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) first-token logits -> (B,) float32 1 - P(ask again), in [0, 1]."""
        z = probe_features(logits) @ self.weight.to(logits.device) + self.bias   # (B,)
        return torch.sigmoid(-z)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"format": FORMAT, "features": list(FEATURES), "weight": self.weight.tolist(),
                                          "bias": self.bias, "fitted_on": self.fitted_on}, indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, snapshot: str | Path | None = None) -> Probe:
        """The probe file `path` (Probe.save's), or a one-line ConfigError naming what is wrong. A
        relative path that names no file here is looked for in `snapshot`, the VLM's snapshot
        directory, where a model ships its probe (vlm.tempering.probe: tempering_probe.json)."""
        where = f"vlm.tempering.probe={str(path)!r}"
        if snapshot is not None and not Path(path).is_absolute() and not Path(path).exists() \
                and (Path(snapshot) / path).is_file():
            path = Path(snapshot) / path
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"{where}: no such file") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"{where}: not a probe file ({type(e).__name__}: {e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ConfigError(f"{where}: format {got!r}, expected {FORMAT!r} (benchmarks/fit_probe.py writes it)")
        if data.get("features") != list(FEATURES):
            raise ConfigError(f"{where}: features {data.get('features')!r}, expected {list(FEATURES)}")
        try:
            return cls(torch.tensor(data["weight"], dtype=torch.float32), float(data["bias"]),
                        dict(data.get("fitted_on", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: bad weight or bias ({type(e).__name__}: {e})") from None


def fit_probe(features: torch.Tensor, ask_again: torch.Tensor, *, l2: float = 1.0, steps: int = 200,
              fitted_on: dict | None = None) -> Probe:
    """A probe from answers at tempering's first rung: features (N, F) of their first tokens
    (probe_features of their logits), ask_again (N,) bool whether each should have been asked again
    (wrong at the first rung; or wrong there and right at the top rung). L2-regularised logistic
    regression on standardized features (l2: the penalty on the standardized weights, per answer:
    larger is smoother), by L-BFGS; the standardization is folded into the weights."""
    x = torch.as_tensor(features, dtype=torch.float32)                       # (N, F)
    if x.dim() != 2 or x.shape[1] != len(FEATURES):
        raise ValueError(f"features must be (N, {len(FEATURES)}) probe_features, got {tuple(x.shape)}")
    y = torch.as_tensor(ask_again, dtype=torch.float32).flatten()            # (N,)
    if y.numel() != x.shape[0] or y.numel() < 2:
        raise ValueError(f"fit_probe needs as many correctness flags as feature rows, at least two "
                         f"(got {x.shape[0]} rows and {y.numel()} flags)")
    if l2 <= 0:
        raise ValueError(f"l2 must be > 0, got {l2}")
    mean, scale = x.mean(0), x.std(0).clamp_min(1e-6)                       # (F,), (F,)
    xs = (x - mean) / scale                                                  # (N, F)
    w = torch.zeros(xs.shape[1], requires_grad=True)
    p = float(y.mean().clamp(1e-3, 1 - 1e-3))
    b = torch.tensor(math.log(p / (1 - p)), requires_grad=True)              # start at the base rate
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def loss_fn():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xs @ w + b, y) + l2 / 2 * (w * w).sum() / len(y)
        loss.backward()
        return loss
    opt.step(loss_fn)
    with torch.no_grad():                                                    # on the raw features
        weight, bias = w / scale, float(b - (w * mean / scale).sum())
    return Probe(weight, bias, dict(fitted_on or {}, answers=int(y.numel()), ask_again=int(y.sum()), l2=l2))
