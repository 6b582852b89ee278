"""One module owns every transformers internal the fast paths touch (pipeline/vlm/hf.py), and
the tested transformers range is checked at load."""
from __future__ import annotations

import re
import tokenize
from pathlib import Path

import pytest
import torch
from conftest import make_frames, request, rewrap

from pipeline.vlm import hf
from pipeline.vlm.loading import build_tiny_vlm

ROOT = Path(__file__).resolve().parents[3]
# names of transformers internals: private config fields, registries, module-level helpers looked
# up through sys.modules, the model's inner attribute paths, layer class names matched by string
# (calls into the adapter, `hf.name(...)`, are what everyone else does; prose does not count)
INTERNALS = re.compile(r"(?<!hf\.)\b(_attn_implementation|language_model|get_rope_index|AttentionInterface"
                       r"|AttentionMaskInterface|masking_utils|sdpa_attention_forward|sdpa_mask|vision_utils"
                       r"|ALL_ATTENTION_FUNCTIONS|eager_attention_forward|apply_rotary_pos_emb_vision)\b"
                       r"|model\.model\.visual|sys\.modules\[type|\)\.__name__(\.endswith| ?[!=]=)"
                       r"|transformers\.(integrations|modeling_utils|models)")
ADAPTER = ROOT / "pipeline" / "vlm" / "hf.py"
# Qwen3-VL's own adapter (transformers' forward with DeepStack): the one other file that may
QWEN3_ADAPTER = ROOT / "pipeline" / "vlm" / "qwen3_vl.py"


def code_lines(path: Path) -> dict[int, str]:
    """Line number -> the line's code without strings and comments."""
    lines: dict[int, list[str]] = {}
    with tokenize.open(path) as f:
        for tok in tokenize.generate_tokens(f.readline):
            if tok.type in (tokenize.NAME, tokenize.OP, tokenize.NUMBER):
                lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: _join(parts) for n, parts in lines.items()}


def _join(parts: list[str]) -> str:
    out = ""
    for t in parts:
        glue = t in ".[]()," or out.endswith((".", "[", "("))
        out += t if glue or not out else " " + t
    return out


def test_only_the_adapter_names_transformers_internals():
    offenders = []
    for package in ("arr_coc", "pipeline", "sources", "sinks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in (ADAPTER, QWEN3_ADAPTER):
                continue
            for number, code in code_lines(path).items():
                if INTERNALS.search(code):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {code}")
    assert not offenders, "transformers internals outside pipeline/vlm/hf.py:\n" + "\n".join(offenders)


def test_the_grep_sees_the_adapter_itself():
    """The pattern matches what the adapter really does (else the test above proves nothing)."""
    hits = [code for code in code_lines(ADAPTER).values() if INTERNALS.search(code)]
    assert len(hits) >= 8, hits
    assert any(INTERNALS.search(code) for code in code_lines(QWEN3_ADAPTER).values())


class TestVersionRange:
    def test_installed_version_is_in_range(self):
        assert hf.check_version() is None, hf.check_version()

    @pytest.mark.parametrize("version, inside", [("5.17.0", True), ("5.24.1", True), ("5.25.0", False),
                                                 ("4.57.1", False), ("5.17.0.dev0", True), ("6.0", False)])
    def test_bounds(self, version, inside):
        assert (hf.check_version(version) is None) is inside

    def test_pyproject_declares_a_range_that_holds_the_tested_one(self):
        """pyproject asks for a broad range (pip installs it beside other packages); the tested range,
        checked at load, must lie inside it, and no upper bound may refuse a newer release."""
        import tomllib
        deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        spec = next(d for d in deps if d.startswith("transformers"))
        assert "<" not in spec and spec.startswith("transformers>="), spec
        floor = spec.removeprefix("transformers>=")
        assert hf._version_tuple(floor) <= hf._version_tuple(hf.TESTED_RANGE[0]), spec


def test_outside_the_range_runs_hfs_forward_with_a_warning(monkeypatch):
    """An untested transformers: a warning, the fast paths off, and the same answer as HF's forward."""
    monkeypatch.setattr(hf, "installed_version", lambda: "9.0.0")
    fallback = build_tiny_vlm("qwen2_vl")
    assert "outside the range" in (fallback.warning or "")
    assert fallback.pool._fast_lm is None and not fallback.config.fast_vision
    assert hf.attention_implementation(fallback.lm.config) == "sdpa"          # HF's own attention
    frames = make_frames(4, 56, 56)
    monkeypatch.setattr(hf, "installed_version", lambda: "5.20.0")
    reference = build_tiny_vlm("qwen2_vl")                           # same seed: the same weights
    reference = rewrap(reference, fast_lm=False, fast_vision=False)
    answers = [v.answer([request(frames)])[0].text for v in (fallback, reference)]
    assert answers[0] == answers[1]


def test_rope_index_matches_the_models_method():
    vlm = build_tiny_vlm("qwen2_vl")
    before, after = vlm.prefixes.prompt_ids("what?", 8)
    ids = torch.tensor(before + [vlm.video_token_id] * 8 + after)
    grid = torch.tensor([2, 4, 4])                                   # 2 x (2x2 merged) = 8 tokens
    positions = vlm.prefixes.rope_positions(ids, grid)                        # (3, L)
    assert positions.shape == (3, len(ids))
    text = positions[:, len(before) + 8:]
    assert torch.equal(text[0], text[1]) and torch.equal(text[1], text[2])  # text: one position on all axes
