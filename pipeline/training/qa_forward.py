"""The training forward of the video-QA VLM: the LM input the pipeline builds at inference, batched.

For each question (a view: a clip, a question, a keep map) the sequence is what VLM.build_prefix
and generate() feed the LM: the chat prompt up to <|vision_start|>, only the kept visual tokens
(pipeline.vlm.selection: pair_lod + select_tokens, LOD-2 cells pooled) at the M-RoPE positions
the full, unpruned prompt gives them (from the model's own get_rope_index), then the question's
turn and the answer at consecutive text positions, as cached decoding places generated tokens.
Frames go through the pipeline's VideoPreprocessor on the device and all clips of a step through
one vision-tower call with the pipeline's batched attention. The loss is the cross-entropy of the
answer tokens and <|im_end|> (where greedy decoding must stop), plus, with an auxiliary head, that
of every visual token's colour (qa_data.token_colors) weighted by aux_weight, of its object's
shape and motion (qa_data.token_objects) weighted by aux_shape_weight and aux_motion_weight, and,
through a probe on the LM's hidden state after `region_layer` layers, of each kept visual token's
3x3 region (qa_data.token_regions) weighted by region_weight, and, with ground_weight, a grounding
loss on the attention of LM layer `ground_layer`: the attention the question's tokens pay to the
visual tokens there (averaged over heads and question tokens, as pass 2 reads it at inference,
pipeline/vlm/passes.py) should fall on the tokens of the object the question names (its colour,
qa_data.token_colors): -log of their share of the visual tokens' attention. Where the samples carry
box targets (qa_targets), the grounding target is every object the answer depends on instead, the
aux head also learns object-centre tokens (centre_weight), and a facts probe reads the LM's state
after `facts_layer` layers where the first answer token is predicted (facts_weight).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.training.qa_data import MOTIONS, ClipSample, token_regions
from pipeline.vlm.prefix import SYSTEM_PROMPT
from pipeline.vlm.passes import question_attention
from evaluation.scenes import COLORS, SHAPES
from pipeline.vlm.preprocess import VideoPreprocessor
from pipeline.vlm.selection import pair_lod, select_tokens
from pipeline.vlm import hf, qwen3_vl
from pipeline.vlm.frame_groups import EMPTY_GROUPS, kept_slots
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.vision_attention import batched_attention, patch_vision_attention

GROUND_ATTENTION = "arrcoc_qa_ground"      # sdpa that also hands over one layer's query and key states
_RECORDING: dict = {}                     # layer index -> where that layer's (query, key) go
_COLOR_INDEX = {c: i for i, c in enumerate(COLORS)}


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    slot = _RECORDING.get(getattr(module, "layer_idx", None))
    if slot is not None:
        slot["q"], slot["k"], slot["scaling"] = query, key, kwargs.get("scaling", module.scaling)
    return hf.sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def named_color(question: str) -> int | None:
    """The index (evaluation.scenes.COLORS) of the first colour word in a question, else None."""
    for word in question.lower().replace("?", " ").split():
        if word in _COLOR_INDEX:
            return _COLOR_INDEX[word]
    return None


BEFORE_VIDEO = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n<|vision_start|>"
IGNORE = -100


def after_video(question: str) -> str:
    return f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n"


@dataclass
class LMBatch:
    """Right-padded LM input of B views: embeds (B, L, D), positions (3, B, L), labels (B, L) (the
    answer token each position predicts, IGNORE elsewhere), each view's length and visual tokens sent."""
    embeds: torch.Tensor
    positions: torch.Tensor
    labels: torch.Tensor
    lengths: list[int]
    tokens_kept: list[int]
    regions: torch.Tensor | None = None   # (B, L) each kept visual token's 3x3 region, -1 elsewhere
    ground: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # grounding targets: (question (B, L), visual (B, L), target (B, L)) bool masks: the question's
    # tokens after <|vision_end|>, the kept visual tokens, those of them showing the named object
    deepstack: torch.Tensor | None = None  # Qwen3-VL: (n, B, L, D) DeepStack features, zeros off the visual slots
    facts: torch.Tensor | None = None      # (B, qa_targets.FACTS) question facts (NaN: none), the facts probe's


class QAForward:
    """ClipSamples -> answer loss through a Qwen2-VL or Qwen3-VL, inputs as at inference. Qwen3-VL's
    input is cut from the pipeline's own video prompt (PrefixBuilder.video_prompt: timestamps per
    frame group, positions) by its own kept_slots under empty_groups (keep, drop, or mix: each view
    draws one), DeepStack features added at the kept visual slots."""

    def __init__(self, model, tokenizer, preprocessor: VideoPreprocessor, aux_head: torch.nn.Module | None = None,
                 aux_weight: float = 0.0, aux_shape_weight: float = 0.0, aux_motion_weight: float = 0.0,
                 region_head: torch.nn.Module | None = None, region_weight: float = 0.0, region_layer: int = 2,
                 ground_weight: float = 0.0, ground_layer: int = 4, *, fps: float = VLMConfig.fps,
                 empty_groups: str = "keep", seed: int = 0, centre_weight: float = 0.0,
                 facts_head: torch.nn.Module | None = None, facts_weight: float = 0.0, facts_layer: int = 4) -> None:
        self.model, self.tokenizer, self.preprocessor = model, tokenizer, preprocessor
        self.aux_head, self.aux_weight, self.aux_shape_weight = aux_head, aux_weight, aux_shape_weight
        self.aux_motion_weight = aux_motion_weight
        self.region_head, self.region_weight, self.region_layer = region_head, region_weight, region_layer
        self.ground_weight, self.ground_layer = ground_weight, ground_layer
        self.centre_weight = centre_weight                 # object-centre tokens on the aux head (qa_targets)
        self.facts_head = facts_head if facts_weight > 0 else None
        self.facts_weight, self.facts_layer = facts_weight, facts_layer
        if ground_weight > 0:
            hf.register_attention(GROUND_ATTENTION, _recording_attention)
        self.device = next(model.parameters()).device
        self.visual, self.lm = hf.vision_tower(model), hf.language_model(model)
        self.video_token_id = model.config.video_token_id
        self.pad_id = tokenizer.pad_token_id
        self.qwen3 = model.config.model_type in qwen3_vl.FAMILIES
        self.hidden = self.lm.config.hidden_size
        if self.qwen3:
            from pipeline.vlm.prefix import PrefixBuilder
            if empty_groups not in (*EMPTY_GROUPS, "mix"):
                raise ValueError(f"Invalid empty_groups ({empty_groups!r}). Supported values are keep, drop, mix.")
            self.prompt = PrefixBuilder(model, self.lm, tokenizer, family=model.config.model_type,
                                        config=VLMConfig(fps=fps), geometry=preprocessor.geometry, device=self.device)
            self.empty_groups, self.rng = empty_groups, np.random.default_rng(seed)
            self._qwen3_layouts: dict[tuple[int, int, int], tuple] = {}
            self.before = self.prompt.prompt_ids("?", 0)[0]
        else:
            patch_vision_attention(self.visual)
            self.before = tokenizer(BEFORE_VIDEO).input_ids
        self._layouts: dict[tuple[int, int, int], tuple[np.ndarray, int]] = {}
        self._token_cache: dict[str, list[int]] = {}

    def layout(self, Tp: int, gh: int, gw: int) -> tuple[np.ndarray, int]:
        """M-RoPE positions (3, v0 + Tp*gh*gw) of the prompt up to the end of the unpruned video, and
        the position of the first text token after it (the model's get_rope_index on a probe)."""
        key = (Tp, gh, gw)
        if key not in self._layouts:
            n_full = Tp * gh * gw
            probe = self.tokenizer(after_video("?")).input_ids
            ids = torch.tensor([self.before + [self.video_token_id] * n_full + probe], device=self.device)
            m = self.preprocessor.geometry.merge_size
            grid = torch.tensor([[Tp, gh * m, gw * m]], device=self.device)
            positions = hf.rope_index(self.model, ids, grid, self.video_token_id)[:, 0].cpu().numpy()  # (3, L_full)
            end = len(self.before) + n_full
            text_start = int(positions[0, end])
            if positions[:, :end].max() >= text_start:
                raise RuntimeError("get_rope_index placed the text after the video below the video's positions")
            self._layouts[key] = (positions[:, :end], text_start)
        return self._layouts[key]

    def vision(self, samples: list[ClipSample]) -> list[torch.Tensor]:
        """Every clip's frames through the preprocessor and one vision-tower call -> per clip merged
        tokens (T', gh, gw, D). The frames travel to the device in one copy."""
        flat = torch.from_numpy(np.concatenate([s.frames.reshape(-1) for s in samples]))
        if self.device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(self.device, non_blocking=True)
        videos = [x.view(s.frames.shape) for x, s in zip(flat.split([s.frames.size for s in samples]), samples)]
        pixels, grids = zip(*(self.preprocessor(v, self.device) for v in videos))
        grid_thw = torch.stack(grids)                                       # (N, 3) patches
        sizes = {(int(h), int(w)) for _, h, w in grid_thw.tolist()}
        length = int(grid_thw[0, 1] * grid_thw[0, 2]) if len(sizes) == 1 else None
        if self.qwen3:                      # each token's DeepStack features ride after it: (sum T' gh gw, D (1 + n))
            merged, deepstack = qwen3_vl.vision_features(self.model, torch.cat(pixels), grid_thw.to(self.device))
            merged = torch.cat([merged, *deepstack], -1)
        else:
            with batched_attention(length):
                out = self.visual(torch.cat(pixels), grid_thw=grid_thw.to(self.device))
            merged = out.pooler_output if hasattr(out, "pooler_output") else out   # (sum T' gh gw, D)
        m = self.preprocessor.geometry.merge_size
        counts = [t * h * w // m**2 for t, h, w in grid_thw.tolist()]
        return [x.view(t, h // m, w // m, -1) for x, (t, h, w) in zip(merged.split(counts), grid_thw.tolist())]

    def batch(self, samples: list[ClipSample], merged: list[torch.Tensor]) -> LMBatch:
        """Views of all samples -> the right-padded LM batch (kept tokens selected per keep map)."""
        views = [(c, v) for c, s in enumerate(samples) for v in range(len(s.questions))]
        groups: dict[tuple[int, int, int], list[int]] = {}
        for b, (c, _) in enumerate(views):
            groups.setdefault(tuple(merged[c].shape[:3]), []).append(b)
        tokens, local = [], [None] * len(views)             # kept tokens (K, D) per group; per view its cells
        rows = [None] * len(views)                          # per view: its rows in cat(tokens)
        offset = 0
        for (Tp, gh, gw), members in groups.items():
            stack = torch.cat([merged[views[b][0]] for b in members])                     # (S*T', gh, gw, D)
            lods = torch.cat([self._lod(samples[views[b][0]].keeps[views[b][1]], (Tp, gh, gw)) for b in members])
            kept, _ = select_tokens(stack, lods.to(self.device, non_blocking=True))       # (K, D)
            # the same selection over one-dimensional zeros on the host: the kept cells' indices
            # without waiting for the device (select_tokens depends on the LOD map alone)
            index = select_tokens(torch.zeros(*lods.shape, 1), lods)[1].numpy()          # (K,)
            n_full = Tp * gh * gw
            bounds = np.searchsorted(index, np.arange(len(members) + 1) * n_full)
            for j, b in enumerate(members):
                local[b] = index[bounds[j]:bounds[j + 1]] - j * n_full
                rows[b] = offset + np.arange(bounds[j], bounds[j + 1])
            tokens.append(kept)
            offset += len(index)
        return self._assemble(samples, views, merged, local, rows, torch.cat(tokens))

    def _lod(self, keep: np.ndarray, grid: tuple[int, int, int]) -> torch.Tensor:
        lod = pair_lod(torch.from_numpy(keep), self.preprocessor.geometry.temporal_patch_size)
        if tuple(lod.shape) != grid:
            raise ValueError(f"keep map {keep.shape} does not match the VLM's tokens {grid}")
        return lod

    def _ids(self, text: str) -> list[int]:
        ids = self._token_cache.get(text)
        if ids is None:
            ids = self._token_cache[text] = self.tokenizer(text).input_ids
        return ids

    def _assemble(self, samples, views, merged, local, rows, tokens: torch.Tensor) -> LMBatch:
        seqs = []
        for b, (c, v) in enumerate(views):
            s = samples[c]
            answer = self._ids(s.answers[v] + "<|im_end|>")
            if self.qwen3:
                text = self.prompt.prompt_ids(s.questions[v], 0)[1]
                video, pos, vis_at, text_start = self.qwen3_video(s.frames.shape[0], merged[c].shape[1:3], local[b])
                text_at, skip = len(video), 0
                ids = video + text + answer[:-1]
            else:
                positions, text_start = self.layout(*merged[c].shape[:3])
                v0 = len(self.before)
                text = self._ids(after_video(s.questions[v]))
                ids = self.before + [self.pad_id] * len(local[b]) + text + answer[:-1]
                pos = np.concatenate([positions[:, :v0], positions[:, v0 + local[b]]], 1)
                vis_at, text_at, skip = v0 + np.arange(len(local[b])), v0 + len(local[b]), 1
            pos = np.concatenate([pos, text_start + np.arange(len(text) + len(answer) - 1)[None].repeat(3, 0)], 1)
            labels = np.full(len(ids), IGNORE)
            labels[len(ids) - len(answer):] = answer
            seqs.append((ids, pos, labels, rows[b], vis_at, (text_at + skip, text_at + len(text))))
        B, L = len(seqs), max(len(s[0]) for s in seqs)
        ids = np.full((B, L), self.pad_id)
        pos = np.zeros((3, B, L), np.int64)
        labels = np.full((B, L), IGNORE)
        vis_row = np.full((B, L), -1)
        regions = np.full((B, L), -1) if self.region_head is not None else None
        ground = np.zeros((3, B, L), bool) if self.ground_weight > 0 else None
        for b, (i, p, lab, r, vis_at, question) in enumerate(seqs):
            n = len(i)
            ids[b, :n], pos[:, b, :n], labels[b, :n] = i, p, lab
            vis_row[b, vis_at] = r
            if regions is not None:
                gh, gw = merged[views[b][0]].shape[1:3]
                regions[b, vis_at] = token_regions((gh, gw)).ravel()[local[b] % (gh * gw)]
            target = self._ground_target(samples[views[b][0]], views[b][1], local[b]) if ground is not None else None
            if target is not None and target.any():
                ground[0, b, question[0]:question[1]] = True                   # the question's tokens
                ground[1, b, vis_at] = True
                ground[2, b, vis_at] = target
        dev = self.device
        vis_row_t = torch.from_numpy(vis_row)
        vis_row_t = (vis_row_t.pin_memory() if dev.type == "cuda" else vis_row_t).to(dev, non_blocking=True)
        ids_t = torch.from_numpy(ids)
        embeds = self.lm.embed_tokens((ids_t.pin_memory() if dev.type == "cuda" else ids_t).to(dev, non_blocking=True))
        visual = tokens[vis_row_t.clamp(min=0)].to(embeds.dtype)             # (B, L, D (1 + n))
        is_visual = (vis_row_t >= 0)[..., None]
        D = embeds.shape[-1]
        embeds = torch.where(is_visual, visual[..., :D], embeds)
        deepstack = None
        if visual.shape[-1] > D:                                             # Qwen3-VL: zeros off the visual slots
            extra = (visual[..., D:] * is_visual).unflatten(-1, (-1, D))       # (B, L, n, D)
            deepstack = extra.permute(2, 0, 1, 3)                              # (n, B, L, D)
        facts = None
        if self.facts_head is not None and all(samples[c].facts is not None for c, _ in views):
            facts = np.stack([samples[c].facts[v] for c, v in views])
        host = [torch.from_numpy(a) for a in (pos, labels, regions, ground, facts) if a is not None]
        if dev.type == "cuda":
            host = [t.pin_memory() for t in host]
        pos_d, labels_d, *rest = (t.to(dev, non_blocking=True) for t in host)
        regions_d = rest.pop(0) if regions is not None else None
        ground_d = rest.pop(0) if ground is not None else None
        ground_d = tuple(ground_d.unbind(0)) if ground_d is not None and ground[2].any() else None
        facts_d = rest.pop(0) if facts is not None else None
        return LMBatch(embeds, pos_d, labels_d, [len(s[0]) for s in seqs], [len(s[3]) for s in seqs],
                       regions_d, ground_d, deepstack, facts_d)

    @staticmethod
    def _ground_target(sample: ClipSample, view: int, cells: np.ndarray) -> np.ndarray | None:
        """The kept tokens (cells (K,)) the view's question should attend to: its answer's objects'
        (qa_targets.evidence_tokens) where the clip has boxes, else its colour word's; None: neither."""
        if sample.evidence is not None:
            return sample.evidence[view].ravel()[cells]
        color = named_color(sample.questions[view])
        return None if color is None else sample.colors.ravel()[cells] == color

    def qwen3_video(self, T: int, grid: tuple[int, int],
                    cells: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray, int]:
        """Qwen3-VL's prompt up to the end of the video for T frames with the kept cells (K,): the
        pipeline's unpruned video prompt cut by kept_slots under this view's empty-group mode ->
        ids, positions (3, S), the slots of the kept visual tokens (K,), the first position after
        the video."""
        gh, gw = grid
        key = (T, gh, gw)
        if key not in self._qwen3_layouts:             # on the host once per grid: no device read per view
            layout = self.prompt.video_prompt(T, gh, gw)
            self._qwen3_layouts[key] = (layout.video, layout.positions.cpu().numpy(), layout.text_start)
        video, all_positions, text_start = self._qwen3_layouts[key]
        mode = self.empty_groups if self.empty_groups != "mix" else EMPTY_GROUPS[int(self.rng.integers(2))]
        slots = kept_slots(video, torch.from_numpy(np.asarray(cells, np.int64)), gh * gw, mode).numpy()
        rank = np.cumsum(slots) - 1
        return (video.ids.numpy()[slots].tolist(), all_positions[:, slots], rank[video.video_slots.numpy()[cells]],
                text_start)

    def logits(self, batch: LMBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> logits (N, V) float32 of every answer position (row-major) and their targets (N,)."""
        return self._forward(batch)[:2]

    def _forward(self, batch: LMBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """logits and targets, and with region labels in the batch the LM's hidden state (B, L, D)
        after region_layer layers (the region probe's input), else None. With grounding targets in
        the batch, self.recorded holds ground_layer's query and key states afterwards."""
        # no mask but the causal one: every row is right padded, so no real token sees a pad, and
        # SDPA runs its causal kernel instead of one with a (B, 1, L, L) mask
        probe = batch.regions is not None
        self.recorded, self.facts_state = None, None
        record = batch.ground is not None
        if record:
            before = hf.attention_implementation(self.lm.config)
            hf.set_attention_implementation(self.lm.config, GROUND_ATTENTION)
            _RECORDING[self.ground_layer] = self.recorded = {}
        try:
            out = self.lm(inputs_embeds=batch.embeds, position_ids=batch.positions, use_cache=False,
                          output_hidden_states=probe or batch.facts is not None,
                          **qwen3_vl.deepstack_lm_kwargs(batch.deepstack))
        finally:
            if record:
                hf.set_attention_implementation(self.lm.config, before)
                _RECORDING.pop(self.ground_layer, None)
        hidden = out.last_hidden_state                                          # (B, L, D)
        where = batch.labels != IGNORE
        if batch.facts is not None:      # the state where each view's first answer token is predicted
            first = where.int().argmax(1)                                       # (B,)
            state = out.hidden_states[self.facts_layer][torch.arange(len(first)), first]   # (B, D)
            # normalised as the next layer reads it: the residual stream's scale would set the probe's
            self.facts_state = F.layer_norm(state.float(), state.shape[-1:])
        # position i predicts labels[i]: labels hold the token that follows each position
        return (self.model.lm_head(hidden[where]).float(), batch.labels[where],
                out.hidden_states[self.region_layer] if probe else None)

    def ground_loss(self, batch: LMBatch) -> torch.Tensor:
        """-log of the named object's share of the question's attention to the visual tokens at
        ground_layer, averaged over the views that have a target (batch.ground)."""
        question, visual, target = batch.ground
        rec = self.recorded
        if not rec or "q" not in rec:
            raise RuntimeError(f"LM layer {self.ground_layer} did not run through the recording attention")
        attention = question_attention(rec["q"], rec["k"], rec["scaling"], question)   # (B, L)
        on_visual = (attention * visual).sum(-1)
        on_target = (attention * target).sum(-1)
        rows = target.any(-1)
        return -torch.log(on_target[rows] / on_visual[rows].clamp_min(1e-12) + 1e-6).mean()

    @staticmethod
    def facts_loss(predicted: torch.Tensor, facts: torch.Tensor) -> torch.Tensor:
        """predicted (B, FACTS) vs qa_targets' facts (NaN: none): the named objects' centres by a
        smooth L1 in token cells of an 8 x 8 grid, the colour's shapes by binary cross-entropy."""
        pos, shapes = facts[:, :4], facts[:, 4:]
        zero = predicted.sum() * 0.0
        known = ~pos.isnan()
        loss = F.smooth_l1_loss(8 * predicted[:, :4][known], 8 * pos[known]) if bool(known.any()) else zero
        known = ~shapes.isnan()
        if bool(known.any()):
            loss = loss + F.binary_cross_entropy_with_logits(predicted[:, 4:][known], shapes[known])
        return loss

    def _labels(self, parts: list[np.ndarray]) -> torch.Tensor:
        labels = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts]).astype(np.int64))
        return (labels.pin_memory() if self.device.type == "cuda" else labels).to(self.device, non_blocking=True)

    def __call__(self, samples: list[ClipSample]) -> tuple[torch.Tensor, dict[str, float]]:
        """-> the loss, and stats: the answers' cross-entropy and the share right under teacher forcing,
        the token colours' cross-entropy (device tensors: reading one waits for the GPU), the share of
        visual tokens kept."""
        merged = self.vision(samples)
        batch = self.batch(samples, merged)
        logits, targets, probe = self._forward(batch)
        answer_loss = F.cross_entropy(logits, targets)
        loss, aux = answer_loss, torch.zeros((), device=answer_loss.device)
        if self.aux_head is not None:
            tokens = torch.cat([m[..., :self.hidden].reshape(-1, self.hidden) for m in merged])   # (N, D)
            out = self.aux_head(tokens).float()                       # (N, C + 1 [+ S + 1] [+ M])
            start = len(COLORS) + 1
            aux = F.cross_entropy(out[:, :start], self._labels([s.colors for s in samples]))
            loss = answer_loss + self.aux_weight * aux
            for field, weight, width in (("shapes", self.aux_shape_weight, len(SHAPES) + 1),
                                         ("motions", self.aux_motion_weight, len(MOTIONS)),
                                         ("centres", self.centre_weight, 2)):
                if weight <= 0:
                    continue
                labels = self._labels([getattr(s, field) if getattr(s, field) is not None
                                       else np.full_like(s.colors, -1) for s in samples])
                part = F.cross_entropy(out[:, start:start + width], labels, ignore_index=-1) \
                    if bool((labels >= 0).any()) else out.sum() * 0.0
                aux, loss, start = aux + part, loss + weight * part, start + width
        if batch.ground is not None:
            ground_loss = self.ground_loss(batch)
            aux = aux + ground_loss
            loss = loss + self.ground_weight * ground_loss
        if self.facts_head is not None and batch.facts is not None:
            facts_loss = self.facts_loss(self.facts_head(self.facts_state).float(), batch.facts)
            aux = aux + facts_loss
            loss = loss + self.facts_weight * facts_loss
        if self.region_head is not None and self.region_weight > 0:
            visual = batch.regions >= 0
            region_loss = F.cross_entropy(self.region_head(probe[visual]).float(), batch.regions[visual])
            aux = aux + region_loss
            loss = loss + self.region_weight * region_loss
        with torch.no_grad():
            wrong = (logits.argmax(-1) != targets).long()
            view = (batch.labels != IGNORE).nonzero()[:, 0]
            per_view = torch.zeros(batch.labels.shape[0], dtype=torch.long, device=wrong.device)
            per_view.index_add_(0, view, wrong)                                # wrong tokens per view
            answer_acc = (per_view == 0).float().mean()
        full = sum(int(np.prod(merged[c].shape[:3])) for c, s in enumerate(samples) for _ in s.questions)
        return loss, {"answer_loss": answer_loss.detach(), "answer_acc": answer_acc, "aux": aux.detach(),
                      "kept": sum(batch.tokens_kept) / full}
