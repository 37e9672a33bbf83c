"""Block keys and the prefix index, without sockets."""

from __future__ import annotations

from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgateway.core.cache_view import AllCleared, BlocksRemoved, BlocksStored
from kvgateway.core.prefix_index import PrefixIndex
from kvgateway.core.prefix_keys import ROOT_KEY, block_keys


def test_block_key_hashes_the_parent_key_and_packed_tokens() -> None:
    first = hash(ROOT_KEY.to_bytes(8, "little", signed=True) + array("q", [1, 2, 3, 4]).tobytes())
    assert block_keys([1, 2, 3, 4, 5], 4) == [first]  # the partial block has no key
    second = hash(first.to_bytes(8, "little", signed=True) + array("q", [5, 6, 7, 8]).tobytes())
    assert block_keys(range(1, 9), 4)[1] == second
    # Extra keys (LoRA, salt) go into the block they are given for, and so down the chain.
    salted = block_keys(range(1, 9), 4, extra_keys=[("salt",), None])
    assert salted[0] != first and salted[1] != second


def test_keys_chain_so_the_same_block_after_another_prefix_differs() -> None:
    a = block_keys([1, 2, 3, 4, 9, 9, 9, 9], 4)
    b = block_keys([5, 6, 7, 8, 9, 9, 9, 9], 4)
    assert a[1] != b[1]
    assert block_keys([], 4) == [] and block_keys([1, 2, 3], 4) == []
    with pytest.raises(ValueError, match="block_size"):
        block_keys([1], 0)


@given(tokens=st.lists(st.integers(-(2**40), 2**40), max_size=80), split=st.integers(0, 10))
def test_continuing_from_a_parent_equals_keying_the_whole(tokens: list[int], split: int) -> None:
    whole = block_keys(tokens, 4)
    head = block_keys(tokens[: split * 4], 4)
    tail = block_keys(tokens[len(head) * 4 :], 4, parent=head[-1] if head else None)
    assert head + tail == whole


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlocksStored:
    return BlocksStored(tuple(hashes), parent, tuple(tokens), 4, **kw)  # type: ignore[arg-type]


def test_precise_view_rebuilds_keys_from_event_tokens_through_parents() -> None:
    index = PrefixIndex()
    prompt = list(range(12))
    keys = block_keys(prompt, 4)
    index.apply_events("n1", [stored([101, 102], None, prompt[:8])], now=0.0)
    index.apply_events("n1", [stored([103], 102, prompt[8:12])], now=0.0)
    assert index.matched_blocks("n1", keys, now=0.0) == 3
    assert index.precise_keys("n1") == set(keys)
    # The middle block evicted: only the first block is a usable prefix.
    index.apply_events("n1", [BlocksRemoved((102,))], now=0.0)
    assert index.matched_blocks("n1", keys, now=0.0) == 1
    index.apply_events("n1", [AllCleared()], now=0.0)
    assert index.matched_blocks("n1", keys, now=0.0) == 0


def test_duplicates_are_counted_orphans_skipped_and_other_media_ignored() -> None:
    index = PrefixIndex()
    keys = block_keys([1, 2, 3, 4], 4)
    index.apply_events("n", [stored([7], None, [1, 2, 3, 4])] * 2, now=0.0)
    index.apply_events("n", [BlocksRemoved((7,))], now=0.0)
    assert index.matched_blocks("n", keys, now=0.0) == 1  # one copy is still cached
    index.apply_events("n", [stored([8], 999, [5, 6, 7, 8])], now=0.0)
    assert index.statistics("n", now=0.0).orphans == 1
    index.apply_events("n", [stored([9], None, [9, 9, 9, 9], medium="CPU")], now=0.0)
    index.apply_events("n", [stored([10], None, [8, 8, 8, 8], group_idx=1)], now=0.0)
    assert index.matched_blocks("n", block_keys([9, 9, 9, 9], 4), now=0.0) == 0
    assert index.matched_blocks("n", block_keys([8, 8, 8, 8], 4), now=0.0) == 0


def test_a_hybrid_node_is_followed_by_its_full_attention_group_whatever_its_number() -> None:
    # gpt-oss / Gemma 3: layer 0 is sliding-window, so vLLM numbers that group 0 and the
    # full-attention group 1. The sliding-window group frees the head of a long prompt
    # as it goes (BlockRemoved in group 0): following group 0 forgot cached prefixes.
    index = PrefixIndex()
    prompt = list(range(12))
    keys = block_keys(prompt, 4)
    sw = {"group_idx": 0, "kind": "sliding_window", "window": 4}
    full = {"group_idx": 1, "kind": "full_attention"}
    index.apply_events(
        "n",
        [stored([1, 2, 3], None, prompt, **sw), stored([1, 2, 3], None, prompt, **full)],
        now=0.0,
    )
    assert index.matched_blocks("n", keys, now=0.0) == 3
    index.apply_events("n", [BlocksRemoved((1, 2), group_idx=0)], now=0.0)  # out of window
    assert index.matched_blocks("n", keys, now=0.0) == 3
    index.apply_events("n", [BlocksRemoved((2,), group_idx=1)], now=0.0)  # evicted for good
    # One block left in full attention, but the window's block before it is gone too:
    # vLLM's hybrid lookup hits nothing.
    assert index.matched_blocks("n", keys, now=0.0) == 0
    # Events without kinds (older vLLM): group 0 or unnumbered.
    old = PrefixIndex()
    old.apply_events("n", [stored([1], None, prompt[:4], group_idx=0)], now=0.0)
    old.apply_events("n", [stored([2], None, prompt[:4], group_idx=None)], now=0.0)
    old.apply_events("n", [stored([3], None, [7, 7, 7, 7], group_idx=1)], now=0.0)
    assert old.matched_blocks("n", keys, now=0.0) == 1
    assert old.matched_blocks("n", block_keys([7, 7, 7, 7], 4), now=0.0) == 0
    # Mamba and other kinds hold no prefix a hit can use.
    mamba = PrefixIndex()
    mamba.apply_events("n", [stored([1], None, prompt[:4], group_idx=0, kind="mamba")], now=0.0)
    assert mamba.matched_blocks("n", keys, now=0.0) == 0


def test_approximate_view_expires_and_is_bounded_by_capacity() -> None:
    index = PrefixIndex(ttl_s=10.0)
    keys = block_keys(list(range(16)), 4)
    index.record_routed("n", keys, now=0.0)
    assert index.matched_blocks("n", keys, now=5.0) == 4
    assert index.matched_blocks("n", keys, now=10.5) == 0  # forgotten after the TTL
    index.set_capacity("n", 3)
    index.record_routed("n", keys, now=20.0)
    # Only 3 blocks fit; the least recently routed (the first) goes, so no prefix is left.
    assert index.statistics("n", now=20.0).approximate_blocks == 3
    assert index.matched_blocks("n", keys, now=20.0) == 0
    index.record_routed("n", keys[:2], now=21.0)
    assert index.matched_blocks("n", keys, now=21.0) == 2
    assert index.matched_blocks("other", keys, now=21.0) == 0


def test_after_a_resync_the_approximate_view_answers_for_the_grace_period() -> None:
    index = PrefixIndex(resync_grace_s=5.0)
    keys = block_keys(list(range(8)), 4)
    index.record_routed("n", keys, now=0.0)
    index.attach_events("n")
    assert index.is_precise("n", now=0.0) and index.matched_blocks("n", keys, now=0.0) == 0
    index.clear("n", now=1.0)
    assert not index.is_precise("n", now=2.0)
    assert index.matched_blocks("n", keys, now=2.0) == 2
    assert index.is_precise("n", now=6.5) and index.matched_blocks("n", keys, now=6.5) == 0
    stats = index.statistics("n", now=6.5)
    assert stats.resyncs == 1 and stats.last_resync_at == 1.0
    index.remove_backend("n")
    assert index.matched_blocks("n", keys, now=7.0) == 0


def test_the_event_block_size_is_remembered_for_keying_prompts() -> None:
    index = PrefixIndex()
    assert index.event_block_size("n") is None
    index.apply_events("n", [BlocksStored((1,), None, (0,) * 16, 16)], now=0.0)
    assert index.event_block_size("n") == 16


def test_expected_blocks_decay_with_age_unless_reported_by_events() -> None:
    index = PrefixIndex(ttl_s=100.0, half_life_s=10.0)
    keys = block_keys(list(range(8)), 4)
    index.record_routed("a", keys, now=0.0)
    assert index.expected_blocks("a", keys, now=0.0) == 2.0
    assert index.expected_blocks("a", keys, now=10.0) == pytest.approx(1.0)
    assert index.expected_blocks("a", keys, now=101.0) == 0.0
    index.apply_events("b", [BlocksStored((1, 2), None, tuple(range(8)), 4)], now=0.0)
    assert index.expected_blocks("b", keys, now=1_000.0) == 2.0
    assert index.expected_blocks("c", keys, now=0.0) == 0.0


@pytest.mark.parametrize(("kind", "hit"), [("mamba", 4), ("chunked_local_attention", 4)])
def test_mamba_and_other_groups_cut_a_hybrid_hit_back(kind: str, hit: int) -> None:
    # Jamba / Nemotron-H / Qwen3-Next (Mamba), Llama 4 (chunked local attention): vLLM's
    # hybrid lookup needs those groups too; their events ignored, the view would
    # predict the whole full-attention run (8 blocks) where the node hits 4.
    index = PrefixIndex()
    prompt = list(range(40))
    keys = block_keys(prompt, 4)
    full = {"group_idx": 0, "kind": "full_attention"}
    other = {"group_idx": 1, "kind": kind}
    hashes = list(range(1, 11))
    index.apply_events(
        "n",
        [stored(hashes, None, prompt, **full), stored(hashes, None, prompt, **other)],
        now=0.0,
    )
    index.apply_events("n", [BlocksRemoved(tuple(hashes[4:]), group_idx=1)], now=0.0)
    assert index.matched_blocks("n", keys[:8], now=0.0) == hit


def test_event_holders_name_the_backends_whose_events_hold_a_block() -> None:
    """Routing nominates a prompt's holders from this map: a block some node reported,
    whatever put it there, names that node until the node reports it gone."""
    index = PrefixIndex(resync_grace_s=0.0)
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    ka, kb = block_keys(a + b, 4)
    index.apply_events("n1", [stored([1, 2], None, a + b)], now=0.0)
    index.apply_events("n2", [stored([7], None, a)], now=0.0)
    assert index.event_holders(ka) == ("n1", "n2") and index.event_holders(kb) == ("n1",)
    # Two copies on n1: the key stays held until both are gone.
    index.apply_events("n1", [stored([3], None, a), BlocksRemoved((1,))], now=0.0)
    assert index.event_holders(ka) == ("n1", "n2")
    index.apply_events("n1", [BlocksRemoved((3,))], now=0.0)
    assert index.event_holders(ka) == ("n2",)
    # A sliding-window group's blocks nominate nobody (the full-attention run decides).
    index.apply_events("n3", [stored([9], None, b, group_idx=1, kind="sliding_window")], now=0.0)
    assert index.event_holders(block_keys(b, 4)[0]) == ()
    # Cleared by the node, resynced, detached or removed: gone from the map.
    index.apply_events("n1", [AllCleared()], now=0.0)
    assert index.event_holders(kb) == ()
    index.apply_events("n1", [stored([1], None, a)], now=0.0)
    index.clear("n1", now=1.0)
    index.apply_events("n4", [stored([1], None, a)], now=0.0)
    index.detach_events("n2")
    index.remove_backend("n4")
    assert index.event_holders(ka) == ()
    index.apply_events("n1", [stored([1], None, a)], now=2.0)
    assert index.event_holders(ka) == ("n1",)


@settings(max_examples=50, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["store", "remove", "clear", "detach"]), st.integers(0, 2)),
        max_size=40,
    )
)
def test_event_holders_always_equal_a_scan_of_every_view(ops: list[tuple[str, int]]) -> None:
    index = PrefixIndex()
    prompts = [[p] * 8 for p in range(3)]
    keys = {k for p in prompts for k in block_keys(p, 4)}
    for n, (op, p) in enumerate(ops):
        backend = f"n{n % 3}"
        if op == "store":
            index.apply_events(backend, [stored([p * 2, p * 2 + 1], None, prompts[p])], now=0.0)
        elif op == "remove":
            index.apply_events(backend, [BlocksRemoved((p * 2 + 1,))], now=0.0)
        elif op == "clear":
            index.clear(backend, now=0.0)
        else:
            index.detach_events(backend)
        for key in keys:
            scan = {b for b in ("n0", "n1", "n2") if key in index.precise_keys(b)}
            assert set(index.event_holders(key)) == scan


def test_a_backend_sent_a_prompt_its_events_do_not_show_awaits_a_batch() -> None:
    """The subscriber warns when such a wait lasts: a publisher nobody hears."""
    index = PrefixIndex()
    keys = block_keys(list(range(12)), 4)
    index.record_routed("plain", keys, now=1.0)  # no events: nothing is awaited
    assert index.events_awaited_since("plain") is None
    index.attach_events("n")
    index.record_routed("n", [], now=1.0)  # no full block: the node stores nothing
    assert index.events_awaited_since("n") is None
    index.record_routed("n", keys, now=2.0)
    index.record_routed("n", keys, now=3.0)
    assert index.events_awaited_since("n") == 2.0  # since the first unanswered prompt
    index.apply_events("n", [stored([1, 2, 3], None, list(range(12)))], now=4.0)
    assert index.events_awaited_since("n") is None
    index.record_routed("n", keys, now=5.0)  # held already: no new block to report
    assert index.events_awaited_since("n") is None
    index.record_routed("n", block_keys(list(range(100, 108)), 4), now=6.0)
    assert index.events_awaited_since("n") == 6.0
    index.detach_events("n")
    assert index.events_awaited_since("n") is None
