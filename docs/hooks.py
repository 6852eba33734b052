"""MkDocs hook: the HTTP reference is the API's own OpenAPI schema.

Before each build it builds the Litestar app the way `lastevent api` does, with a stand-in
model and nothing connected (Redis and Postgres are reached only in the app's lifespan,
which never runs here), and writes the schema the app serves at ``/schema/openapi.json``
to ``docs/reference/openapi.json`` (ignored by git). ``docs/reference/http-api.md`` renders
that file with neoteroi-mkdocs' ``[OAD(...)]`` tag into static Markdown: no script, no
viewer loaded from anywhere. ``python docs/hooks.py`` prints the schema.
"""

from __future__ import annotations

import html
import json
import sys
import warnings
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec

SCHEMA = Path(__file__).parent / "reference" / "openapi.json"
PROSE = frozenset({"description", "summary"})


def openapi_schema() -> dict[str, Any]:
    """The schema of the app `lastevent api` serves (a stand-in for the model's tokenizer)."""
    from litestar.exceptions import LitestarDeprecationWarning, LitestarWarning

    from service.api import app as api_app
    from service.settings import Settings
    from service.tokenize import ModelInfo

    model = mock.Mock(spec=ModelInfo, max_model_len=128)
    with mock.patch.object(ModelInfo, "load", return_value=model), warnings.catch_warnings():
        # (Litestar's notices about the handlers' style are the code's business, not the site's)
        warnings.simplefilter("ignore", LitestarWarning)
        warnings.simplefilter("ignore", LitestarDeprecationWarning)
        settings = Settings.from_env({"LASTEVENT_AUTH": "off"})  # (no key store: no Postgres)
        app = api_app.create_app(settings)
        # (its examples hold msgspec structs: encoded as the app encodes them)
        schema: dict[str, Any] = json.loads(msgspec.json.encode(app.openapi_schema.to_schema()))
    return schema


def as_text(node: Any) -> Any:
    """The schema with ``<`` and ``>`` in its prose escaped: the plugin copies descriptions
    into Markdown, where ``<ms>-<seq>`` would be taken for HTML tags and vanish."""
    if isinstance(node, dict):
        return {
            k: (html.escape(v, quote=False) if k in PROSE and isinstance(v, str) else as_text(v))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [as_text(v) for v in node]
    return node


def on_pre_build(config: Any) -> None:
    """Write the schema before MkDocs collects the files (only when it changed, so that
    `mkdocs serve` does not rebuild for ever)."""
    schema = as_text(openapi_schema())
    # (the app names no server: say where `make run` serves it rather than the site's root)
    schema["servers"] = [{"url": "http://127.0.0.1:8000", "description": "make run"}]
    text = json.dumps(schema, indent=2, sort_keys=True) + "\n"
    if not SCHEMA.exists() or SCHEMA.read_text() != text:
        SCHEMA.write_text(text)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    json.dump(openapi_schema(), sys.stdout, indent=2, sort_keys=True)
    print()
