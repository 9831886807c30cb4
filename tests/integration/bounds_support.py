"""What the input-bounds tests share: a real cloud (tiny zoo, SQLite) with an API key and an enrolled device's
credential, a real edge agent beside it, and JSON text nested deeper than ``json.dumps`` can write."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlmodel import Session

from controlplane.fleet.devices import create_enrollment_token
from controlplane.storage.database import create_db
from controlplane.tenancy.service import create_api_key, create_tenant
from tests.conftest import base_env, free_port, migrated_sqlite, run_server, seed_data_dir, server_process

CLOUD_LM = "tierline/lm-cloud"
EDGE_LM = "tierline/lm-edge-onnx-int8"


@dataclass(frozen=True, slots=True)
class Cloud:
    url: str
    key: str  # an API key of the tenant
    device_token: str  # an enrolled device's credential (tld-...)
    spare_tokens: tuple[str, ...]  # enrollment tokens not used yet

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @property
    def device_auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.device_token}"}


@contextmanager
def running_cloud(data_dir: Path, tiny_zoo: Path, session_data_dir: Path) -> Iterator[Cloud]:
    data = seed_data_dir(data_dir, tiny_zoo, session_data_dir)
    db_url = migrated_sqlite(data)
    engine = create_db(db_url)
    with Session(engine) as s:
        tenant = create_tenant(s, "bounds")
        key = create_api_key(s, tenant).secret
        tokens = [create_enrollment_token(s, tenant).secret for _ in range(3)]
        s.commit()
    engine.dispose()
    env = base_env(
        data,
        TIERLINE_DATABASE_URL=db_url,
        TIERLINE_CLOUD_ZOO_PRESET="tiny",
        TIERLINE_CLOUD_KV_CACHE_MB="16",
        TIERLINE_CLOUD_USAGE_FLUSH_MS="50",
        TIERLINE_CLOUD_SPECULATION="off",
    )
    port = free_port()
    log = data / "cloud.log"  # what a failure's 500 logged
    with server_process(["cloud", "serve"], env, port, ready_path="/readyz", timeout=180, stop_timeout=30, log=log):
        url = f"http://127.0.0.1:{port}"
        r = httpx.post(f"{url}/v1/edge/enroll", json={"token": tokens[0], "name": "bounds-1"}, timeout=30)
        assert r.status_code == 200, r.text
        yield Cloud(url, key, r.json()["device_token"], tuple(tokens[1:]))


@contextmanager
def running_edge(data_dir: Path, tiny_zoo: Path, session_data_dir: Path) -> Iterator[str]:
    """An agent that is not enrolled: everything is answered on the device."""
    data = seed_data_dir(data_dir, tiny_zoo, session_data_dir)
    env = base_env(data, TIERLINE_EDGE_ZOO_DIR=str(data / "zoo" / "tiny"))
    with run_server(["edge", "run"], env, free_port(), timeout=120) as url:
        yield url


def nested_schema(levels: int) -> str:
    """A JSON schema (as text) of ``levels`` objects, each the only property of the one around it."""
    return '{"type":"object","properties":{"a":' * levels + '{"type":"string"}' + "}}" * levels


def nested_array(levels: int) -> str:
    return "[" * levels + "]" * levels
