"""The scored sessions of the serving benchmark (bench/serve.py): multi-turn
conversations whose every turn asks a question with a known answer about the
conversation's own history, built from the evaluation split of the corpus
(never the calibration split) with seeded draws, on the designs of the
evaluation's generators (lab/eval_tasks.cpp), which score the same way:

- niah: a haystack of real text with one pass key per turn planted at spread
  depths, each under its own label (RULER's multi-key needle: the
  evaluation's needle sentence, "The pass key is 1234567. Remember it.
  1234567 is the pass key.", with "of the <label>" added); turn t asks for
  label t. A chat; scored like the evaluation: the reply contains the key.
- kvr: the evaluation's JSON object of 5-letter keys and 6-digit values
  ("Lost in the Middle", as lab/eval_tasks.cpp sizes it for a small model);
  turn t asks key t, the keys drawn from the middle 80% of the object. A
  chat; scored: the reply contains the value.
- code: next-line completion in a Python file, raw /completion prompts as a
  code editor sends them: turn 1 is the file up to a target line, each later
  turn the file up to a target line further on (the true lines in between,
  so a turn's prompt extends the last one's); scored like the evaluation:
  the first non-blank line of the reply against the target line, exact match
  and edit similarity (2 LCS / (|a| + |b|), LongBench's and RepoBench's).

In the chats the assistant's earlier turns are the reference mode's replies
(bench/serve.py), so every mode sends the same requests (paired
comparisons), whatever it answered; "reply" below is the true answer, for
reading.
Lengths are aimed with the corpus manifest's token counts (SmolLM2's
tokenizer); the server's own counts are what the benchmark reports.
Standard library only.
"""
import random

import corpus

NIAH_HEAD = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
             "I will quiz you about the important information there.\n\n")
KVR_HEAD = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{"
LABELS = ["red door", "blue box", "green gate", "yellow car", "white tower", "black boat", "silver key", "golden cup",
          "brown horse", "purple kite", "orange tent", "grey bridge"]
TASKS = ("niah", "kvr", "code")
KVR_TOKENS_PER_PAIR = 13  # '"ABCDE": "123456", ': digits are one token each in SmolLM2's and Qwen2.5's vocabularies


def _digits(rng, n):
    return str(rng.randrange(1, 10)) + "".join(str(rng.randrange(10)) for _ in range(n - 1))


def _name(rng):
    return "".join(chr(65 + rng.randrange(26)) for _ in range(5))


def _text(doc, root):
    with open(corpus.path(doc, root), errors="replace") as f:
        return f.read()


def code_target(line):
    """A line worth predicting (lab/eval_tasks.cpp): 8+ characters of code,
    not a comment, not a lone docstring quote."""
    t = line.strip()
    return len(t) >= 8 and not t.startswith("#") and not t.startswith('"""') and not t.startswith("'''")


def first_code_line(generated):
    """The first line of a reply with a non-blank character, stripped."""
    for line in generated.split("\n"):
        if line.strip():
            return line.strip()
    return ""


def edit_similarity(a, b):
    """2 LCS / (|a| + |b|) over bytes; 1 when both are empty."""
    a, b = a.encode(), b.encode()
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return 2.0 * prev[-1] / (len(a) + len(b))


def score(task, answers, reply):
    """(score, edit similarity or None) in [0, 1]."""
    if task == "code":
        got = first_code_line(reply)
        return float(got == answers[0]), edit_similarity(answers[0], got)
    return float(all(a in reply for a in answers)), None


def _niah(rng, text, turns):
    chars = len(text)
    keys = [_digits(rng, 7) for _ in range(turns)]
    labels = rng.sample(LABELS, turns)
    depths = [0.1 + 0.8 * (i + rng.random()) / turns for i in range(turns)]
    ins = sorted((int(d * chars), i) for i, d in enumerate(depths))
    out, at = [], 0
    for pos, i in ins:
        cut = text.rfind(" ", 0, pos) + 1 or pos  # between words
        out.append(text[at:cut])
        out.append(f"\nThe pass key of the {labels[i]} is {keys[i]}. Remember it. {keys[i]} is the pass key of the {labels[i]}.\n")
        at = cut
    out.append(text[at:chars])
    order = list(range(turns))
    rng.shuffle(order)  # turn 1 does not always ask the first needle
    qs = [{"question": f"What is the pass key of the {labels[i]}? Answer with the number only.", "answers": [keys[i]],
           "reply": f"The pass key of the {labels[i]} is {keys[i]}.", "depth": round(depths[i], 3), "max_tokens": 28} for i in order]
    return NIAH_HEAD + "".join(out), qs


def _kvr(rng, tokens, turns):
    n = max(turns * 4, (tokens - 40) // KVR_TOKENS_PER_PAIR)
    kv, seen = [], set()
    while len(kv) < n:
        k = _name(rng)
        if k not in seen:
            seen.add(k)
            kv.append((k, _digits(rng, 6)))
    picks = rng.sample(range(n // 10, n - n // 10), turns)
    body = ", ".join(f'"{k}": "{v}"' for k, v in kv)
    qs = [{"question": f'Key: "{kv[i][0]}"\nWhat is the value associated with this key? Answer with the value only.',
           "answers": [kv[i][1]], "reply": f'"{kv[i][0]}": "{kv[i][1]}"', "depth": round(i / n, 3), "max_tokens": 28} for i in picks]
    return KVR_HEAD + body + "}", qs


def _code_cuts(rng, text, chars_per_token, tokens, turns, step_tokens):
    """A window of the file starting at a line start, ~`tokens` tokens up to
    turn 1's target line (drawn among those with room before and after), each
    later turn's target ~step_tokens further on. (window start, [{"cut": byte
    offset of the target line, "answers": [the line, stripped]}]) or None
    when the file is too short."""
    starts = [0] + [i + 1 for i, c in enumerate(text[:-1]) if c == "\n"]
    ends = {s: (text.find("\n", s) if text.find("\n", s) >= 0 else len(text)) for s in starts}
    cands = [s for s in starts if code_target(text[s:ends[s]])]
    span = int(chars_per_token * tokens)
    room = int(chars_per_token * step_tokens * 1.3 * (turns - 1))
    first = [s for s in cands if span <= s <= len(text) - room]
    if not first:
        return None
    qs = [first[rng.randrange(len(first))]]
    for _ in range(turns - 1):
        after = [s for s in cands if s >= qs[-1] + int(chars_per_token * step_tokens * (0.7 + 0.6 * rng.random()))]
        if not after:
            return None
        qs.append(after[0])
    begin = max(s for s in starts if s <= qs[0] - span)
    return begin, [{"cut": c, "answers": [text[c:ends[c]].strip()], "max_tokens": 32, "depth": None} for c in qs]


def sessions(root, first, count, lo, hi, turns, seed=1, step_tokens=150):
    """Sessions first..first+count-1 (a block of the benchmark; a session's
    content depends on its index and the seed only). Each: {"id", "task",
    "doc", "kind": "chat" | "completion", "turns": [{"question" | "prompt",
    "answers", "reply" (chats: the assistant turn the next request
    carries), "max_tokens"}]}; turn 1's history aimed at lo..hi tokens."""
    docs = {k: corpus.documents("eval", [k], root=root) for k in corpus.KINDS}
    out = []
    for i in range(first, first + count):
        rng = random.Random(seed * 1000003 + i * 7919)
        task = TASKS[i % len(TASKS)]
        want = lo + rng.randrange(max(1, hi - lo + 1))
        s = {"id": i, "task": task, "tokens_aimed": want}
        if task == "niah":
            pool = [d for d in docs["prose"] + docs["docs"] if d["tokens"] >= want]
            d = pool[rng.randrange(len(pool))]
            text = _text(d, root)
            text = text[:int(len(text) * want / d["tokens"])]
            ctx, qs = _niah(rng, text, turns)
            s.update(doc=d["id"], kind="chat", context=ctx, turns=qs)
        elif task == "kvr":
            ctx, qs = _kvr(rng, want, turns)
            s.update(doc="(json)", kind="chat", context=ctx, turns=qs)
        else:
            pool = [d for d in docs["code"] if ".py" in d["id"] and d["tokens"] >= want + turns * step_tokens * 2]
            rng.shuffle(pool)
            for d in pool:
                text = _text(d, root)
                got = _code_cuts(rng, text, len(text) / d["tokens"], want, turns, step_tokens)
                if got:
                    begin, qs = got
                    for q in qs:
                        q["prompt"] = text[begin:q.pop("cut")]
                    s.update(doc=d["id"], kind="completion", turns=qs)
                    break
            else:
                raise SystemExit(f"serve_tasks: no Python file of the evaluation split holds {want} tokens and {turns} turns")
        out.append(s)
    return out
