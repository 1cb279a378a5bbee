"""`server.max_in_flight: auto`: each endpoint's budget follows the server's own load, read from vLLM's /metrics.

The budget grows while few requests wait in the server's queue and its KV cache has room, and shrinks to what the
server runs plus a queue when more than that waits or the cache is full. The queue, half the budget, is what keeps
the engine fed: a finished request is replaced from it at once, while its successor is still on its way through the
client and the server's front end; shorter queues lost throughput (benchmarks/README.md,
`generation_utilization.py --phases auto`). Waiting requests hold no KV cache, so a deep queue costs the server
nothing. As in TCP, the budget doubles until the server first pushes back, then grows by a sixteenth, so it stays
near the server's limit instead of swinging around it. A fixed budget is either too small for a big server or a
long queue on a small one; this one keeps every endpoint just saturated whatever its size.
"""

from __future__ import annotations

import asyncio

from eagle3_datagen.errors import Log
from eagle3_datagen.protocol import ServerLoad
from tasks.generation.pool import Endpoint, EndpointPool

AUTO_START = 32  # the first budget of an endpoint under `auto`
AUTO_CAP = 1024  # never more in flight to one endpoint
FOLLOW_EVERY_S = 0.5  # between readings after the budget changed
RAMP_EVERY_S = 0.1  # between readings while the budget climbs from its start, so a big server fills quickly
SETTLED_EVERY_S = 2.0  # at most between readings while the budget stays put: a reading costs a loaded vLLM front end
# CPU that its engine would otherwise use
KV_CACHE_FULL = 0.95  # share of the KV cache in use past which the server preempts
KV_CACHE_ROOM = 0.85  # below this share there is room for more requests
QUEUE_SHARE = 2  # up to half the budget may wait in the server's queue; it grows while a quarter or less waits

def next_limit(limit: int, peak_in_flight: int, load: ServerLoad, pushed_back: bool = False,
               just_grown: bool = False) -> int:
    """The next budget of an endpoint, from its current one, the most it had in flight lately, its load, whether
    it ever pushed back (requests queued or a full cache) during this run, and whether the budget grew (or the run
    began) less than FOLLOW_EVERY_S ago."""
    queue = max(2, limit // QUEUE_SHARE)
    cache = load.kv_cache_usage
    if load.waiting > queue or (cache is not None and cache >= KV_CACHE_FULL):
        return max(1, min(limit, int(load.running) + queue))
    # the server counts at least half of what was sent (three quarters right after a growth, when its front end may
    # still be reading the burst): growing while it reads only piles up more. Not all of it: requests in pre- and
    # post-processing are counted nowhere
    taken_in = load.running + load.waiting >= (3 * limit // 4 if just_grown else limit // 2)
    # requests wait in vLLM's queue only for a step or two while it has room; if they wait while it runs half the
    # budget or less, it is full, and the budget is already what it runs plus a queue as long
    few_wait = load.waiting <= queue // QUEUE_SHARE and (load.waiting == 0 or 2 * load.running > limit)
    if few_wait and (cache is None or cache < KV_CACHE_ROOM) and peak_in_flight >= limit and taken_in:
        return min(AUTO_CAP, limit + max(1, limit // 16) if pushed_back else 2 * limit)
    return limit


def next_pause(pause: float, changed: bool, ramping: bool, every_s: float = FOLLOW_EVERY_S) -> float:
    """Seconds until the next reading: RAMP_EVERY_S while the budget climbs from its start, `every_s` after a
    change, then twice the last pause after each reading that changed nothing, up to SETTLED_EVERY_S."""
    if ramping:
        return RAMP_EVERY_S
    return every_s if changed else min(SETTLED_EVERY_S, 2 * pause)


async def follow_load(pool: EndpointPool, endpoint: Endpoint, log: Log, every_s: float = FOLLOW_EVERY_S) -> None:
    """Move one endpoint's budget with its load until cancelled; a failed reading leaves the budget as it is."""
    loop = asyncio.get_running_loop()
    pushed_back, grew_at, pause = False, loop.time(), RAMP_EVERY_S
    while True:
        await asyncio.sleep(pause)
        peak, endpoint.peak_in_flight = endpoint.peak_in_flight, endpoint.in_flight
        load = await endpoint.client.load()
        if load is None:
            continue
        now = loop.time()
        limit = next_limit(endpoint.limit, peak, load, pushed_back, now - grew_at < every_s)
        pushed_back |= limit < endpoint.limit
        grew_at = now if limit > endpoint.limit else grew_at
        if limit != endpoint.limit:
            log.debug("budget of %s: %d -> %d (running %.0f, waiting %.0f, KV cache %s)", endpoint.url,
                      endpoint.limit, limit, load.running, load.waiting, load.kv_cache_usage)
            pool.wake(max(0, limit - endpoint.limit))
        pause = next_pause(pause, limit != endpoint.limit, not pushed_back and now - grew_at < every_s, every_s)
        endpoint.limit = limit
