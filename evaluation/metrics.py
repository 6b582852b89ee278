"""Relevance metrics with ground truth: the seeds' three claims made measurable.

1. Adaptive allocation: how much of the budget (and of the relevance mass) lands in the target's
   box; IoU of the top-20% cells with the box.
2. Query awareness: the same frame under different queries puts each query's tokens on its own
   object; distinctiveness = mean pairwise (1 - cosine) between the queries' homunculi.
3. Temporal coherence: cosine between consecutive homunculi inside a shot, the drop at cuts, and
   precision / recall / F1 of detected scene changes against the true transitions.

Boxes are pixel boxes (y0, x0, y1, x1), end-exclusive. A box enters the grid as each cell's
*covered fraction* (exact area overlap / cell area), so a uniform homunculus scores exactly the
box's share of the frame and partially covered cells earn partial credit.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def box_coverage(boxes: torch.Tensor, size: tuple[int, int], grid: tuple[int, int]) -> torch.Tensor:
    """(B, 4) pixel boxes (y0, x0, y1, x1) -> (B, gh, gw) covered fraction of each cell in [0, 1]."""
    H, W = size
    gh, gw = grid
    b = boxes.to(torch.float64)
    ys = torch.linspace(0, H, gh + 1, dtype=torch.float64, device=boxes.device)   # (gh + 1,) cell edges
    xs = torch.linspace(0, W, gw + 1, dtype=torch.float64, device=boxes.device)   # (gw + 1,)
    oy = (torch.minimum(ys[1:], b[:, 2:3]) - torch.maximum(ys[:-1], b[:, 0:1])).clamp_min(0)  # (B, gh)
    ox = (torch.minimum(xs[1:], b[:, 3:4]) - torch.maximum(xs[:-1], b[:, 1:2])).clamp_min(0)  # (B, gw)
    cover = oy[:, :, None] * ox[:, None, :] / ((H / gh) * (W / gw))              # (B, gh, gw)
    return cover.clamp(0, 1).float()


def share_inside(allocation: torch.Tensor, coverage: torch.Tensor) -> torch.Tensor:
    """(B,) share of a non-negative map (tokens or relevance, (B, gh, gw)) that lies inside the box.

    1 when everything sits on fully covered cells; a uniform map gives the box's area share.
    """
    a = allocation.flatten(1).to(torch.float64)                     # (B, N)
    c = coverage.flatten(1).to(torch.float64)                       # (B, N)
    return ((a * c).sum(1) / a.sum(1).clamp_min(1e-12)).float()


def best_share(coverage: torch.Tensor, budget: int) -> torch.Tensor:
    """(B,) the largest share_inside any `budget` one-token cells can reach (the oracle's ceiling)."""
    top = coverage.flatten(1).topk(min(budget, coverage[0].numel()), dim=1).values  # (B, K)
    return top.sum(1) / budget


def top_fraction_iou(relevance: torch.Tensor, coverage: torch.Tensor, fraction: float = 0.2,
                     inside: float = 0.5) -> torch.Tensor:
    """(B,) IoU between the top `fraction` of cells by relevance and the box's cells.

    The box's cells are those at least `inside` covered. Ties are broken by raster order, so a
    uniform map picks the first cells (its IoU is whatever those happen to cover).
    """
    r = relevance.flatten(1)                                        # (B, N)
    k = max(1, math.ceil(fraction * r.shape[1]))
    top = torch.zeros_like(r, dtype=torch.bool)
    order = torch.sort(r, dim=1, descending=True, stable=True).indices[:, :k]   # (B, k)
    top.scatter_(1, order, True)
    box = coverage.flatten(1) >= inside                              # (B, N)
    inter = (top & box).sum(1).float()
    union = (top | box).sum(1).float()
    return inter / union.clamp_min(1.0)


def own_object_accuracy(homunculi: torch.Tensor, coverages: torch.Tensor) -> torch.Tensor:
    """Share of queries whose tokens land more on their own object than on any other one.

    homunculi: (Q, gh, gw) one map per query of the same frame; coverages: (Q, gh, gw) the box
    coverage of the object each query names. Returns a scalar in [0, 1].
    """
    Q = homunculi.shape[0]
    h = homunculi.flatten(1).to(torch.float64)                      # (Q, N)
    c = coverages.flatten(1).to(torch.float64)                      # (Q, N)
    share = (h @ c.T) / h.sum(1, keepdim=True).clamp_min(1e-12)     # (Q, Q) query q's share on object o
    own = share.diagonal()                                          # (Q,)
    others = share.masked_fill(torch.eye(Q, dtype=torch.bool, device=h.device), float("-inf")).amax(1)
    return (own > others).float().mean()


def distinctiveness(homunculi: torch.Tensor) -> torch.Tensor:
    """Mean pairwise (1 - cosine) between Q >= 2 homunculi (Q, gh, gw) of the same frame; scalar."""
    Q = homunculi.shape[0]
    if Q < 2:
        raise ValueError(f"distinctiveness needs at least 2 homunculi, got {Q}")
    v = F.normalize(homunculi.flatten(1).to(torch.float64), dim=1)  # (Q, N)
    cos = v @ v.T                                                   # (Q, Q)
    pairs = torch.triu(torch.ones(Q, Q, dtype=torch.bool, device=v.device), diagonal=1)
    return (1 - cos[pairs]).mean().float()


def consecutive_cosine(maps: torch.Tensor) -> torch.Tensor:
    """(T - 1,) cosine between each map (T, gh, gw) and the next; 1 where both are all zero."""
    v = maps.flatten(1).to(torch.float64)                           # (T, N)
    a, b = v[:-1], v[1:]
    na, nb = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(1) / (na * nb).clamp_min(1e-12)
    return torch.where((na == 0) & (nb == 0), torch.ones_like(cos), cos).float()


def cut_scores(detected: list[int] | torch.Tensor, events: list[tuple[int, int]],
               tolerance: int = 1, ignore_before: int = 1) -> dict[str, float]:
    """Precision / recall / F1 of detected scene-change frames against true transitions.

    events: (start, end) frame spans, start == end for a hard cut. A detection within
    [start - tolerance, end + tolerance] of a not yet matched event matches it (each event and
    each detection count once). Detections before `ignore_before` (the stream's first frame,
    which every detector flags as a new scene) are not scored.
    """
    dets = sorted(int(d) for d in (detected.tolist() if torch.is_tensor(detected) else detected)
                  if int(d) >= ignore_before)
    matched = [False] * len(events)
    tp = 0
    for d in dets:
        for i, (s, e) in enumerate(events):
            if not matched[i] and s - tolerance <= d <= e + tolerance:
                matched[i] = True
                tp += 1
                break
    precision = tp / len(dets) if dets else 1.0
    recall = tp / len(events) if events else 1.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "tp": tp, "detections": len(dets),
            "events": len(events)}
