"""The model's tokenizer and chat template, without torch or transformers.

``lastevent model prepare`` writes ``tokenizer.json`` and ``lastevent.json`` (EOS
ids, chat template, context length) into the model dir; the API and the workers
load only those.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class ModelNotPrepared(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    name: str
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    chat_template: str

    @classmethod
    def load(cls, model_dir: Path, name: str | None = None) -> ModelInfo:
        meta_path = model_dir / "lastevent.json"
        tok_path = model_dir / "tokenizer.json"
        if not meta_path.exists() or not tok_path.exists():
            raise ModelNotPrepared(
                f"no prepared model in {model_dir}: run `lastevent model prepare` first"
            )
        meta = json.loads(meta_path.read_text())
        return cls(
            name=name or meta["model_name"],
            tokenizer=Tokenizer.from_file(str(tok_path)),
            eos_token_ids=tuple(meta["eos_token_ids"]),
            max_model_len=int(meta.get("max_model_len") or 8192),
            chat_template=meta["chat_template"],
        )

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def _raise(message: str) -> None:
    raise ValueError(message)
