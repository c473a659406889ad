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


def test_several_tokens_at_once_stop_at_the_token_that_completed_the_stop():
    tok = _tokenizer()
    ids = tok.encode("one two three four five", add_special_tokens=False)
    one_by_one = IncrementalDetokenizer(tok, [], SamplingParams(stop=["thr"]))
    for i in ids:
        one_by_one.add([i])
        if one_by_one.stopped:
            break
    at_once = IncrementalDetokenizer(tok, [], SamplingParams(stop=["thr"]))
    at_once.add(ids[:1])
    at_once.add(ids[1:])  # a speculative step: every remaining token in one call
    assert at_once.stopped and at_once.text == one_by_one.text == "one two "
    assert at_once.num_tokens == one_by_one.num_tokens < len(ids)
    assert at_once.add(ids) == "" and at_once.num_tokens == one_by_one.num_tokens
