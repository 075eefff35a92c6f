"""The worker's commit drains Faust's producer buffer (stream_jobs/faust_patches.py,
drain_producer_buffer): table changelog writes queue there, and a transaction committed
before they reach their producer loses them with a crashed worker while the offsets of the
inputs they record are committed (CI, worker fault: 13 of 36 calls missing).

Against a real faust ProducerBuffer whose sender is slow (a publish takes 0.2 s, as on two
busy cores): Faust's own flush() gives up with writes still queued; ours hands every one over."""
import asyncio
from types import SimpleNamespace

from faust.transport.producer import ProducerBuffer
from faust.types.tuples import FutureMessage, PendingMessage

from spanrl.stream_jobs.faust_patches import _count_buffer_sends, drain_producer_buffer


class SlowChannel:
    def __init__(self, delay_s: float):
        self.delay_s, self.published = delay_s, []

    async def publish_message(self, fut, wait: bool = False):
        await asyncio.sleep(self.delay_s)
        self.published.append(fut.message.key)


def _buffer_with(channel, n: int) -> ProducerBuffer:
    buf = ProducerBuffer()
    buf.app = SimpleNamespace(conf=SimpleNamespace(producer_threaded=False))
    for i in range(n):
        buf.put(FutureMessage(PendingMessage(channel, f"k{i}", b"v", 0, None, None, None, None, None)))
    return buf


def test_faust_flush_gives_up_on_a_slow_sender():
    """The upstream behaviour the patch works around (faust-streaming 0.15.3): if this starts
    failing, Faust's flush drains now and the patch may go."""
    async def main():
        ch = SlowChannel(0.2)
        buf = _buffer_with(ch, 4)
        await buf.start()
        await buf.flush()
        left = buf.size
        while not buf.pending.empty():  # (its stop() would refuse to stop with writes queued)
            buf.pending.get_nowait()
        await buf.stop()
        return left

    assert asyncio.run(main()) > 0


def test_drain_hands_over_every_queued_write_and_waits_for_the_senders():
    _count_buffer_sends()

    async def main():
        ch = SlowChannel(0.2)
        buf = _buffer_with(ch, 4)
        await buf.start()  # its background sender takes one write at once and holds it 0.2 s
        await asyncio.sleep(0.05)
        try:
            sent = await drain_producer_buffer(buf)
            return sent, buf.pending.qsize(), getattr(buf, "_spanrl_sending", 0), sorted(ch.published)
        finally:
            await buf.stop()

    sent, queued, sending, published = asyncio.run(main())
    assert (queued, sending) == (0, 0)
    assert published == ["k0", "k1", "k2", "k3"]  # the sender's one included: waited for
    assert 1 <= sent <= 3  # the rest went through the background sender meanwhile


def test_drain_of_an_empty_buffer_returns_at_once():
    async def main():
        buf = _buffer_with(SlowChannel(0.0), 0)
        return await asyncio.wait_for(drain_producer_buffer(buf), timeout=1.0)

    assert asyncio.run(main()) == 0


class UnevenChannel(SlowChannel):
    """A publish of ``slow_key`` takes ``delay_s``; every other publish is immediate."""

    def __init__(self, slow_key: str, delay_s: float):
        super().__init__(delay_s)
        self.slow_key = slow_key

    async def publish_message(self, fut, wait: bool = False):
        if fut.message.key == self.slow_key:
            await asyncio.sleep(self.delay_s)
        self.published.append(fut.message.key)


def test_drain_waits_for_the_write_the_background_sender_holds():
    """The counter of writes held by the sender (_count_buffer_sends): without it, the drain
    returns once the queue is empty while the sender still holds its write, which then misses
    the transaction the commit that follows closes."""
    _count_buffer_sends()

    async def main():
        ch = UnevenChannel("k0", 0.3)
        buf = _buffer_with(ch, 3)
        await buf.start()  # its background sender takes k0 and holds it 0.3 s
        await asyncio.sleep(0.05)
        try:
            await drain_producer_buffer(buf)
            return sorted(ch.published)
        finally:
            await buf.stop()

    assert asyncio.run(main()) == ["k0", "k1", "k2"]
