import numpy as np
import pytest
import torch

from conftest import make_frames
from pipeline.vlm.geometry import VLMGeometry
from pipeline.vlm.preprocess import OPENAI_CLIP_STD, VideoPreprocessor
from pipeline.vlm.selection import pair_lod, select_tokens

GEOMETRY = VLMGeometry(min_pixels=56 * 56, max_pixels=112 * 112)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]
SHAPES = [(4, 56, 84), (3, 50, 70), (5, 130, 100), (2, 300, 240)]   # no resize, upscale, downscale


def hf_video_processor():
    pytest.importorskip("torchvision", reason="HF's video processor needs torchvision")
    from transformers import Qwen2VLVideoProcessor
    return Qwen2VLVideoProcessor(min_pixels=GEOMETRY.min_pixels, max_pixels=GEOMETRY.max_pixels,
                                 cap_pixels_per_frame=False)


class TestAgainstHF:
    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("shape", SHAPES)
    def test_pixel_values_equal_hf_processor(self, shape, device):
        hf = hf_video_processor()
        frames = make_frames(*shape, seed=sum(shape))
        ours, grid = VideoPreprocessor(GEOMETRY)(frames, device)
        ref = hf(videos=[frames], return_tensors="pt", device=device)
        assert grid.tolist() == ref["video_grid_thw"][0].tolist()
        # identical kernels on the same device: bit-exact
        torch.testing.assert_close(ours, ref["pixel_values_videos"].to(device), atol=0, rtol=0)
        if device != "cpu":
            # vs the processor's default (CPU: torch's fixed-point uint8 bicubic kernel) the float kernel
            # rounds differently: mean < 0.3 uint8 levels, >= 99% within one level, rare outliers
            cpu_ref = hf(videos=[frames], return_tensors="pt")["pixel_values_videos"]
            levels = ((ours.cpu() - cpu_ref).abs() * 255 * torch.tensor(OPENAI_CLIP_STD).repeat_interleave(
                ours.shape[1] // 3)).round()
            assert levels.mean() < 0.3 and (levels <= 1).float().mean() >= 0.99 and levels.max() <= 16

    def test_input_ids_equal_hf_processor(self, vlm):
        hf = hf_video_processor()
        from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor
        processor = Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(), tokenizer=vlm.tokenizer,
                                     video_processor=hf)
        frames = make_frames(4, 56, 84)
        before, after = vlm.prefixes.prompt_ids("what?", 0)
        text = vlm.tokenizer.decode(before + [vlm.video_token_id] + after)
        ref = processor(text=[text], videos=[frames], return_tensors="pt")
        ours = vlm.prefixes.full_input_ids("what?", int(ref["video_grid_thw"][0].prod()) // 4)
        assert ref["input_ids"][0].tolist() == ours.tolist()


class TestLayout:
    def test_odd_frame_count_repeats_last_frame(self):
        frames = make_frames(3, 56, 56)
        pixels, grid = VideoPreprocessor(GEOMETRY)(frames, "cpu")
        assert grid.tolist() == [2, 4, 4]
        last = pixels[16:].view(16, 3, 2, 14, 14)                             # second temporal patch
        torch.testing.assert_close(last[:, :, 0], last[:, :, 1], atol=0, rtol=0)
        first = pixels[:16].view(16, 3, 2, 14, 14)
        assert not torch.equal(first[:, :, 0], first[:, :, 1])

    def test_patch_rows_follow_merge_blocks(self):
        # frame = its own pixel coordinates; a row's first pixel tells where the patch came from
        H, W = 56, 84
        frames = np.zeros((2, H, W, 3), dtype=np.uint8)
        frames[..., 0] = np.arange(H)[:, None]
        frames[..., 1] = np.arange(W)[None, :]
        pre = VideoPreprocessor(GEOMETRY, image_mean=(0, 0, 0), image_std=(1, 1, 1))
        pixels, grid = pre(frames, "cpu")
        origin = (pixels.view(-1, 3, 2, 14, 14)[:, :2, 0, 0, 0] * 255).round().long()  # (rows, (y, x))
        expected = [(by * 28 + dy * 14, bx * 28 + dx * 14) for by in range(2) for bx in range(3)
                    for dy in range(2) for dx in range(2)]
        assert [tuple(r) for r in origin.tolist()] == expected

    def test_rejects_non_uint8_frames(self):
        with pytest.raises(ValueError, match=r"\(T, H, W, 3\) uint8"):
            VideoPreprocessor(GEOMETRY)(np.zeros((2, 56, 56, 3), dtype=np.float32), "cpu")


class TestSelectionRules:
    def test_pair_lod_prefers_detail_and_pads_odd_counts(self):
        keep = torch.tensor([[[1, 0], [2, 0]], [[2, 2], [0, 0]], [[0, 2], [0, 1]]])
        lod = pair_lod(keep)
        assert lod.tolist() == [[[1, 2], [2, 0]], [[0, 2], [0, 1]]]

    def test_pooled_block_is_the_mean_at_its_anchor(self):
        merged = torch.arange(9.0).view(1, 3, 3, 1)                          # odd grid: partial edge blocks
        lod = torch.tensor([[[1, 0, 2], [0, 2, 2], [2, 2, 0]]], dtype=torch.int8)
        tokens, index = select_tokens(merged, lod)
        # full (0,0); block(0,1) = cells 2,5 -> anchor 2; block(0,0) lod-2 cell 4 -> anchor 4;
        # block(1,0) = cells 6,7 -> anchor 6
        assert index.tolist() == [0, 2, 4, 6]
        assert tokens.squeeze(1).tolist() == [0.0, 3.5, 4.0, 6.5]

    def test_all_full_keeps_every_token_in_order(self):
        merged = torch.randn(2, 4, 6, 8)
        tokens, index = select_tokens(merged, torch.ones(2, 4, 6, dtype=torch.int8))
        assert torch.equal(index, torch.arange(48))
        assert torch.equal(tokens, merged.reshape(48, 8))
