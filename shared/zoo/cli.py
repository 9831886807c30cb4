"""``tierline zoo``: build, train and verify the model zoo."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from shared.zoo.presets import PRESET_NAMES


@click.group()
def zoo() -> None:
    """Build and verify the project's own models (nothing is downloaded)."""


def _step(msg: str) -> None:
    click.echo(f"[zoo] {msg}", err=True)


@zoo.command()
@click.option("--preset", type=click.Choice(PRESET_NAMES), default="demo", show_default=True)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="zoo directory (default $TIERLINE_DATA_DIR/zoo); the preset goes in OUT/<preset>",
)
@click.option("--retrain", is_flag=True, help="train the LMs instead of taking committed weights")
@click.option("--force", is_flag=True, help="rebuild even when a build with the same fingerprint exists")
@click.option("--json", "as_json", is_flag=True, help="print the build report as JSON")
def build(preset: str, out_dir: Path | None, retrain: bool, force: bool, as_json: bool) -> None:
    """Build the zoo: LMs, edge exports (ONNX fp32/INT8, TFLite), GGUF for llama.cpp, digits, signed manifests.

    Cached: a second call with the same preset returns at once.
    """
    from tqdm import tqdm

    from shared.artifacts import load_or_create_signing_key
    from shared.settings import CoreSettings
    from shared.zoo.build import NUM_BUILD_STEPS, build_zoo
    from shared.zoo.presets import get_preset

    core = CoreSettings()
    key = load_or_create_signing_key(core.signing_key_path)
    with tqdm(total=NUM_BUILD_STEPS, unit="step", desc=f"zoo {preset}", file=sys.stderr, leave=True) as bar:

        def step(msg: str) -> None:
            bar.write(f"[zoo] {msg}", file=sys.stderr)
            bar.update(1)

        report = build_zoo(get_preset(preset), out_dir or core.zoo_dir, key, retrain=retrain, force=force, step=step)
        bar.n = bar.total
        bar.refresh()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        click.echo((out_dir or core.zoo_dir) / preset)


@zoo.command()
@click.argument("directory", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option(
    "--key",
    "key_files",
    multiple=True,
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    help="trusted Ed25519 public key (PEM); default: this data dir's signing key",
)
def verify(directory: Path, key_files: tuple[Path, ...]) -> None:
    """Check every artifact's sha256 and signature under DIRECTORY; exit 1 naming each file that fails."""
    from shared.artifacts import load_public_key, public_path
    from shared.errors import ConfigurationError
    from shared.settings import CoreSettings
    from shared.zoo.registry import verify_zoo

    paths = list(key_files) or [public_path(CoreSettings().signing_key_path)]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise ConfigurationError(f"no trusted key at {missing[0]}; pass --key PUBLIC_KEY.pem")
    results = verify_zoo(directory, [load_public_key(p) for p in paths])
    failures = [(path, err) for path, err in results if err]
    for path, err in failures:
        click.echo(f"FAIL {path}: {err}", err=True)
    click.echo(f"{len(results) - len(failures)} of {len(results)} artifacts verified")
    if failures:
        sys.exit(1)


@zoo.command()
@click.option("--preset", type=click.Choice(PRESET_NAMES), default="demo", show_default=True)
@click.option(
    "--role",
    type=click.Choice(["all", "tokenizer", "edge", "cloud", "draft", "micro"]),
    default="all",
    show_default=True,
    help="train one part (edge, cloud and micro may run as separate processes after the tokenizer; the draft, "
    "distilled from edge and cloud, after them)",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(path_type=Path),
    default=None,
    help="where to write (default: the committed weights directory for demo, ./var/train otherwise)",
)
@click.option("--threads", type=int, default=None, help="torch threads (results are reproducible per thread count)")
def train(preset: str, role: str, out_dir: Path | None, threads: int | None) -> None:
    """Train the tokenizer and LMs of a preset from the standard library (seeded; long for demo)."""
    import time

    import torch

    from shared.zoo.build import committed_weights, write_pinned_hashes
    from shared.zoo.presets import get_preset
    from shared.zoo.train import ROLES, train_role, train_tokenizer_for, write_training_report
    from shared.zoo.train_lm import ProgressFn

    p = get_preset(preset)
    out = out_dir or (committed_weights(p) if p.is_committed else Path("var/train") / p.name)
    if threads:
        torch.set_num_threads(threads)
    dtype = torch.float16 if p.is_committed else torch.float32

    def progress(role_name: str) -> ProgressFn:
        def show(step: int, total: int, loss: float) -> None:
            if step % 50 == 0 or step == total:
                _step(f"{role_name} {step}/{total} loss {loss:.3f} at {time.strftime('%X')}")

        return show

    if role in ("all", "tokenizer"):
        train_tokenizer_for(p, out)
    for r in ROLES:
        if role in ("all", r):
            train_role(p, r, out, dtype, progress(r))
    if all((out / f"training-{r}.json").is_file() for r in ROLES):
        write_training_report(p, out)
        if p.is_committed:
            write_pinned_hashes(out)
    click.echo(out)
