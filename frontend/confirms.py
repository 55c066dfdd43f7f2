"""Publisher-confirm bookkeeping for one channel in confirm mode.

A publish gets the channel's next sequence number and is settled once every
shard it went to has answered (CONFIRM or CONFIRM_NACK); one nack from any
shard nacks the whole message. Settlements are gathered during a loop turn and
turned into as few basic.ack/basic.nack frames as possible by ``drain``: one
``multiple=True`` ack covering the contiguous settled prefix, single frames for
the rest. Sequence numbers are consecutive, so the lowest unsettled one is
tracked with a cursor instead of a sorted structure.
"""

from __future__ import annotations


class ConfirmTracker:
    __slots__ = ("next_seq", "_remaining", "_nacked", "_settled", "_low", "n_acked")

    def __init__(self) -> None:
        self.next_seq = 1
        self.n_acked = 0  # publishes drained as acked, in total (counted per drain, for the stats)
        # seq -> number of shards that have not answered yet
        self._remaining: dict[int, int] = {}
        # seqs that some shard nacked while others were still pending
        self._nacked: set[int] = set()
        # (seq, ok) settled since the last drain
        self._settled: list[tuple[int, bool]] = []
        # every seq below this one is settled
        self._low = 1

    @property
    def unconfirmed(self) -> int:
        return len(self._remaining)

    def publish(self, shards: int) -> int:
        """Number a publish that went to ``shards`` shards (0 = unroutable: settled as acked now)."""
        seq = self.next_seq
        self.next_seq = seq + 1
        if shards > 0:
            self._remaining[seq] = shards
        else:
            self._settled.append((seq, True))
        return seq

    def publish_run(self, shards: int, n: int) -> int:
        """Number n publishes that each went to ``shards`` (> 0) shards: the first of their n seqs."""
        first = self.next_seq
        self.next_seq = first + n
        self._remaining.update(dict.fromkeys(range(first, first + n), shards))
        return first

    def confirm(self, seqs: list[int], ok: bool = True) -> None:
        """One shard's CONFIRM (ok) or CONFIRM_NACK for these seqs. Unknown seqs are ignored."""
        remaining = self._remaining
        for seq in seqs:
            left = remaining.get(seq)
            if left is None:
                continue
            if not ok:
                self._nacked.add(seq)
            if left > 1:
                remaining[seq] = left - 1
                continue
            del remaining[seq]
            if self._nacked:
                settled_ok = seq not in self._nacked
                self._nacked.discard(seq)
            else:
                settled_ok = True
            self._settled.append((seq, settled_ok))

    def fail_all(self) -> None:
        """Nack everything still pending (a shard that had them restarted)."""
        for seq in list(self._remaining):
            del self._remaining[seq]
            self._settled.append((seq, False))
        self._nacked.clear()

    def drain(self) -> list[tuple[int, bool, bool]]:
        """Frames to send now as (delivery_tag, multiple, is_ack), in send order.

        Nacks go first and singly; then one multiple ack up to the highest acked
        seq below the lowest unsettled seq (a multiple ack only covers tags the
        client still has outstanding, so re-covering already-answered ones is
        harmless); then single acks for those settled out of order.
        """
        settled = self._settled
        if not settled:
            return []
        self._settled = []
        if not self._remaining and len(settled) == 1:
            # One settled and nothing pending (a synchronous publisher's one message in flight):
            # what _drain returns for it (tests/test_frontend_logic.py compares), without its loops.
            seq, ok = settled[0]
            self._low = self.next_seq
            if ok:
                self.n_acked += 1
                return [(seq, False, True)]
            return [(seq, False, False)]
        return self._drain(settled)

    def _drain(self, settled: list[tuple[int, bool]]) -> list[tuple[int, bool, bool]]:
        remaining = self._remaining
        low = self._low
        nxt = self.next_seq
        while low < nxt and low not in remaining:
            low += 1
        self._low = low
        out: list[tuple[int, bool, bool]] = []
        prefix_max = 0
        prefix_count = 0
        singles: list[int] = []
        for seq, ok in settled:
            if not ok:
                out.append((seq, False, False))
            elif seq < low:
                prefix_count += 1
                if seq > prefix_max:
                    prefix_max = seq
            else:
                singles.append(seq)
        self.n_acked += prefix_count + len(singles)
        if prefix_count:
            out.append((prefix_max, prefix_count > 1, True))
        if singles:
            singles.sort()
            out.extend((seq, False, True) for seq in singles)
        return out
