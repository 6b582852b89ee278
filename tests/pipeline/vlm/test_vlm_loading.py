import json
import math
import threading
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from arr_coc._validate import ConfigError
from conftest import make_frames, random_keep, request
from pipeline.vlm import VLMLoadError, load_vlm
from pipeline.vlm_config import VLMConfig
from pipeline.vlm.batcher import VLMBatcher
from pipeline.vlm.loading import TINY_WARNING, build_tiny_vlm


class TestLoadErrors:
    def _one_line(self, spec, **kw) -> str:
        with pytest.raises(VLMLoadError) as err:
            load_vlm(spec, device="cpu", dtype="float32", **kw)
        message = str(err.value)
        assert "\n" not in message and spec in message
        return message

    def test_missing_local_path(self, tmp_path):
        assert "does not exist" in self._one_line(str(tmp_path / "nope"))

    def test_directory_without_config(self, tmp_path):
        assert "not a Qwen2-VL-family snapshot" in self._one_line(str(tmp_path))

    def test_directory_of_another_model(self, tmp_path):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
        message = self._one_line(str(tmp_path))
        assert "model_type='llama'" in message and "qwen2_vl, qwen2_5_vl" in message

    def test_hub_id_not_available_offline(self):
        message = self._one_line("no-such-org-arrcoc/no-such-model", local_files_only=True)
        assert "not found" in message


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_snapshot_round_trip(tmp_path, family):
    """The real loading path (from_pretrained + tokenizer + processor json) on a saved tiny snapshot."""
    tiny = build_tiny_vlm(family)
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"image_mean": list(tiny.preprocessor.image_mean), "image_std": list(tiny.preprocessor.image_std),
         "resample": 3, "rescale_factor": 1 / 255}))
    loaded = load_vlm(str(tmp_path), device="cpu", dtype="float32")
    assert loaded.family == family and loaded.warning is None
    assert loaded.preprocessor == tiny.preprocessor
    frames = make_frames(2, 56, 84)
    keep = random_keep(tiny, frames, seed=1)
    a, b = (v.prepare([request(frames, keep)])[0] for v in (tiny, loaded))
    torch.testing.assert_close(a.embeds, b.embeds)
    assert torch.equal(a.positions, b.positions)
    assert torch.equal(tiny.generate([a], max_new_tokens=5).tokens, loaded.generate([b], max_new_tokens=5).tokens)


def test_tiny_random_says_it_is_meaningless():
    vlm = load_vlm("tiny-random", device="cpu", dtype="float32", config=VLMConfig(max_new_tokens=4))
    assert vlm.warning == TINY_WARNING and "meaningless" in vlm.warning
    (result,) = vlm.answer([request(make_frames(2, 56, 56))])
    assert result.tokens_kept == result.tokens_full == 4 and isinstance(result.text, str)


class TestConfig:
    @pytest.mark.parametrize("field,value", [("top_p", 0.0), ("temperature", -1.0), ("max_batch", 0),
                                             ("fps", 0.0), ("dtype", "int8"), ("max_new_tokens", 2.5),
                                             ("max_pixels", 56 * 56 - 1)])
    def test_rejects_bad_values(self, field, value):
        with pytest.raises(ConfigError) as err:
            VLMConfig(**{field: value})
        assert field in str(err.value) and "\n" not in str(err.value)


class TestBatcher:
    def test_groups_streams_and_matches_direct_answers(self):
        vlm = build_tiny_vlm("qwen2_vl", config=VLMConfig(max_new_tokens=6))
        reqs = [request(make_frames(2 + i % 2, 56, 84, seed=i), None, f"question {i}?", stream=f"s{i}")
                for i in range(5)]
        reqs[3] = request(reqs[3].frames, random_keep(vlm, reqs[3].frames, seed=3), "q3", stream="s3")
        direct = [vlm.answer([r])[0] for r in reqs]
        futures = [None] * len(reqs)
        with VLMBatcher(vlm, max_batch=3, max_wait_s=0.5) as batcher:
            threads = [threading.Thread(target=lambda i=i: futures.__setitem__(i, batcher.submit(reqs[i])))
                       for i in range(len(reqs))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            results = [f.result(timeout=60) for f in futures]
        assert sum(batcher.batch_sizes) == 5 and max(batcher.batch_sizes) == 3   # waited to fill a batch
        for got, want in zip(results, direct):
            assert (got.text, got.tokens_kept, got.tokens_full) == (want.text, want.tokens_kept, want.tokens_full)

    def test_timings_say_where_each_batch_waited(self):
        vlm = build_tiny_vlm("qwen2_vl", config=VLMConfig(max_new_tokens=2))
        frames = make_frames(2, 56, 84)
        arrived = time.monotonic() - 0.25                                   # windows complete 250 ms ago
        reqs = [replace(request(frames, None, f"q{i}?", stream=f"s{i}"), arrival_s=arrived) for i in range(3)]
        reqs.append(request(frames, None, "no arrival?", stream="s3"))
        with VLMBatcher(vlm, max_batch=2, max_wait_s=0.2) as batcher:
            futures = [batcher.submit(r) for r in reqs]
            for f in futures:
                f.result(timeout=60)
        timings = list(batcher.timings)
        assert [len(t.queued_s) for t in timings] == batcher.batch_sizes == [2, 2]
        first, second = timings
        assert second.started >= first.started + first.answer_s               # one batch after the other
        assert all(q >= 0 for t in timings for q in t.queued_s)
        assert min(second.queued_s) >= first.answer_s                         # waited for the first batch
        assert all(0.25 <= r < 5 for r in first.ready_s + second.ready_s[:1])
        assert math.isnan(second.ready_s[1])                                  # no arrival time: unknown

    def test_error_reaches_the_future_and_closed_batcher_refuses(self):
        vlm = build_tiny_vlm("qwen2_vl", config=VLMConfig(max_new_tokens=2))
        frames = make_frames(2, 56, 84)
        batcher = VLMBatcher(vlm, max_batch=2, max_wait_s=0.0)
        bad = batcher.submit(request(frames, np.ones((2, 5, 5), dtype=np.int64)))
        with pytest.raises(ValueError, match="does not match the VLM grid"):
            bad.result(timeout=60)
        batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            batcher.submit(request(frames))


class TestBuiltinTokenizer:
    BEFORE = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|>"
    AFTER = "<|vision_end|>What is the person on the left doing with the red object?<|im_end|>\n<|im_start|>assistant\n"

    def test_english_merges_give_qwen2_token_counts(self):
        from pipeline.vlm.builtin import build_tokenizer
        tok = build_tokenizer("english")
        # Qwen2's own vocabulary: 14 tokens of system + user turn, <|vision_start|>; the question
        # one per word and "?", then <|im_end|> \n <|im_start|> assistant \n
        assert len(tok(self.BEFORE).input_ids) == 15
        assert tok.convert_ids_to_tokens(tok(self.AFTER).input_ids)[1:14] == [
            "What", "Ġis", "Ġthe", "Ġperson", "Ġon", "Ġthe", "Ġleft", "Ġdoing", "Ġwith", "Ġthe", "Ġred", "Ġobject", "?"]
        assert len(tok(self.AFTER).input_ids) == 19
        byte_level = build_tokenizer()
        assert len(byte_level(self.BEFORE).input_ids) == 45 and len(byte_level(self.AFTER).input_ids) == 71

    @pytest.mark.parametrize("vocabulary", ["bytes", "english"])
    def test_any_text_round_trips(self, vocabulary):
        from pipeline.vlm.builtin import SPECIAL_TOKENS, build_tokenizer
        tok = build_tokenizer(vocabulary)
        for text in ["Zebra xylophone, quantum 42!", "红色 (red) ✓\n\ttabs", self.AFTER]:
            assert tok.decode(tok(text).input_ids) == text
        assert len({tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}) == len(SPECIAL_TOKENS)

    def test_unknown_vocabulary_is_refused(self):
        from pipeline.vlm.builtin import build_tokenizer
        with pytest.raises(ValueError, match="Invalid vocabulary"):
            build_tokenizer("klingon")
