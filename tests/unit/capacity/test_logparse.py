"""parse_vllm_log: every wording vLLM has used for its KV-cache start-up lines."""

from __future__ import annotations

import pytest

from kvgateway.capacity import parse_vllm_log
from kvgateway.capacity.explain import logged_drafter
from kvgateway.capacity.speculative import SpeculativeSpec
from tests.support.capacity_data import read_data


def test_v1_separate_lines_with_ansi_prefixes() -> None:
    facts = parse_vllm_log(read_data("v1_llama31_8b_a100_40gb.log"))
    assert facts.engine == "v1" and facts.vllm_version == "0.10.1.1"
    assert facts.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert facts.max_model_len == 131_072 and facts.tensor_parallel_size == 1
    assert facts.kv_cache_dtype == "auto" and facts.dtype == "bfloat16"
    assert facts.quantization is None
    assert facts.available_kv_gib == 19.25
    assert facts.kv_cache_tokens == 157_648  # thousands separators
    assert facts.concurrency_len == 131_072 and facts.max_concurrency == 1.20
    assert facts.num_gpu_blocks == 9853  # cache_config_info line
    assert facts.weights_gib == 14.9889 and facts.cuda_graph_gib == 0.52
    assert not facts.startup_failed


def test_newest_single_line_and_memory_summary() -> None:
    facts = parse_vllm_log(read_data("v1_llama31_8b_h100_one_line.log"))
    assert facts.kv_cache_tokens == 460_496 and facts.max_concurrency == 3.51
    assert facts.concurrency_len == 131_072
    assert facts.total_gpu_gib == 79.25 and facts.gpu_memory_utilization == 0.92
    assert facts.activation_gib == 1.44 and facts.cuda_graph_gib == 0.23
    assert facts.weights_gib == 15.0 and facts.available_kv_gib == 56.21


def test_debug_memory_profile_lines() -> None:
    facts = parse_vllm_log(read_data("v1_qwen3_8b_fp8_24gb.log"))
    assert facts.quantization == "fp8" and facts.max_model_len == 1024
    assert facts.activation_gib == 1.40 and facts.weights_gib == 8.80
    assert facts.kv_cache_tokens == 62_608 and facts.max_concurrency == 61.14


def test_v1_startup_failure_models_s_wording() -> None:
    facts = parse_vllm_log(read_data("v1_qwen25_14b_too_long.log"))
    assert facts.startup_failed
    assert facts.max_model_len == 131_072
    assert facts.needed_kv_gib == 24.00 and facts.available_kv_gib == 10.91
    assert facts.estimated_max_model_len == 59_584
    assert facts.kv_cache_tokens is None


def test_v1_startup_failure_with_parenthesis_wording() -> None:
    facts = parse_vllm_log(read_data("v1_qwen3_8b_too_long.log"))
    assert facts.needed_kv_gib == 4.50 and facts.available_kv_gib == 4.47
    assert facts.estimated_max_model_len == 32_560 and facts.max_model_len == 32_768


def test_older_model_s_wording_without_estimate() -> None:
    line = (
        "ValueError: To serve at least one request with the model's max seq len (8192), "
        "(1.00 GiB KV cache is needed, which is larger than the available KV cache memory "
        "(0.50 GiB). Try increasing `gpu_memory_utilization` or decreasing `max_model_len` "
        "when initializing the engine."
    )
    facts = parse_vllm_log(line)
    assert facts.startup_failed and facts.needed_kv_gib == 1.0
    assert facts.available_kv_gib == 0.5 and facts.estimated_max_model_len is None


def test_v0_blocks_and_concurrency() -> None:
    facts = parse_vllm_log(read_data("v0_llama31_8b_3090_20k.log"))
    assert facts.engine == "v0" and facts.vllm_version == "0.6.4.post1"
    assert facts.num_gpu_blocks == 1952 and facts.num_cpu_blocks == 2048
    assert facts.concurrency_len == 20_000 and facts.max_concurrency == 1.56
    assert facts.available_kv_gib == 3.81  # kv_cache_size=3.81GiB
    assert facts.total_gpu_gib == 23.58 and facts.gpu_memory_utilization == 0.90
    assert facts.weights_gib == 14.9888  # "Loading model weights took 14.9888 GB"


def test_v0_max_seq_len_failure() -> None:
    facts = parse_vllm_log(read_data("v0_llama31_8b_3090_29k_too_long.log"))
    assert facts.startup_failed and facts.v0_kv_token_capacity == 23_648
    assert facts.max_model_len == 29_000 and facts.num_gpu_blocks == 1478


@pytest.mark.parametrize(
    "line",
    [
        "INFO 03-01 10:00:00 gpu_executor.py:122] # GPU blocks: 2000, # CPU blocks: 512",
        "INFO 03-01 10:00:00 neuron_executor.py:40] # gpu blocks: 2000, # cpu blocks: 512",
        "INFO 03-01 10:00:00 worker.py:1] # GPU blocks: 2000",
    ],
)
def test_gpu_and_cpu_block_wordings(line: str) -> None:
    facts = parse_vllm_log(line)
    assert facts.num_gpu_blocks == 2000
    if "CPU" in line.upper():
        assert facts.num_cpu_blocks == 512


def test_early_v1_block_count_and_unseparated_numbers() -> None:
    facts = parse_vllm_log(read_data("v1_early_gpu_blocks.log"))
    assert facts.num_gpu_blocks == 1381 and facts.concurrency_len == 2048
    assert facts.max_concurrency == 10.79 and facts.max_model_len == 2048
    assert facts.weights_gib == 67.7229


def test_tp_ranks_keep_the_smallest_pool() -> None:
    text = "\n".join(
        f"(Worker_TP{i} pid={100 + i}) INFO 08-14 14:07:22 [gpu_worker.py:563] "
        f"Available KV cache memory: {gib} GiB"
        for i, gib in enumerate(["6.87", "6.52", "6.91", "6.70"])
    )
    assert parse_vllm_log(text).available_kv_gib == 6.52


def test_v0_memory_breakdown_line() -> None:
    text = (
        "INFO 12-20 20:25:46 worker.py:241] the current vLLM instance can use total_gpu_memory "
        "(15.77GiB) x gpu_memory_utilization (0.90) = 14.20GiB\n"
        "INFO 12-20 20:25:46 worker.py:241] model weights take 7.51GiB; non_torch_memory takes "
        "0.39GiB; PyTorch activation peak memory takes 2.53GiB; the rest of the memory reserved "
        "for KV Cache is 3.76GiB.\n"
        "INFO 12-20 20:25:46 distributed_gpu_executor.py:57] # GPU blocks: 3852, # CPU blocks: 4096"
    )
    facts = parse_vllm_log(text)
    assert facts.total_gpu_gib == 15.77 and facts.gpu_memory_utilization == 0.90
    assert facts.weights_gib == 7.51 and facts.activation_gib == 2.53
    assert facts.available_kv_gib == 3.76 and facts.num_gpu_blocks == 3852


def test_hybrid_padding_and_auto_fit() -> None:
    text = (
        "WARNING 03-13 17:30:52 [kv_cache_utils.py:1054] Add 3 padding layers, may waste at "
        "most 6.25% KV cache memory\n"
        "INFO 03-13 17:30:53 [kv_cache_utils.py:900] Auto-fit max_model_len: reduced from "
        "262144 to 98304 to fit in available GPU memory (12.50 GiB available for KV cache)"
    )
    facts = parse_vllm_log(text)
    assert facts.padding_layers == 3 and facts.max_model_len == 98_304


def test_labelled_token_count() -> None:
    line = (
        "INFO 09-02 10:00:00 [kv_cache_utils.py:2040] GPU KV cache size (max_concurrency x "
        "max_model_len): 1,553,140 tokens, Maximum concurrency for 1,000,000 tokens per "
        "request: 1.55x"
    )
    facts = parse_vllm_log(line)
    assert facts.kv_cache_tokens == 1_553_140 and facts.max_concurrency == 1.55


def test_unrelated_text_is_empty() -> None:
    facts = parse_vllm_log("hello\nINFO Uvicorn running on http://0.0.0.0:8000\n")
    assert facts.is_empty


def test_drafter_and_stages_from_the_engine_config_line() -> None:
    line = (
        "INFO 05-27 10:10:31 [core.py:94] Initializing a V1 LLM engine (v0.11.0) with config: "
        "model='deepseek-ai/DeepSeek-V3', speculative_config=SpeculativeConfig("
        "method='deepseek_mtp', model='deepseek-ai/DeepSeek-V3', num_spec_tokens=1), "
        "tensor_parallel_size=8, pipeline_parallel_size=2, kv_cache_dtype=auto"
    )
    facts = parse_vllm_log(line)
    assert facts.speculative_method == "deepseek_mtp"
    assert facts.num_speculative_tokens == 1
    assert facts.pipeline_parallel_size == 2 and facts.tensor_parallel_size == 8
    assert logged_drafter(facts) == SpeculativeSpec("mtp", 1)
    none = parse_vllm_log(line.replace("method='deepseek_mtp'", "method='medusa'"))
    assert logged_drafter(none) is None
