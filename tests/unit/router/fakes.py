"""What the routing service's unit tests share: a discovery client with fixed workers,
and a predictor taught by finished requests."""

from __future__ import annotations

import time

from splitserve.contracts.wire import ReleaseCall


class FakeClient:
    """Dynamo's worker client as the service reads it: the live instance ids."""

    def __init__(self, ids):
        self.ids = list(ids)

    def instance_ids(self):
        return list(self.ids)


TAUGHT = ((1, 20.0), (3, 30.0))
"""(batch, TPOT ms): alone 20 ms, in threes 30 ms, i.e. 15 ms + 5 ms per running request
(8 running would make 55 ms)."""


def teach(svc, worker: int, batches=TAUGHT) -> None:
    """Finished requests on ``worker``, three rounds of ``batches``: TTFT 50 ms, each
    batch's TPOT as given, 11 output tokens."""
    predictor = svc.qos.predictor
    now = time.monotonic() - 1000.0
    for batch, tpot in batches * 3:
        rids = [f"t{worker}-{now}-{i}" for i in range(batch)]
        for rid in rids:
            predictor.place(rid, f"{worker:x}", predictor.predict(f"{worker:x}", 10, now),
                            now, class_name="default")
        duration = 0.05 + 10 * tpot / 1000.0
        now += duration
        for rid in rids:
            svc.qos.observe(ReleaseCall(request_id=rid, worker_id=worker, output_tokens=11,
                                        ttft_s=0.05, duration_s=duration), now)
        now += 10.0
