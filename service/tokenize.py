"""The model's tokenizer and chat template, without torch or transformers.

``lastevent model prepare`` writes ``tokenizer.json`` and ``lastevent.json`` (EOS
ids, chat template, context length) into the model dir; the API and the workers
load only those.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

INFO_FILE = "lastevent.json"
GIL_HELD_CHARS = 8192  # texts up to this long are encoded holding the GIL (quicker)


class ModelNotPrepared(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class ModelMeta:
    """``lastevent.json``, which ``lastevent model prepare`` writes into a model dir."""

    model_name: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    chat_template: str
    max_model_len: int

    def write(self, model_dir: Path) -> None:
        data = {**dataclasses.asdict(self), "eos_token_ids": list(self.eos_token_ids)}
        text = json.dumps(data, indent=2) + "\n"
        (model_dir / INFO_FILE).write_text(text, encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    chat_template: str

    @classmethod
    def load(cls, model_dir: Path, name: str | None = None) -> ModelInfo:
        """From ``lastevent.json`` (written by `lastevent model prepare`), or from a plain
        Hugging Face model directory (tokenizer.json, tokenizer_config.json, config.json)."""
        meta_path = model_dir / INFO_FILE
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.exists():
            raise ModelNotPrepared(
                f"no tokenizer.json in {model_dir}: run `lastevent model prepare` "
                "(or point LASTEVENT_MODEL_DIR at a Hugging Face model directory)"
            )
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else _hf_meta(model_dir)
        return cls(
            name=name or meta["model_name"],
            tokenizer=Tokenizer.from_file(str(tok_path)),
            eos_token_ids=tuple(meta["eos_token_ids"]),
            max_model_len=int(meta.get("max_model_len") or 8192),
            chat_template=meta["chat_template"],
        )

    def renamed(self, name: str) -> ModelInfo:
        """The same tokenizer and template under another name (an adapter's)."""
        return dataclasses.replace(self, name=name)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """``tools``: OpenAI tool objects, as Hugging Face templates take them."""
        extra = {} if tools is None else {"tools": tools}
        template = _compiled(self.chat_template)
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **extra
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """tokenizers' ``encode`` holds the GIL throughout (3.6 s over a 10 MB prompt,
        measured), so an API process rendering a large prompt on a thread answered nobody
        meanwhile; its ``encode_batch`` lets the GIL go while it works, for a few
        microseconds more, so a long text takes that path (the same ids)."""
        if len(text) <= GIL_HELD_CHARS:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)
        [encoding] = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


@functools.lru_cache(maxsize=8)
def _compiled(chat_template: str) -> Template:
    """Compiling the template cost more than the rest of the submit path: once per template."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(chat_template)


def _hf_meta(model_dir: Path) -> dict[str, Any]:
    """What lastevent.json holds, read from a Hugging Face model directory."""

    def read(name: str) -> dict[str, Any]:
        path = model_dir / name
        return json.loads(path.read_text()) if path.exists() else {}

    tok, config, gen = (
        read("tokenizer_config.json"),
        read("config.json"),
        read("generation_config.json"),
    )
    template = tok.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").exists():
        template = (model_dir / "chat_template.jinja").read_text()
    if not template:
        raise ModelNotPrepared(f"{model_dir} has no chat template")
    eos = gen.get("eos_token_id", config.get("eos_token_id"))
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not eos_ids and isinstance(tok.get("eos_token"), str):
        vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        found = vocab.token_to_id(tok["eos_token"])
        eos_ids = [found] if found is not None else []
    return {
        "model_name": model_dir.name,
        "eos_token_ids": eos_ids,
        "chat_template": template,
        "max_model_len": config.get("max_position_embeddings") or 8192,
    }


def _raise(message: str) -> None:
    raise ValueError(message)
