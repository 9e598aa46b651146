"""One kdj checkout's tokens/s on the real SmolLM2 pair: AR, DFlash, DDTree 16 and 64 at
batch 1 (4 held-out ShareGPT prompts of one 16-token length bucket, one at a time) and batch
64 (64 held-out ShareGPT prompts), bf16, greedy, 128 new tokens, stop tokens off, the cache
fixed at 384 slots; the best of two runs of each. With a second drafter (NEW_DRAFTER) it
also runs that drafter beside the shipped one, and both on 64 HumanEval prompts.

It uses only the public API (kdj.load_target / load_drafter / generate), so the same file
measures two versions of kdj in one lease: run it once per checkout, the older one first on
PYTHONPATH (a `git worktree add OLD <commit>` checkout, e.g. the commit before a refactor):

    PYTHONPATH=OLD python bench/refactor_ab.py before PROMPTS before.json
    python bench/refactor_ab.py after PROMPTS after.json [NEW_DRAFTER]

PROMPTS: eval_prompts.json as `kdj train-drafter` writes it (held-out ShareGPT + HumanEval).
"""

import json
import sys
from collections import Counter

import jax
import numpy as np

import kdj


def chat_prompts(tok, messages, max_tokens=256):
    """One-turn chat prompts of at most max_tokens (longer ones are left out)."""
    ids = (tok.encode(tok.apply_chat_template([{"role": "user", "content": m}])) for m in messages)
    return [p for p in ids if len(p) <= max_tokens]


def tokens_per_s(target, prompts, batch, method, drafter, **kw):
    """(best decode tokens/s of two runs, mean tau) over the prompts in batches of `batch`."""
    best, taus = None, []
    for _ in range(2):
        toks, dec, taus = 0, 0.0, []
        for i in range(0, len(prompts), batch):
            part = prompts[i : i + batch]
            s = kdj.generate(target, part, drafter=drafter, method=method, max_new_tokens=128,
                             temperature=0.0, stop_tokens=[], cache_size=384,
                             **kw).stats  # fmt: skip
            toks += s["new_tokens"] - len(part)  # the first token of each comes from prefill
            dec += s["decode_s"]
            if method != "ar":
                taus += [x for row in s["acceptance_lengths"] for x in row]
        best = toks / dec if best is None else max(best, toks / dec)
    return best, float(np.mean(taus)) if taus else 1.0


def main(argv=None) -> int:
    label, prompts_json, out, *new = argv if argv is not None else sys.argv[1:]
    target = kdj.load_target("smollm2-135m-instruct", dtype="bfloat16")
    texts = json.load(open(prompts_json))
    share = chat_prompts(target.tokenizer, texts["sharegpt"][64:256])
    heval = chat_prompts(target.tokenizer, texts["humaneval"])
    bucket = Counter(len(p) // 16 for p in share).most_common(1)[0][0]
    one = [p for p in share if len(p) // 16 == bucket][:4]  # one length: one compile
    drafters = {"shipped": kdj.load_drafter("kdj/assets/smollm2-135m-dflash-b16", target=target)}
    if new:
        drafters["new"] = kdj.load_drafter(new[0], target=target)
    res = {"label": label, "device": jax.devices()[0].device_kind, "rows": []}

    def run(prompts, batch, method, name, **kw):
        drafter = drafters[name] if method != "ar" else None
        tok_s, tau = tokens_per_s(target, prompts, batch, method, drafter, **kw)
        row = dict(set=len(prompts), batch=batch, method=method + str(kw.get("tree_budget", "")),
                   drafter=name if drafter else None, tok_s=tok_s, tau=tau)  # fmt: skip
        res["rows"].append(row)
        print(label, json.dumps(row), flush=True)
        with open(out, "w") as f:
            json.dump(res, f, indent=1)

    for batch, prompts in ((1, one), (64, share[:64])):
        run(prompts, batch, "ar", None)
        for name in drafters:
            run(prompts, batch, "dflash", name)
            run(prompts, batch, "ddtree", name, tree_budget=16)
            run(prompts, batch, "ddtree", name, tree_budget=64)
    if new:
        for name in drafters:
            run(heval[:64], 64, "dflash", name)
            run(heval[:64], 64, "ddtree", name, tree_budget=64)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
