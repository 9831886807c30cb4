"""Edge LM artifact directories side by side: greedy decode tokens/s over alternating rounds, medians and ranges.

    python -m bench.lab.lm_rounds DIR [DIR ...] [--rounds 7] [--tokens 64]

Each DIR is an edge LM artifact (``edge_model.json`` beside the model: ONNX, ONNX INT8, TFLite v1 or v2), loaded
with the agent's own runtime (``load_causal_lm``). The prompt is the first 64 tokens of the first held-out file
(the one ``bench edge`` times), encoded with the first DIR's tokenizer; every run is one greedy sequence (prefill,
then one decode step per token), the DIRs in turn within each round so host load hits them alike. Prints one JSON
object: per DIR the median, min and max tokens/s, the median's ratio to the first DIR's, and whether its greedy
tokens equal the first DIR's.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import click

from edge_agent.runtime.lm import load_causal_lm

PROMPT_TOKENS = 64


def _prompt(model_dir: Path) -> list[int]:
    from tokenizers import Tokenizer

    from shared.zoo.corpus import held_out_files

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return list(tok.encode(held_out_files()[0].text).ids[:PROMPT_TOKENS])


@click.command()
@click.argument("dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--rounds", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True, help="new tokens per run")
@click.option("--threads", type=click.IntRange(1, 64), default=1, show_default=True)
def main(dirs: tuple[Path, ...], rounds: int, tokens: int, threads: int) -> None:
    prompt = _prompt(dirs[0])
    runtimes = [load_causal_lm(d, threads) for d in dirs]
    outputs = [rt.greedy(prompt, tokens) for rt in runtimes]  # warm-up, and the outputs compared
    times: list[list[float]] = [[] for _ in dirs]
    for _ in range(rounds):
        for i, rt in enumerate(runtimes):
            started = time.perf_counter()
            rt.greedy(prompt, tokens)
            times[i].append(time.perf_counter() - started)
    medians = [tokens / statistics.median(t) for t in times]
    result = {
        "prompt_tokens": len(prompt),
        "new_tokens": tokens,
        "rounds": rounds,
        "threads": threads,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "runs": [
            {
                "dir": str(d),
                "runtime": type(rt).__name__,
                "io": rt.meta.get("io"),
                "tokens_per_s_median": round(med, 1),
                "tokens_per_s_range": [round(tokens / max(t), 1), round(tokens / min(t), 1)],
                "vs_first_median": round(med / medians[0], 3),
                "outputs_identical_to_first": out == outputs[0],
            }
            for d, rt, med, t, out in zip(dirs, runtimes, medians, times, outputs, strict=True)
        ],
    }
    click.echo(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
