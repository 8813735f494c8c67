"""The ledger's flow control: stream queues survive a resume, not a revoke."""

from __future__ import annotations

import asyncio
import inspect

from faust.tables.recovery import Recovery
from mode.utils.queues import FlowControlEvent, FlowControlQueue

from tokenbudget.streams.faust_adapt.flow import ResumeKeepsQueued
from tokenbudget.streams.ledger_worker import LedgerSettings, build_app
from tokenbudget.streams.topics import Topics


def queue_after(flow: FlowControlEvent, step: str) -> list[str]:
    async def main() -> list[str]:
        queue: FlowControlQueue[str] = FlowControlQueue(flow_control=flow, clear_on_resume=True)
        flow.resume()
        await queue.put("delivered after the seek")
        flow.suspend()
        getattr(flow, step)()
        return [queue.get_nowait() for _ in range(queue.qsize())]

    return asyncio.run(main())


def test_events_queued_before_a_resume_are_kept() -> None:
    assert queue_after(ResumeKeepsQueued(), "resume") == ["delivered after the seek"]
    # Faust's own flow control drops them: the loss this class exists for.
    assert queue_after(FlowControlEvent(), "resume") == []


def test_a_revoke_still_clears_the_queues() -> None:
    assert queue_after(ResumeKeepsQueued(), "clear") == []


def test_deliveries_wait_while_suspended_and_go_on_after_resume() -> None:
    async def main() -> None:
        flow = ResumeKeepsQueued()
        waiting = asyncio.ensure_future(flow.acquire())
        await asyncio.sleep(0)
        assert not waiting.done()
        flow.resume()
        await asyncio.wait_for(waiting, 5)
        assert flow.is_active()

    asyncio.run(main())


def test_the_ledger_app_uses_it() -> None:
    app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))
    assert isinstance(app.flow_control, ResumeKeepsQueued)


def test_fausts_recovery_resumes_the_flow_after_the_seek() -> None:
    """The order ResumeKeepsQueued is for: Faust's recovery seeks the stream
    partitions, then resumes the app's flow control (which stock mode clears)."""
    for step in (Recovery.on_recovery_completed, Recovery._resume_streams):
        source = inspect.getsource(step)
        assert source.index("perform_seek()") < source.index("flow_control.resume()")


def test_the_ledger_apps_stream_queues_obey_its_flow_control() -> None:
    app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))

    async def main() -> list[str]:
        queue = app.channel().queue  # how every stream of the app buffers its events
        app.flow_control.resume()  # as the worker does once started
        await queue.put("delivered after the seek")
        app.flow_control.suspend()
        app.flow_control.resume()
        return [queue.get_nowait() for _ in range(queue.qsize())]

    assert asyncio.run(main()) == ["delivered after the seek"]
