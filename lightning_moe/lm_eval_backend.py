"""lm-evaluation-harness backend: ``--model lightning-moe`` (lm-eval 0.4.13's ``LM`` interface).

    moe-lm-eval --model lightning-moe \\
        --model_args pretrained=DIR,gpu_memory=24GiB,device=cuda,dtype=bfloat16 --tasks hellaswag,arc_easy

``moe-lm-eval`` (:mod:`lightning_moe.lm_eval_cli`) is lm-eval's own command line (``lm_eval.__main__.cli_evaluate``,
every flag as documented there) with this module imported first, so that ``@register_model("lightning-moe")`` has
run: lm-eval 0.4.13 finds models only in its own registry and reads no entry points.
``python -m lightning_moe.lm_eval_cli ...`` is the same.
The package also declares the entry point ``lm_eval.models: lightning-moe``, the group later lm-eval releases'
plugin discovery reads; there plain ``lm_eval --model lightning-moe ...`` should work (0.4.13 is the version tested). From Python::

    import lm_eval, lightning_moe.lm_eval_backend  # noqa: F401  (registers "lightning-moe")
    lm_eval.simple_evaluate(model="lightning-moe", model_args="pretrained=DIR,device=cpu,dtype=float32", tasks=[...])

Requests run through :class:`lightning_moe.api.LLM` (the engine of ``moe-batch run``), batched by the planner:
lm-eval hands a backend all the requests of one kind at once, and every ``loglikelihood`` call is one prefill-only
scoring call (one plan for all its sequences), every ``loglikelihood_rolling`` call one more (all windows of all
texts), and ``generate_until`` one generation call per distinct set of generation arguments.

Tokenization is lm-eval's own, so the numbers are the ``hf`` backend's (``HFLM``): this class is a ``TemplateLM``,
whose ``loglikelihood`` splits each (context, continuation) pair as HFLM does (trailing spaces of the context move to
the continuation; the whole text is encoded and the continuation is what follows the context's tokens; an empty
context is the BOS token), ``tok_encode`` is HFLM's (the tokenizer's special tokens unless the text already starts
with BOS), and rolling windows are ``lm_eval.utils.get_rolling_token_windows`` with HFLM's arguments. The engine then
gets token ids (``prompt_token_ids`` / ``continuation_token_ids``) and re-tokenizes nothing.

One difference, at the context limit only: the engine feeds every scored token (HFLM drops the last token of a
sequence, which predicts nothing), so a sequence may hold ``max_length`` tokens rather than ``max_length + 1``:
a context too long is cut from the left by one token more than HFLM cuts, and rolling windows hold
``max_length - 1`` tokens (texts shorter than the model context get HFLM's windows exactly).

Model arguments (``--model_args key=value,...``):

=====================  ======================================================================================
``pretrained``         checkpoint directory (or ``tiny-mixtral``), as ``moe-batch run``'s ``model``
``device``             ``cuda`` (default), ``cuda:N``, ``cpu``
``dtype``              ``bfloat16``, ``float16``, ``float32``, or ``auto`` (default: bfloat16 on CUDA, float32 on
                       the CPU)
``gpu_memory``         GPU budget, e.g. ``24GiB`` (the planner plans for it; the CUDA allocator is capped)
``cpu_memory``         host budget for the planner, e.g. ``192GiB``
``hardware``           hardware preset (``h200``, ``l4``, ...) or profile YAML
``policy``             ``auto`` (the planner, default) or a policy YAML
``executor``           ``cgopipe`` (default on CUDA) or ``serial`` (default on the CPU)
``expert_ffn``         ``auto``, ``torch``, ``triton``, ``grouped_mm``
``serial_batch_size``  sequences per batch of the serial executor (default 16)
``max_length``         context length in tokens (default and upper bound: the model's)
``max_gen_toks``       default tokens per generation when a task gives none (256, as HFLM)
``add_bos_token``      force the tokenizer's special tokens on or off (HFLM's argument)
``prefix_token_id``    the token an empty context is (HFLM's argument; default BOS, else EOS)
``seed``               sampling seed of ``do_sample`` generations (default 0; with the request's index)
=====================  ======================================================================================

lm-eval's ``--batch_size`` / ``--max_batch_size`` are accepted and not used: the planner sizes the batches.
``generate_until`` takes ``until``, ``max_gen_toks`` (or ``max_new_tokens`` / ``max_tokens``), ``do_sample``,
``temperature`` and ``top_p`` from the task's ``generation_kwargs``; other keys (``top_k``, ...) are ignored with a
warning. Chat templates: ``--apply_chat_template`` renders the conversation with the tokenizer's chat template
(:meth:`LightningMoELM.apply_chat_template`, as HFLM).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Union

from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from tqdm import tqdm

from .api import LLM, SamplingParams
from .config import ConfigError

log = logging.getLogger(__name__)

NAME = "lightning-moe"
_USED_GEN_KEYS = ("do_sample", "temperature", "top_p", "until", "max_gen_toks")


@register_model(NAME, "lightning_moe")
class LightningMoELM(TemplateLM):
    """lm-eval's ``LM`` over a :class:`lightning_moe.api.LLM` (model arguments: the module docstring)."""

    backend = "causal"

    def __init__(self, pretrained: str, device: Optional[str] = "cuda", dtype: str = "auto",
                 gpu_memory: Union[int, str, None] = None, cpu_memory: Union[int, str, None] = None,
                 hardware: Optional[str] = None, policy: str = "auto", executor: Optional[str] = None,
                 expert_ffn: str = "auto", serial_batch_size: int = 16, max_length: Optional[int] = None,
                 max_gen_toks: int = 256, add_bos_token: Optional[bool] = None, prefix_token_id: Optional[int] = None,
                 seed: int = 0, batch_size: Any = None, max_batch_size: Any = None, **unknown: Any):
        super().__init__()
        if unknown:
            raise ConfigError(f"{NAME}: unknown model_args: {', '.join(sorted(unknown))} (see "
                              f"lightning_moe.lm_eval_backend for the arguments taken)")
        device = str(device or "cuda")
        if dtype in (None, "auto"):
            dtype = "float32" if device == "cpu" else "bfloat16"
        self.llm = LLM(str(pretrained), device=device, dtype=str(dtype), gpu_memory=gpu_memory,
                       cpu_memory=cpu_memory, hardware=hardware, policy=policy, executor=executor,
                       expert_ffn=expert_ffn, batch_size=int(serial_batch_size))
        self.tokenizer = self.llm.get_tokenizer()  # TemplateLM.chat_template reads it
        self.pretrained = str(pretrained)
        self._device = device
        self._context = int(self.llm.spec.max_position_embeddings)
        if max_length is not None and not 2 <= int(max_length) <= self._context:
            raise ConfigError(f"{NAME}: max_length: {max_length} outside 2..{self._context} (the model context)")
        self._max_length = int(max_length) if max_length is not None else self._context
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.seed = int(seed)
        self._warned: set = set()

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "LightningMoELM":
        """The model from ``--model_args`` (a dict); lm-eval's own settings (``--device``, default cuda:0, and
        ``--batch_size``) fill only what the model arguments do not give: ``model_args device=cpu`` wins."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "LightningMoELM":
        """The model from ``--model_args key=value,...`` (see :meth:`create_from_arg_obj`)."""
        return cls.create_from_arg_obj(lm_utils.simple_parse_args_string(arg_string), additional_config)

    # ---- what lm-eval reads ----------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context stands for, and the first input of a rolling window (HFLM's rule)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def get_model_info(self) -> dict:
        job = self.llm.job
        return {"model_dtype": job.dtype, "lightning_moe_executor": job.executor, "lightning_moe_device": job.device}

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the tokenizer's chat template, as text (HFLM's call)."""
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt,
                                                  continue_final_message=not add_generation_prompt)

    # ---- tokenization (HFLM's) -------------------------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs) -> list[int]:
        """HFLM.tok_encode: the tokenizer's special tokens (or ``add_bos_token``), none when the text already starts
        with BOS."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _generation_ids(self, context: str, max_ctx_len: int) -> list[int]:
        """A generation context's ids as HFLM.tok_batch_encode makes them (no special tokens when the text starts
        with the BOS string), left-truncated to ``max_ctx_len``."""
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        else:
            special = {}
        ids = list(self.tokenizer(context, **special)["input_ids"])
        return ids[-max_ctx_len:]

    # ---- scoring -----------------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """``[(request strings or None, context ids, continuation ids)]`` -> ``[(logprob, is_greedy)]``, scored in one
        ``LLM.score`` call (identical pairs once)."""
        if not requests:
            return []
        keep = min(self._max_length + 1, self._context)  # tokens of a sequence kept (HFLM: max_length + 1)
        pairs = []
        for _, ctx, cont in requests:
            ctx, cont = [int(t) for t in ctx], [int(t) for t in cont]
            if not ctx or not cont:
                raise ValueError(f"{NAME}: empty context or continuation ids ({len(ctx)}, {len(cont)} tokens)")
            if len(cont) >= keep:
                raise ValueError(f"{NAME}: a continuation of {len(cont)} tokens leaves no context in "
                                 f"{keep} tokens (max_length {self._max_length}, model context {self._context})")
            seq = (ctx + cont)[-keep:]
            pairs.append((tuple(seq[: len(seq) - len(cont)]), tuple(cont)))
        unique = list(dict.fromkeys(pairs))
        outs = self.llm.score([{"prompt_token_ids": list(c), "continuation_token_ids": list(k)} for c, k in unique],
                              "loglikelihood", use_tqdm=not disable_tqdm)
        by_pair = {p: (float(o.logprob), bool(o.is_greedy)) for p, o in zip(unique, outs)}
        res = []
        for (strings, _, _), p in zip(requests, pairs):
            answer = by_pair[p]
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
            res.append(answer)
        return res

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts: HFLM's rolling windows (``prefix_token_id`` first, context_len 1), every
        window of every text scored in one call, summed per text."""
        window = min(self._max_length, self._context - 1)  # a window's sequence is window + 1 tokens
        strings, windows, counts = [], [], []
        for (string,) in tqdm([r.args for r in requests], disable=disable_tqdm, desc="Rolling windows"):
            ws = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=window,
                context_len=1)]
            strings.append(string)
            counts.append(len(ws))
            windows.extend((None, ctx, cont) for ctx, cont in ws)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        out, at = [], 0
        for string, n in zip(strings, counts):
            total = sum(lp for lp, _ in scores[at: at + n])
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
            out.append(total)
        return out

    # ---- generation --------------------------------------------------------------------------------
    def _warn_once(self, msg: str) -> None:
        if msg not in self._warned:
            self._warned.add(msg)
            log.warning(msg)

    def _sampling(self, gen_kwargs: dict) -> tuple[SamplingParams, list[str], int]:
        """(SamplingParams, the stop strings lm-eval cuts at, max_gen_toks) for one request's generation_kwargs."""
        if not isinstance(gen_kwargs, dict):
            raise TypeError(f"{NAME}: generate_until: expected the generation kwargs as a dict, got "
                            f"{type(gen_kwargs).__name__}")
        kw = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        until = handle_stop_sequences(kw.pop("until", None),
                                      eos=self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False))
        max_gen = int(kw.pop("max_gen_toks"))
        do_sample = bool(kw.pop("do_sample", False))
        temperature, top_p = float(kw.pop("temperature", 0.0)), float(kw.pop("top_p", 1.0))
        if not do_sample:  # greedy (normalize_gen_kwargs already set temperature 0)
            temperature, top_p = 0.0, 1.0
        for k in sorted(kw):
            self._warn_once(f"{NAME}: generate_until: generation kwarg {k}={kw[k]!r} is not supported and is ignored "
                            f"(taken: {', '.join(_USED_GEN_KEYS)})")
        params = SamplingParams(max_tokens=max_gen, temperature=temperature, top_p=top_p, seed=self.seed,
                                stop=[s for s in until if s])
        return params, until, max_gen

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Generate for each (context, generation kwargs): greedy unless ``do_sample``, at most ``max_gen_toks`` tokens,
        the text cut before the earliest ``until`` string (and the EOS text, as HFLM adds it). One ``LLM.generate``
        call per distinct set of kwargs; a request's index is its id (the sampling seed with ``seed``)."""
        groups: dict[str, list[int]] = {}
        args = [r.args for r in requests]
        for i, (_, gen_kwargs) in enumerate(args):
            groups.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        res: list[Optional[str]] = [None] * len(requests)
        for idx in groups.values():
            params, until, max_gen = self._sampling(args[idx[0]][1])
            max_ctx_len = self._max_length - max_gen
            if max_ctx_len < 1:
                raise ValueError(f"{NAME}: generate_until: max_gen_toks {max_gen} leaves no room for a context in "
                                 f"max_length {self._max_length}")
            prompts = [{"prompt_token_ids": self._generation_ids(args[i][0], max_ctx_len)} for i in idx]
            outs = self.llm.generate(prompts, params, request_ids=[str(i) for i in idx], use_tqdm=not disable_tqdm)
            for i, o in zip(idx, outs):
                text = postprocess_generated_text(o.text, until, None)
                self.cache_hook.add_partial("generate_until", args[i], text)
                res[i] = text
        return res  # type: ignore[return-value]

