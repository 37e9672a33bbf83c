"""Pipeline parallelism: layers, weights and KV per stage, against hand-worked numbers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgateway.capacity import CapacityConfigError, CapacitySpec, estimate, parse_vllm_log
from kvgateway.capacity.explain import explain_log
from kvgateway.capacity.pipeline import pp_partition

GIB = 1 << 30


@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        (80, 2, (40, 40)),
        (61, 2, (31, 30)),  # the remainder goes to the stage before the last
        (61, 4, (15, 15, 16, 15)),
        (22, 4, (5, 6, 6, 5)),
        (5, 3, (2, 2, 1)),
        (3, 2, (2, 1)),
        (32, 1, (32,)),
    ],
)
def test_partition_follows_get_pp_indices(layers: int, pp: int, expected: tuple[int, ...]) -> None:
    assert pp_partition(layers, pp) == expected


@given(st.integers(1, 200), st.integers(1, 16))
def test_partition_covers_every_layer_and_spares_the_last_stage(layers: int, pp: int) -> None:
    if pp > layers:
        return
    parts = pp_partition(layers, pp)
    assert len(parts) == pp and sum(parts) == layers
    assert max(parts) - min(parts) <= 1
    assert parts[-1] == layers // pp  # the last stage (LM head) never takes a spare layer


def _llama70b(**extra: object) -> CapacitySpec:
    return CapacitySpec.from_mapping(
        {"preset": "llama-3.1-70b", "gpu_memory_gib": 79.25, "overhead_gib": 3.0, **extra}, "c"
    )


def test_llama_70b_tp4_pp2_by_hand() -> None:
    # Per GPU: 8 KV heads / tp 4 = 2 heads x 128 x 2 (K, V) x 2 B = 1,024 B per layer, and a
    # stage holds 40 of the 80 layers: 40,960 B per token.
    # Weights: 70,553,706,496 params; embedding = LM head = 128,256 x 8,192 = 1,050,673,152;
    # a layer averages (70,553,706,496 - 2 x 1,050,673,152) / 80 = 855,654,502.4.
    # Stage 0: 40 layers + embedding = 35,276,853,248 params x 2 B / tp 4 = 17,638,426,624 B
    # (16.43 GiB); stage 1 the same with the LM head.
    # Pool: ceil(79.25 GiB x 0.92) = 78,286,516,388 - 17,638,426,624 - 3 GiB
    #       = 57,426,864,292 B; // (16 x 1,024) // 40 = 87,626 blocks = 1,402,016 tokens.
    est = estimate(_llama70b(tp=4, pp=2))
    assert [s.model_layers for s in est.stages] == [40, 40]
    assert [s.weights_bytes for s in est.stages] == [17_638_426_624] * 2
    assert [s.pool_bytes for s in est.stages] == [57_426_864_292] * 2
    assert est.bytes_per_token == 40_960
    assert est.num_gpu_blocks == 87_626
    assert est.vllm_logged_tokens == 1_402_016
    assert est.kv_cache_tokens == 1_402_000


def test_tp4_pp2_holds_what_tp8_holds_and_twice_tp4() -> None:
    # 8 GPUs either way: one KV head x 80 layers (tp 8) = two heads x 40 layers (tp 4 pp 2),
    # and the same weights per GPU, so the same blocks.
    assert estimate(_llama70b(tp=8)).num_gpu_blocks == 87_626
    # tp 4 alone: 80 layers x 2 heads per GPU and twice the weights per GPU.
    tp4 = estimate(_llama70b(tp=4))
    assert tp4.num_gpu_blocks == 30_356
    assert tp4.num_gpu_blocks * 2 < 87_626


def test_pp_alias_and_conflicts() -> None:
    spec = _llama70b(tp=4, pipeline_parallel_size=2)
    assert spec.pp == 2
    with pytest.raises(CapacityConfigError, match=r"c\.pp: give pp or pipeline_parallel_size"):
        _llama70b(pp=2, pipeline_parallel_size=2)
    with pytest.raises(CapacityConfigError, match=r"c\.pp: expected a positive integer"):
        _llama70b(pp=0)
    with pytest.raises(CapacityConfigError, match="a stage would hold no layer"):
        _llama70b(pp=81)


def _deepseek(**extra: object) -> CapacitySpec:
    return CapacitySpec.from_mapping(
        {"preset": "deepseek-v3", "tp": 8, "block_size": 64, **extra},
        "c",
    )  # fmt: skip


def test_mla_with_pp_by_hand() -> None:
    # MLA: (512 + 64) x 2 B = 1,152 B per layer per token on every rank (TP does not
    # divide it); a 64-token page is 73,728 B. 20 GiB = 21,474,836,480 B // 73,728 =
    # 291,271 pages. pp 2 splits 61 layers [31, 30]: stage 0 has 291,271 // 31 = 9,395
    # blocks, stage 1 291,271 // 30 = 9,709; the node runs on 9,395 = 601,280 tokens.
    est = estimate(_deepseek(kv_cache_memory_gib=20, pp=2))
    assert est.bytes_per_token_per_layer == 1_152
    assert [s.model_layers for s in est.stages] == [31, 30]
    assert [s.num_blocks for s in est.stages] == [9_395, 9_709]
    assert est.num_gpu_blocks == 9_395
    assert est.kv_layers_per_gpu == 31  # the limiting stage's
    assert est.vllm_logged_tokens == 601_280
    # One stage: 291,271 // 61 = 4,774 blocks: pp 2 nearly doubles the pool per token.
    assert estimate(_deepseek(kv_cache_memory_gib=20)).num_gpu_blocks == 4_774


def test_mla_mtp_layer_sits_on_the_last_stage() -> None:
    # DeepSeek V3's MTP layer (num_nextn_predict_layers 1) is MLA too: pp 1 divides by
    # 62 layers (291,271 // 62 = 4,697); with pp 2 it lands on the last stage, [31, 30 + 1],
    # and both stages then hold 9,395 blocks.
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    assert estimate(_deepseek(kv_cache_memory_gib=20, speculative=mtp)).num_gpu_blocks == 4_697
    est = estimate(_deepseek(kv_cache_memory_gib=20, pp=2, speculative=mtp))
    assert [(s.model_layers, s.draft_layers) for s in est.stages] == [(31, 0), (30, 1)]
    assert [s.num_blocks for s in est.stages] == [9_395, 9_395]


def test_mla_pp_weights_per_stage_by_hand() -> None:
    # 671,026,419,200 params at 1 B (fp8); embedding = LM head = 129,280 x 7,168 =
    # 926,679,040; a layer averages (671,026,419,200 - 2 x 926,679,040) / 61
    # = 10,970,050,182.3. Stage 0: 31 layers + embedding, / tp 8 = 42,624,779,336 B;
    # stage 1: 30 layers + LM head = 41,253,523,063 B. On a 139.8 GiB GPU at 0.92 with 4 GiB
    # overhead: ceil(150,109,106,995 x 0.92) = 138,100,378,436; stage 0 keeps
    # 138,100,378,436 - 42,624,779,336 - 4 GiB = 91,180,631,804 B // 73,728 // 31 = 39,894
    # blocks, stage 1 92,551,888,077 B // 73,728 // 30 = 41,843; the node runs on 39,894.
    est = estimate(_deepseek(gpu_memory_gib=139.8, overhead_gib=4, pp=2))
    assert [s.weights_bytes for s in est.stages] == [42_624_779_336, 41_253_523_063]
    assert [s.pool_bytes for s in est.stages] == [91_180_631_804, 92_551_888_077]
    assert [s.num_blocks for s in est.stages] == [39_894, 41_843]
    assert est.num_gpu_blocks == 39_894
    assert est.pool.weights_bytes == 42_624_779_336  # the limiting stage's breakdown
    assert any("pipeline parallel 2" in note for note in est.notes)


def test_hybrid_model_with_pp_divides_each_stage_by_its_share() -> None:
    # gpt-oss-20b: 12 sliding + 12 full layers, 2 groups of 12; pp 2 puts 12 layers on
    # each stage, so each worker's group size is 6 and the blocks double.
    spec = {"preset": "gpt-oss-20b", "kv_cache_memory_gib": 10}
    one = estimate(CapacitySpec.from_mapping(spec, "c"))
    two = estimate(CapacitySpec.from_mapping({**spec, "pp": 2}, "c"))
    assert one.layout.group_size == 12 and one.layout.num_groups == 2
    assert [s.kv_layers for s in two.stages] == [6, 6]
    assert two.num_gpu_blocks == int(10 * GIB) // (16 * 2_048) // 6
    assert two.num_gpu_blocks == pytest.approx(2 * one.num_gpu_blocks, abs=1)


def test_gemma3_groups_are_projected_onto_each_stage() -> None:
    # Gemma 3 27B: 62 layers, every sixth full (5, 11, ..., 59), 52 sliding. Model-wide
    # groups of 10: one full group, six sliding groups (sliding[i::6]). pp 2 = layers 0-30
    # and 31-61. Stage 0 holds 5 full layers and sliding positions 0-25: group 0 gets
    # 0, 6, 12, 18, 24 = 5 of them, no group more; stage 1 holds 5 full and positions
    # 26-51: groups 2 and 3 get 5 each. Both stages divide their pool by 5 (not 10).
    spec = {"preset": "gemma-3-27b", "tp": 2, "kv_cache_memory_gib": 20}
    one = estimate(CapacitySpec.from_mapping(spec, "c"))
    two = estimate(CapacitySpec.from_mapping({**spec, "pp": 2}, "c"))
    assert (one.layout.group_size, one.layout.num_groups) == (10, 7)
    assert [s.kv_layers for s in two.stages] == [5, 5]
    page = 16 * one.bytes_per_token_per_layer
    assert two.num_gpu_blocks == int(20 * GIB) // page // 5
    assert one.num_gpu_blocks == int(20 * GIB) // page // 10
    # pp 4 splits [15, 16, 16, 15]; stage 0 holds full 5, 11 and sliding positions 0-12,
    # so group 0 (0, 6, 12) has 3: the largest share on any stage is 3.
    four = estimate(CapacitySpec.from_mapping({**spec, "pp": 4}, "c"))
    assert [s.kv_layers for s in four.stages] == [3, 3, 3, 3]


def test_eagle_under_pp_loads_its_own_embedding() -> None:
    # Without PP the head borrows the target's embedding; on the last stage it cannot.
    spec = _llama70b(tp=4, pp=2, speculative={"method": "eagle"})
    est = estimate(spec)
    head = 855_654_502.4 + 2 * 8_192 * 8_192  # one average layer + fc
    embedding = 128_256 * 8_192
    assert est.stages[1].draft_layers == 1
    assert est.pool.weights_bytes == 17_638_426_624 + int((head + embedding) * 2 / 4)
    # the drafter's layer and weights make the last stage the smaller one
    assert est.num_gpu_blocks == est.stages[1].num_blocks < est.stages[0].num_blocks


_PP_LOG = """\
(EngineCore_DP0 pid=90) INFO 11-20 08:01:12 [core.py:101] Initializing a V1 LLM engine (v0.29.1) \
with config: model='meta-llama/Llama-3.1-70B-Instruct', speculative_config=None, \
dtype=torch.bfloat16, max_seq_len=131072, tensor_parallel_size=4, pipeline_parallel_size=2, \
data_parallel_size=1, quantization=None, kv_cache_dtype=auto
(Worker_PP0_TP0 pid=301) INFO 11-20 08:03:40 [gpu_worker.py:692] Available KV cache memory: 53.61 GiB
(Worker_PP1_TP0 pid=305) INFO 11-20 08:03:40 [gpu_worker.py:692] Available KV cache memory: 53.48 GiB
(EngineCore_DP0 pid=90) INFO 11-20 08:03:41 [kv_cache_utils.py:2464] GPU KV cache size: 1,401,936 \
tokens, Maximum concurrency for 131,072 tokens per request: 10.70x
"""


def test_a_pp_log_is_cross_checked_per_stage() -> None:
    # The smallest rank's 53.48 GiB over a stage's 40 layers of 1,024 B:
    # 57,423,345,582 B // 16,384 // 40 = 87,621 blocks = 1,401,936 tokens. Read as one
    # 80-layer stage it would be 700,960: half.
    facts = parse_vllm_log(_PP_LOG)
    assert facts.pipeline_parallel_size == 2 and facts.available_kv_gib == 53.48
    spec = CapacitySpec.from_mapping({"preset": "llama-3.1-70b", "kv_cache_memory_gib": 1}, "c")
    report = explain_log(facts, spec)
    check = report.cross_check
    assert check is not None and check.ok
    assert check.predicted_tokens == check.logged_tokens == 1_401_936
    assert any(f.startswith("pp 2:") for f in report.findings)


@given(
    st.sampled_from(["llama-3.1-8b", "llama-3.1-70b", "qwen3-32b", "deepseek-v2-lite"]),
    st.integers(1, 8),
    st.sampled_from([None, "eagle", "mtp", "ngram"]),
    st.floats(1, 60),
)
def test_more_stages_never_shrink_a_measured_pool(
    preset: str, pp: int, method: str | None, gib: float
) -> None:
    # Same KV memory on every GPU: the node's blocks are set by the stage with the most
    # KV layers, so splitting further never loses blocks, and a drafter never adds any.
    base: dict[str, object] = {"preset": preset, "kv_cache_memory_gib": gib}
    if method is not None:
        base["speculative"] = {"method": method}
    one = estimate(CapacitySpec.from_mapping(base, "c"))
    many = estimate(CapacitySpec.from_mapping({**base, "pp": pp}, "c"))
    page = 16 * many.bytes_per_token_per_layer
    heaviest = max(s.model_layers + s.draft_layers for s in many.stages)
    assert many.num_gpu_blocks == int(gib * GIB) // page // heaviest
    assert many.num_gpu_blocks >= one.num_gpu_blocks
    plain = estimate(CapacitySpec.from_mapping({**base, "speculative": None, "pp": pp}, "c"))
    assert many.num_gpu_blocks <= plain.num_gpu_blocks
