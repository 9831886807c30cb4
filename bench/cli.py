"""``tierline bench``: benchmarks that print JSON."""

from __future__ import annotations

import json
from pathlib import Path

import click

from shared.planned import planned


@click.group()
def bench() -> None:
    """Benchmarks that put tierline beside its peers on the same work (JSON on stdout)."""


@bench.command("zoo")
@click.option("--preset", type=click.Choice(["tiny", "demo"]), default="demo", show_default=True)
@click.option("--zoo-dir", type=click.Path(path_type=Path), default=None, help="default $TIERLINE_DATA_DIR/zoo")
@click.option("--tokens", type=int, default=64, show_default=True, help="tokens to decode per run")
@click.option("--repeats", type=int, default=3, show_default=True)
def bench_zoo(preset: str, zoo_dir: Path | None, tokens: int, repeats: int) -> None:
    """Edge LM decode speed per format (ONNX fp32, ONNX INT8, TFLite) beside transformers on the same weights."""
    from bench.zoo_bench import run_zoo_bench
    from shared.settings import CoreSettings

    root = (zoo_dir or CoreSettings().zoo_dir) / preset
    click.echo(json.dumps(run_zoo_bench(root, num_tokens=tokens, repeats=repeats), indent=2))


bench.add_command(planned("engine", "LLM engine throughput beside transformers.", issue=3))
bench.add_command(planned("cascade", "Edge/cloud cascade quality vs edge share.", issue=6))
bench.add_command(planned("billing", "Usage ingestion and rating throughput.", issue=8))
