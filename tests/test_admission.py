"""The Ingress's chat admission: bounded in flight, bounded waiting, refusals at once, slots always returned."""
import asyncio
import gc

import pytest

from deployments.ingress import Admission, APIError


def test_limits_waiting_refusal_and_hand_over():
    async def main():
        adm = Admission(limit=2, waiting=1)
        a, b = await adm.enter(), await adm.enter()
        assert adm.in_flight == 2
        third = asyncio.ensure_future(adm.enter())
        await asyncio.sleep(0)
        assert not third.done()                           # waits for a slot
        with pytest.raises(APIError) as e:                # nobody else may wait: refused at once
            await adm.enter()
        assert e.value.body["error"]["type"] == "overloaded_error"
        a.release()
        a.release()                                       # twice is once
        c = await asyncio.wait_for(third, 1)              # the slot went to the waiter
        assert adm.in_flight == 2
        b.release()
        c.release()
        assert adm.in_flight == 0 and adm.free == 2

    asyncio.run(main())


def test_a_cancelled_waiter_and_a_dropped_slot_give_their_slots_back():
    async def main():
        adm = Admission(limit=1, waiting=4)
        held = await adm.enter()
        waiter = asyncio.ensure_future(adm.enter())
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        del held
        gc.collect()                                      # a slot nobody released (a stream that never started)
        assert adm.free == 1
        again = await asyncio.wait_for(adm.enter(), 1)
        again.release()

    asyncio.run(main())


def test_no_limit_admits_everything():
    async def main():
        adm = Admission(limit=None, waiting=0)
        slots = [await adm.enter() for _ in range(100)]
        [s.release() for s in slots]

    asyncio.run(main())
