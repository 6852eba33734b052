"""A stream token is verified, or refused with None, whatever the text it is given --
never an exception (a non-ASCII signature was a 500 without any key)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.api.auth import Principal
from service.api.tokens import StreamTokens

TOKENS = StreamTokens(b"s" * 32, ttl_s=60)
ISSUED = TOKENS.issue(Principal(tenant="t", key_id="k", role="user"), "chatcmpl-x", now=0.0)
VERSION, BODY, SIG = ISSUED.split(".")

texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)


@given(texts)
def test_any_text_is_refused_without_an_error(token: str) -> None:
    assert TOKENS.verify(token, "chatcmpl-x", now=1.0) is None


@given(texts)
def test_a_signature_or_body_of_any_text_is_refused(junk: str) -> None:
    assert TOKENS.verify(f"{VERSION}.{BODY}.{junk}", "chatcmpl-x", now=1.0) is None
    assert TOKENS.verify(f"{VERSION}.{junk}.{SIG}", "chatcmpl-x", now=1.0) is None


def test_the_issued_token_verifies_for_its_request_only() -> None:
    assert TOKENS.verify(ISSUED, "chatcmpl-x", now=1.0) is not None
    assert TOKENS.verify(ISSUED, "chatcmpl-y", now=1.0) is None
    assert TOKENS.verify(ISSUED.replace(SIG, SIG + "é"), "chatcmpl-x", now=1.0) is None
