import pytest
import torch

from arr_coc.lod import DROPPED, FULL, POOLED, pad_to_pairs, pair_lod, pair_soft, token_frames


class TestPairing:
    def test_most_detailed_lod_of_the_pair_wins(self):
        a = torch.tensor([[[DROPPED, POOLED, FULL, POOLED]], [[DROPPED, DROPPED, POOLED, FULL]]])  # (2, 1, 4)
        assert pair_lod(a).tolist() == [[[DROPPED, POOLED, FULL, FULL]]]

    def test_odd_count_repeats_the_last_frame(self):
        lod = torch.tensor([[[FULL]], [[DROPPED]], [[POOLED]]])                 # (3, 1, 1)
        assert pair_lod(lod).flatten().tolist() == [FULL, POOLED]
        assert pad_to_pairs(lod)[1].flatten().tolist() == [POOLED, POOLED]

    @pytest.mark.parametrize("frames, tokens", [(1, 1), (2, 1), (3, 2), (16, 8), (17, 9)])
    def test_token_frames_counts_what_pairing_makes(self, frames, tokens):
        assert token_frames(frames) == tokens == pair_lod(torch.zeros(frames, 2, 2, dtype=torch.long)).shape[0]

    def test_soft_is_the_pairs_mean_capped_at_one_token(self):
        soft = torch.tensor([[[0.2]], [[0.6]], [[3.0]]])
        torch.testing.assert_close(pair_soft(soft).flatten(), torch.tensor([0.4, 1.0]))

    def test_soft_keeps_gradients(self):
        soft = torch.rand(4, 3, 3, requires_grad=True)
        pair_soft(soft).sum().backward()
        assert soft.grad is not None and soft.grad.abs().sum() > 0
