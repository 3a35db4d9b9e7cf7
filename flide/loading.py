"""Loading models and tokenizers: checkpoints (local folder or hub id), and random-weight models built from a config
(the benchmarks' models: the real shapes and the real tokenizer, weights drawn at random)."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from .config import FlideConfig

logger = logging.getLogger("flide")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_tokenizer(path: str | Path):
    """AutoTokenizer of a folder or hub id; a folder holding only `tokenizer.json.gz` is unpacked to a cache first."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if folder.is_dir() and not (folder / "tokenizer.json").exists() and (folder / "tokenizer.json.gz").exists():
        digest = hashlib.sha256((folder / "tokenizer.json.gz").read_bytes()).hexdigest()[:16]
        cache = Path.home() / ".cache" / "flide" / "tokenizers" / digest
        if not (cache / "tokenizer.json").exists():
            cache.mkdir(parents=True, exist_ok=True)
            # several processes may unpack at once (a benchmark's parts starting together): each writes its own
            # temporary files and moves them in place atomically, the last one's copy wins (all are the same)
            tmp = cache / f".tokenizer.json.{os.getpid()}.{threading.get_ident()}.tmp"
            with gzip.open(folder / "tokenizer.json.gz", "rb") as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)
            for name in TOKENIZER_FILES:
                if (folder / name).exists() and name != "tokenizer.json":
                    part = cache / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
                    shutil.copy(folder / name, part)
                    os.replace(part, cache / name)
            os.replace(tmp, cache / "tokenizer.json")  # last: its presence means the folder is complete
        folder = cache
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise ValueError(f"Cannot load a tokenizer from {str(path)!r}: {error}") from error


def _is_jev(path: str, config) -> bool:
    from transformers import JevConfig

    if getattr(config, "model_type", None) == "jev":
        return True
    folder = Path(path)
    return folder.is_dir() and any((folder / name).exists() for name in JevConfig.extra_config_files)


def load_model(name_or_path: str, cfg: FlideConfig, **kwargs):
    """(model, tokenizer) of a checkpoint: a causal LM, or a Jev decision model (its own repo, or a head shipped next
    to a causal LM's weights). Weights come from the folder or hub id given; nothing is fetched for a local path."""
    from transformers import AutoConfig, AutoModelForCausalLM, JevForDecision

    device = pick_device(cfg.runtime.device)
    dtype = "auto" if cfg.runtime.dtype == "auto" else DTYPES[cfg.runtime.dtype]
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as error:
        raise ValueError(f"Cannot load a model config from {name_or_path!r}: {error}") from error
    cls = JevForDecision if _is_jev(name_or_path, config) else AutoModelForCausalLM
    logger.info("loading %s from %s", cls.__name__, name_or_path)
    model = cls.from_pretrained(name_or_path, dtype=dtype, **kwargs).to(device).eval()
    return model, load_tokenizer(name_or_path)


def random_model(config_path: str | Path, dtype: torch.dtype | str = torch.bfloat16, device: str = "auto",
                 seed: int = 0):
    """A causal LM with random weights in the shapes of a config (a config.json or a folder holding one).

    Weights are drawn on the target device (fast for multi-billion-parameter shapes) with transformers' own init.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(config_path)
    if path.is_dir():
        path = path / "config.json"
    values = json.loads(path.read_text(encoding="utf-8"))
    values.pop("architectures", None)
    values.pop("torch_dtype", None)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    target = pick_device(device)
    torch.manual_seed(seed)
    with torch.device(target):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    logger.warning("%s has RANDOM weights (built from %s): its answers carry no meaning.", type(model).__name__, path)
    return model.eval()
