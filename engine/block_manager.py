"""Paged KV-cache blocks with prefix caching (vLLM v1 / nano-vllm style).

A block is either referenced (ref_count > 0) or free. Free blocks keep their hash and sit in an
LRU queue, so a later request with the same prefix (the next chat turn) can still hit them until
they are reused. Only FULL blocks whose KV is entirely computed are hashed; generated tokens count,
so a follow-up that repeats prompt + output hits them too.

Where the cached blocks stop matching (a regenerated reply's last, partly filled block; an edited
message), the prompt also reuses the matching start of a cached block that continues the same chain:
those KV slots are copied into a fresh block (copy-on-write, `copy_kv`), so a prompt is computed only
from the first token that differs (a regenerated one: only its final token, for the logits).

Chat sessions may pin the blocks of their last turn (a session reference), the partly filled last
one included: the session's next turn, whose prompt extends those tokens, takes that block over and
computes only its new tokens. Pinned blocks are evicted only under memory pressure, least recently
used session first. The pins are a cache: a session's state is its client-side record
(engine/serve/session.py), and a session whose pins went still works, computing what is not cached.

Sliding-window models (every attention layer windowed: Mistral-style, Phi-3-mini) never read keys more
than `window` positions behind the next query, so a sequence gives back its blocks wholly behind that
point as it goes (`drop_outside_window`; its table keeps DROPPED in their place): a 32k-token chat holds
about window / block_size blocks, not 32k / block_size. The dropped blocks keep their hashes (another
prompt with the same start may still hit them), and a session pins its whole last turn, as hybrid models
do, since the next turn cannot be matched from the start through blocks already given back.

Models that mix windowed and full-attention layers (Gemma 3: 5 windowed to 1 global; gpt-oss) keep two
KV-cache groups (vLLM's term): the full-attention layers' blocks as above, and the windowed layers' blocks in
a pool of their own (`window_group`), with a second block table per sequence (`seq.window_block_table`) that
drops its blocks behind the window as the all-windowed mode does. Both tables cover the same positions, so one
chain of block hashes names both groups' blocks: a prefix hit needs the full group's blocks from the start and
the windowed group's blocks for the window behind the hit point only (the hit is cut back until both have
them). Sessions pin both whole tables, as in windowed mode; admission, growth and preemption take blocks from
both pools or from neither, and evicting a session gives back its blocks in both.

Hybrid models (Gated DeltaNet layers) carry a recurrent state per sequence, so a block-hash hit
alone cannot resume a sequence: the state at the hit point is needed too. In hybrid mode
(num_state_slots > 0) hash hits are off; instead a session pins its WHOLE last turn (every block,
the partial last one included, and its state slot), and the next turn adopts them when its prompt
extends the pinned tokens, resuming exactly where the last turn stopped.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from nanochat.engine.sequence import Sequence


def chain_hash(prev_hash: int, token_ids: list[int] | tuple[int, ...]) -> int:
    # Python's int/tuple hash is deterministic within a process, which is all a cache needs;
    # collisions are caught by comparing token ids on every hit.
    return hash((prev_hash, tuple(token_ids)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    parent: int = -1                # the hash of the block before it in its chain (when hashed)


@dataclass
class CacheCounters:
    hit_tokens: int = 0
    queried_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class BlockStats:
    total: int
    used: int          # referenced by a running sequence or a session
    cached: int        # free but still holding a hash (hittable)
    free: int          # free (cached ones included)
    hit_tokens: int
    queried_tokens: int
    pinned_sessions: int = 0
    hit_rate: float = 0.0


class NoFreeBlocksError(RuntimeError):
    pass


DROPPED = -1   # a block-table entry whose block went back (behind every window); never read


@dataclass
class SessionPin:
    blocks: list[int]
    tokens: tuple[int, ...] = ()    # hybrid mode: the computed tokens the blocks and state hold
    state_slot: int | None = None   # hybrid mode: the recurrent state at len(tokens)
    tail: tuple[int, tuple[int, ...]] | None = None   # the partly filled last block and its computed tokens
    table: list[int] | None = None  # windowed mode: the whole block table, DROPPED entries included
    hashes: list[int] = field(default_factory=list)   # windowed mode: the table's block hashes
    window_table: list[int] | None = None   # two groups: the windowed group's whole table


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_state_slots: int = 0, window: int = 0, window_group: tuple[int, int] | None = None):
        """window: every attention layer's window (0: some layer reads every key). window_group: (W, blocks) for
        a model whose windowed layers (the widest window W) sit beside full-attention ones: their own pool of
        `blocks` blocks (this manager's other blocks are the full-attention layers')."""
        self.block_size = block_size
        self.hybrid = num_state_slots > 0
        self.window = 0 if self.hybrid else window   # keys a query sees (0: all); see drop_outside_window
        # Two groups: the windowed layers' pool (a manager used for its blocks and hashes only) and their window.
        self.wpool: BlockManager | None = None
        self.group_window = 0
        if window_group is not None and not self.hybrid and not self.window:
            self.group_window = window_group[0]
            # Blocks are taken from it only after _can_get_both made room (evicting this manager's sessions).
            self.wpool = BlockManager(window_group[1], block_size, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.children: dict[int, set[int]] = {}   # parent hash -> hashed blocks that follow it
        # copy_kv(src, dst, n): copy the first n token slots of block src's KV into block dst (set by the
        # engine); without it, a partly matching last block is computed again.
        self.copy_kv = None
        self.counters = CacheCounters()
        self.sessions: OrderedDict[str, SessionPin] = OrderedDict()   # LRU: oldest first
        self.free_slots: list[int] = list(range(num_state_slots - 1, -1, -1))
        self.num_state_slots = num_state_slots

    # ------------------------------------------------------------------ capacity
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def _take_free_block(self) -> Block:
        if not self.free_queue and not self._evict_one_session():
            raise NoFreeBlocksError("out of KV-cache blocks")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            siblings = self.children.get(block.parent, set())
            siblings.discard(block_id)
            if self.hash_to_block.get(block.hash) == block_id:
                # Another block may hold the same tokens (computed twice): it answers for the hash now.
                twin = next((i for i in siblings if self.blocks[i].hash == block.hash), None)
                if twin is None:
                    del self.hash_to_block[block.hash]
                else:
                    self.hash_to_block[block.hash] = twin
            if not siblings:
                self.children.pop(block.parent, None)
        block.hash, block.token_ids, block.ref_count = None, (), 1
        return block

    def _ref(self, block: Block) -> None:
        if block.ref_count == 0:
            del self.free_queue[block.block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"negative ref count on block {block_id}"
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def can_get(self, n: int) -> bool:
        """Whether n fresh blocks can be had, evicting pinned sessions if necessary."""
        while self.num_free_blocks < n:
            if not self._evict_one_session():
                return False
        return True

    def _can_get_both(self, n: int, n_window: int) -> bool:
        """Two groups: whether n blocks of the full group and n_window of the windowed one can be had."""
        while self.num_free_blocks < n or self.wpool.num_free_blocks < n_window:
            if not self._evict_one_session():
                return False
        return True

    # ------------------------------------------------------------------ prefix lookup
    def _cached_prefix(self, seq: Sequence) -> tuple[list[Block], Block | None, int]:
        """Blocks holding a prefix of seq, capped so at least one token is computed; then a full block
        whose first tokens continue that prefix (and how many), for a copy-on-write partial hit."""
        if not self.enable_prefix_caching or self.hybrid or (seq.pooling is not None and
                                                               seq.pooling.reads_every_position):
            return [], None, 0
        hits: list[Block] = []
        prev = -1
        max_blocks = (len(seq) - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(prev, tokens)
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(self.blocks[block_id])
            prev = h
        if self.copy_kv is None:
            return hits, None, 0
        start = len(hits) * self.block_size   # the first block not cached whole: how far does one match?
        rest = seq.token_ids[start:min(start + self.block_size, len(seq) - 1)]
        best, best_n = None, 0
        for block_id in self.children.get(prev, ()):
            tokens = self.blocks[block_id].token_ids
            n = next((i for i, (a, b) in enumerate(zip(tokens, rest)) if a != b), min(len(tokens), len(rest)))
            if n > best_n:
                best, best_n = self.blocks[block_id], n
        return hits, best, best_n

    def allocate(self, seq: Sequence, budget: int | None = None) -> bool:
        """Admit seq: reuse cached prefix blocks and allocate the rest of its current tokens (windowed mode
        with a token `budget`: only up to what its first chunk computes; the scheduler grows it chunk by
        chunk while the blocks behind the window go back, so a long prompt never holds all of its blocks).

        Returns False (and changes nothing) when the blocks cannot be had.
        """
        assert not seq.block_table
        if self.hybrid:
            return self._allocate_hybrid(seq)
        if self.wpool is not None:
            return self._allocate_grouped(seq, budget)
        if self.window and self._resume_pinned(seq, budget):
            return True
        hits, partial, partial_n = self._cached_prefix(seq)
        tail, tail_n = self._session_tail(seq, hits)
        if tail is not None:
            partial = None   # the session's own last block, taken over: nothing to copy
        kept = hits + [b for b in (tail, partial) if b is not None]
        for block in kept:   # protect them from eviction below
            self._ref(block)
        upto = len(seq)
        if self.window and budget is not None:
            upto = min(upto, len(hits) * self.block_size + tail_n + (partial_n if partial is not None else 0) + budget)
        needed = max(0, self.num_blocks_for(upto) - len(hits) - (tail is not None))
        if not self.can_get(needed):
            for block in reversed(kept):
                self._unref(block.block_id)
            return False
        seq.block_table = [b.block_id for b in hits] + ([tail.block_id] if tail is not None else [])
        seq.block_hashes = [b.hash for b in hits]
        for _ in range(needed):
            seq.block_table.append(self._take_free_block().block_id)
        cached = len(hits) * self.block_size + tail_n
        if partial is not None:
            self.copy_kv(partial.block_id, seq.block_table[len(hits)], partial_n)
            self._unref(partial.block_id)
            cached += partial_n
        seq.num_computed_tokens = cached
        seq.stats.num_cached_tokens = cached
        self.counters.hit_tokens += cached
        self.counters.queried_tokens += len(seq)
        self.drop_outside_window(seq)
        return True

    def _resume_pinned(self, seq: Sequence, budget: int | None) -> bool:
        """Windowed mode or two groups: take over the session's pinned last turn (its table, and the windowed
        group's) when seq's prompt goes on from it."""
        grouped = self.wpool is not None
        pin = self.sessions.get(seq.session_id) if seq.session_id is not None else None
        if pin is None or pin.table is None or (grouped and pin.window_table is None) \
                or len(pin.tokens) >= len(seq) or tuple(seq.token_ids[:len(pin.tokens)]) != pin.tokens:
            return False
        del self.sessions[seq.session_id]   # its references become seq's
        seq.block_table = list(pin.table)
        if grouped:
            seq.window_block_table = list(pin.window_table)
        upto = len(seq) if budget is None else min(len(seq), len(pin.tokens) + budget)
        grown = self._grow_grouped(seq, len(seq), upto) if grouped else self.ensure_slots(seq, upto)
        if not grown:   # all or nothing: give the pin back untouched
            self.sessions[seq.session_id] = pin
            seq.block_table = []
            if grouped:
                seq.window_block_table = []
            return False
        seq.block_hashes = list(pin.hashes)
        seq.num_computed_tokens = seq.stats.num_cached_tokens = len(pin.tokens)
        self.counters.hit_tokens += len(pin.tokens)
        self.counters.queried_tokens += len(seq)
        return True

    def _window_hits(self, seq: Sequence, hashes: list[int], cached: int,
                     partial: Block | None) -> list[Block | None] | None:
        """Two groups: the windowed pool's blocks a sequence resuming at `cached` tokens reads, by the full
        group's hashes (both groups' blocks of one position hold the same tokens): the blocks from the one holding
        the first key of the window up to the hits' end, then the twin of the copy-on-write `partial`. Blocks
        wholly behind the window are None (never read). None when one of them is not there any more."""
        bs, pool = self.block_size, self.wpool
        first = max(0, cached - self.group_window + 1) // bs
        found: list[Block | None] = [None] * min(first, len(hashes))
        for i in range(first, len(hashes)):
            block_id = pool.hash_to_block.get(hashes[i])
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            if block_id is None or pool.blocks[block_id].token_ids != tokens:
                return None
            found.append(pool.blocks[block_id])
        if partial is not None:
            block_id = pool.hash_to_block.get(partial.hash)
            if block_id is None or pool.blocks[block_id].token_ids != partial.token_ids:
                return None
            found.append(pool.blocks[block_id])
        return found

    def _allocate_grouped(self, seq: Sequence, budget: int | None) -> bool:
        """allocate() with two groups: the longest cached prefix both groups hold, the full group's blocks for
        the whole prompt (as one group does), the windowed group's up to the first chunk's end (`budget`)."""
        if self._resume_pinned(seq, budget):
            return True
        bs = self.block_size
        hits, partial, partial_n = self._cached_prefix(seq)
        hashes = [b.hash for b in hits]
        while True:   # cut the hit back until the windowed group has the blocks its window reads
            cached = len(hits) * bs + (partial_n if partial is not None else 0)
            window_hits = self._window_hits(seq, hashes[:len(hits)], cached, partial)
            if window_hits is not None:
                break
            if partial is not None:
                partial, partial_n = None, 0
            else:
                hits = hits[:-1]
        kept = hits + ([partial] if partial is not None else [])
        window_kept = [b for b in window_hits if b is not None]
        for block in kept:   # protect them from eviction below
            self._ref(block)
        for block in window_kept:
            self.wpool._ref(block)
        upto = len(seq) if budget is None else min(len(seq), cached + budget)
        needed = self.num_blocks_for(len(seq)) - len(hits)
        needed_window = max(0, self.num_blocks_for(upto) - len(hits))
        if not self._can_get_both(needed, needed_window):
            for block in reversed(kept):
                self._unref(block.block_id)
            for block in reversed(window_kept):
                self.wpool._unref(block.block_id)
            return False
        seq.block_table = [b.block_id for b in hits] + [self._take_free_block().block_id for _ in range(needed)]
        seq.window_block_table = [DROPPED if b is None else b.block_id for b in window_hits[:len(hits)]] + \
            [self.wpool._take_free_block().block_id for _ in range(needed_window)]
        seq.block_hashes = hashes[:len(hits)]
        if partial is not None:
            self.copy_kv(partial.block_id, seq.block_table[len(hits)], partial_n, 0)
            self.copy_kv(window_hits[-1].block_id, seq.window_block_table[len(hits)], partial_n, 1)
            self._unref(partial.block_id)
            self.wpool._unref(window_hits[-1].block_id)
        seq.num_computed_tokens = seq.stats.num_cached_tokens = cached
        self.counters.hit_tokens += cached
        self.counters.queried_tokens += len(seq)
        self.drop_outside_window(seq)
        return True

    def _grow_grouped(self, seq: Sequence, num_tokens: int, window_tokens: int) -> bool:
        """Two groups: grow the full group's table to num_tokens and the windowed group's to window_tokens, both
        or neither."""
        needed = max(0, self.num_blocks_for(num_tokens) - len(seq.block_table))
        needed_window = max(0, self.num_blocks_for(window_tokens) - len(seq.window_block_table))
        if not self._can_get_both(needed, needed_window):
            return False
        seq.block_table += [self._take_free_block().block_id for _ in range(needed)]
        seq.window_block_table += [self.wpool._take_free_block().block_id for _ in range(needed_window)]
        return True

    def drop_outside_window(self, seq: Sequence) -> None:
        """Give back seq's blocks that every later query is past: a query at position p reads keys after
        p - window, and no query of seq comes before its first uncomputed token. (Two groups: the windowed
        group's.)"""
        if self.wpool is not None:
            table, pool, window = seq.window_block_table, self.wpool, self.group_window
        else:
            table, pool, window = seq.block_table, self, self.window
        if not window:
            return
        first_key = seq.num_computed_tokens - window + 1
        # Given back blocks are always a prefix of the table: walk back only to the last one given back
        # (a decode step gives back at most one block, not a scan of a long chat's whole table).
        for i in range(max(0, first_key) // self.block_size - 1, -1, -1):
            if table[i] == DROPPED:
                break
            pool._unref(table[i])
            table[i] = DROPPED

    def _session_tail(self, seq: Sequence, hits: list[Block]) -> tuple[Block | None, int]:
        """The partly filled last block pinned by seq's session, when seq's prompt goes on from it."""
        pin = self.sessions.get(seq.session_id) if seq.session_id is not None else None
        if pin is None or pin.tail is None:
            return None, 0
        block_id, tokens = pin.tail
        start = len(hits) * self.block_size
        if [b.block_id for b in hits] != pin.blocks[:-1] or start + len(tokens) > len(seq) - 1 \
                or tuple(seq.token_ids[start:start + len(tokens)]) != tokens:
            return None, 0
        return self.blocks[block_id], len(tokens)

    def _allocate_hybrid(self, seq: Sequence) -> bool:
        pin = self.sessions.get(seq.session_id) if seq.session_id is not None else None
        if pin is not None and self.enable_prefix_caching and len(pin.tokens) < len(seq) \
                and tuple(seq.token_ids[:len(pin.tokens)]) == pin.tokens:
            # Resume the session: its blocks and state slot become this sequence's.
            del self.sessions[seq.session_id]
            seq.block_table, seq.state_slot = pin.blocks, pin.state_slot
            if not self.ensure_slots(seq, len(seq)):   # all or nothing: give the pin back untouched
                self.sessions[seq.session_id] = pin
                seq.block_table, seq.state_slot = [], None
                return False
            seq.num_computed_tokens = seq.stats.num_cached_tokens = len(pin.tokens)
            self.counters.hit_tokens += len(pin.tokens)
            self.counters.queried_tokens += len(seq)
            return True
        if pin is not None:
            self.release_session(seq.session_id)
        if not self._acquire_slot_possible() or not self.can_get(self.num_blocks_for(len(seq))):
            return False
        seq.state_slot = self.free_slots.pop()
        seq.block_table = [self._take_free_block().block_id for _ in range(self.num_blocks_for(len(seq)))]
        seq.num_computed_tokens = seq.stats.num_cached_tokens = 0
        self.counters.queried_tokens += len(seq)
        return True

    def _acquire_slot_possible(self) -> bool:
        while not self.free_slots:
            if not self._evict_one_session():
                return False
        return True

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table (two groups: both tables) to hold num_tokens tokens; False if blocks ran out."""
        if self.wpool is not None:
            return self._grow_grouped(seq, num_tokens, num_tokens)
        needed = self.num_blocks_for(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if not self.can_get(needed):
            return False
        for _ in range(needed):
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def spare_slots(self, seq: Sequence, num_tokens: int) -> int:
        """How many tokens past its first num_tokens seq could hold with its own blocks and the free ones,
        evicting nothing (speculative proposals take only those)."""
        spare = (len(seq.block_table) + self.num_free_blocks) * self.block_size - num_tokens
        if self.wpool is not None:
            spare = min(spare, (len(seq.window_block_table) + self.wpool.num_free_blocks) * self.block_size - num_tokens)
        return max(0, spare)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks wholly past its first num_tokens tokens (those held for proposals that were
        rejected: fresh blocks, never hashed)."""
        keep = self.num_blocks_for(num_tokens)
        for table, pool in ((seq.block_table, self), (seq.window_block_table, self.wpool)):
            while len(table) > keep:
                block_id = table.pop()
                if block_id != DROPPED:
                    pool._unref(block_id)

    def deallocate(self, seq: Sequence) -> None:
        # Tail blocks first, so the LRU queue evicts the ends of chains before their prefixes.
        for block_id in reversed(seq.block_table):
            if block_id != DROPPED:
                self._unref(block_id)
        seq.block_table = []
        for block_id in reversed(seq.window_block_table):
            if block_id != DROPPED:
                self.wpool._unref(block_id)
        seq.window_block_table = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    # ------------------------------------------------------------------ hashing
    def commit_computed(self, seq: Sequence) -> None:
        """Hash every newly full block of seq whose KV is now entirely computed."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed_tokens, len(seq)) // self.block_size
        prev = seq.block_hashes[-1] if seq.block_hashes else -1
        for i in range(len(seq.block_hashes), full):
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = chain_hash(prev, tokens)
            self._register(seq.block_table[i], h, tokens, prev)
            if self.wpool is not None and seq.window_block_table[i] != DROPPED:
                self.wpool._register(seq.window_block_table[i], h, tokens, prev)
            seq.block_hashes.append(h)
            prev = h

    def _register(self, block_id: int, h: int, tokens: tuple[int, ...], prev: int) -> None:
        block = self.blocks[block_id]
        if block.hash is None:
            block.hash, block.token_ids, block.parent = h, tokens, prev
            self.hash_to_block.setdefault(h, block.block_id)
            self.children.setdefault(prev, set()).add(block.block_id)

    # ------------------------------------------------------------------ sessions
    def pin_session(self, session_id: str, seq: Sequence) -> None:
        """Keep seq's KV resident for the session's next turn (replaces older pins)."""
        self.release_session(session_id)
        if not self.enable_prefix_caching:
            return
        if self.hybrid:
            # Whole block table + state slot, handed over from the sequence (deallocate skips the slot).
            computed = seq.num_computed_tokens
            self._pin(session_id, list(seq.block_table), tuple(seq.token_ids[:computed]), seq.state_slot)
            seq.state_slot = None
            return
        if self.window or self.wpool is not None:
            # The whole table (blocks behind the window already given back) and the tokens it holds; two groups:
            # both tables.
            computed = min(seq.num_computed_tokens, len(seq))
            table = list(seq.block_table)
            self._pin(session_id, [b for b in table if b != DROPPED], tuple(seq.token_ids[:computed]))
            pin = self.sessions[session_id]
            pin.table, pin.hashes = table, list(seq.block_hashes)
            if self.wpool is not None:
                pin.window_table = list(seq.window_block_table)
                for block_id in pin.window_table:
                    if block_id != DROPPED:
                        self.wpool._ref(self.wpool.blocks[block_id])
            return
        full = len(seq.block_hashes)
        blocks, tail = seq.block_table[:full], None
        computed = min(seq.num_computed_tokens, len(seq))
        if computed > full * self.block_size and full < len(seq.block_table):
            tail = (seq.block_table[full], tuple(seq.token_ids[full * self.block_size:computed]))
            blocks = blocks + [tail[0]]
        self._pin(session_id, blocks, tail=tail)

    def _pin(self, session_id: str, blocks: list[int], tokens: tuple[int, ...] = (),
             state_slot: int | None = None, tail: tuple[int, tuple[int, ...]] | None = None) -> None:
        for block_id in blocks:
            self._ref(self.blocks[block_id])
        self.sessions[session_id] = SessionPin(blocks, tokens, state_slot, tail)

    def touch_session(self, session_id: str) -> None:
        if session_id in self.sessions:
            self.sessions.move_to_end(session_id)

    def release_session(self, session_id: str) -> None:
        pin = self.sessions.pop(session_id, None)
        if pin is None:
            return
        for block_id in reversed(pin.blocks):
            self._unref(block_id)
        for block_id in reversed(pin.window_table or ()):
            if block_id != DROPPED:
                self.wpool._unref(block_id)
        if pin.state_slot is not None:
            self.free_slots.append(pin.state_slot)

    def _evict_one_session(self) -> bool:
        """Drop the least recently used session's pins (its blocks stay cached until reused)."""
        if not self.sessions:
            return False
        session_id = next(iter(self.sessions))
        self.release_session(session_id)
        return True

    # ------------------------------------------------------------------ introspection
    def stats(self) -> BlockStats:
        cached = sum(1 for i in self.free_queue if self.blocks[i].hash is not None)
        total = len(self.blocks)
        return BlockStats(total=total, used=total - self.num_free_blocks, cached=cached,
                          free=self.num_free_blocks, hit_tokens=self.counters.hit_tokens,
                          queried_tokens=self.counters.queried_tokens,
                          pinned_sessions=len(self.sessions), hit_rate=self.counters.hit_rate)

    def check_invariants(self) -> None:
        free = set(self.free_queue)
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref count {block.ref_count}"
            assert (block.ref_count == 0) == (block.block_id in free), \
                f"block {block.block_id}: ref {block.ref_count} but free={block.block_id in free}"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"stale hash entry for block {block_id}"
        for block in self.blocks:
            assert block.hash is None or block.hash in self.hash_to_block, f"block {block.block_id} cannot be found"
        for parent, ids in self.children.items():
            for block_id in ids:
                block = self.blocks[block_id]
                assert block.hash is not None and block.parent == parent, f"stale child entry {block_id}"
        assert len(set(self.free_slots)) == len(self.free_slots), "a state slot is free twice"
        if self.wpool is not None:
            self.wpool.check_invariants()
