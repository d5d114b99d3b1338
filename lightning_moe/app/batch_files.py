"""OpenAI batch files (``moe-batch run-batch -i in.jsonl -o out.jsonl --model DIR``): the request format of the
OpenAI Batch API and of vLLM's ``run_batch`` in, their output format out, run by the engine of ``moe-batch run``.

Input, one JSON object a line (blank lines are skipped)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "any", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64, "temperature": 0}}
    {"custom_id": "q2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "any", "prompt": "1, 2, 3,", "max_tokens": 16, "stop": ["\\n"], "seed": 7}}

Output, one line per input line::

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "req_...",
     "body": {"id": "chatcmpl-...", "object": "chat.completion", "created": 1718000000, "model": "<checkpoint>",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."}, "logprobs": null,
                           "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}}}, "error": null}

(``/v1/completions``: ``"object": "text_completion"``, ``"id": "cmpl-..."``, choices carry ``"text"``.) A line that
cannot run becomes ``{"id", "custom_id" (null when unknown), "response": null, "error": {"code": "invalid_request",
"message": "in.jsonl:LINE: field: problem"}}``: not JSON, not an object, a missing or non-string custom_id, a method
other than POST, another url, a missing or bad body field, a prompt too long for the context.

Body fields. Used: ``messages`` (chat; ``content`` a string or a list of ``{"type": "text", "text"}`` parts, joined
with newlines; roles system, user, assistant, tool) or ``prompt`` (completions; one string), ``max_tokens`` (chat also
``max_completion_tokens``; default ``--max-tokens``), ``temperature`` (default 1, as OpenAI's), ``top_p`` (default 1),
``stop`` (a string or a list), ``seed`` (default 0; sampling is seeded by the seed and the custom_id, so a re-run draws
the same tokens), and vLLM's ``stop_token_ids`` (each in the model's vocabulary) and ``ignore_eos``: every
``GenerationConfig`` field under its vLLM name (``config.job_field``; :func:`_generation` reads them). Log-probs:
chat's ``logprobs`` (true / false) and ``top_logprobs`` (0..20, with ``logprobs: true``), completions' ``logprobs``
(0..20 alternatives); the choice's ``logprobs`` is then filled in the endpoint's format (:func:`_choice_logprobs`),
from the fp32 log-softmax of the raw logits (vLLM's default: before temperature and top-p). Accepted and not used:
``model`` (the checkpoint that runs is ``--model``; the response's ``model`` names it) and ``user``. Accepted only at
their default value, an error record otherwise: ``n`` (1), ``stream`` (false), ``stream_options``,
``presence_penalty`` and ``frequency_penalty`` (0), ``logit_bias`` ({}), chat's
``response_format`` ({"type": "text"}), completions' ``echo`` (false), ``best_of`` (1) and ``suffix``. Any other field
is an error record naming it; null counts as absent everywhere.

custom_id must be unique in the file (as the Batch API requires): a duplicate refuses the whole file, naming both
lines, before anything is written or any weight is read -- an error record for the second line would leave two
records with one custom_id, and no way to match them to their lines.

How it runs. The valid lines are grouped by their sampling settings and endpoint (a chat and a completion request
differ in how the prompt is tokenized); each group is one ``moe-batch run`` job, in the order the groups first appear,
all through one :class:`app.engine.ModelRunner` (the weights are read once and the executor is kept while its policy
fits the group: :meth:`ModelRunner.executor`). A group's job lives in the state directory beside the output
(``out.jsonl`` -> ``out.batch/``): ``g-<key>.requests.jsonl`` (its requests as job lines, ``id`` = custom_id),
``g-<key>.jsonl`` (the engine's records, each fsync'd when it finishes), its partial generations, report and settings.
When a group ends -- or is stopped, or fails -- its records are turned into output lines, in input order, and appended
to ``out.jsonl`` (each line fsync'd, through :class:`data.writer.ResultsWriter`). A record's ids derive from its
custom_id (or, without one, its line number), so a run writes the same records every time.

Resume. Running the command again with the same ``-o`` writes only the custom_ids that have no line in ``out.jsonl``:
a group's records already in ``out.batch/`` are converted first, then its job resumes as ``moe-batch run`` does
(finished sequences skipped, the sequences in flight continued from their partial generations). A custom_id is
never written twice, and a line once written is kept. ``out.batch/meta.json`` keeps the model, the dtype and a digest
of every request: a re-run with another model or dtype, or whose line changed for a custom_id that is finished or
that an earlier run started (its record or partial generation is in ``out.batch/``), is refused (write to a new
``-o``). The state directory may be deleted once a run has finished every line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import (MAX_LOGPROBS, ConfigError, generation_from_dict, generation_from_vllm, job_from_dict, recorded,
                      vllm_fields)
from ..data.sources import CHAT_ROLES, DataError, utf8_lines
from ..data.writer import ResultsWriter, atomic_write, read_results, write_json_atomic

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
OBJECTS = {"chat": "chat.completion", "completion": "text_completion"}
BODY_IDS = {"chat": "chatcmpl-", "completion": "cmpl-"}
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default (sampling); give "temperature": 0 for greedy decoding
_LINE_KEYS = ("custom_id", "method", "url", "body")
_SPECIAL = ("max_new_tokens", "logprobs")  # generation keys whose body fields differ by endpoint: read by _body itself
_BODY_DEFAULTS = {"temperature": DEFAULT_TEMPERATURE}  # OpenAI's defaults where they differ from the job's
_USED = {"model", "user", "max_tokens"} | {f.metadata["vllm"] for f in vllm_fields() if f.name not in _SPECIAL}
_USED_BY = {"chat": {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}, "completion": {"prompt", "logprobs"}}
# fields taken only at their default: (endpoints, allowed values besides null, why another value is refused)
_DEFAULT_ONLY = {
    "n": (("chat", "completion"), (1,), "one choice per request (repeat the line with another custom_id and seed)"),
    "stream": (("chat", "completion"), (False,), "batch responses are not streamed"),
    "stream_options": (("chat", "completion"), (), "batch responses are not streamed"),
    "presence_penalty": (("chat", "completion"), (0,), "presence and frequency penalties are not implemented"),
    "frequency_penalty": (("chat", "completion"), (0,), "presence and frequency penalties are not implemented"),
    "logit_bias": (("chat", "completion"), ({},), "logit biases are not implemented"),
    "response_format": (("chat",), ({"type": "text"},), "structured output is not implemented"),
    "echo": (("completion",), (False,), "the prompt is not echoed"),
    "best_of": (("completion",), (1,), "one candidate per request"),
    "suffix": (("completion",), (), "insertion (a suffix) is not implemented"),
}


class BatchFileError(DataError):
    """A batch file that cannot run at all (a duplicate custom_id, unreadable text), or output that does not belong
    to it; nothing is written."""


@dataclass
class Entry:
    """One input line."""

    line: int  # 1-based line number in the input
    custom_id: Optional[str]  # None when missing or not a string
    kind: Optional[str] = None  # "chat" | "completion" (None: the url was bad)
    prompt: Any = None  # completions: the prompt string; chat: the messages [{"role", "content"}]
    generation: dict = field(default_factory=dict)  # the job's generation section
    max_tokens_from: str = "--max-tokens"  # where max_new_tokens came from: body.max_tokens, ... or --max-tokens
    error: Optional[str] = None  # "in.jsonl:LINE: field: problem" when the line cannot run
    digest: Optional[str] = None  # sha256 of the line's method, url and body (resume: a finished line must not change)

    @property
    def key(self) -> str:
        """What the output is keyed by: the custom_id, or ``#line:N`` for a line without one."""
        return self.custom_id if self.custom_id is not None else f"#line:{self.line}"

    @property
    def group(self) -> str:
        """The group this line runs in: a digest of its endpoint and sampling settings."""
        return hashlib.sha256(json.dumps([self.kind, self.generation], sort_keys=True).encode()).hexdigest()[:12]


def _tname(v: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(v: Any, allowed: Any) -> bool:
    """``v`` equals ``allowed`` with the same JSON type (``true`` is not 1; 0 and 0.0 are both zero)."""
    if isinstance(allowed, bool) or isinstance(v, bool):
        return isinstance(v, bool) and isinstance(allowed, bool) and v == allowed
    if _is_num(allowed):
        return _is_num(v) and v == allowed
    return type(v) is type(allowed) and v == allowed


class _Bad(Exception):
    """A problem of one line: ``field: problem``."""


def _messages(msgs: Any) -> list:
    if not isinstance(msgs, list) or not msgs:
        raise _Bad(f"body.messages: expected a non-empty list of {{role, content}} objects, got "
                   f"{'an empty list' if isinstance(msgs, list) else _tname(msgs)}")
    out = []
    for i, m in enumerate(msgs):
        where = f"body.messages[{i}]"
        if not isinstance(m, dict):
            raise _Bad(f"{where}: expected an object with 'role' and 'content', got {_tname(m)}")
        for k in m:
            if k not in ("role", "content"):
                raise _Bad(f"{where}.{k}: not supported (a message has 'role' and 'content')")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise _Bad(f"{where}.role: expected a string, got {_tname(role)}")
        if role not in CHAT_ROLES:
            raise _Bad(f"{where}.role: {role!r} is not a chat role (one of {', '.join(CHAT_ROLES)})")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise _Bad(f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                               f"are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif not isinstance(content, str):
            raise _Bad(f"{where}.content: expected a string or a list of text parts, got {_tname(content)}")
        out.append({"role": role, "content": content})
    return out


def _body(body: Any, kind: str, default_max_tokens: int) -> tuple[Any, dict, str]:
    """(the prompt or messages, the generation section, where max_tokens came from) of a request body; _Bad names the
    first bad field."""
    if not isinstance(body, dict):
        raise _Bad(f"body: expected an object, got {_tname(body)}")
    for k, v in body.items():
        if v is None or k in _USED or k in _USED_BY[kind]:
            continue
        if k in _DEFAULT_ONLY and kind in _DEFAULT_ONLY[k][0]:
            _kinds, allowed, why = _DEFAULT_ONLY[k]
            if not any(_same(v, a) for a in allowed):
                ok = " or ".join(["null"] + [json.dumps(a) for a in allowed])
                raise _Bad(f"body.{k}: {json.dumps(v)} is not supported ({ok} only): {why}")
            continue
        other = next((o for o in URLS.values() if o != kind and k in _USED_BY[o]), None)
        hint = (f" (a field of {'/v1/chat/completions' if other == 'chat' else '/v1/completions'})" if other else "")
        raise _Bad(f"body.{k}: unknown field for {next(u for u, c in URLS.items() if c == kind)}{hint}")
    if kind == "chat":
        if body.get("messages") is None:
            raise _Bad("body.messages: missing (a chat completion needs its messages)")
        prompt = _messages(body["messages"])
    else:
        p = body.get("prompt")
        if p is None:
            raise _Bad("body.prompt: missing (a completion needs its prompt)")
        if isinstance(p, list):
            raise _Bad("body.prompt: a list (several prompts, or token ids) is not supported: give one prompt string "
                       "a line")
        if not isinstance(p, str):
            raise _Bad(f"body.prompt: expected a string, got {_tname(p)}")
        if not p.strip():
            raise _Bad("body.prompt: empty string")
        prompt = p
    mt, mct = body.get("max_tokens"), body.get("max_completion_tokens")
    if mt is not None and mct is not None and mt != mct:
        raise _Bad(f"body.max_completion_tokens: {mct!r} differs from body.max_tokens {mt!r} (give one)")
    name = "max_completion_tokens" if mct is not None else "max_tokens"
    max_tokens = mct if mct is not None else mt
    if max_tokens is not None and not _is_int(max_tokens):
        raise _Bad(f"body.{name}: expected an integer, got {_tname(max_tokens)}")
    gen = _generation(body, default_max_tokens, name)
    gen["logprobs"] = _logprobs_field(body, kind)
    return prompt, _checked(gen, name), "--max-tokens" if max_tokens is None else f"body.{name}"


def _generation(body: dict, default_max_tokens: int, name: str) -> dict:
    """The generation section of a body's fields under their vLLM names (config.job_field's ``vllm``; OpenAI's
    default where it differs from the job's and the body has none), unchecked but for JSON's types: a number given
    as a string is refused (a job YAML accepts ``'1e-4'``)."""
    given = {}
    for f in vllm_fields():
        key, v = f.metadata["vllm"], body.get(f.metadata["vllm"])
        if f.name in _SPECIAL or v is None:
            continue
        if isinstance(v, str) and isinstance(f.default, (int, float)) and not isinstance(f.default, bool):
            raise _Bad(f"body.{key}: expected {'an integer' if isinstance(f.default, int) else 'a number'}, got "
                       f"{_tname(v)}")
        given[key] = v
    gen = {**_BODY_DEFAULTS, **generation_from_vllm(given)}
    mt = body.get(name)
    gen["max_new_tokens"] = default_max_tokens if mt is None else mt
    return gen


def _checked(gen: dict, name: str) -> dict:
    """``gen`` checked by the job's rules (_Bad naming the body field: ``body.max_tokens: must be >= 1``) and as a
    group keeps it (config.recorded: greedy requests run together whatever their seed, top_p, ...)."""
    gen = {k: v for k, v in gen.items() if v is not None}
    try:
        parsed = generation_from_dict(gen, "body")
    except ConfigError as e:  # "body: generation.max_new_tokens: must be >= 1" -> "body.max_tokens: must be >= 1"
        msg = str(e).removeprefix("body: generation.")
        for f in vllm_fields():
            if msg.startswith((f"{f.name}:", f"{f.name}[")):
                msg = (name if f.name == "max_new_tokens" else f.metadata["vllm"]) + msg[len(f.name):]
                break
        raise _Bad(f"body.{msg}") from None
    return recorded({f.name: getattr(parsed, f.name) for f in vllm_fields()}, greedy_defaults=True)


def _logprobs_field(body: dict, kind: str) -> Optional[int]:
    """The job's ``generation.logprobs`` (None: none asked) from OpenAI's fields: chat ``logprobs`` (true / false) with
    ``top_logprobs`` (0..20 alternatives; only with ``logprobs: true``), completions ``logprobs`` (0..20: the
    alternatives; vLLM's limit, OpenAI's is 5). _Bad names the field."""
    lp = body.get("logprobs")
    if kind == "chat":
        top = body.get("top_logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise _Bad(f"body.logprobs: expected true or false, got {_tname(lp)}")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
            raise _Bad(f"body.top_logprobs: expected an integer in 0..{MAX_LOGPROBS}, got "
                       f"{top if _is_int(top) else _tname(top)}")
        if top and not lp:
            raise _Bad("body.top_logprobs: needs \"logprobs\": true")
        return (top or 0) if lp else None
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_LOGPROBS):
        raise _Bad(f"body.logprobs: expected an integer in 0..{MAX_LOGPROBS} (the alternatives per token), got "
                   f"{lp if _is_int(lp) else _tname(lp)}")
    return lp


def parse_line(text: str, line: int, label: str, default_max_tokens: int) -> Entry:
    """The :class:`Entry` of one input line (an error entry when it cannot run; nothing raises)."""
    where = f"{label}:{line}"
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as e:
        return Entry(line, None, error=f"{where}: malformed JSON: {e.msg} (column {e.colno})")
    if not isinstance(rec, dict):
        return Entry(line, None, error=f"{where}: expected a JSON object, got {_tname(rec)}")
    cid = rec.get("custom_id")
    ent = Entry(line, cid if isinstance(cid, str) and cid else None)
    try:
        if cid is None:
            raise _Bad("custom_id: missing (every request needs a unique custom_id)")
        if not isinstance(cid, str):
            raise _Bad(f"custom_id: expected a string, got {_tname(cid)}")
        if not cid:
            raise _Bad("custom_id: empty string")
        for k in rec:
            if k not in _LINE_KEYS:
                raise _Bad(f"{k}: unknown field (a request line has {', '.join(_LINE_KEYS)})")
        if rec.get("method") != "POST":
            raise _Bad(f"method: expected \"POST\", got {json.dumps(rec.get('method'))}")
        url = rec.get("url")
        if url not in URLS:
            raise _Bad(f"url: {json.dumps(url)} is not supported (one of {', '.join(URLS)})")
        ent.kind = URLS[url]
        if "body" not in rec:
            raise _Bad("body: missing")
        ent.prompt, ent.generation, ent.max_tokens_from = _body(rec["body"], ent.kind, default_max_tokens)
    except _Bad as e:
        ent.error = f"{where}: {e}"
        return ent
    ent.digest = hashlib.sha256(json.dumps([rec.get("method"), rec.get("url"), rec.get("body")],
                                           sort_keys=True).encode()).hexdigest()
    return ent


def read_batch_file(path: str, label: str, default_max_tokens: int) -> list[Entry]:
    """Every non-blank line of ``path`` as an :class:`Entry`. Raises BatchFileError for a duplicate custom_id
    (naming both lines) or text that is not UTF-8."""
    entries: list[Entry] = []
    first: dict[str, int] = {}
    for n, text in utf8_lines(path, label, BatchFileError):  # a line not UTF-8: label:line: ... column
        ent = parse_line(text, n, label, default_max_tokens)
        if ent.custom_id is not None:
            if ent.custom_id in first:
                raise BatchFileError(f"{label}:{n}: custom_id: duplicate {ent.custom_id!r} (first at line "
                                     f"{first[ent.custom_id]}); a batch file's custom_ids must be unique: "
                                     f"nothing was run")
            first[ent.custom_id] = n
        entries.append(ent)
    return entries


# ------------------------------------------------------------------------------------------------
# output records
# ------------------------------------------------------------------------------------------------
def _hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def record_id(key: str) -> str:
    """The output line's ``id`` for the entry keyed ``key`` (stable across runs)."""
    return f"batch_req_{_hex(key)}"


def error_line(ent: Entry, message: str) -> dict:
    """The output line of a request that cannot run."""
    return {"id": record_id(ent.key), "custom_id": ent.custom_id, "response": None,
            "error": {"code": "invalid_request", "message": message}}


def _choice_logprobs(kind: str, rec: dict, tokenizer) -> Optional[dict]:
    """A choice's ``logprobs`` in the endpoint's format from the record's ``logprobs`` / ``top_logprobs`` (None when
    the request asked for none). Tokens are spelled by ``tokenizer.decode([id])``. Chat: ``{"content": [{"token",
    "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}], "refusal": null}``; completions:
    ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob} of the chosen token and the k best], "text_offset"}``
    (vLLM's)."""
    if "logprobs" not in rec:
        return None
    cache: dict[int, str] = {}

    def tok(i: int) -> str:
        if i not in cache:
            cache[i] = tokenizer.decode([i])
        return cache[i]

    ids, lps = rec["output_ids"], rec["logprobs"]
    tops = rec.get("top_logprobs") or [[] for _ in ids]
    if kind == "chat":
        def entry(i: int, lp: float) -> dict:
            return {"token": tok(i), "logprob": lp, "bytes": list(tok(i).encode("utf-8"))}

        return {"content": [{**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]}
                            for i, lp, top in zip(ids, lps, tops)], "refusal": None}
    offsets, at = [], 0
    for i in ids:
        offsets.append(at)
        at += len(tok(i))
    top_dicts = []
    for i, lp, top in zip(ids, lps, tops):
        d = {tok(i): lp}
        for j, v in top:
            d.setdefault(tok(j), v)
        top_dicts.append(d)
    return {"tokens": [tok(i) for i in ids], "token_logprobs": list(lps), "top_logprobs": top_dicts,
            "text_offset": offsets}


def response_line(ent: Entry, rec: dict, model_name: str, created: int, tokenizer=None) -> dict:
    """The output line of the engine's generation record ``rec`` for ``ent`` (``tokenizer`` spells the tokens of
    log-probs, when the request asked for them)."""
    h = _hex(ent.key)
    choice: dict = {"index": 0}
    if ent.kind == "chat":
        choice["message"] = {"role": "assistant", "content": rec["text"]}
    else:
        choice["text"] = rec["text"]
    choice.update(logprobs=_choice_logprobs(ent.kind, rec, tokenizer) if tokenizer is not None else None,
                  finish_reason=rec["finish_reason"])
    usage = {"prompt_tokens": rec["prompt_tokens"], "completion_tokens": rec["output_tokens"],
             "total_tokens": rec["prompt_tokens"] + rec["output_tokens"]}
    body = {"id": BODY_IDS[ent.kind] + h, "object": OBJECTS[ent.kind], "created": created, "model": model_name,
            "choices": [choice], "usage": usage}
    return {"id": record_id(ent.key), "custom_id": ent.custom_id,
            "response": {"status_code": 200, "request_id": f"req_{h}", "body": body}, "error": None}


_ENGINE_WORDS = (("generation.max_new_tokens", "max_tokens"), ("; shorten it or set data.truncate: left", "; shorten it"))


def engine_error(message: str, requests_path: str, ent: Entry, label: str) -> str:
    """An engine error record's message (``<group requests file>:N: field: ...``) named by the input line."""
    rest = re.sub(rf"^{re.escape(requests_path)}:\d+: ", "", message)
    for a, b in _ENGINE_WORDS:
        rest = rest.replace(a, b)
    rest = re.sub(r"^(prompt|messages):", r"body.\1:", rest)
    return f"{label}:{ent.line}: {rest}"


# ------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------
def state_dir(output_path: str) -> str:
    """The state directory beside ``output_path``: ``out.jsonl`` -> ``out.batch``."""
    return os.path.splitext(os.path.abspath(output_path))[0] + ".batch"


def _model_name(model: str) -> str:
    return os.path.basename(os.path.normpath(model)) or model


def _done_keys(path: str, entries: list[Entry]) -> set:
    """Keys of ``entries`` that have a line in the output ``path`` (by custom_id, or by id for lines without one);
    BatchFileError when a custom_id has two lines there."""
    by_cid: dict[str, int] = {}
    ids = set()
    for n, rec in enumerate(read_results(path), start=1):
        cid = rec.get("custom_id")
        if isinstance(cid, str):
            if cid in by_cid:
                raise BatchFileError(f"{path}:{n}: custom_id {cid!r} has a second line (first at line {by_cid[cid]}); "
                                     f"the file was not written by one moe-batch run-batch (move it away)")
            by_cid[cid] = n
        ids.add(rec.get("id"))
    return {e.key for e in entries if (e.custom_id in by_cid if e.custom_id is not None else record_id(e.key) in ids)}


def _started(state: str, gid: str) -> set:
    """Ids with work in group ``gid``'s files in ``state``: an engine record or a partial generation."""
    ids: set = set()
    for suffix in (".jsonl", ".partial.jsonl"):
        path = os.path.join(state, f"g-{gid}{suffix}")
        if os.path.exists(path):
            ids.update(r.get("id") for r in read_results(path))
    return ids


def _check_meta(meta_path: str, settings: dict, entries: list[Entry], done: set, out_path: str, label: str) -> dict:
    """Compare the saved settings and request digests with this run's and return the meta to save. ConfigError when
    results exist (lines in the output, or work in the state directory) of another model or dtype, or when a line
    changed whose custom_id has a line in the output or work in its group's files (it would be reused)."""
    old: dict = {}
    if os.path.exists(meta_path):
        try:
            with open(meta_path) as f:
                old = json.load(f)
            if not isinstance(old, dict):
                raise ValueError(f"expected a JSON object, got {_tname(old)}")
        except ValueError as e:
            raise ConfigError(f"{meta_path}: unreadable ({e}); delete it to accept {out_path} as it is") from None
    state = os.path.dirname(meta_path)
    digests = dict(old.get("requests") or {})
    work = bool(done) or any(n.startswith("g-") for n in (os.listdir(state) if os.path.isdir(state) else ()))
    diff = [k for k in settings if old and work and old.get(k) != settings[k]]
    if diff:
        raise ConfigError(f"{out_path} holds results of other settings ("
                          + "; ".join(f"{k}: {old.get(k)!r} then, {settings[k]!r} now" for k in diff)
                          + f"; saved in {meta_path}): write to a new -o, or move the old output and "
                          f"{state} away")
    started: dict[str, set] = {}
    for e in entries:
        if e.digest is None or digests.get(e.key) in (None, e.digest):
            continue
        if e.key in done:
            raise ConfigError(f"{label}:{e.line}: custom_id {e.custom_id!r} changed since its line in {out_path} "
                              f"was written; write to a new -o to run the changed requests")
        if e.custom_id in started.setdefault(e.group, _started(state, e.group)):
            raise ConfigError(f"{label}:{e.line}: custom_id {e.custom_id!r} changed since an earlier run started it "
                              f"(its work is in {state}/g-{e.group}.*); write to a new -o, or delete those files "
                              f"to start the group over")
    for e in entries:
        if e.digest is not None and e.key not in done:
            digests[e.key] = e.digest
    return {**settings, "requests": digests}


def run_batch(input_path: str, output_path: str, model: str, *, device: str = "cuda", dtype: str = "bfloat16",
              gpu_memory: Any = None, cpu_memory: Any = None, hardware: Optional[str] = None, policy: Any = "auto",
              executor: Optional[str] = None, expert_ffn: str = "auto", batch_size: int = 16,
              max_tokens: int = 128, checkpoint_seconds: Optional[float] = 60.0, progress: bool = True,
              log=sys.stderr) -> dict:
    """Run the batch file ``input_path`` into ``output_path`` (resuming what an earlier run left); returns a summary
    ``{"output", "state", "lines", "written", "errors", "completed", "groups": [...]}``.

    The settings are a job's (``config.job_from_dict`` checks them: a ConfigError names the setting);
    ``max_tokens`` is the default of bodies without one. Raises ConfigError / BatchFileError (nothing written) for bad
    settings, a missing input, a duplicate custom_id or an output of other settings; JobStopped (app.engine) after a
    stop signal, with every finished record written.
    """
    from .engine import ModelRunner, check_device, run_job
    from .plan import ModelFiles

    label = input_path
    if not os.path.isfile(input_path):
        raise ConfigError(f"{label}: input file not found")
    out = os.path.abspath(output_path)
    if os.path.isdir(out):
        raise ConfigError(f"{output_path}: is a directory, expected the output .jsonl file")
    if os.path.exists(out) and os.path.samefile(out, input_path):
        raise ConfigError(f"{output_path}: is the input file; it would be overwritten")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"--max-tokens: expected an integer >= 1, got {max_tokens!r}")
    base: dict = {"model": model, "device": device, "dtype": dtype, "policy": policy, "expert_ffn": expert_ffn,
                  "batch_size": batch_size}
    for k, v in (("gpu_memory", gpu_memory), ("cpu_memory", cpu_memory), ("hardware", hardware),
                 ("executor", executor)):
        if v is not None:
            base[k] = v
    ckpt = {"every_seconds": checkpoint_seconds} if checkpoint_seconds else {"every_seconds": None}
    probe = job_from_dict({**base, "checkpoint": ckpt}, "moe-batch run-batch", in_memory=True,
                          notify=True)  # every setting checked
    check_device(probe)
    entries = read_batch_file(input_path, label, max_tokens)
    files = ModelFiles(probe.model)
    context = files.spec.max_position_embeddings
    has_template = getattr(files.tokenizer, "chat_template", None) is not None
    for e in entries:
        if e.error is not None:
            continue
        if e.kind == "chat" and not has_template:
            e.error = (f"{label}:{e.line}: body.messages: the model's tokenizer has no chat template (send a prompt "
                       f"to /v1/completions instead)")
        elif e.generation["max_new_tokens"] >= context:
            e.error = (f"{label}:{e.line}: {e.max_tokens_from}: {e.generation['max_new_tokens']} leaves no room for "
                       f"a prompt in the model context of {context} tokens")
        else:
            bad = [(j, t) for j, t in enumerate(e.generation.get("stop_token_ids", ())) if t >= files.spec.vocab_size]
            if bad:
                e.error = (f"{label}:{e.line}: body.stop_token_ids[{bad[0][0]}]: {bad[0][1]} is outside the model's "
                           f"vocabulary [0, {files.spec.vocab_size}) (the ids it can generate)")

    state = state_dir(out)
    done = _done_keys(out, entries) if os.path.exists(out) else set()  # a torn last line does not count
    meta_path = os.path.join(state, "meta.json")
    meta = _check_meta(meta_path, {"model": probe.model, "dtype": probe.dtype}, entries, done, out, label)
    os.makedirs(state, exist_ok=True)
    write_json_atomic(meta_path, meta)
    writer = ResultsWriter(out)  # a torn last line (a killed run) is cut away here
    try:
        summary: dict = {"output": out, "state": state, "lines": len(entries), "skipped_already_done": len(done),
                         "groups": []}
        for e in entries:  # lines that cannot run: their records first, before any weight is read
            if e.error is not None and e.key not in done:
                writer.write(error_line(e, e.error))
        groups: dict[str, list[Entry]] = {}
        for e in entries:
            if e.error is None and e.key not in done:
                groups.setdefault(e.group, []).append(e)
        name = _model_name(probe.model)
        runner = ModelRunner(files, probe.dtype, log) if groups else None
        try:
            for i, (gid, ents) in enumerate(groups.items()):
                summary["groups"].append(_run_group(i, len(groups), gid, ents, base, ckpt, state, writer, runner,
                                                    name, label, progress, log, run_job))
        finally:
            if runner is not None:
                runner.close()
        recs = read_results(out)
        mine = {record_id(e.key) for e in entries}
        summary["written"] = writer.written
        summary["errors"] = sum(1 for r in recs if r.get("id") in mine and r.get("error") is not None)
        summary["completed"] = sum(1 for r in recs if r.get("id") in mine and r.get("error") is None)
        return summary
    finally:
        writer.close()


def _describe_group(kind: str, gen: dict) -> str:
    parts = [f"max_tokens {gen['max_new_tokens']}", f"temperature {gen['temperature']:g}"]
    if gen["top_p"] != 1.0:
        parts.append(f"top_p {gen['top_p']:g}")
    if gen["temperature"] > 0:
        parts.append(f"seed {gen['seed']}")
    if gen.get("stop"):
        parts.append(f"stop {json.dumps(gen['stop'])}")
    if gen.get("stop_token_ids"):
        parts.append(f"stop_token_ids {gen['stop_token_ids']}")
    if not gen["stop_at_eos"]:
        parts.append("ignore_eos")
    if gen.get("logprobs") is not None:
        parts.append(f"logprobs {gen['logprobs']}")
    return f"{'chat' if kind == 'chat' else 'completions'}, " + ", ".join(parts)


def _run_group(i: int, count: int, gid: str, ents: list[Entry], base: dict, ckpt: dict, state: str,
               writer: ResultsWriter, runner, model_name: str, label: str, progress: bool, log, run_job) -> dict:
    """Run one group's job (resuming its records and partials in ``state``) and append its output lines."""
    kind, gen = ents[0].kind, ents[0].generation
    stem = os.path.join(state, f"g-{gid}")
    req_path, res_path = stem + ".requests.jsonl", stem + ".jsonl"

    def engine_records() -> dict:
        return {r["id"]: r for r in read_results(res_path)} if os.path.exists(res_path) else {}

    def convert() -> int:
        """Append the output lines of this group's engine records that are not in the output yet (input order)."""
        recs, n, created, written = engine_records(), 0, int(time.time()), writer.done_ids()
        for e in ents:
            rec = recs.get(e.custom_id)
            if rec is None or record_id(e.key) in written:
                continue
            if rec.get("error") is not None:
                writer.write(error_line(e, engine_error(rec["error"], req_path, e, label)))
            else:
                writer.write(response_line(e, rec, model_name, created, runner.files.tokenizer))
            n += 1
        return n

    info = {"group": f"g-{gid}", "settings": _describe_group(kind, gen), "requests": len(ents), "ran": 0,
            "report": None}
    convert()  # records an earlier run finished but did not append
    have = engine_records()
    todo = [e for e in ents if e.custom_id not in have]
    if not todo:
        return info
    print(f"moe-batch run-batch: group {i + 1}/{count} ({info['settings']}): {len(todo)} "
          f"request{'s' if len(todo) != 1 else ''}", file=log, flush=True)
    lines = [json.dumps({"id": e.custom_id, ("messages" if kind == "chat" else "prompt"): e.prompt},
                        ensure_ascii=False) + "\n" for e in todo]
    write_json_lines(req_path, lines)
    job = job_from_dict({**base, "name": f"g-{gid}", "task": "generate", "on_error": "record",
                         "data": {"source": "jsonl", "path": req_path, "chat_template": kind == "chat"},
                         "output": {"path": res_path}, "generation": gen, "checkpoint": ckpt},
                        "moe-batch run-batch")
    try:
        report = run_job(job, progress=progress, log=log, runner=runner)
    finally:
        convert()  # also after a stop or a failure: what finished is kept
    info.update(ran=len(todo), report=job.output.report_path, generated_tokens=report.get("generated_tokens"),
                end_to_end_tokens_per_s=report.get("end_to_end_tokens_per_s"))
    return info


def write_json_lines(path: str, lines: list[str]) -> None:
    """Replace ``path`` atomically with ``lines``."""
    atomic_write(path, lambda f: f.write("".join(lines).encode("utf-8")))


__all__ = ["run_batch", "read_batch_file", "parse_line", "state_dir", "record_id", "BatchFileError", "Entry"]
