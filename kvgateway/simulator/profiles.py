"""Hardware profiles: simulated nodes sized from real model and GPU numbers.

All three serve Llama-3.1-8B-Instruct in bf16. Its KV cache per token:
32 layers x 2 (K and V) x 8 KV heads x 128 head_dim x 2 bytes = 131,072 B (128 KiB),
so 1 GiB of KV holds 8,192 tokens. Weights: 8.03e9 params x 2 B = 16.06 GB (14.96 GiB).

vLLM sizes the pool as ``gpu_memory * gpu_memory_utilization - weights - activation peak
(profiling run at max_num_batched_tokens) - CUDA graphs - non-torch memory`` and cuts it
into blocks of 16 tokens; block 0 is reserved. The activation/graph/non-torch figure below
(~3.4 GiB at 2048 batched tokens, ~8 GiB at 8192) is an estimate, not a measurement.

Timing follows the roofline of ``engine.CostModel`` from public datasheet figures:
decode reads all weights once per step (bytes / HBM bandwidth), prefill is compute-bound
at ~2 x 8.03e9 FLOPs per token at 40-60% of dense bf16 peak, attention reads 128 KiB of
KV per context token, and offloaded weights cross PCIe every step. These are estimates,
good for the shape of a fleet's behaviour (who saturates first, how latency grows), not
for absolute numbers.

Any field can be overridden per node (``simulate:`` in the config, or CLI flags).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from kvgateway.simulator.settings import NodeSettings, SettingsError

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
KV_BYTES_PER_TOKEN = 131_072  # Llama-3.1-8B bf16, see module docstring

# 24 GB-class card (RTX 4090 / 3090 class: 24 GiB, ~1.0 TB/s, ~165 TFLOP/s bf16).
#   24 GiB x 0.92 = 22.08 GiB; - 14.96 GiB weights - ~3.37 GiB activations/graphs/other
#   = 3.75 GiB of KV = 30,720 tokens = 1,920 blocks of 16 (30,704 usable: block 0 reserved).
#   Decode: 16.06 GB / 1.0 TB/s = 16 ms per step, + 2 ms overhead;
#   KV read 131,072 B / 1.0e12 B/s = 0.131 us per context token (a full pool adds ~4 ms).
#   Prefill: 16.06 GFLOP per token at ~80 TFLOP/s effective = 5k tokens/s = 200 us/token.
GPU24_8B = NodeSettings(
    profile="gpu24-8b",
    model=LLAMA_8B,
    max_model_len=8192,
    num_gpu_blocks=1920,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=2048,
    gpu_memory_utilization=0.92,
    step_overhead_s=0.002,
    weight_read_s=0.016,
    offload_s=0.0,
    prefill_s_per_token=200e-6,
    kv_read_s_per_token=KV_BYTES_PER_TOKEN / 1.0e12,
)

# 80 GB card (H100 SXM: 79.2 GiB usable, 3.35 TB/s, ~990 TFLOP/s bf16 dense).
#   79.2 GiB x 0.92 = 72.9 GiB; - 14.96 GiB weights - ~7.9 GiB activations at 8192 batched
#   tokens, CUDA graphs and other = 50 GiB of KV = 409,600 tokens = 25,600 blocks.
#   (The reference /metrics sample, Qwen3-8B on one H100, shows 25,217 blocks.)
#   Decode: 16.06 GB / 3.35 TB/s = 4.8 ms per step, + 1.5 ms overhead;
#   KV read 131,072 B / 3.35e12 B/s = 0.039 us per context token.
#   Prefill: ~30k tokens/s = 33 us/token.
GPU80_8B = NodeSettings(
    profile="gpu80-8b",
    model=LLAMA_8B,
    max_model_len=32768,
    num_gpu_blocks=25_600,
    block_size=16,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    gpu_memory_utilization=0.92,
    step_overhead_s=0.0015,
    weight_read_s=0.0048,
    offload_s=0.0,
    prefill_s_per_token=33e-6,
    kv_read_s_per_token=KV_BYTES_PER_TOKEN / 3.35e12,
)

# 32 GB card (RTX 5090 class: 32 GiB, 1.79 TB/s, ~210 TFLOP/s bf16) with --cpu-offload-gb 8.
#   32 GiB x 0.92 = 29.44 GiB; GPU-resident weights 14.96 - 8 = 6.96 GiB; - ~3.4 GiB
#   activations/graphs/other = 19 GiB of KV = 155,648 tokens = 9,728 blocks, enough for
#   one 131,072-token request (vLLM's startup check).
#   Every forward pass streams the 8 GiB (8.59 GB) of offloaded weights over PCIe at
#   ~34 GB/s effective: +253 ms per step, prefill or decode alike (VLLM.md: each
#   offloaded GiB adds ~20-40 ms). Resident weights: 7.47 GB / 1.79 TB/s = 4.2 ms.
#   KV read 131,072 B / 1.79e12 B/s = 0.073 us per context token.
#   Prefill: ~7k tokens/s = 143 us/token (plus the PCIe stream per 2048-token chunk).
OFFLOAD_8B = NodeSettings(
    profile="offload-8b",
    model=LLAMA_8B,
    max_model_len=131_072,
    num_gpu_blocks=9_728,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=2048,
    gpu_memory_utilization=0.92,
    step_overhead_s=0.002,
    weight_read_s=0.0042,
    offload_s=0.253,
    prefill_s_per_token=143e-6,
    kv_read_s_per_token=KV_BYTES_PER_TOKEN / 1.79e12,
)

# A deliberately tiny node for tests: 64 usable blocks of 16 tokens (1,024 tokens).
TINY = NodeSettings(
    profile="tiny",
    model="sim-tiny",
    max_model_len=512,
    num_gpu_blocks=65,
    block_size=16,
    max_num_seqs=8,
    max_num_batched_tokens=256,
    step_overhead_s=0.002,
    weight_read_s=0.008,
    prefill_s_per_token=20e-6,
    kv_read_s_per_token=1e-7,
    output_mean=32.0,
    output_max=256,
)

# Hybrid attention: gpt-oss-20b (24 layers alternating sliding-window 128 / full, 8 KV
# heads x 64, bf16 KV = 2,048 B per token per layer; mxfp4 weights 12.86 GiB) on a 24 GB
# card. vLLM groups the layers into one full-attention and one sliding-window group of 12,
# and every block of the pool serves one group: 7.73 GiB of KV // (16 x 2,048 B) // 12
# = 21,110 blocks, holding (21,110 - 1) // 2 x 16 = 168,864 tokens of short requests
# (`gateway plan --preset gpt-oss-20b --gpu-memory-gib 24`). The sliding-window group
# frees blocks that fall out of its window, so long decodes cost about one block per
# 16 tokens. Decode reads ~13.8 GB of weights at ~1.0 TB/s; prefill ~3.6e9 active params
# at ~80 TFLOP/s effective is ~90 us per token. Estimates, as above.
GPU24_GPTOSS_20B = NodeSettings(
    profile="gpu24-gptoss-20b",
    model="openai/gpt-oss-20b",
    max_model_len=32_768,
    num_gpu_blocks=21_110,
    block_size=16,
    max_num_seqs=16,
    max_num_batched_tokens=2048,
    gpu_memory_utilization=0.92,
    step_overhead_s=0.002,
    weight_read_s=0.014,
    prefill_s_per_token=90e-6,
    kv_read_s_per_token=49_152 / 1.0e12,
    sliding_window=128,
    num_sliding_window_groups=1,
    sliding_window_first=True,  # layer 0 is a sliding-window layer
)

PROFILES: Mapping[str, NodeSettings] = MappingProxyType(
    {p.profile: p for p in (GPU24_8B, GPU80_8B, OFFLOAD_8B, TINY, GPU24_GPTOSS_20B)}
)


def get_profile(name: str, path: str = "profile") -> NodeSettings:
    """The named profile; the error names ``path`` and lists the known profiles."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise SettingsError(f'{path}: unknown profile "{name}"; known: {known}') from None
