"""tests/unit: the pure protocol tests, which must run without torch or transformers.

``tiny_model`` is a byte-level BPE tokenizer trained in memory (the same kind of
tokenizer as SmolLM2's: ByteLevel pre-tokenizer and decoder, BPE, no normalizer),
on a corpus full of multi-byte UTF-8 so that many of its tokens are fragments of a
character, or end in the middle of one and begin the next. It never touches the
packaged model, which needs torch to convert (the session fixture ``model`` in
tests/conftest.py): `make test-fast` runs ``pytest tests/unit`` without the
``cpu`` extra. The guard at the end of this file keeps it that way.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from service.tokenize import ModelInfo

UNIT_DIR = Path(__file__).resolve().parent
HEAVY_MODULES = ("torch", "transformers")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
EOS_TOKEN = "<|im_end|>"
VOCAB_SIZE = 700  # the trainer reaches it: the corpus has more than enough pairs
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "Hello world, hi there! The quick brown fox jumps over the lazy dog.",
    "Café crème, déjà vu, naïve façade, señor, Ærøskøbing, straße, Größe, Ärger.",
    "e\u0301 a\u0301 n\u0303 — combining accents: e\u0301te\u0301, cafe\u0301.",
    "Prices: 5€, 10 €, £3, ¥500, ₹20, ₿0.1 ... 100% «quoted» “curly” ‘single’.",  # noqa: RUF001
    "日本語のテキスト、東京都、日本語、日本、本日は晴天なり。",
    "中文文本：你好，世界！我们的模型。漢字와 한국어 문장입니다, 안녕하세요.",  # noqa: RUF001
    "Русский текст: привет, мир! Ελληνικά: γειά σου κόσμε. עברית: שלום. العربية: مرحبا",  # noqa: RUF001
    "Emoji: 🤖🤖🤖 👩‍👩‍👧 👍🏽 🇯🇵 🎉🎉 ❤️ 😀😃😄 🚀 🤖 robot 🤖.",
    "###END\n\n## heading\n- item\n\tTabbed\r\nWindows line\n",
    "ÃƒÂ© mojibake Ã© Ã¼ ß ß ß ab ab ab ##END## STOP stop.",
    "def main():\n    print('hi')  # comment\n    return 0\n",
]


def build_tokenizer(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # every byte is a token: any text encodes, nothing is unknown
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS * 5, trainer=trainer)
    return tokenizer


@pytest.fixture(scope="session")
def tiny_model() -> ModelInfo:
    tokenizer = build_tokenizer()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE  # the strategies draw ids below it
    eos = tokenizer.token_to_id(EOS_TOKEN)
    assert eos is not None
    return ModelInfo(
        name="tiny-bpe",
        tokenizer=tokenizer,
        eos_token_ids=(eos,),
        max_model_len=2048,
        chat_template=CHAT_TEMPLATE,
    )


def _only_unit_tests(session: pytest.Session) -> bool:
    items = session.items
    return bool(items) and all(UNIT_DIR in Path(item.path).resolve().parents for item in items)


def heavy_imports() -> list[str]:
    return [name for name in HEAVY_MODULES if sys.modules.get(name) is not None]


@pytest.fixture(scope="session", autouse=True)
def _no_torch_in_unit_tests(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails (at teardown of the session's last unit test) when a session that ran only
    tests/unit imported torch or transformers. A teardown error, unlike a change of the
    exit status in a hook, also reaches the controller under pytest-xdist."""
    yield
    if _only_unit_tests(request.session):
        found = heavy_imports()
        assert not found, (
            f"tests/unit imported {found}: the pure protocol tests must run without the "
            "cpu extra (`make test-fast`); use the tiny_model fixture, not the packaged model"
        )
