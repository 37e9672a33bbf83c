from pathlib import Path

from kvgateway.upstream.vllm_metrics import parse_node_metrics

SAMPLE = Path(__file__).parents[2] / "data" / "vllm_metrics_sample.txt"


def test_reads_the_reference_page():
    m = parse_node_metrics(SAMPLE.read_text())
    assert (m.kv_usage, m.running, m.waiting, m.preemptions) == (0.6843, 12.0, 3.0, 7.0)
    assert (m.num_gpu_blocks, m.block_size) == (25217, 16)


def test_old_gauge_name_and_data_parallel_engines():
    text = """# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.4
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.7
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 3.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="900"} 1.0
"""
    m = parse_node_metrics(text)
    assert m.kv_usage == 0.7 and m.waiting == 5.0 and m.num_gpu_blocks == 900


def test_garbage_gives_nothing_rather_than_crashing():
    m = parse_node_metrics("hello\nworld 1 2 3\n")
    assert m.kv_usage is None and m.num_gpu_blocks is None


def test_implausible_values_are_not_readings():
    """A node's page is not trusted blindly: a block_size of "1000000" is no reading (it
    would set the whole model's reservation block size, every request rounded up to 10^6
    tokens), nor is a negative block count (a negative pool), nor a NaN or infinite gauge."""
    text = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} NaN
vllm:kv_cache_usage_perc{engine="1"} +Inf
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} -3
vllm:num_requests_running{engine="1"} 2
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="1000000",engine="0",num_gpu_blocks="-5"} 1.0
"""
    m = parse_node_metrics(text)
    assert (m.kv_usage, m.running, m.block_size, m.num_gpu_blocks) == (None, 2.0, None, None)
    for label in ('block_size="-16"', 'block_size="1_6"', 'block_size="16.0"', 'block_size="0"'):
        page = f"# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{{label}}} 1.0\n"
        assert parse_node_metrics(page).block_size is None, label
    page = 'vllm:cache_config_info{block_size="32",num_gpu_blocks="100000000000"} 1.0\n'
    assert (parse_node_metrics(page).block_size, parse_node_metrics(page).num_gpu_blocks) == (
        32,
        None,
    )
    assert parse_node_metrics("vllm:kv_cache_usage_perc 1.7\n").kv_usage == 1.0
