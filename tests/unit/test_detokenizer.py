from engine import IncrementalDetokenizer, SamplingParams, load_tokenizer
from engine.model_loader import resolve_model_dir

TOKENIZER = None


def _tokenizer():
    global TOKENIZER
    if TOKENIZER is None:
        TOKENIZER = load_tokenizer(resolve_model_dir("tiny"))
    return TOKENIZER


def test_multibyte_characters_are_never_split():
    tok = _tokenizer()
    text = "héllo wörld 日本語 🎉 done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Say:", add_special_tokens=False),
                                   SamplingParams())
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == text
    assert all("\ufffd" not in d for d in deltas)
    # Some tokens end inside a character and produce nothing until it completes.
    assert "" in deltas


def test_stop_string_ends_text_and_is_not_returned():
    tok = _tokenizer()
    ids = tok.encode("one two three four", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=[" three"]))
    shown = ""
    for i in ids:
        shown += detok.add([i])
        if detok.stopped:
            break
    assert detok.stopped and detok.text == "one two"
    assert shown + detok.flush() == "one two"


def test_possible_stop_prefix_is_held_back_until_resolved():
    tok = _tokenizer()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=["END!"]))
    shown = detok.add(tok.encode("ok EN", add_special_tokens=False))
    assert shown == "ok " and not detok.stopped
    shown += detok.add(tok.encode("D?", add_special_tokens=False))
    assert shown == "ok END?" and not detok.stopped
