"""A checkpoint that ships only a SentencePiece ``tokenizer.model``: its ``tokenizer.json``, converted as transformers
does on load. Build-time tooling (it needs transformers, sentencepiece and protobuf): a push runs it, devices never."""

from __future__ import annotations

from pathlib import Path

from shared.errors import ConfigurationError
from shared.tokenizer_files import SENTENCEPIECE_MODEL, TOKENIZER_JSON


def ensure_tokenizer_json(model_dir: Path, out_dir: Path | None = None) -> Path:
    """``model_dir/tokenizer.json``, or when the checkpoint ships only a SentencePiece ``tokenizer.model``, the
    ``tokenizer.json`` converted from it into ``out_dir`` (default ``model_dir``; a push converts into its staging
    copy). transformers converts it, as ``AutoTokenizer`` does on load, so the ids are transformers'.

    Raises:
        ConfigurationError: neither file is there, or the conversion needs packages that are not installed, or it
            fails; the message names the fix.
    """
    if (model_dir / TOKENIZER_JSON).is_file():
        return model_dir / TOKENIZER_JSON
    target = (out_dir or model_dir) / TOKENIZER_JSON
    if not (model_dir / SENTENCEPIECE_MODEL).is_file():
        raise ConfigurationError(f"{model_dir}: no tokenizer.json (nor a SentencePiece tokenizer.model to convert)")
    try:
        import google.protobuf  # noqa: F401  (transformers' SentencePiece converter reads the model's protobuf)
        import sentencepiece  # noqa: F401
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ConfigurationError(
            f"{model_dir}: only a SentencePiece tokenizer.model; converting it needs {exc.name} "
            "(pip install sentencepiece protobuf transformers), or save the tokenizer with "
            "AutoTokenizer.from_pretrained(dir).save_pretrained(dir) to write tokenizer.json"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{type(tokenizer).__name__} has no fast (tokenizers) form")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".json.tmp")
        backend.save(str(tmp))
        tmp.replace(target)
    except Exception as exc:  # transformers' converters raise bare Exceptions too (e.g. a missing unk token)
        raise ConfigurationError(f"{model_dir}: cannot convert tokenizer.model to tokenizer.json: {exc}") from None
    return target
