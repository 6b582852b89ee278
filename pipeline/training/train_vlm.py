"""Fine-tuning ARR-COC through a frozen VLM's answer loss (seed Part 45).

The pipeline's VLM stage keeps or drops visual tokens (hard selection), which has no gradient.
For training, every merged visual token is instead scaled by its soft keep weight — ARR-COC's
differentiable budget, averaged over the frames one temporal patch merges and capped at one
token — before it enters the language model. The VLM's parameters are frozen (requires_grad
off); the loss is the cross-entropy of the ground-truth answer given the question, so only the
ARR-COC parameters learn which tokens the answer needs.

Two sources of questions: still scenes asked "where is the <color> <shape>?" (stage `vlm`), and
the generated video QA the shipped `arrcoc-synth-qa` was trained on (stage `vlm_qa`: clips of the
train split seen at the VLM's frame rate, every question of each clip), which fine-tunes ARR-COC
for that model's answers.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from arr_coc.lod import pair_soft
from arr_coc.model import ARRCOC
from evaluation.synth_qa import where_answer

@torch.no_grad()
def clip_inputs(vlm, model: ARRCOC, frames: np.ndarray):
    """What every question of one video shares: ARR-COC's texture and the VLM's merged visual
    tokens (T', gh, gw, D), neither trained."""
    grid = vlm.geometry.grid(*frames.shape[1:3])
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).to(vlm.device)  # (T, 3, H, W)
    return model.extract(x, None, grid), vlm.encoder.merged_tokens([frames])[0]


def answer_loss(vlm, model: ARRCOC, frames: np.ndarray, question: str, answer: str,
                query: torch.Tensor, inputs=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Cross-entropy of `answer` after the question, with ARR-COC's soft keep on the visual tokens.

    frames: uint8 (T, H, W, 3) of one video; query: the question as ARR-COC reads it, (384,) or
    (L, 384) MiniLM vectors (training.train.QueryEmbedder), whatever VLM computes the loss.
    inputs: clip_inputs(vlm, model, frames) when several questions share the video.
    Returns (loss, the balancer's tensions). Gradients reach ARR-COC only.
    """
    device = vlm.device
    texture, merged = inputs if inputs is not None else clip_inputs(vlm, model, frames)   # merged (T', gh, gw, D)
    allocation, _, _ = model.realize(texture, query)
    keep = pair_soft(allocation.soft, vlm.geometry.temporal_patch_size)    # (T', gh, gw)
    if tuple(keep.shape) != tuple(merged.shape[:3]):
        raise ValueError(f"soft keep {tuple(keep.shape)} does not match the VLM's merged tokens "
                         f"{tuple(merged.shape[:3])}")
    visual = (merged.float() * keep.unsqueeze(-1)).flatten(0, 2)           # (N, D)
    Tp, gh, gw = merged.shape[:3]
    n_full = Tp * gh * gw
    ids = vlm.prefixes.full_input_ids(question, n_full)                             # (L_full,)
    m = vlm.geometry.merge_size
    positions = vlm.prefixes.rope_positions(ids, torch.tensor([Tp, gh * m, gw * m]))  # (3, L_full)
    target = torch.tensor(vlm.tokenizer(answer + "<|im_end|>").input_ids, device=device)  # (A,)
    v0 = int((ids == vlm.video_token_id).nonzero()[0])
    with torch.no_grad():
        text = vlm.lm.embed_tokens(torch.cat([ids, target[:-1]])).float()  # (L_full + A - 1, D)
    L = ids.shape[0]
    embeds = torch.cat([text[:v0], visual, text[v0 + n_full:]]).to(vlm.dtype)  # (L_full + A - 1, D)
    next_pos = int(positions.max()) + 1
    answer_pos = (next_pos + torch.arange(target.numel() - 1, device=device)).expand(3, -1)
    pos = torch.cat([positions, answer_pos], 1)[:, None]                   # (3, 1, L + A - 1)
    hidden = vlm.pool.lm_step(embeds[None], None, pos, None)[0, L - 1:]        # (A, D) predicts each answer token
    logits = vlm.model.lm_head(hidden).float()                             # (A, V)
    return F.cross_entropy(logits, target), allocation.tensions


def vlm_step_loss(model: ARRCOC, vlm, scenes, idx, embed) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean answer loss over a batch of still scenes (each shown as a two-frame clip)."""
    losses, tensions = [], {}
    for i in idx.tolist():
        scene = scenes[i]
        target = scene.objects[scene.target]
        question = f"where is the {target.color} {target.shape}?"
        frames = np.stack([scene.image, scene.image])
        loss, tensions = answer_loss(vlm, model, frames, question, where_answer(target.box, scene.image.shape[:2]),
                                     query=embed(question))
        losses.append(loss)
    return torch.stack(losses).mean(), tensions


def qa_clips(seeds, vlm_fps: float) -> list:
    """Generated video-QA clips (evaluation.synth_qa, train split) as the VLM sees them: (frames at
    vlm_fps, [(question, answer)])."""
    from evaluation.synth_qa import make_qa_clip
    from .qa_data import vlm_frame_indices

    out = []
    for seed in seeds:
        clip = make_qa_clip(int(seed), split="train")
        frames = clip.frames[vlm_frame_indices(len(clip.frames), clip.fps, vlm_fps)]
        out.append((np.ascontiguousarray(frames), [(qa.question, qa.answer) for qa in clip.qas]))
    return out


def qa_step_loss(model: ARRCOC, vlm, clips, idx, embed) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Mean answer loss over every question of a batch of generated video-QA clips."""
    losses, tensions = [], {}
    for i in idx.tolist():
        frames, questions = clips[i]
        inputs = clip_inputs(vlm, model, frames)
        for question, answer in questions:
            loss, tensions = answer_loss(vlm, model, frames, question, answer, query=embed(question), inputs=inputs)
            losses.append(loss)
    return torch.stack(losses).mean(), tensions
