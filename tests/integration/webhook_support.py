"""What the webhook tests share: one tenant event queued for delivery on a real database."""

from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import Session

from cloud.gateway.webhooks import WebhookStore, new_delivery_id
from controlplane.storage.tables import WebhookDelivery
from controlplane.tenancy.service import create_tenant


def queue_delivery(engine: Engine, url: str) -> tuple[WebhookStore, str]:
    """A tenant with a webhook secret and one ``budget.threshold`` delivery to ``url``: the store, its id."""
    store = WebhookStore(engine)
    with Session(engine) as s:
        tenant = create_tenant(s, "acme")
        s.commit()
        tenant_id = int(tenant.id or 0)
    store.rotate_secret(tenant_id)
    delivery_id = new_delivery_id()
    with Session(engine) as s:
        s.add(WebhookDelivery(id=delivery_id, tenant_id=tenant_id, event="budget.threshold", payload={"a": 1}, url=url))
        s.commit()
    return store, delivery_id
