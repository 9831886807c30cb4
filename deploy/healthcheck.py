"""The image's HEALTHCHECK: finds the ``tierline`` server running in this container and asks its health endpoint.

One image runs every service, so the check reads the server's own command line (``/proc/*/cmdline``) for what it
is and which port it listens on: ``cloud serve`` -> ``/readyz`` (database migrated, backends up), ``console serve``
-> ``/healthz``, ``engine serve`` -> ``/health`` (503 once its engine died). Anything else (``db upgrade``, a
one-shot job) has no endpoint and counts as healthy while it runs. Exit 0 healthy, 1 not (the reason on stdout,
which ``docker inspect`` shows). Standard library only: it runs every few seconds.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

# (subcommand, sub-subcommand) -> (health path, default port, port environment variable)
SERVERS = {
    ("cloud", "serve"): ("/readyz", 8400, "TIERLINE_CLOUD_PORT"),
    ("console", "serve"): ("/healthz", 8401, "TIERLINE_CONSOLE_PORT"),
    ("engine", "serve"): ("/health", 8000, None),
}


def server_url(argv: list[str], env: dict[str, str]) -> str | None:
    """The health URL of the tierline server ``argv`` runs, or None when it runs no server."""
    names = [a for a in argv if not a.startswith("-")]
    for i in range(len(names) - 1):
        spec = SERVERS.get((names[i], names[i + 1]))
        if spec is None:
            continue
        path, port, port_env = spec
        if "--port" in argv[:-1]:
            port = int(argv[argv.index("--port") + 1])
        elif any(a.startswith("--port=") for a in argv):
            port = int(next(a for a in argv if a.startswith("--port="))[len("--port=") :])
        elif port_env and env.get(port_env):
            port = int(env[port_env])
        return f"http://127.0.0.1:{port}{path}"
    return None


def tierline_commands() -> list[list[str]]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = [a.decode(errors="replace") for a in cmdline.read_bytes().split(b"\0") if a]
        except OSError:
            continue
        if any(Path(a).name == "tierline" for a in argv[:2]):
            found.append(argv)
    return found


def main() -> int:
    for argv in tierline_commands():
        url = server_url(argv, dict(os.environ))
        if url is None:
            continue
        try:
            with urllib.request.urlopen(url, timeout=4) as response:  # noqa: S310 (a loopback http URL)
                print(f"{url}: {response.status}")
                return 0
        except urllib.error.HTTPError as exc:
            print(f"{url}: {exc.code} {exc.read(300).decode(errors='replace')}")
            return 1
        except OSError as exc:
            print(f"{url}: {exc}")
            return 1
    print("no tierline server in this container: nothing to check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
