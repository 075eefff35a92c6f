"""stream_jobs/faust_patches.py: the installed Faust is one the patches were verified
against, and install() patches each internal once."""
from faust.transport.consumer import TransactionManager
from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread
from faust.transport.producer import ProducerBuffer
from mode.utils.queues import FlowControlEvent

from spanrl.stream_jobs import faust_patches


def test_installed_faust_is_a_verified_version():
    # an upgrade fails here on purpose: re-verify (make chaos, worker fault), then add it
    assert faust_patches.check_version() in faust_patches.VERIFIED_VERSIONS


def test_install_patches_each_internal_once():
    faust_patches.install()
    patched = (TransactionManager.send, TransactionManager.commit, ProducerBuffer._send_pending,
               AIOKafkaConsumerThread._highwaters, FlowControlEvent.resume)
    assert all(getattr(f, "_spanrl_patched", False) for f in patched)
    faust_patches.install()  # idempotent: the same functions, not wrappers of wrappers
    assert (TransactionManager.send, TransactionManager.commit, ProducerBuffer._send_pending,
            AIOKafkaConsumerThread._highwaters, FlowControlEvent.resume) == patched


def test_resume_of_a_flowing_queue_keeps_its_records():
    """The records the fetcher hands an agent while Recovery awaits its seek sit in a
    clear_on_resume queue when Recovery calls flow_control.resume() on a flow that is already
    active; upstream that resume() dropped them (after their read offset had passed them)."""
    import asyncio

    from mode.utils.queues import FlowControlQueue

    faust_patches.install()

    async def main():
        flow = FlowControlEvent(initially_suspended=False)
        q = FlowControlQueue(flow_control=flow, clear_on_resume=True)
        await q.put("span@28")
        flow.resume()  # already flowing: nothing is dropped
        kept = q.qsize()
        flow.suspend()  # a rebalance: ending the suspension still clears, as upstream
        flow.resume()
        return kept, q.qsize()

    assert asyncio.run(main()) == (1, 0)
