"""Idempotency-Key claims on each database: a lapsed claim is taken by one retry only, and fences its old holder."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from sqlmodel import Session

from cloud.gateway.idempotency import IdempotencyInProgressError, IdempotencyStore
from controlplane.storage.database import create_db
from controlplane.storage.tables import IdempotentResponse, utcnow
from controlplane.tenancy.service import create_tenant


def test_retries_racing_for_a_lapsed_claim_take_it_once_and_fence_the_old_holder(migrated_db: str) -> None:
    engine = create_db(migrated_db)
    with Session(engine) as s:
        tenant_id = create_tenant(s, "acme").id or 0
        s.commit()
    dead = IdempotencyStore(engine, lease_s=60).claim(tenant_id, "k", "h" * 64, False)
    with Session(engine) as s:  # its process died long ago
        row = s.get(IdempotentResponse, (tenant_id, "k"))
        assert row is not None
        row.claimed_at = utcnow().replace(year=2000)
        s.add(row)
        s.commit()
    replicas = [IdempotencyStore(create_db(migrated_db), lease_s=60) for _ in range(6)]
    barrier = threading.Barrier(len(replicas))

    def retry(store: IdempotencyStore) -> str | None:
        barrier.wait()
        try:
            claim = store.claim(tenant_id, "k", "h" * 64, False)
        except IdempotencyInProgressError as exc:
            assert 1 <= exc.retry_after <= 60
            return None
        assert claim.response is None
        return claim.token

    with ThreadPoolExecutor(len(replicas)) as pool:
        tokens = [t for t in pool.map(retry, replicas) if t is not None]
    assert len(tokens) == 1  # exactly one retry runs the request
    replicas[0].release(tenant_id, "k", dead.token)  # the dead holder's late release drops nothing
    replicas[0].complete(tenant_id, "k", dead.token, {"from": "dead"})  # nor does its late answer count
    replicas[0].complete(tenant_id, "k", tokens[0], {"from": "retry"})
    assert replicas[1].claim(tenant_id, "k", "h" * 64, False).response == {"from": "retry"}
    for store in [*replicas]:
        store.engine.dispose()
    engine.dispose()
