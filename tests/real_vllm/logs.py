"""What a vLLM node said of itself at start-up, read from its log."""

from __future__ import annotations

import re


def logged_kv_tokens(log: str) -> int:
    """``<device> KV cache size: N tokens`` (vLLM >= 0.32 counts every block it has)."""
    m = re.search(r"KV cache size: ([\d,]+) tokens", log)
    assert m, "no KV cache size line in the node's log"
    return int(m.group(1).replace(",", ""))


def logged_blocks(log: str) -> int:
    m = re.search(r"with num_gpu_blocks_override=(\d+)", log)
    assert m, "no block override line in the node's log"
    return int(m.group(1))


def logged_group_block_sizes(log: str) -> tuple[int, ...] | None:
    """``kv cache group sizes (128, 128)``: one entry per KV-cache group (hybrid only)."""
    m = re.search(r"kv cache group sizes \(([\d, ]+)\)", log)
    if not m:
        return None
    return tuple(int(x) for x in m.group(1).split(",") if x.strip())


def logged_max_model_len(log: str) -> int:
    m = re.search(r"max_seq_len=(\d+)", log)
    assert m, "no engine config line in the node's log"
    return int(m.group(1))
