"""The built-in default model: a small GLM-5.3-Flash-architecture checkpoint.

When the repository ships trained weights (train.py's exports, copied into `default_weights/`),
`ensure()` returns the first of SHIPPED_VARIANTS found there. Otherwise it builds a checkpoint on the spot:
the real file layout (config.json, safetensors shards + index, generation_config.json,
tokenizer.json, tokenizer_config.json, chat_template.jinja) with random tiny weights. The tokenizer is a byte-level
BPE trained on Python standard-library files every interpreter ships, plus GLM-5.3-Flash's special
tokens in the real relative order (glm53.md §5.1). Everything is a pure function of those files,
the template and this code, so `ensure()` builds it once into a folder named by their hash.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent
TEMPLATE = ROOT / "chat_template.jinja"  # byte-identical copy of the published current template
# English prose (the language reference in pydoc_data) and commented code: fixed, so the BPE is too.
CORPUS = ("pydoc_data/topics.py", "argparse.py", "textwrap.py", "json/__init__.py", "dataclasses.py")
BPE_VOCAB = 4000
SEED = 0
# The 36 added tokens from <|endoftext|> (id 154820 in the real vocabulary) on, in the family's
# order: the ids the spec confirms (gMASK +2, <sop> +4, <|user|> +7, <|observation|> +9, image/video
# markers +10..+13, <|image|> +34, <|video|> +35) keep the same offsets here.
SPECIAL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>", "/nothink",
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)
EOS_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")  # the three stop tokens (serving.md §1.1)
NAME = "glm53-default-tiny"
SHIPPED = ROOT / "default_weights"  # train.py's exports: bf16/, exl3-2bit/, exl3-3bit/, exl3-4bit/
SHIPPED_VARIANTS = ("exl3-4bit", "bf16")  # the first one shipped is served (EXL3 experts: what this engine is for)
SHIPPED_DRAFTER = SHIPPED / "dflash2"  # train.py --drafter's DFlash2 drafter for the shipped model


def corpus_texts() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    missing = [f for f in CORPUS if not (stdlib / f).is_file()]
    if missing:
        raise FileNotFoundError(f"the default tokenizer trains on standard-library files {missing}, "
                                f"not found under {stdlib}")
    return [(stdlib / f).read_text(encoding="utf-8") for f in CORPUS]


def build_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenizer, like the GLM family) + the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def tokenizer_config() -> dict:
    """The fields the published tokenizer_config.json sets (glm53.md §5.1)."""
    return {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "clean_up_tokenization_spaces": False,
            "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 1048576,
            "padding_side": "left", "do_lower_case": False, "remove_space": False,
            "extra_special_tokens": [t for t in SPECIAL_TOKENS if t != "<|endoftext|>"]}


def model_config(tok: Tokenizer) -> dict:
    """The tests' tiny architecture (checkpoint.tiny_config_dict) with this tokenizer's vocabulary."""
    import checkpoint

    eos = [tok.token_to_id(t) for t in EOS_TOKENS]
    return checkpoint.tiny_config_dict(vocab_size=tok.get_vocab_size(), eos_token_id=eos, pad_token_id=eos[0],
                                       max_position_embeddings=4096)


def _key(texts: list[str]) -> str:
    """Hash of everything the folder's content depends on (a changed input means a rebuild)."""
    import tokenizers
    import torch

    h = hashlib.sha256()
    for part in [*texts, TEMPLATE.read_text(), Path(__file__).read_text(), (ROOT / "checkpoint.py").read_text(),
                 f"{BPE_VOCAB} {SEED} {tokenizers.__version__} {torch.__version__}"]:
        h.update(hashlib.sha256(part.encode()).digest())
    return h.hexdigest()[:16]


def build(path: Path, texts: list[str]) -> None:
    import checkpoint
    from model_glm import GLMConfig

    tok = build_tokenizer(texts)
    config_dict = model_config(tok)
    weights = checkpoint.random_weights(GLMConfig.from_dict(config_dict), SEED)
    checkpoint.write_checkpoint(path, config_dict, weights)
    write_extras(path, tok)


def write_extras(path: Path, tok: Tokenizer) -> None:
    """What a checkpoint folder holds besides the weights and configs: tokenizer and chat template."""
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    shutil.copyfile(TEMPLATE, path / "chat_template.jinja")


def shipped() -> Path | None:
    """The trained checkpoint shipped with the repository, if one is there (complete)."""
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for variant in SHIPPED_VARIANTS:
        if all((SHIPPED / variant / f).is_file() for f in needed):
            return SHIPPED / variant
    return None


def shipped_drafter() -> Path | None:
    """The DFlash2 drafter trained against the shipped checkpoint, if one is there (complete)."""
    if all((SHIPPED_DRAFTER / f).is_file() for f in ("config.json", "model.safetensors")):
        return SHIPPED_DRAFTER
    return None


def ensure(cache_dir: str | Path | None = None) -> Path:
    """Path of the default checkpoint: the shipped trained one, else the random one built on first
    use (~1 s) under `cache_dir` (default $GLM53_CACHE or ~/.cache/glm53)."""
    trained = shipped()
    if trained is not None:
        return trained
    cache_dir = Path(cache_dir or os.environ.get("GLM53_CACHE") or Path.home() / ".cache" / "glm53")
    texts = corpus_texts()
    path = cache_dir / f"default-{_key(texts)}"
    if (path / "tokenizer.json").is_file():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so concurrent first runs never see half a checkpoint.
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=cache_dir))
    try:
        build(tmp, texts)
        try:
            tmp.rename(path)
        except OSError:
            if not (path / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
