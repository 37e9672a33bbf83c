import math
import statistics

from kvgateway.tokens.prompt_estimate import PromptCalibration


def test_tiny_chats_with_a_fixed_template_do_not_poison_long_prompts():
    # ratio_poison: a node whose template adds 30 fixed tokens; 20 tiny chats.
    cal = PromptCalibration()
    cal.observe("big-1", "m", 26_000, 26_030)
    for i in range(20):
        cal.observe("big-1", "m", 3 + i % 3, 33 + i % 3)
    assert 25 <= cal.fixed("m") <= 31
    assert cal.ratio("m") < 1.01
    bound = cal.scaled("m", 26_000, 0.0)
    # Never under what the node counts, and nowhere near doubled.
    assert 26_030 <= bound <= 26_400


def test_a_tokenizer_ratio_is_learned_from_large_prompts():
    cal = PromptCalibration()
    for _ in range(30):
        cal.observe("a", "m", 1_300, 1_625)  # the node's tokenizer counts 25% more
    assert 1.2 < cal.ratio("m") <= 1.26
    assert cal.scaled("m", 10_000, 0.0) >= 12_400


def test_one_wild_answer_moves_the_fit_only_so_far():
    cal = PromptCalibration()
    for _ in range(30):
        cal.observe("a", "m", 2_000, 2_000)
    cal.observe("a", "m", 2_000, 2_000_000)  # garbage usage from a node
    assert cal.ratio("m") < 1.2
    for _ in range(30):
        cal.observe("a", "m", 10, 5_000_000)
    assert cal.fixed("m") <= 4096


def test_fits_are_per_backend_and_reads_take_the_largest():
    cal = PromptCalibration()
    for _ in range(10):
        cal.observe("plain", "m", 1_000, 1_000)
        cal.observe("wordy", "m", 1_000, 1_500)
        cal.observe("other", "n", 1_000, 3_000)
    assert 1.45 < cal.ratio("m") <= 1.5
    assert cal.scaled("m", 1_000, 0.0) >= 1_450
    assert cal.ratio("unknown") == 1.0 and cal.scaled("unknown", 100, 0.1) == 110


def test_learned_predictions_wait_for_enough_reports():
    cal = PromptCalibration()
    assert cal.learned("m", 1_000, 0.0, min_samples=3) is None
    for _ in range(2):
        cal.observe("a", "m", 1_000, 1_010)
    assert cal.learned("m", 1_000, 0.0, min_samples=3) is None
    cal.observe("b", "m", 1_000, 1_010)  # reports of every backend of the model count
    got = cal.learned("m", 2_000, 0.0, min_samples=3)
    assert got is not None and 2_000 <= got <= 2_030
    assert cal.learned("other", 2_000, 0.0, min_samples=1) is None


def test_one_digit_heavy_chat_does_not_scale_every_prompt_after_it():
    """upper_bound false against a Qwen node: one chat of numbers (stand-in 2,807, node
    7,028) teaches no ratio, so English prompts of 3,529 and 5,029 tokens stay as
    counted; a 2.5x ratio would predict them at 8.8k and 12.6k, refused on an 8k node
    that serves them. English chats seen often set the ratio (1.05), numbers now and
    then do not."""
    cal = PromptCalibration()
    cal.observe("n", "m", 2_807, 7_028)
    assert cal.scaled("m", 3_529, 0.0) == 3_529
    assert cal.scaled("m", 5_029, 0.0) == 5_029
    for i in range(12):
        cal.observe("n", "m", 3_000, 3_150)  # English: 5% more on the node
        if i % 4 == 3:
            cal.observe("n", "m", 2_807, 7_028)  # and a chat of numbers now and then
    assert cal.ratio("m") == 1.05
    assert cal.scaled("m", 5_029, 0.0) <= 5_290


def test_a_request_reads_every_fit_without_recomputing_its_median(monkeypatch):
    """Every request reads the fits of every backend of its model: each fit's median is
    taken when it learns, so a read costs a multiply per backend (at 1,000 backends a
    median each took ~2 ms a request). The bound is the same either way."""
    cal = PromptCalibration()
    for b in range(50):
        for i in range(10):
            cal.observe(f"n{b}", "m", 1_000 + i, 1_100 + i + b)
    expected = max(
        math.ceil(f.fixed + max(1.0, statistics.median(f.ratios)) * 2_000 - 1e-9)
        for f in cal._fits["m"].values()
    )
    medians: list[int] = []

    def median(values: object) -> float:
        medians.append(1)
        return 1.0

    monkeypatch.setattr(statistics, "median", median)
    assert cal.scaled("m", 2_000, 0.0) == expected
    assert cal.learned("m", 2_000, 0.0, 16) == expected
    assert medians == []
