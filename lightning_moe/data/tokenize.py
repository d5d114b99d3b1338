"""Tokenization of requests: chat templates, scoring splits, and the context-length check.

Rules (one place, so generation and scoring agree):

* Plain prompts: ``tokenizer(prompt).input_ids`` -- special tokens as the tokenizer adds them (BOS for
  Llama/Mistral tokenizers).
* Chat (``data.chat_template: true``): ``tokenizer.apply_chat_template(messages, add_generation_prompt=True,
  tokenize=True)``; a plain ``prompt`` becomes ``[{"role": "user", "content": prompt}]``, and
  ``data.system_prompt`` is prepended as a ``system`` message unless the messages already start with one;
  ``data.chat_template_kwargs`` are passed to the template as its variables (Qwen3's ``enable_thinking``).
  (The template itself supplies BOS; no extra special tokens are added.)
* Loglikelihood / multiple choice (lm-eval-harness's split): ``context = encode(prompt)``; the
  continuation's ids are ``encode(prompt + continuation)[len(context):]`` when that encoding starts with
  the context ids (so the tokens are the ones the model would see in the joined text), else
  ``encode(continuation)`` without special tokens. For chat contexts the joined text is the rendered
  template text plus the continuation, encoded without special tokens.
* Token ids (``prompt_token_ids``, with ``continuation_token_ids`` for loglikelihood): taken as given, nothing added
  or re-tokenized; every id must be below the tokenizer's vocabulary size (``len(tokenizer)``).
* Perplexity: ``text_ids = encode(text)`` (with BOS when the tokenizer adds it); every token after the
  first is scored.
* Length: generate needs ``len(prompt_ids) + max_new_tokens <= max_context``; scoring needs each full
  sequence ``len(context) + len(continuation) <= max_context`` (perplexity: ``len(text_ids) <= max_context``
  unless ``score.stride`` is set, when the scorer rolls windows and any length is fine). Too long: with
  ``data.truncate: left`` the oldest context tokens are dropped (a leading BOS is kept; continuations are
  never cut); otherwise a :class:`DataError`, or an error record under ``on_error: record``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning_moe.config import ConfigError
from lightning_moe.data.sources import DataError, Request


@dataclass(frozen=True)
class TokenizedRequest:
    """A request with its token ids (all ids are Python ints)."""

    id: str  # request id
    request: Request  # the source request (file, line, texts)
    prompt_ids: list  # generate: the prompt; loglikelihood/multiple_choice: the context; perplexity: []
    continuation_ids: Optional[list] = None  # loglikelihood: ids scored after the context
    choice_ids: Optional[list] = None  # multiple_choice: one id list per choice, scored after the context
    text_ids: Optional[list] = None  # perplexity: the whole text's ids (first token unscored)
    truncated: int = 0  # context tokens dropped from the left (data.truncate: left)
    error: Optional[str] = None  # "file:line: field: problem" when the request failed (on_error: record)

    @property
    def prompt_tokens(self) -> int:
        """Number of prompt (context) tokens fed to the model before generation/scoring."""
        return len(self.prompt_ids)

    @property
    def score_inputs(self) -> list:
        """``[(sequence_ids, first_scored_index), ...]`` for the scorer.

        The scored tokens of ``seq`` are ``seq[first:]``; their log-probs are entries ``first-1 ..`` of
        ``SerialExecutor.prompt_logprobs([seq])[0]`` (which has ``len(seq) - 1`` entries). One entry for
        loglikelihood, one per choice for multiple_choice, one for perplexity (first = 1; with
        ``score.stride`` the scorer windows the sequence itself). Empty for generate and error requests.
        """
        if self.error is not None:
            return []
        if self.continuation_ids is not None:
            return [(self.prompt_ids + self.continuation_ids, len(self.prompt_ids))]
        if self.choice_ids is not None:
            return [(self.prompt_ids + c, len(self.prompt_ids)) for c in self.choice_ids]
        if self.text_ids is not None:
            return [(list(self.text_ids), 1)]
        return []


# ------------------------------------------------------------------------------------------------
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model", "tekken.json", "*.tiktoken")  # a tokenizer's vocabulary, one of these


def _has_tokenizer_files(model_dir: str) -> bool:
    """Whether ``model_dir`` holds one of :data:`TOKENIZER_FILES` (a directory that cannot be listed: assumed so)."""
    try:
        names = os.listdir(model_dir)
    except OSError:
        return True
    return any(n in TOKENIZER_FILES or n.endswith(".tiktoken") for n in names)


def load_tokenizer(model_dir: str):
    """``transformers.AutoTokenizer.from_pretrained(model_dir)`` (``"tiny-mixtral"`` resolves to the embedded model).

    Raises:
        DataError: the directory has no loadable tokenizer (the message names the directory; with none of
            :data:`TOKENIZER_FILES` in it, the files looked for).
    """
    from transformers import AutoTokenizer

    if model_dir == "tiny-mixtral":
        from lightning_moe.model.tiny import ensure_tiny_mixtral

        model_dir = ensure_tiny_mixtral()
    try:
        tok = AutoTokenizer.from_pretrained(model_dir)
    except Exception as e:  # transformers raises OSError/ValueError/... depending on what is missing
        if not _has_tokenizer_files(model_dir):  # its message then blames packages ("sentencepiece or tiktoken")
            raise DataError(f"model: no tokenizer files in {model_dir} (looked for {', '.join(TOKENIZER_FILES)}); "
                            f"copy them from the checkpoint's source, beside its config.json") from None
        raise DataError(f"model: could not load a tokenizer from {model_dir}: {e}") from None
    # prompt lengths are checked against the job's budget by our own code (with file:line errors); without this
    # transformers prints its own "sequence length is longer than ..." warning first. Nothing here truncates.
    tok.model_max_length = 10**30
    return tok


# ------------------------------------------------------------------------------------------------
def _ids(x: Any) -> list:
    """Normalize tokenizer output (list, BatchEncoding/dict with input_ids, tensor, nested [1, T]) to list[int]."""
    if hasattr(x, "keys") and "input_ids" in x:
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    x = list(x)
    if len(x) == 1 and isinstance(x[0], (list, tuple)):
        x = list(x[0])
    return [int(t) for t in x]


def _encode(tokenizer, text: str, special: bool) -> list:
    return _ids(tokenizer(text, add_special_tokens=special)["input_ids"])


class _Failure(Exception):
    """A per-request problem (becomes a DataError or an error record)."""


def _messages_for(req: Request, system_prompt: Optional[str]) -> list:
    msgs = list(req.messages) if req.messages is not None else [{"role": "user", "content": req.prompt}]
    if system_prompt is not None and not (msgs and msgs[0].get("role") == "system"):
        msgs = [{"role": "system", "content": system_prompt}] + msgs
    return msgs


def _chat(tokenizer, req: Request, system_prompt: Optional[str], render: bool = False,
          template_kwargs: Optional[dict] = None):
    msgs = _messages_for(req, system_prompt)
    field = "messages" if req.messages is not None else "prompt"
    kw = template_kwargs or {}
    try:
        ids = _ids(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False,
                                                 **kw))
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw) if render else None
    except Exception as e:  # jinja TemplateError, e.g. "roles must alternate user/assistant"
        raise _Failure(f"{req.where}: {field}: chat template failed: {e}") from None
    return ids, text


def _split(tokenizer, ctx_ids: list, ctx_text: str, cont: str, special: bool, full: Optional[list] = None) -> list:
    """Continuation ids after a context (see module docstring for the rule); ``full``: the ids of ``ctx_text + cont``
    when already encoded (the batched call of :func:`encode_requests`)."""
    if full is None:
        full = _encode(tokenizer, ctx_text + cont, special)
    if full[: len(ctx_ids)] == ctx_ids and len(full) > len(ctx_ids):
        return full[len(ctx_ids):]
    return _encode(tokenizer, cont, False)


def _truncate_left(ids: list, keep: int, bos: Optional[int]) -> tuple[list, int]:
    """Keep the last ``keep`` tokens (a leading BOS stays in front). Returns (ids, dropped)."""
    if len(ids) <= keep:
        return ids, 0
    if bos is not None and ids and ids[0] == bos and keep >= 2:
        kept = [ids[0]] + ids[len(ids) - (keep - 1):]
    else:
        kept = ids[len(ids) - keep:]
    return kept, len(ids) - len(kept)


def encode_requests(requests: Sequence[Request], tokenizer, job, max_context: int) -> list:
    """Tokenize requests for ``job.task`` / ``job.score.mode`` and check them against the context length.

    Args:
        requests: from :func:`lightning_moe.data.sources.load_requests` (requests with ``.error`` pass through
            as error results).
        tokenizer: a Hugging Face tokenizer (``load_tokenizer``).
        job: the :class:`lightning_moe.config.Job`.
        max_context: the model's context length in tokens (``MoESpec.max_position_embeddings``).

    Returns:
        list[TokenizedRequest], same order as ``requests``; under ``on_error: record`` failed ones have
        ``error`` set and empty ids.

    Raises:
        ConfigError: ``generation.max_new_tokens`` leaves no room for a prompt in ``max_context``.
        DataError: ``data.chat_template`` is on but the tokenizer has no chat template; or (unless
            ``on_error: record``) a request is too long (``file:line: field: N tokens ...``) or its chat
            template fails to render.
    """
    task = job.task
    mode = job.score.mode if job.score is not None else None
    chat = job.data.chat_template
    truncate = job.data.truncate == "left"
    record = job.on_error == "record"
    bos = getattr(tokenizer, "bos_token_id", None)

    if chat and getattr(tokenizer, "chat_template", None) is None and any(
            r.error is None for r in requests) and mode != "perplexity":
        raise DataError("data.chat_template: the model's tokenizer has no chat template "
                        "(set data.chat_template: false to feed prompts as plain text)")
    if task == "generate":
        budget = max_context - job.generation.max_new_tokens
        if budget < 1:
            raise ConfigError(f"{job.label}: generation.max_new_tokens: {job.generation.max_new_tokens} leaves no room for a "
                              f"prompt in the model context of {max_context} tokens")
    else:
        budget = max_context

    # Plain prompts/texts, and the joined context + continuation texts of plain-text scoring requests (the split's
    # first encoding), are encoded in one batched call (fast tokenizers parallelize it): keys i and (i, k)
    texts: dict = {}
    for i, r in enumerate(requests):
        if r.error is not None:
            continue
        if mode == "perplexity":
            texts[i] = r.text
        elif not chat and r.prompt is not None:
            texts[i] = r.prompt
            if mode in ("loglikelihood", "multiple_choice") and r.prompt_ids is None:
                conts = [r.continuation] if mode == "loglikelihood" else list(r.choices or [])
                texts.update({(i, k): r.prompt + c for k, c in enumerate(conts) if isinstance(c, str)})
    batch_ids: dict = {}
    if texts:
        keys = list(texts)
        enc = tokenizer([texts[k] for k in keys])["input_ids"]
        batch_ids = {k: _ids(e) for k, e in zip(keys, enc)}

    out = []
    for i, r in enumerate(requests):
        if r.error is not None:
            out.append(TokenizedRequest(id=r.id, request=r, prompt_ids=[], error=r.error))
            continue
        try:
            out.append(_one(r, i, tokenizer, job, task, mode, chat, truncate, bos, budget, max_context, batch_ids))
        except _Failure as e:
            if not record:
                raise DataError(str(e)) from None
            out.append(TokenizedRequest(id=r.id, request=r, prompt_ids=[], error=str(e)))
    return out


def _one(r: Request, i: int, tokenizer, job, task, mode, chat, truncate, bos, budget, max_context, batch_ids):
    field = "messages" if r.messages is not None else "prompt"
    hint = "shorten it or set data.truncate: left"

    if mode == "perplexity":
        ids = batch_ids[i]
        dropped = 0
        if job.score.stride is None and len(ids) > max_context:
            if not truncate:
                raise _Failure(f"{r.where}: text: {len(ids)} tokens exceed the model context of {max_context} "
                               f"(set score.stride to score it in rolling windows, or {hint})")
            ids, dropped = _truncate_left(ids, max_context, bos)
        return TokenizedRequest(id=r.id, request=r, prompt_ids=[], text_ids=ids, truncated=dropped)

    if r.prompt_ids is not None:
        field = "prompt_token_ids"
        vocab = len(tokenizer)
        for fld, ids in ((field, r.prompt_ids), ("continuation_token_ids", r.continuation_ids)):
            if ids and max(ids) >= vocab:
                k = next(k for k, t in enumerate(ids) if t >= vocab)
                raise _Failure(f"{r.where}: {fld}[{k}]: {ids[k]} is not a token id of the model's tokenizer "
                               f"(vocabulary of {vocab})")
        ctx_ids, ctx_text, special = list(r.prompt_ids), None, False
    elif chat:
        ctx_ids, ctx_text = _chat(tokenizer, r, job.data.system_prompt, render=task == "score",
                                  template_kwargs=job.data.chat_template_kwargs)
        special = False
    else:
        ctx_ids, ctx_text, special = batch_ids[i], r.prompt, True

    if task == "generate":
        ids, dropped = ctx_ids, 0
        if len(ids) > budget:
            if not truncate:
                raise _Failure(f"{r.where}: {field}: {len(ids)} tokens exceed the prompt budget of {budget} "
                               f"(model context {max_context} - generation.max_new_tokens "
                               f"{job.generation.max_new_tokens}); {hint}")
            ids, dropped = _truncate_left(ids, budget, bos)
        return TokenizedRequest(id=r.id, request=r, prompt_ids=ids, truncated=dropped)

    # loglikelihood / multiple_choice: continuations are never truncated, contexts may be
    if mode == "loglikelihood":
        if r.continuation_ids is not None:
            conts, names = [list(r.continuation_ids)], ["continuation_token_ids"]
        else:
            conts = [_split(tokenizer, ctx_ids, ctx_text, r.continuation, special, batch_ids.get((i, 0)))]
            names = ["continuation"]
    else:
        conts = [_split(tokenizer, ctx_ids, ctx_text, c, special, batch_ids.get((i, k))) for k, c in enumerate(r.choices)]
        names = [f"choices[{k}]" for k in range(len(conts))]
    longest = max(len(c) for c in conts)
    which = names[max(range(len(conts)), key=lambda k: len(conts[k]))]
    dropped = 0
    if len(ctx_ids) + longest > max_context:
        room = max_context - longest
        if not truncate or room < 1:
            raise _Failure(f"{r.where}: {field if room >= 1 else which}: context {len(ctx_ids)} + {which} {longest} "
                           f"tokens exceed the model context of {max_context}"
                           + (f"; {hint}" if room >= 1 else " (the continuation alone does not fit)"))
        ctx_ids, dropped = _truncate_left(ctx_ids, room, bos)
    if mode == "loglikelihood":
        return TokenizedRequest(id=r.id, request=r, prompt_ids=ctx_ids, continuation_ids=conts[0], truncated=dropped)
    return TokenizedRequest(id=r.id, request=r, prompt_ids=ctx_ids, choice_ids=conts, truncated=dropped)
