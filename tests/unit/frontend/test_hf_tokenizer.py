"""The Hugging Face twin of the byte tokenizer: same ids, same text, loadable by clients."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from dualpath.config import ModelSpec
from dualpath.frontend.tokenizer import (
    ByteTokenizer,
    HfTokenizer,
    hf_byte_tokenizer,
    load_tokenizer,
    save_hf_tokenizer,
)

SPEC = ModelSpec(preset="tiny")  # vocab 512: ids past the 256 bytes exist
TEXTS = [
    "hello world",
    "  leading and trailing spaces \n\t",
    "héllo wörld ✓ 🎉 日本語",
    "<|user|>hi\n<|assistant|>",
    "".join(map(chr, range(1, 300))),
]


def random_text(rng: random.Random) -> str:
    return "".join(
        chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)])) for _ in range(50)
    )


def test_ids_are_the_byte_tokenizers() -> None:
    byte, hf = ByteTokenizer(SPEC.vocab_size), hf_byte_tokenizer(SPEC.vocab_size)
    rng = random.Random(0)
    for text in TEXTS + [random_text(rng) for _ in range(50)]:
        ids = byte.encode(text)
        assert hf.encode(text).ids == ids
        assert hf.decode(ids) == text


def test_every_model_id_decodes_as_the_byte_tokenizer_does() -> None:
    byte, hf = ByteTokenizer(SPEC.vocab_size), hf_byte_tokenizer(SPEC.vocab_size)
    assert hf.get_vocab_size() == SPEC.vocab_size
    rng = random.Random(1)
    for _ in range(100):  # what a random model emits: any id, specials included
        ids = [rng.randrange(SPEC.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert hf.decode(ids) == byte.decode(ids)


def test_saved_dir_loads_in_transformers_with_ids_and_chat_template(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    out = save_hf_tokenizer(SPEC, tmp_path / "tok")
    auto = transformers.AutoTokenizer.from_pretrained(str(out))
    byte = ByteTokenizer(SPEC.vocab_size)
    for text in TEXTS[:4]:
        assert auto.encode(text, add_special_tokens=False) == byte.encode(text)
        assert auto.encode(text) == byte.encode(text)  # no BOS added: the server adds none
    assert auto.eos_token_id == byte.eos_id
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi ✓"}]
    rendered = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert rendered == byte.chat(msgs)


def test_checkpoint_keeps_its_own_tokenizer(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    save_hf_tokenizer(SPEC, ckpt)  # stands in for a real checkpoint's tokenizer.json
    spec = SPEC.model_copy(update={"checkpoint_path": str(ckpt)})
    assert save_hf_tokenizer(spec, tmp_path / "elsewhere") == ckpt
    assert not (tmp_path / "elsewhere").exists()
    tok = load_tokenizer(spec)
    assert isinstance(tok, HfTokenizer)
    byte = ByteTokenizer(SPEC.vocab_size)
    text = TEXTS[2]
    assert tok.encode(text) == byte.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.chat(msgs) == byte.chat(msgs)
    dec = tok.stream()
    ids = byte.encode(text)
    assert "".join(dec.push([i]) for i in ids) + dec.flush() == text
    assert isinstance(load_tokenizer(SPEC), ByteTokenizer)  # no checkpoint: the byte one


def test_a_vocab_too_small_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="vocabSize"):
        hf_byte_tokenizer(100)
