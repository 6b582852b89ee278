"""The budget plan: what each pass of an answer may spend, in one place.

Pass 1 (ARR-COC's allocator) keeps candidates; each answering pass then keeps a share of them:

  no pass 2, no tempering   pass 1 keeps the configured budget and the VLM answers from all of it
  pass 2 (vlm.pass2)        pass 1 keeps candidate_factor x the budget (retention, or top_k); pass 2
                            keeps 1 / candidate_factor of those candidates, the best attended
  tempering (ladder)        pass 1 keeps the top rung used (rank: attention, candidate_factor x it),
                            a share of the cells (fraction mode, whatever the configured selection);
                            rung r keeps r / that share of the candidates

Every share becomes a count through arr_coc.attending.retained_tokens (half up), so pass 1's budget
of a frame and a rung's keep of a window follow the same rule.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from arr_coc.attending import AttendingConfig, retained_tokens
from pipeline.vlm_config import VLMConfig


@dataclass(frozen=True)
class BudgetPlan:
    """factor: pass 1 keeps this many times the configured budget (pass 2 without tempering); share:
    with tempering, pass 1 keeps this share of every frame's cells instead (None without); keep: the
    share of pass 1's candidates each answering pass keeps, in order (() when the VLM answers once
    from all of them); rungs: the retention of each tempering rung used (() without)."""
    factor: float = 1.0
    share: float | None = None
    keep: tuple[float, ...] = ()
    rungs: tuple[float, ...] = ()

    @classmethod
    def of(cls, vlm: VLMConfig) -> BudgetPlan:
        """The plan of a VLM configured as `vlm` (vlm.pass2, vlm.candidate_factor, vlm.tempering)."""
        rungs = vlm.tempering.rungs
        if rungs:
            factor = vlm.candidate_factor if vlm.tempering.rank == "attention" else 1.0
            share = min(1.0, factor * rungs[-1])                             # pass 1's share of the cells
            return cls(share=share, keep=tuple(min(1.0, rung / share) for rung in rungs), rungs=rungs)
        if vlm.pass2 == "off":
            return cls()
        return cls(factor=vlm.candidate_factor, keep=(1.0 / vlm.candidate_factor,))

    def pass1(self, attending: AttendingConfig) -> AttendingConfig:
        """The allocator's config for pass 1 (its candidates) from model.attending: as configured, the
        tempering share in fraction mode, or factor x the retention (top_k)."""
        if self.share is not None:
            return replace(attending, selection="fraction", retention=self.share)
        if self.factor == 1:
            return attending
        if attending.selection == "topk":
            return replace(attending, top_k=retained_tokens(attending.top_k, self.factor))
        return replace(attending, retention=attending.retention * self.factor)   # <= 1: PipelineConfig checks

    def pass_sizes(self, candidates: int) -> list[int]:
        """Tokens each answering pass keeps of `candidates`: retained_tokens(candidates, share), at
        least one and at most all (all at share 1); a size no larger than the one before is dropped
        (that pass would answer from the same tokens again). [candidates] when every pass keeps all;
        [0] without candidates."""
        sizes: list[int] = []
        for share in self.keep or (1.0,):
            n = candidates if share >= 1.0 else min(candidates, max(1, retained_tokens(candidates, share)))
            if not sizes or n > sizes[-1]:
                sizes.append(n)
        return sizes
