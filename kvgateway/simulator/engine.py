"""The engine core of a simulated vLLM V1 node: KV block pool and scheduler.

Pure and synchronous: no I/O, no clock. The driver calls :meth:`EngineCore.step` with
the current simulated time; the core schedules one batch the way vLLM V1's scheduler
does, computes how long that batch takes with :class:`CostModel`, and returns a
:class:`StepResult` describing what happened by the end of the step.

Scheduling, after ``vllm/v1/core/sched/scheduler.py`` (FCFS policy):

1. Running sequences first, oldest first, sharing a token budget of
   ``max_num_batched_tokens``: a prefilling sequence gets a chunk of its remaining
   prompt (chunked prefill), a decoding one gets one token. If a sequence needs a new
   block and none is free, the newest running sequence is preempted (blocks freed,
   progress dropped, put back at the *front* of the waiting queue to be recomputed from
   scratch), repeatedly, until the block fits or the sequence preempted itself.
2. Only if nothing was preempted this step, waiting sequences in FCFS order: the head is
   admitted if its whole sequence (prompt, plus output generated before a preemption)
   fits the free blocks past its cached prefix (vLLM's ``scheduler_reserve_full_isl``,
   on by default: ``allocate_slots(full_sequence_must_fit=True)``; a sliding-window group
   counted up to its admission cap) and fewer than ``max_num_seqs`` run; otherwise
   admission stops there (head-of-line blocking, so a request bigger than the whole pool
   stalls the queue, as in vLLM).

Blocks are then allocated chunk by chunk, as ``allocate_slots`` does: an admitted prompt
takes the blocks of each chunk as it is scheduled, so decodes growing meanwhile can still
run the pool out mid-prefill, and then the newest running sequence is preempted.

Blocks live in a :class:`~kvgateway.simulator.block_pool.BlockPool` managed per KV-cache
group by :class:`~kvgateway.simulator.kv_manager.KVCacheManager`: with prefix caching
(on by default, as in vLLM V1) an admitted sequence starts from the longest cached
prefix of its token ids and only the rest is prefilled (and costed). Full blocks enter
the cache as they are scheduled; freed blocks stay cached until the pool reuses them.
Output token ids are those of the text the node streams (``output_ids``, one id per
filler word, from the node's tokenizer) so that a client sending the answer back in its
next turn presents the same ids; without them they are synthetic, distinct per
sequence. Either way a preempted sequence finds its own blocks again if not evicted.

Block 0 is reserved (vLLM's null block): ``num_gpu_blocks - 1`` blocks are usable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum

from kvgateway.capacity.layout import kv_tokens_from_blocks
from kvgateway.simulator.block_pool import BlockHash, BlockPool, KVEvent, none_hash
from kvgateway.simulator.cost import CostModel
from kvgateway.simulator.kv_manager import KVCacheManager


class SeqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_gpu_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    cost: CostModel = field(default_factory=CostModel)
    enable_prefix_caching: bool = True
    # One entry per KV-cache group: None for full attention, else the sliding window.
    kv_windows: tuple[int | None, ...] = (None,)
    enable_kv_events: bool = False
    hash_seed: str | None = None

    @property
    def usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def kv_tokens(self) -> int:
        """Tokens of short requests the pool holds: every group keeps a copy."""
        return kv_tokens_from_blocks(self.num_gpu_blocks, self.block_size, len(self.kv_windows))


@dataclass(slots=True, eq=False)
class Sequence:
    """One sequence in the engine (a request with ``n`` > 1 is ``n`` of these)."""

    seq_id: int
    prompt_tokens: int
    # Output tokens after which the sequence ends, and the reason it then reports.
    target_tokens: int
    target_reason: str
    arrival: float
    state: SeqState = SeqState.WAITING
    num_computed: int = 0
    output_tokens: int = 0
    num_blocks: int = 0
    # Prompt and output token ids, and the hashes of the full blocks among them.
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    # Preemptions the node's counter shows: vLLM records one on the request and counts it
    # when the request next produces output (after its recompute).
    preemptions_counted: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one step did; every token in it becomes visible at ``end``."""

    start: float
    end: float
    num_scheduled: int
    prefill_tokens: int
    decode_tokens: int
    # Sequences that gained one output token at `end` (in scheduling order).
    sampled: tuple[Sequence, ...]
    finished: tuple[Sequence, ...]
    preempted: tuple[Sequence, ...]
    # Prompt tokens of sequences whose first token came out in this step.
    prompt_tokens_done: int
    ttfts: tuple[float, ...]
    inter_token_latencies: tuple[float, ...]
    kv_events: tuple[KVEvent, ...] = ()


# Synthetic output ids: distinct per sequence, stable across a preemption.
_OUTPUT_ID_BASE = 50_000
_OUTPUT_ID_SPAN = 100_000


def output_token_id(seq_id: int, index: int) -> int:
    return _OUTPUT_ID_BASE + (seq_id * 7_919 + index * 104_729) % _OUTPUT_ID_SPAN


class EngineCore:
    """Scheduler state; mutate only through :meth:`add`, :meth:`abort`, :meth:`step`."""

    def __init__(self, config: EngineConfig, output_ids: Seq[int] = ()) -> None:
        if config.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (block 0 is reserved)")
        self.config = config
        self.clock = 0.0
        self._output_ids = tuple(output_ids)
        pool = BlockPool(
            config.num_gpu_blocks,
            enable_caching=config.enable_prefix_caching,
            enable_events=config.enable_kv_events,
        )
        self.kv = KVCacheManager(
            pool,
            block_size=config.block_size,
            windows=config.kv_windows,
            root_hash=none_hash(config.hash_seed),
        )
        self.running: list[Sequence] = []
        self.waiting: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_steps = 0
        self._next_id = 0

    # -- queries -------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks no request holds, cached ones (evictable) included, as vLLM counts."""
        return self.kv.pool.num_free

    @property
    def used_blocks(self) -> int:
        return self.config.usable_blocks - self.free_blocks

    @property
    def usage(self) -> float:
        """vLLM's kv_cache_usage_perc: used / usable blocks, 0..1."""
        return self.used_blocks / self.config.usable_blocks

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- mutations -----------------------------------------------------------------

    def add(
        self,
        *,
        target_tokens: int,
        target_reason: str,
        arrival: float,
        prompt_token_ids: Seq[int] | None = None,
        prompt_tokens: int | None = None,
    ) -> Sequence:
        """Queue a sequence at the back of the waiting queue.

        Give the prompt's token ids; a bare ``prompt_tokens`` count stands for a prompt
        of ids no other sequence shares (it never hits the prefix cache).
        """
        if prompt_token_ids is not None:
            ids = list(prompt_token_ids)
        else:
            ids = [-(self._next_id + 1)] * (prompt_tokens or 0)
        prompt_tokens = len(ids)
        if prompt_tokens < 1 or target_tokens < 1:
            raise ValueError("a sequence needs at least one prompt and one output token")
        if prompt_tokens + target_tokens - 1 > self.config.max_model_len:
            raise ValueError("sequence would exceed max_model_len")
        seq = Sequence(
            seq_id=self._next_id,
            prompt_tokens=prompt_tokens,
            target_tokens=target_tokens,
            target_reason=target_reason,
            arrival=arrival,
            token_ids=ids,
        )
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def abort(self, seq: Sequence, now: float) -> bool:
        """Drop a sequence wherever it is and free its blocks; False if already done."""
        if seq.state is SeqState.FINISHED:
            return False
        if seq.state is SeqState.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.state = SeqState.FINISHED
        seq.finish_reason = "abort"
        seq.finished_at = max(now, seq.arrival)
        return True

    def step(self, not_before: float) -> StepResult | None:
        """Schedule and run one batch starting at ``max(clock, not_before)``.

        Returns None (and leaves the clock alone) when nothing can be scheduled: the
        engine is idle or stalled, and only a new arrival or an abort can change that.
        """
        start = max(self.clock, not_before)
        if not self.running and self.waiting:
            # Idle engine: it starts when the first queued request arrived, not before.
            start = max(start, self.waiting[0].arrival)
        cfg = self.config
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            preempted_self = False
            while not kv.allocate(seq.seq_id, seq, seq.num_computed + num_new, seq.num_computed):
                victim = running.pop()  # the newest running sequence
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                break
            kv.cache_blocks(seq.seq_id, seq, seq.num_computed + num_new)
            self._count_blocks(seq)
            scheduled.append((seq, num_new))
            budget -= num_new
            i += 1

        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
                seq = waiting[0]
                if seq.arrival > start:
                    break  # not arrived yet in simulated time
                computed, num_hit = kv.get_computed_blocks(seq)
                num_new = min(seq.num_tokens - num_hit, budget)
                # Admitted only if its whole sequence fits the free blocks (vLLM's
                # scheduler_reserve_full_isl, on by default), then given blocks for this
                # step's chunk only: the rest come step by step, so decodes growing
                # meanwhile may still preempt it mid-prefill.
                whole = min(seq.num_tokens, cfg.max_model_len)
                if not kv.can_admit(
                    seq.seq_id, whole, num_hit, computed, cfg.max_num_batched_tokens
                ) or not kv.allocate(seq.seq_id, seq, num_hit + num_new, num_hit, computed):
                    break  # FCFS: nobody overtakes the head
                kv.record_lookup(seq, num_hit)
                waiting.popleft()
                seq.num_computed = num_hit
                seq.state = SeqState.RUNNING
                if seq.scheduled_at is None:
                    seq.scheduled_at = start
                kv.cache_blocks(seq.seq_id, seq, num_hit + num_new)
                self._count_blocks(seq)
                running.append(seq)
                scheduled.append((seq, num_new))
                budget -= num_new

        if not scheduled:
            if preempted:
                # Everything running was preempted (a sequence bigger than the pool);
                # time still passes so the loop cannot spin without progress.
                self.num_steps += 1
                events = tuple(self.kv.pool.take_events())
                return StepResult(
                    start, start, 0, 0, 0, (), (), tuple(preempted), 0, (), (), events
                )
            return None

        prefill_tokens = decode_tokens = context = 0
        for seq, num_new in scheduled:
            if num_new == 1 and seq.num_computed == seq.num_tokens - 1 and seq.output_tokens:
                decode_tokens += 1
            else:
                prefill_tokens += num_new
            context += seq.num_computed + num_new
        end = start + cfg.cost.step_duration(prefill_tokens + decode_tokens, context)

        sampled: list[Sequence] = []
        finished: list[Sequence] = []
        ttfts: list[float] = []
        itls: list[float] = []
        prompt_done = 0
        for seq, num_new in scheduled:
            seq.num_computed += num_new
            if seq.num_computed < seq.num_tokens:
                continue  # prefill chunk: no token sampled yet
            ids = self._output_ids
            seq.token_ids.append(
                ids[seq.output_tokens % len(ids)]
                if ids
                else output_token_id(seq.seq_id, seq.output_tokens)
            )
            seq.output_tokens += 1
            if seq.first_token_at is None:
                seq.first_token_at = end
                ttfts.append(end - seq.arrival)
                prompt_done += seq.prompt_tokens
            elif seq.last_token_at is not None:
                itls.append(end - seq.last_token_at)
            seq.last_token_at = end
            sampled.append(seq)
            if seq.output_tokens >= seq.target_tokens:
                seq.state = SeqState.FINISHED
                seq.finish_reason = seq.target_reason
                seq.finished_at = end
                self._release(seq)
                finished.append(seq)
        if finished:
            self.running = [s for s in running if s.state is SeqState.RUNNING]
        self.clock = end
        self.num_steps += 1
        return StepResult(
            start=start,
            end=end,
            num_scheduled=len(scheduled),
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            sampled=tuple(sampled),
            finished=tuple(finished),
            preempted=tuple(preempted),
            prompt_tokens_done=prompt_done,
            ttfts=tuple(ttfts),
            inter_token_latencies=tuple(itls),
            kv_events=tuple(self.kv.pool.take_events()),
        )

    # -- internals -----------------------------------------------------------------

    def _release(self, seq: Sequence) -> None:
        self.kv.free(seq.seq_id)
        seq.num_blocks = 0

    def _count_blocks(self, seq: Sequence) -> None:
        seq.num_blocks = self.kv.num_held(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed = 0  # recomputed from scratch (prompt + output so far)
        seq.state = SeqState.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
