"""Lab tools: measurements behind findings written in the docs, kept runnable (``python -m bench.lab.<tool>``) for
re-checking those findings or A/B-testing a change; not part of ``tierline bench``. See README.md here."""

from __future__ import annotations

import argparse
from pathlib import Path


def spec_lab_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments the speculation lab tools share: the zoo or weights dir (default: the committed demo weights),
    ``--concurrency`` (repeated), ``--threads`` and ``--tokens`` (generated per request)."""
    from shared.zoo.build import committed_weights
    from shared.zoo.presets import DEMO

    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("zoo", nargs="?", type=Path, default=committed_weights(DEMO))
    parser.add_argument("--concurrency", type=int, action="append")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    return parser
