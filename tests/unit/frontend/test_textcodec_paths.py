"""Fast paths of the text codec: the detokenizer says which token ids the text it returns
was decoded from, so that a tool-call or reasoning parser gets the worker's own ids
instead of the text encoded again (and says it does not know where held-back text is
released or a stop cuts); a marked chat template is split without a per-request
pattern."""

from __future__ import annotations

import pytest

from splitserve.components.frontend.textcodec import _split_marked

pytestmark = pytest.mark.unit


def pushes(detok, ids, step=1):
    out = []
    for i in range(0, len(ids), step):
        text = detok.push(ids[i:i + step])
        out.append((text, detok.text_ids))
    return out


def test_each_piece_carries_its_own_ids(codec):
    ids = codec.prompt_ids("Checking the weather in Paris now.")
    got = pushes(codec.detokenizer([]), ids)
    assert "".join(t for t, _ in got) == codec.decode(ids)
    assert [i for _, piece in got for i in piece] == ids
    assert all(codec.decode(piece) == text for text, piece in got)


def test_a_character_split_over_tokens_comes_with_all_of_them(codec):
    ids = codec.prompt_ids("おわん")
    got = pushes(codec.detokenizer([]), ids)
    assert "".join(t for t, _ in got) == "おわん"
    assert [i for _, piece in got for i in piece] == ids
    assert any(t == "" and piece == [] for t, piece in got)  # a part held for the rest


def test_held_back_or_cut_text_has_no_ids(codec):
    ids = codec.prompt_ids("one two END three")
    detok = codec.detokenizer(["END"])
    got = pushes(detok, ids)
    assert "".join(t for t, _ in got) == "one two "
    assert detok.stopped
    assert got[-1][1] is None or got[-1][0] == ""
    assert any(piece is None for _, piece in got)  # the stop's prefix held, then cut


NONCE = "0123abcd0123abcd"


def marker(i) -> str:
    return f"\ue000{NONCE}:{i}\ue001"


@pytest.mark.parametrize(("rendered", "literal", "order"), [
    (f"<s>{marker(0)}</s><s>{marker(1)}</s>", ["<s>", "</s><s>", "</s>"], [0, 1]),
    ("no content at all", ["no content at all"], []),
    (f"a{marker(0)}", ["a", ""], [0]),
    # A marker the template altered (cut, or its index rewritten) stays in the text.
    (f"a\ue000{NONCE}:0 b{marker(1)}c", [f"a\ue000{NONCE}:0 b", "c"], [1]),
    (f"a\ue000{NONCE}:x\ue001b", [f"a\ue000{NONCE}:x\ue001b"], []),
])
def test_a_marked_template_splits_into_its_text_and_the_contents_order(
        rendered, literal, order):
    assert _split_marked(rendered, NONCE) == (literal, order)

