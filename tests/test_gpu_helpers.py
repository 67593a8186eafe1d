"""The agreement rule and the transformers references of tests/test_gpu.py, on CPU: every bf16
and fp32 verdict of the GPU tests rests on them."""

import torch

from helpers.gpu_helpers import Reference, bf16_ulp, check_greedy_agreement, hf_gaps_along, hf_greedy, load_hf, tie_tolerance
from helpers.tiny_models import make_tiny_model


def test_tie_tolerance_is_ten_bf16_ulps_or_a_tiny_fp32_fraction():
    assert bf16_ulp(1.0) == 2.0**-7 and bf16_ulp(3.0) == 2.0**-6 and bf16_ulp(0.75) == 2.0**-8
    assert tie_tolerance(-3.0, torch.bfloat16) == 10 * 2.0**-6  # of the largest |logit|
    assert tie_tolerance(8.0, torch.float32) == 8.0 * 2.0**-13


def test_a_difference_is_excused_only_at_a_near_tie():
    reference = Reference(tokens=[1, 2, 3, 4], gaps=[5.0, 0.01, 5.0, 5.0], tols=[0.1] * 4)
    same = check_greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4], reference)
    assert (same.compared, same.error) == (4, None)
    at_tie = check_greedy_agreement([1, 9, 7, 7], [1, 2, 3, 4], reference)
    assert (at_tie.compared, at_tie.error) == (1, None)  # position 1 is a near tie: accepted there
    at_gap = check_greedy_agreement([1, 2, 9, 4], [1, 2, 3, 4], reference, "req")
    assert at_gap.compared == 2 and "diverged at output position 2" in at_gap.error
    shorter = check_greedy_agreement([1, 2], [1, 2, 3, 4], reference, "req")
    assert shorter.compared == 2 and "lengths differ" in shorter.error


def test_teacher_forced_gaps_match_greedy_decoding(tmp_path):
    """hf_gaps_along on hf_greedy's own tokens sees the same choices, gaps and tolerances."""
    model = load_hf(make_tiny_model("llama", tmp_path), torch.float32, "cpu")
    prompt = [5, 17, 33, 2, 90]
    greedy = hf_greedy(model, prompt, 6)
    forced = hf_gaps_along(model, prompt, greedy.tokens)
    assert forced.tokens == greedy.tokens
    for ours, theirs in ((forced.gaps, greedy.gaps), (forced.tols, greedy.tols)):
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-6)
    assert all(g >= 0 for g in greedy.gaps)
