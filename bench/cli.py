"""``tierline bench``: benchmarks that print JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from bench.common import emit, zoo_root

PRESETS = ["tiny", "demo"]


def _zoo_options(fn: Any) -> Any:
    fn = click.option("--json", "as_json", is_flag=True, help="print one JSON object")(fn)
    fn = click.option(
        "--zoo-dir", type=click.Path(path_type=Path), default=None, help="default $TIERLINE_DATA_DIR/zoo"
    )(fn)
    return click.option("--preset", type=click.Choice(PRESETS), default="demo", show_default=True)(fn)


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


@bench.command("monitor")
@click.option("--preset", type=click.Choice(["tiny", "demo"]), default="demo", show_default=True)
@click.option("--zoo-dir", type=click.Path(path_type=Path), default=None, help="default $TIERLINE_DATA_DIR/zoo")
@click.option("--trials", type=click.IntRange(min=1), default=1000, show_default=True, help="random shadow streams")
@click.option("--horizon", type=click.IntRange(min=1), default=200, show_default=True, help="shadow samples per stream")
def bench_monitor(preset: str, zoo_dir: Path | None, trials: int, horizon: int) -> None:
    """The quality monitor on the digits pair with a real gap: alerts on mis-set and on calibrated policies."""
    from bench.monitor_bench import run_monitor_bench
    from shared.settings import CoreSettings

    root = (zoo_dir or CoreSettings().zoo_dir) / preset
    click.echo(json.dumps(run_monitor_bench(root, trials=trials, horizon=horizon), indent=2))


@bench.command("engine")
@_zoo_options
@click.option("--requests", "num_requests", type=int, default=64, show_default=True)
@click.option("--max-num-seqs", type=int, default=64, show_default=True)
@click.option("--skip-hf", is_flag=True, help="only this engine (no transformers baselines)")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="every contender once a round, in turn; medians reported (a host whose speed drifts slows all alike)",
)
@click.option(
    "--vs",
    type=click.Choice(["hf", "llamacpp"]),
    default="hf",
    show_default=True,
    help="the peer: transformers, or llama.cpp on the zoo's GGUF exports (needs tierline[peers]: make peers)",
)
@click.option(
    "--shape",
    type=click.Choice(["qwen2.5-0.5b", "smollm2-360m", "test-qwen2"]),
    default=None,
    help="with --vs llamacpp: a random-initialised checkpoint in this published configuration instead of the zoo's "
    "lm-cloud (cached under $TIERLINE_DATA_DIR/bench-shapes), 16 concurrent and batch 1, peak RSS of each",
)
@click.option(
    "--llama-server/--no-llama-server",
    "with_llama_server",
    default=True,
    show_default=True,
    help="with --vs llamacpp: also llama.cpp's C++ server against `tierline engine serve`, both over HTTP, at batch "
    "1 and 16 and 64 concurrent, 128 tokens each (skipped, saying why, until `make llama-server` built it)",
)
def bench_engine(
    preset: str,
    zoo_dir: Path | None,
    as_json: bool,
    num_requests: int,
    max_num_seqs: int,
    skip_hf: bool,
    rounds: int,
    vs: str,
    shape: str | None,
    with_llama_server: bool,
) -> None:
    """Continuous batching on mixed requests beside transformers (sequential and static batches) or llama.cpp."""
    if shape is not None and vs != "llamacpp":
        raise click.UsageError("--shape runs beside llama.cpp: add --vs llamacpp")
    if vs == "llamacpp":
        from bench.engine_bench import HTTP_LEVELS, bench_engine_vs_llamacpp
        from bench.llamacpp import missing_reason

        if (reason := missing_reason()) is not None:
            raise click.UsageError(f"--vs llamacpp: {reason}")
        if shape is not None:
            from bench.shape_bench import bench_shape
            from shared.settings import CoreSettings

            emit(bench_shape(shape, CoreSettings().data_dir / "bench-shapes", rounds=rounds), as_json)
            return
        root = zoo_root(preset, zoo_dir)
        levels = HTTP_LEVELS if with_llama_server else None
        emit(bench_engine_vs_llamacpp(root, num_requests, max_num_seqs, rounds=rounds, http_levels=levels), as_json)
        return
    from bench.engine_bench import bench_engine as run

    emit(run(zoo_root(preset, zoo_dir), num_requests, max_num_seqs, skip_hf, rounds=rounds), as_json)


@bench.command("spec")
@_zoo_options
@click.option("--prompts", "num_prompts", type=int, default=8, show_default=True)
@click.option("--tokens", "num_tokens", type=int, default=96, show_default=True)
@click.option(
    "--concurrency",
    type=click.IntRange(min=1),
    multiple=True,
    help="concurrent requests to sweep (repeat the option); default 1, 2, 4, 8, 16, 64",
)
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True, help="alternating rounds; medians")
@click.option("--check/--no-check", default=True, show_default=True, help="exit 1 when speculation lost anywhere")
def bench_spec(
    preset: str,
    zoo_dir: Path | None,
    as_json: bool,
    num_prompts: int,
    num_tokens: int,
    concurrency: tuple[int, ...],
    rounds: int,
    check: bool,
) -> None:
    """Plain decoding, draft-model and n-gram speculation side by side at each concurrency, beside transformers
    assisted generation; fails (after printing) when either method was more than 2 % slower than plain at any
    concurrency swept."""
    from bench import engine_bench
    from bench.engine_bench import NEVER_SLOWER_TOLERANCE, SPEC_CONCURRENCY

    sweep = tuple(sorted(set(concurrency))) or SPEC_CONCURRENCY
    result = engine_bench.bench_spec(
        zoo_root(preset, zoo_dir), num_prompts, num_tokens, concurrency=sweep, rounds=rounds
    )
    emit(result, as_json)
    lost = engine_bench.slower_than_plain(result)
    if check and lost:
        where = ", ".join(f"{s['method']} {s['x_plain']}x at {s['concurrency']}" for s in lost)
        raise click.ClickException(f"speculation below {NEVER_SLOWER_TOLERANCE}x plain decoding: {where}")


@bench.command("prefix")
@_zoo_options
@click.option("--requests", "num_requests", type=int, default=16, show_default=True)
@click.option("--system-tokens", type=int, default=448, show_default=True, help="shared prefix length (< context)")
def bench_prefix(preset: str, zoo_dir: Path | None, as_json: bool, num_requests: int, system_tokens: int) -> None:
    """Time to first token with and without prefix caching for requests sharing a system prompt."""
    from bench.engine_bench import bench_prefix as run

    emit(run(zoo_root(preset, zoo_dir), num_requests, system_tokens), as_json)


@bench.command("structured")
@_zoo_options
@click.option("--requests", "num_requests", type=int, default=32, show_default=True)
@click.option("--max-tokens", type=int, default=64, show_default=True)
def bench_structured(preset: str, zoo_dir: Path | None, as_json: bool, num_requests: int, max_tokens: int) -> None:
    """Constrained decoding (a JSON schema's grammar) beside plain decoding: tokens/s at batch 1 and 32 on the
    cloud engine and at batch 1 on the edge runtime, grammar compile time and mask cost per token."""
    from bench.structured_bench import bench_structured as run

    emit(run(zoo_root(preset, zoo_dir), num_requests, max_tokens), as_json)


@bench.command("api")
@_zoo_options
@click.option("--duration", type=float, default=30.0, show_default=True, help="seconds of load")
@click.option("--concurrency", type=int, default=64, show_default=True, help="streaming clients")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option(
    "--stream-interval",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="the server's TIERLINE_CLOUD_STREAM_INTERVAL: tokens per streamed event at least",
)
@click.option(
    "--usage-checkpoint-tokens",
    type=click.IntRange(min=0),
    default=None,
    help="the server's TIERLINE_CLOUD_USAGE_CHECKPOINT_TOKENS (0: streams not checkpointed; default: its default)",
)
def bench_api(
    preset: str,
    zoo_dir: Path | None,
    as_json: bool,
    duration: float,
    concurrency: int,
    max_tokens: int,
    stream_interval: int,
    usage_checkpoint_tokens: int | None,
) -> None:
    """Concurrent streaming clients against a real cloud server: throughput, errors, TTFT, API overhead."""
    from bench.api_bench import run_api_bench
    from shared.settings import CoreSettings

    root = zoo_root(preset, zoo_dir)
    emit(
        run_api_bench(
            root,
            CoreSettings().data_dir,
            duration,
            concurrency,
            max_tokens,
            stream_interval=stream_interval,
            usage_checkpoint_tokens=usage_checkpoint_tokens,
        ),
        as_json,
    )


@bench.command("tensor")
@_zoo_options
@click.option("--requests", "num_requests", type=int, default=2000, show_default=True)
@click.option("--concurrency", type=int, default=64, show_default=True)
def bench_tensor(preset: str, zoo_dir: Path | None, as_json: bool, num_requests: int, concurrency: int) -> None:
    """The digits classifier through ONNX Runtime: dynamic batching vs one request at a time."""
    from bench.tensor_bench import run_tensor_bench

    emit(run_tensor_bench(zoo_root(preset, zoo_dir), num_requests, concurrency), as_json)


def _register() -> None:
    from bench.billing_bench import billing_command
    from bench.cascade_bench import cascade_command
    from bench.edge_bench import edge_command

    bench.add_command(edge_command)
    bench.add_command(cascade_command)
    bench.add_command(billing_command)


_register()


@bench.command("backends")
@_zoo_options
@click.option("--requests", type=int, default=64, show_default=True, help="streams per path, concurrency and round")
@click.option("--concurrency", type=int, default=64, show_default=True, help="measured at 1 and at this")
@click.option("--max-tokens", type=int, default=32, show_default=True)
@click.option("--kills", type=click.IntRange(min=0), default=1, show_default=True, help="failover trials")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="alternating rounds")
def bench_backends(
    preset: str,
    zoo_dir: Path | None,
    as_json: bool,
    requests: int,
    concurrency: int,
    max_tokens: int,
    kills: int,
    rounds: int,
) -> None:
    """Gateway overhead in front of `tierline engine serve` vs direct and vs the built-in engine; failover time."""
    from bench.backends_bench import run_backends_bench
    from shared.settings import CoreSettings

    root = zoo_root(preset, zoo_dir)
    data_dir = CoreSettings().data_dir
    emit(run_backends_bench(root, data_dir, requests, concurrency, max_tokens, kills, rounds), as_json)


@bench.command("scale")
@_zoo_options
@click.option("--requests", type=int, default=64, show_default=True, help="streams per path (1 vs 2 gateways)")
@click.option("--concurrency", type=int, default=16, show_default=True)
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--duration", type=float, default=20.0, show_default=True, help="seconds of load around the kill -9")
@click.option("--vs", "peer", type=click.Choice(["litellm"]), default=None, help="also run beside the LiteLLM proxy")
@click.option("--litellm", "litellm_exe", default=None, help="the litellm executable (default: .venv-peers, PATH)")
@click.option(
    "--peer-requests",
    default="1:40,8:160,64:320",
    show_default=True,
    help="concurrency:requests points of --vs litellm",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="--vs litellm: alternate upstream alone, tierline and LiteLLM this many times per point",
)
@click.option(
    "--upstream",
    type=click.Choice(["engine", "paced"]),
    default="engine",
    show_default=True,
    help="the model server: the zoo's LM on `tierline engine serve` (it shares this host's cores), or one that "
    "streams at --ttft-ms / --token-ms and spends almost no CPU (as a GPU host of its own would)",
)
@click.option("--ttft-ms", type=click.FloatRange(min=0), default=20.0, show_default=True, help="--upstream paced")
@click.option("--token-ms", type=click.FloatRange(min=0), default=10.0, show_default=True, help="--upstream paced")
@click.option("--redis-url", default=None, help="default $TIERLINE_BENCH_REDIS_URL or redis://127.0.0.1:6379/0")
def bench_scale(
    preset: str,
    zoo_dir: Path | None,
    as_json: bool,
    requests: int,
    concurrency: int,
    max_tokens: int,
    duration: float,
    peer: str | None,
    litellm_exe: str | None,
    peer_requests: str,
    rounds: int,
    upstream: str,
    ttft_ms: float,
    token_ms: float,
    redis_url: str | None,
) -> None:
    """Two gateways on PostgreSQL + Redis behind a round-robin front: 1 vs 2 gateways, a kill -9 of one mid-load
    (failed requests, records lost or duplicated, spend); --vs litellm: overhead and CPU beside the LiteLLM proxy.
    --upstream paced: in front of a model server that streams at a set pace without taking the host's CPU.

    PostgreSQL comes from TIERLINE_BENCH_DATABASE_URL (or TIERLINE_TEST_DATABASE_URL): a fresh schema, dropped after.
    """
    import os

    from bench.billing_bench import _postgres_answers, _postgres_url
    from bench.scale_bench import run_scale_bench
    from shared.settings import CoreSettings

    try:
        points = {int(c): int(n) for c, n in (p.split(":") for p in peer_requests.split(","))}
    except ValueError:
        hint = "CONCURRENCY:REQUESTS[,...], e.g. 1:40,8:160,64:320"
        raise click.BadParameter(hint, param_hint="--peer-requests") from None
    url = _postgres_url()
    problem = _postgres_answers(url) if url else "no PostgreSQL configured (TIERLINE_BENCH_DATABASE_URL)"
    if url is None or problem:
        raise click.ClickException(f"bench scale needs PostgreSQL: {problem}")
    redis_url = redis_url or os.environ.get("TIERLINE_BENCH_REDIS_URL") or "redis://127.0.0.1:6379/0"
    result = run_scale_bench(
        zoo_root(preset, zoo_dir),
        CoreSettings().data_dir,
        db_url=url,
        redis_url=redis_url,
        requests=requests,
        concurrency=concurrency,
        max_tokens=max_tokens,
        duration=duration,
        vs_litellm=peer == "litellm",
        litellm=litellm_exe,
        peer_requests=points,
        rounds=rounds,
        pace=(ttft_ms, token_ms) if upstream == "paced" else None,
    )
    emit(result, as_json)
