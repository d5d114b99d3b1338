"""The Python API: ``from lightning_moe import LLM, SamplingParams`` (vLLM's names where they fit).

    from lightning_moe import LLM, SamplingParams

    llm = LLM("tiny-mixtral", device="cpu", dtype="float32")
    for out in llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(max_tokens=16)):
        print(out.request_id, out.finish_reason, repr(out.text))

An :class:`LLM` is one model with the settings of a job (device, dtype, memory caps, hardware, policy, executor, ...),
validated as a job YAML's keys are (``config.job_from_dict``: a wrong value or an unknown keyword is an error naming
it). It reads the tokenizer and the weights once, in the constructor, and every call reuses them.

Each call is an in-memory job run by the engine of ``moe-batch run`` (``app.engine``): the requests are checked and
tokenized as a JSONL file's are (chat messages through the tokenizer's chat template, as ``data.chat_template``
does), planned (``policy: auto`` plans every call for its real prompt lengths), and run by the same executor and batch
loop; the records are the ones ``moe-batch run`` writes for the same requests and settings, returned in input order
instead of written. Nothing is written to disk (no resume, checkpoints or report) and no signal handler is installed.

Executors are kept between calls: a cgopipe executor keeps its policy for a later call while that policy fits the
call's workload (the memory model) and is predicted at >= 90% of the planner's end-to-end tokens/s for it
(``app.engine.KEEP_POLICY_SPEED``; :meth:`LLM.plan` shows the planner's choice). Otherwise it is rebuilt with the
planner's policy, which reads the weights again (its page pool held the experts; a line on stderr says so). A GPU
``gpu_memory`` cap is applied to this process's CUDA allocator in the constructor.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

from .config import SCORE_MODES, ConfigError, generation_from_dict, generation_from_vllm, job_from_dict, vllm_fields

Messages = Sequence[Mapping[str, str]]  # one chat conversation: [{"role": "user", "content": "..."}, ...]
TokensPrompt = Mapping[str, Sequence[int]]  # {"prompt_token_ids": [...]}: token ids fed as they are (vLLM's name)
Prompt = Union[str, Messages, TokensPrompt]  # a plain prompt, a conversation rendered with the tokenizer's chat
#   template, or token ids


class _LibraryLog:
    """Standard error (as it is at each write) for the engine's messages, which start with the command's name
    (``moe-batch: ``): from the library they start with ``lightning_moe: ``."""

    def write(self, text: str) -> int:
        if text.startswith("moe-batch: "):
            text = "lightning_moe: " + text[len("moe-batch: "):]
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


_LIBRARY_LOG = _LibraryLog()


# ================================================================================================
# sampling parameters
# ================================================================================================
_SAMPLING_DOC = """How to decode (vLLM's names; the job's ``generation:`` section).

    Checked when made, with the job's rules (a ConfigError names the field). Greedy when ``temperature`` is 0;
    sampled tokens are seeded by ``seed`` and the request id (the same id and seed draw the same tokens, whatever the
    batch, as in ``moe-batch run``). ``stop``: the text is cut before the earliest stop string found (whatever tokens
    it spans) and finish_reason is "stop"; ``stop_token_ids``: the sequence ends at such a token (kept in token_ids;
    every id must be in the model's vocabulary, checked by generate(): ValueError naming the field). ``logprobs``
    (vLLM's): None returns none; k >= 0 (at most 20) returns, per generated token, its log-probability and those of
    the k most likely tokens, as vLLM does by default: the fp32 log-softmax of the model's raw logits (before
    temperature and top-p), whatever the sampling settings. Nothing is computed when it is None.

    One keyword per ``config.GenerationConfig`` field with a vLLM name (``config.job_field``), made from those fields:
    """


def _sampling_post_init(self) -> None:
    self.generation()  # every check now, not at the first generate()


def _sampling_generation(self) -> dict:
    """The job's ``generation:`` section for these parameters, validated (ConfigError names the field).

    The one place a SamplingParams becomes job keys (``config.generation_from_vllm``: each field's ``to_job``).
    """
    fields = vllm_fields()
    gen = generation_from_vllm({f.metadata["vllm"]: getattr(self, f.metadata["vllm"]) for f in fields})
    try:
        generation_from_dict(gen, "SamplingParams")
    except ConfigError as e:  # name the field as the caller wrote it: "SamplingParams: max_tokens (generation...)"
        msg = str(e)
        for f in fields:
            prefix = f"SamplingParams: generation.{f.name}:"
            if msg.startswith(prefix):
                msg = f"SamplingParams: {f.metadata['vllm']} (generation.{f.name}):" + msg[len(prefix):]
        raise ConfigError(msg) from None
    return gen


SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(f.metadata["vllm"], f.type, dataclasses.field(default=f.metadata["vllm_default"])) for f in vllm_fields()],
    frozen=True,
    namespace={"__module__": __name__, "__post_init__": _sampling_post_init, "generation": _sampling_generation,
               "__doc__": _SAMPLING_DOC + "".join(f"\n    - ``{f.metadata['vllm']}`` (generation.{f.name}): "
                                                  f"{f.metadata['doc']}" for f in vllm_fields()) + "\n"})


# ================================================================================================
# outputs (one per request, in input order)
# ================================================================================================
@dataclass(frozen=True)
class RequestOutput:
    """One generated request: what ``moe-batch run`` writes as its record (``id`` -> request_id, ``output_ids`` ->
    token_ids; ``prompt_tokens`` and ``output_tokens`` are the lengths of prompt_token_ids and token_ids)."""

    request_id: str  # the request's id ("0", "1", ... in input order unless generate() was given request_ids)
    prompt: Prompt  # the prompt as given (a string, or the chat messages)
    prompt_token_ids: list[int]  # the tokens fed to the model (chat: the rendered template; after truncation)
    text: str  # the generated text (special tokens skipped)
    token_ids: list[int]  # the generated token ids (EOS included when it ended the sequence)
    finish_reason: str  # "stop" (EOS, a stop token id or a stop string) | "length" (max_tokens reached)
    truncated_tokens: int = 0  # prompt tokens dropped from the left (LLM(truncate="left"))
    logprobs: Optional[list[dict[int, float]]] = None  # SamplingParams(logprobs=k): per generated token (vLLM's shape)
    #   {token id: log-prob} of the token chosen (first) and the k most likely ones; None when not asked
    cumulative_logprob: Optional[float] = None  # the sum of the chosen tokens' log-probs (when logprobs is asked)


def _logprob_dicts(rec: dict) -> Optional[list[dict[int, float]]]:
    """A record's ``logprobs`` / ``top_logprobs`` as vLLM's per-token dicts (the chosen token first)."""
    if "logprobs" not in rec:
        return None
    tops = rec.get("top_logprobs") or [[] for _ in rec["logprobs"]]
    out = []
    for tok, lp, top in zip(rec["output_ids"], rec["logprobs"], tops):
        d = {tok: lp}
        for i, v in top:
            d.setdefault(i, v)
        out.append(d)
    return out


@dataclass(frozen=True)
class LoglikelihoodOutput:
    """One ``loglikelihood`` request: log p(continuation | context), as the JSONL score record (``id`` ->
    request_id)."""

    request_id: str
    prompt_tokens: int  # context tokens
    continuation_tokens: int  # tokens scored
    logprob: float  # sum of the continuation tokens' log-probabilities
    logprob_mean: float  # their mean
    is_greedy: bool  # every continuation token is the argmax of its distribution
    truncated_tokens: int = 0  # context tokens dropped from the left (LLM(truncate="left"))


@dataclass(frozen=True)
class MultipleChoiceOutput:
    """One ``multiple_choice`` request, as the JSONL score record (``id`` -> request_id)."""

    request_id: str
    prompt_tokens: int  # context tokens
    choice_logprobs: list[float]  # summed log-probability of each choice after the context
    choice_logprobs_per_byte: list[float]  # the same per UTF-8 byte of the choice text
    pick: int  # index of the largest choice_logprobs
    pick_norm: int  # index of the largest choice_logprobs_per_byte
    answer: Optional[int] = None  # the request's answer index, when given
    correct: Optional[bool] = None  # pick == answer (None without an answer)
    correct_norm: Optional[bool] = None  # pick_norm == answer
    truncated_tokens: int = 0  # context tokens dropped from the left


@dataclass(frozen=True)
class PerplexityOutput:
    """One ``perplexity`` request, as the JSONL score record (``id`` -> request_id)."""

    request_id: str
    prompt_tokens: int  # 0 (a perplexity text has no context)
    tokens: int  # the text's tokens
    scored_tokens: int  # every token after the first
    nll: float  # their summed negative log-likelihood
    windows: int  # rolling windows scored (score(stride=...)), 1 without a stride
    perplexity: float  # exp(nll / scored_tokens)
    truncated_tokens: int = 0  # text tokens dropped from the left


ScoreOutput = Union[LoglikelihoodOutput, MultipleChoiceOutput, PerplexityOutput]
_SCORE_OUTPUTS = {"loglikelihood": LoglikelihoodOutput, "multiple_choice": MultipleChoiceOutput,
                  "perplexity": PerplexityOutput}


def _score_output(mode: str, rec: dict) -> ScoreOutput:
    cls = _SCORE_OUTPUTS[mode]
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(request_id=rec["id"], **{k: v for k, v in rec.items() if k in names})


# ================================================================================================
# the model
# ================================================================================================
_PER_CALL = {  # job keys that an LLM does not take, and why
    "task": "generate() and score() choose the task",
    "generation": "decoding is set per call: pass SamplingParams(...) to generate()",
    "max_new_tokens": "decoding is set per call: pass SamplingParams(max_tokens=...) to generate()",
    "score": "scoring is set per call: score(requests, mode, stride=...)",
    "data": "the requests are given to each call (system_prompt and truncate are LLM keywords)",
    "output": "the records are returned, nothing is written",
    "checkpoint": "nothing is written (no partial generations)",
    "shard": "give each process its own requests",
    "on_error": "a bad request raises an error naming it",
    "chat_template": "chat messages are rendered with the chat template, plain strings are not",
}


class LLM:
    """A Mixture-of-Experts model for batch generation and scoring (vLLM's ``LLM``, offline).

    Args:
        model: ``"tiny-mixtral"`` (the embedded toy model) or a Hugging Face checkpoint directory (config.json +
            safetensors; a ``moe-batch quantize`` output too).
        device: ``"cuda"``, ``"cuda:N"`` or ``"cpu"``.
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (weights and compute).
        gpu_memory: GPU budget, bytes or ``"24GiB"``: the planner plans for it and this process's CUDA allocator is
            capped at it (a larger card behaves like this one). Default: the GPU's own memory.
        cpu_memory: host budget for the planner, bytes or ``"192GiB"``. Default: the hardware profile's.
        hardware: a preset name (``"h200"``, ``"l4"``, ...) or a profile YAML from ``moe-batch profile``; default: the
            preset of the CUDA device's family (app.plan.job_hardware), else h200.
        policy: ``"auto"`` (the planner, for each call's workload), a policy YAML path, or a mapping of policy fields.
        executor: ``"cgopipe"`` (pipelined, offloading; the default on CUDA) or ``"serial"`` (the reference; the
            default on the CPU).
        expert_ffn: cgopipe's expert FFN: ``"auto"``, ``"torch"`` (tokens identical to serial), ``"triton"``,
            ``"grouped_mm"`` or ``"mm_loop"``.
        batch_size: sequences per batch of the serial executor (cgopipe batches by its policy).
        system_prompt: a system message put before chat messages that do not start with one (data.system_prompt).
        truncate: a prompt longer than the context: ``"error"`` or ``"left"`` (drop its oldest tokens;
            data.truncate).
        chat_template_kwargs: variables the chat template reads, e.g. ``{"enable_thinking": False}`` for Qwen3
            (data.chat_template_kwargs; vLLM's name).
        **job_keys: nothing else is taken: any other keyword is a ConfigError naming it (a job key that is set per
            call says where it goes).

    Raises:
        ConfigError: a bad value or an unknown keyword (named), CUDA asked for without a CUDA device.
        DataError: the model has no loadable tokenizer.

    The tokenizer and the weights are read here, once. Use as a context manager, or call :meth:`close`, to release
    an executor's worker thread and pinned memory before the object goes away.
    """

    def __init__(self, model: str, device: str = "cuda", dtype: str = "bfloat16",
                 gpu_memory: Union[int, str, None] = None, cpu_memory: Union[int, str, None] = None,
                 hardware: Optional[str] = None, policy: Union[str, Mapping[str, Any]] = "auto",
                 executor: Optional[str] = None, expert_ffn: str = "auto", batch_size: int = 16,
                 system_prompt: Optional[str] = None, truncate: str = "error",
                 chat_template_kwargs: Optional[Mapping[str, Any]] = None, **job_keys: Any):
        from .app.engine import ModelRunner, check_device
        from .app.gpu import apply_gpu_cap, use_device
        from .app.plan import ModelFiles

        for k in job_keys:
            if k in _PER_CALL:
                raise ConfigError(f"LLM: {k}: not an LLM keyword: {_PER_CALL[k]}")
            close = difflib.get_close_matches(k, _LLM_KEYWORDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"LLM: {k}: unknown keyword{hint}; LLM takes: model, {', '.join(_LLM_KEYWORDS)}")
        keys: dict = {"model": model, "device": device, "dtype": dtype, "policy": policy, "expert_ffn": expert_ffn,
                      "batch_size": batch_size, "name": "llm"}
        for k, v in (("gpu_memory", gpu_memory), ("cpu_memory", cpu_memory), ("hardware", hardware),
                     ("executor", executor)):
            if v is not None:
                keys[k] = v
        data: dict = {"truncate": truncate}
        if system_prompt is not None:
            data["system_prompt"] = system_prompt
        if chat_template_kwargs is not None:
            data["chat_template_kwargs"] = dict(chat_template_kwargs)
        job = job_from_dict({**keys, "data": data}, "LLM", in_memory=True, notify=True)
        # the validated values (paths made absolute) serve every call's job
        keys.update(model=job.model, policy=job.policy, executor=job.executor)
        if job.hardware is not None:
            keys["hardware"] = job.hardware
        self._keys, self._data = keys, data
        self.job = job  # the validated settings (task generate; each call makes its own job from them)
        check_device(job)
        self._files = ModelFiles(job.model)  # spec and tokenizer
        use_device(job.device)  # kernels and events made without a device land on the job's
        self.gpu_cap = apply_gpu_cap(job.device, job.gpu_memory)  # None on the CPU or without a cap
        self._runner = ModelRunner(self._files, job.dtype, log=_LIBRARY_LOG)
        # cgopipe's page pool reads the experts from the files a layer at a time (the host peak the planner budgets)
        self._runner.load_weights(lazy_experts=job.executor == "cgopipe" or job.gpus > 1, packed_experts=job.gpus <= 1)

    # ---- properties ---------------------------------------------------------------------------
    def get_tokenizer(self):
        """The model's Hugging Face tokenizer (the one prompts are encoded and outputs decoded with)."""
        return self._files.tokenizer

    @property
    def spec(self):
        """The model's architecture (``model.spec.MoESpec``: layers, experts, context length, ...)."""
        return self._files.spec

    # ---- calls --------------------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 *, request_ids: Optional[Sequence[Union[str, int]]] = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate a continuation of every prompt.

        Args:
            prompts: a string, a list of strings, or a list of chat conversations (each a list of
                ``{"role", "content"}`` messages, rendered with the tokenizer's chat template and its generation
                prompt, as a job with ``data.chat_template: true`` does); a single conversation may be passed as it
                is. Strings and conversations do not mix in one call. A prompt may also be token ids,
                ``{"prompt_token_ids": [...]}`` (vLLM's TokensPrompt), fed as they are (nothing added); these mix
                with strings.
            sampling_params: how to decode: one SamplingParams for every prompt, or a list of them, one per prompt
                (vLLM's rule: as long as ``prompts``); default ``SamplingParams()``: greedy, 128 tokens. Prompts with
                equal parameters run as one job (one plan, batched together), the groups one after the other.
            request_ids: one id per prompt (strings, or integers written as strings; unique), the ids a JSONL file
                would give them: they seed sampling. Default ``"0"``, ``"1"``, ... in input order.
            use_tqdm: show a progress bar (generated tokens) on stderr.

        Returns:
            one :class:`RequestOutput` per prompt, in input order.

        Raises:
            DataError: a bad prompt (empty, too long for the context with max_tokens, a bad chat role), named as
                ``prompts[i]``; ValueError: a list of sampling_params of another length than prompts, a stop token id
                outside the vocabulary (``sampling_params[i].stop_token_ids``); TypeError: a prompt or a
                sampling_params of another type. Every prompt is checked before any is run.
        """
        from .app.engine import plan_for_job, run_in_memory

        items, chat = _prompts(prompts)
        per = _sampling_list(sampling_params, len(items))
        groups: dict[str, list[int]] = {}  # prompts with equal parameters, in order of first appearance
        gens = [sp.generation() for sp in per]
        for i, gen in enumerate(gens):
            groups.setdefault(repr(sorted(gen.items())), []).append(i)
        ids = _request_ids(request_ids, len(items), "prompts")
        runs = []  # every group checked and tokenized before any runs
        for idx in groups.values():
            job = self._job("generate", chat, generation=gens[idx[0]])
            where = "sampling_params" if len(groups) == 1 and not isinstance(sampling_params, (list, tuple)) \
                else f"sampling_params[{idx[0]}]"
            _check_stop_ids(job, self.spec, where)
            prep = self._prepare(job, [_prompt_record(items[i], chat) for i in idx], [ids[i] for i in idx],
                                 "prompts", idx)
            runs.append((idx, job, prep))
        out: list = [None] * len(items)
        for idx, job, prep in runs:
            records = run_in_memory(job, prep, self._runner, plan_for_job(job, prep), progress=use_tqdm,
                                    log=_LIBRARY_LOG, cap=self.gpu_cap)
            for i, tr, rec in zip(idx, prep.treqs, records):
                lps = _logprob_dicts(rec)
                out[i] = RequestOutput(request_id=rec["id"], prompt=items[i], prompt_token_ids=list(tr.prompt_ids),
                                       text=rec["text"], token_ids=list(rec["output_ids"]),
                                       finish_reason=rec["finish_reason"],
                                       truncated_tokens=rec.get("truncated_tokens", 0), logprobs=lps,
                                       cumulative_logprob=float(sum(rec["logprobs"])) if lps is not None else None)
        return out

    def score(self, requests: Sequence[Any], mode: str, *, stride: Optional[int] = None,
              use_tqdm: bool = True) -> list[ScoreOutput]:
        """Score requests by prefill alone (lm-evaluation-harness's definitions, as ``task: score`` does).

        Args:
            requests: per ``mode``:
                ``"loglikelihood"``: ``(context, continuation)`` pairs, or dicts ``{"prompt" | "messages",
                "continuation"}``, or token ids ``{"prompt_token_ids": [...], "continuation_token_ids": [...]}``
                (scored as given: the continuation's tokens after the context's, nothing added or re-tokenized);
                ``"multiple_choice"``: dicts ``{"prompt" | "messages", "choices": [...], "answer": index (optional)}``;
                ``"perplexity"``: strings, or dicts ``{"text"}``.
                Dicts are the JSONL format's records: an ``"id"`` is the request's id (default: its index), other
                fields are ignored; contexts given as ``messages`` are rendered with the chat template.
            mode: ``"loglikelihood"``, ``"multiple_choice"`` or ``"perplexity"``.
            stride: perplexity only: score texts longer than the context in rolling windows, ``stride`` new tokens
                each (score.stride).
            use_tqdm: show a progress bar (requests) on stderr.

        Returns:
            one output per request, in input order: :class:`LoglikelihoodOutput`, :class:`MultipleChoiceOutput` or
            :class:`PerplexityOutput`, with the fields of the JSONL score record.

        Raises:
            ConfigError: an unknown mode, a stride outside perplexity; DataError: a bad request (named
            ``requests[i]``); TypeError: a request of another type.
        """
        from .app.engine import plan_for_job, run_in_memory

        job, recs = self._score_job(requests, mode, stride)
        prep = self._prepare(job, recs, None, "requests")
        records = run_in_memory(job, prep, self._runner, plan_for_job(job, prep), progress=use_tqdm,
                                log=_LIBRARY_LOG, cap=self.gpu_cap)
        return [_score_output(job.score.mode, r) for r in records]

    def plan(self, prompts: Union[Prompt, Sequence[Any]], sampling_params: Optional[SamplingParams] = None, *,
             mode: Optional[str] = None, stride: Optional[int] = None):
        """The policy the planner would choose for these requests, and its estimate, without running anything.

        ``prompts`` and ``sampling_params`` as :meth:`generate` takes them (the workload: the prompts' real token
        lengths and max_tokens); with ``mode``, ``prompts`` are scoring requests as :meth:`score` takes them (a
        prefill-only workload). The plan is the one ``moe-batch run`` would make for the same job (``policy: auto``:
        the planner; a policy file or mapping: that policy), checked against the memory budgets for whatever executor
        this LLM runs.

        Returns:
            ``app.plan.JobPlan``: ``policy`` (mu, n, resident experts, GPU-attention micro-batches, ...),
            ``estimate`` (HRM: ``prefill_tok_s``, ``decode_tok_s``, ``e2e_tok_s``, bindings, ``memory``),
            ``gpu_budget`` and ``cpu_budget`` (bytes).

        Raises:
            PolicyError: the policy does not fit the budgets (one line); PlanInfeasible: no policy does.
        """
        from .app.plan import fit_plan_to_cap, plan_job

        if mode is None:
            sampling_params = sampling_params if sampling_params is not None else SamplingParams()
            items, chat = _prompts(prompts)
            job = self._job("generate", chat, generation=sampling_params.generation())
            recs = [_prompt_record(p, chat) for p in items]
            prep = self._prepare(job, recs, None, "prompts")
        else:
            job, recs = self._score_job(prompts, mode, stride)
            prep = self._prepare(job, recs, None, "requests")
        return fit_plan_to_cap(job, prep, plan_job(job, prep), self.gpu_cap, _LIBRARY_LOG)  # the plan calls run

    def close(self) -> None:
        """Release the executor held (its worker thread and pinned host memory). Later calls build a new one, reading
        the weights again if that executor had taken them."""
        self._runner.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers ------------------------------------------------------------------------------
    def _job(self, task: str, chat: bool, generation: Optional[dict] = None, score: Optional[dict] = None):
        """This LLM's settings as an in-memory job for one call (validated by config.job_from_dict)."""
        d = {**self._keys, "task": task, "data": {**self._data, "chat_template": chat}}
        if generation is not None:
            d["generation"] = generation
        if score is not None:
            d["score"] = score
        return job_from_dict(d, "LLM", in_memory=True)

    def _score_job(self, requests: Sequence[Any], mode: str, stride: Optional[int]):
        if not isinstance(mode, str) or mode not in SCORE_MODES:
            raise ConfigError(f"LLM.score: mode: expected one of {', '.join(map(repr, SCORE_MODES))}, got {mode!r}")
        if isinstance(requests, (str, Mapping)):
            requests = [requests]  # one request
        recs = [_score_record(r, mode, i) for i, r in enumerate(requests)]
        chat = mode != "perplexity" and any(r.get("messages") is not None for r in recs)
        if chat and any(r.get("prompt") is not None for r in recs):
            raise ValueError("LLM.score: requests mix plain prompts and chat messages; give one kind per call")
        score = {"mode": mode, **({"stride": stride} if stride is not None else {})}
        return self._job("score", chat, score=score), recs

    def _prepare(self, job, recs: list[dict], request_ids, label: str, indexes: Optional[list[int]] = None):
        """The call's requests checked (as a JSONL file's lines are) and tokenized: app.plan.Prepared. ``indexes``:
        each record's index in the call (errors name ``label[index]``; default 0, 1, ...)."""
        from .app.plan import Prepared
        from .data.sources import request_from_record

        indexes = list(range(len(recs))) if indexes is None else indexes
        if request_ids is None:
            request_ids = _request_ids(None, len(recs), label, [r.pop("id", None) for r in recs], indexes)
        reqs = [request_from_record(rec, str(request_ids[j]), job, f"{label}[{indexes[j]}]", 0)
                for j, rec in enumerate(recs)]
        return Prepared(job, reqs, files=self._files)


def _request_ids(request_ids, n: int, label: str, given: Optional[list] = None,
                 indexes: Optional[list[int]] = None) -> list[str]:
    """The ids of ``n`` requests: ``request_ids`` (one per prompt), else the records' own (``given``: None where
    absent), else the index; checked (non-empty strings or integers, unique). DataError / ValueError name them."""
    from .data.sources import DataError

    indexes = list(range(n)) if indexes is None else indexes
    if request_ids is not None:
        request_ids = list(request_ids)
        if len(request_ids) != n:
            raise ValueError(f"request_ids: {len(request_ids)} ids for {n} prompts")
        given = request_ids
    given = given if given is not None else [None] * n
    seen: dict[str, int] = {}
    out = []
    for j, rid in enumerate(given):
        where = f"{label}[{indexes[j]}]"
        rid = str(indexes[j]) if rid is None else rid
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or not str(rid).strip():
            raise DataError(f"{where}: id: expected a non-empty string or an integer, got {rid!r}")
        rid = str(rid)
        if rid in seen:
            raise DataError(f"{where}: id: duplicate id {rid!r} (first at {label}[{seen[rid]}])")
        seen[rid] = indexes[j]
        out.append(rid)
    return out


def _sampling_list(sp: Any, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: ``sp`` for all, or a list of n (vLLM's rule); TypeError / ValueError name the
    entry at fault."""
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if not isinstance(sp, (list, tuple)):
        raise TypeError(f"generate: sampling_params: expected a SamplingParams or a list of them, got "
                        f"{type(sp).__name__}")
    for i, p in enumerate(sp):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"generate: sampling_params[{i}]: expected a SamplingParams, got {type(p).__name__}")
    if len(sp) != n:
        what = (f"prompts[{len(sp)}] has none" if len(sp) < n else f"sampling_params[{n}] has no prompt")
        raise ValueError(f"generate: sampling_params: {len(sp)} SamplingParams for {n} prompts ({what}); give one "
                         f"SamplingParams for all prompts or a list of one per prompt")
    return list(sp)


def _check_stop_ids(job, spec, where: str) -> None:
    """ValueError (a ConfigError) when a stop token id is outside the model's vocabulary [0, vocab_size)."""
    from .app.plan import check_stop_token_ids

    check_stop_token_ids(job, spec, f"{where}.stop_token_ids")


_LLM_KEYWORDS = ["device", "dtype", "gpu_memory", "cpu_memory", "hardware", "policy", "executor", "expert_ffn",
                 "batch_size", "system_prompt", "truncate", "chat_template_kwargs"]


def _is_tokens(p: Any) -> bool:
    return isinstance(p, Mapping) and "prompt_token_ids" in p


def _is_messages(p: Any) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, Mapping) and not _is_tokens(m) for m in p)


def _prompt_record(p: Any, chat: bool) -> dict:
    """A generation prompt as the JSONL record it stands for."""
    if chat:
        return {"messages": p}
    if isinstance(p, str):
        return {"prompt": p}
    ids = p["prompt_token_ids"]
    return {"prompt_token_ids": list(ids) if isinstance(ids, (list, tuple)) else ids}


def _prompts(prompts: Any) -> tuple[list, bool]:
    """(the prompts as a list, whether they are chat conversations): one string or one conversation becomes a list
    of one; TypeError for anything else, ValueError when strings and conversations mix."""
    if isinstance(prompts, str) or _is_messages(prompts) or _is_tokens(prompts):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts: expected a string, a list of strings or a list of chat conversations, got "
                        f"{type(prompts).__name__}")
    items, kinds = [], set()
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            kinds.add("str")
            items.append(p)
        elif _is_tokens(p):
            kinds.add("str")  # token ids: a plain (not chat) prompt
            items.append(dict(p))
        elif _is_messages(p):
            kinds.add("chat")
            items.append([dict(m) for m in p])
        else:
            raise TypeError(f"prompts[{i}]: expected a string, a list of {{'role', 'content'}} messages or "
                            f"{{'prompt_token_ids': [...]}}, got {type(p).__name__}")
    if len(kinds) > 1:
        raise ValueError("prompts: strings and chat conversations mix; give one kind per call")
    return items, kinds == {"chat"}


def _score_record(r: Any, mode: str, i: int) -> dict:
    """A scoring request as the JSONL record it stands for."""
    if isinstance(r, Mapping):
        return {k: list(v) if k.endswith("_token_ids") and isinstance(v, tuple) else v for k, v in r.items()}
    if mode == "perplexity" and isinstance(r, str):
        return {"text": r}
    if mode == "loglikelihood" and isinstance(r, (tuple, list)) and len(r) == 2:
        return {"prompt": r[0], "continuation": r[1]}
    want = {"loglikelihood": "a (context, continuation) pair or a dict", "multiple_choice": "a dict with prompt and "
            "choices", "perplexity": "a string or a dict with text"}[mode]
    raise TypeError(f"requests[{i}]: expected {want}, got {type(r).__name__}")


__all__ = ["LLM", "SamplingParams", "RequestOutput", "LoglikelihoodOutput", "MultipleChoiceOutput",
           "PerplexityOutput", "ScoreOutput"]
