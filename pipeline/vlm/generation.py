"""Generation: the KV-cached decoding loop after a prefill, batched over requests, with the
confidence tempering reads (of the first answer token, or of the answer's least sure token)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeline.vlm.decoding import StaticDecoder, sample_next
from pipeline.vlm.prefill import DecoderPool
from pipeline.vlm.prefix import Prefix
from pipeline.vlm.probe import Probe
from pipeline.vlm.tempering import PER_TOKEN, first_token_confidence
from pipeline.vlm_config import VLMConfig

DONE_CHECK_EVERY = 8      # decode steps between host checks for "every row has finished" (each one syncs)


@dataclass
class Generation:
    tokens: torch.Tensor               # (B, N) generated ids, pad after EOS
    lengths: list[int]                 # generated tokens per row up to and including EOS
    step_logits: list[torch.Tensor]    # N x (B, V) float32, only when requested
    decode_s: float = float("nan")     # first token -> last token wall time, only when timed
    confidence: list[float] | None = None   # (B) of the first token, or of the answer's least sure one


class Generator:
    """Decodes from a DecoderPool's prefills: sampling, stop tokens, and the answers' confidence
    (the probe's where vlm.tempering.confidence is probe)."""

    def __init__(self, pool: DecoderPool, tokenizer, *, config: VLMConfig, probe: Probe | None) -> None:
        self.pool, self.tokenizer, self.config, self.probe = pool, tokenizer, config, probe
        self.device = pool.device
        self.pad_token_id = pool.pad_token_id
        eos = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        self.eos_ids = torch.tensor([i for i in eos if i is not None and i >= 0], device=self.device)

    @torch.no_grad()
    def generate_from(self, decoder: StaticDecoder, logits: torch.Tensor, batch: int, *,
                      max_new_tokens: int | None = None, temperature: float | None = None,
                      top_p: float | None = None, seed: int | None = None, return_logits: bool = False,
                      timed: bool = False, confidence: torch.Tensor | None = None) -> Generation:
        """The decoding loop after prefill(): `batch` rows, from the first token's logits (B, V) on.
        confidence: the first token's (B,) first_confidence, where the caller already has it (None:
        computed here)."""
        cfg = self.config
        max_new = cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
        temperature = cfg.temperature if temperature is None else temperature
        top_p = cfg.top_p if top_p is None else top_p
        gen = torch.Generator(device=self.device).manual_seed(cfg.seed if seed is None else seed)
        B = batch
        measure = cfg.tempering.confidence
        if confidence is None:
            confidence = self.first_confidence(logits)                       # (B,), before a replay overwrites
        else:
            confidence = confidence.to(self.device, torch.float32)
        per_token = measure in PER_TOKEN                                      # the least sure of every token
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(B, dtype=torch.long, device=self.device)
        tokens, step_logits = [], []
        t_first = None
        for step in range(max_new):
            if return_logits:
                step_logits.append(logits.clone())                           # a graph overwrites its output
            if per_token and step:                                           # step 0: `confidence` already
                confidence = torch.where(done, confidence, torch.minimum(confidence,
                                                                         first_token_confidence(logits, measure)))
            token = sample_next(logits, temperature, top_p, gen)             # (B,)
            token = torch.where(done, self.pad_token_id, token)
            lengths += (~done).long()
            tokens.append(token)
            done |= torch.isin(token, self.eos_ids)
            if timed and step == 0:
                self.pool.sync()
                t_first = time.perf_counter()
            # bool() waits for the GPU, so it is asked only every few steps; the steps in between
            # emit pad for finished rows and are trimmed below
            if step == max_new - 1 or (step % DONE_CHECK_EVERY == DONE_CHECK_EVERY - 1 and bool(done.all())):
                break
            logits = decoder.step(token)
        decode_s = float("nan")
        if timed:
            self.pool.sync()
            decode_s = time.perf_counter() - t_first
        lengths_list = lengths.tolist()
        n = max(lengths_list)
        return Generation(torch.stack(tokens[:n], 1), lengths_list, step_logits[:n], decode_s, confidence.tolist())

    def first_confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, V) first-token logits -> (B,) float32 confidence in [0, 1] by vlm.tempering.confidence
        (the probe's when it is `probe`; `answer` and `coverage` report the first token's margin)."""
        if self.probe is not None:
            return self.probe.confidence(logits)
        return first_token_confidence(logits, self.config.tempering.confidence)

    @torch.no_grad()
    def logits_without_cache(self, prefix: Prefix, continuation: torch.Tensor) -> torch.Tensor:
        """Reference for the cached loop: one uncached forward over prefix + continuation (N,) ids
        -> (N + 1, V) float32 logits predicting each next token."""
        cont = self.pool.lm.embed_tokens(continuation.to(self.device))            # (N, D)
        embeds = torch.cat([prefix.embeds, cont])[None]                      # (1, L + N, D)
        pos_cont = prefix.next_position + torch.arange(continuation.numel(), device=self.device)
        positions = torch.cat([prefix.positions, pos_cont.expand(3, -1)], 1)[:, None]  # (3, 1, L + N)
        deepstack = None                                                     # (n, 1, L + N, D) Qwen3-VL
        if prefix.deepstack is not None:
            deepstack = embeds.new_zeros(prefix.deepstack.shape[0], *embeds.shape)
            deepstack[:, 0, :prefix.deepstack.shape[1]] = prefix.deepstack
        hidden = self.pool.lm_step(embeds, None, positions, None, deepstack)[0, prefix.embeds.shape[0] - 1:]
        return self.pool.model.lm_head(hidden).float()

    def decode(self, tokens: torch.Tensor, length: int) -> str:
        ids = tokens[:length].tolist()
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()
