"""Job configuration: frozen dataclasses loaded and validated from a job YAML.

A job YAML (see ``jobs/*.yaml`` and the schema table in docs/REFERENCE.md) becomes one :class:`Job`.
Everything is checked before any heavy work (model loading, tokenization):

* unknown keys are errors that name the key and list the allowed ones;
* every value is type checked (``true`` is not an integer; ``128.0`` is not an integer);
* paths (``model``, ``data.path``, ``policy``, ``hardware``, ``output.path``) are resolved against the
  directory of the YAML file and the inputs must exist;
* every error is a :class:`ConfigError` whose message starts with the file and the dotted key, e.g.
  ``jobs/x.yaml: generation.temperature: expected a number, got 'hot' (a string)``.

YAML 1.1 note (PyYAML): ``1e-4`` (no dot in the mantissa) is read as the *string* ``'1e-4'``. For
fields that take a number this module accepts such a string *on purpose* and converts it to the
float it spells (``'1e-4'`` -> ``0.0001``); any other string is an error. Integer fields never accept
strings (``max_new_tokens: 1e3`` is an error that suggests writing ``1000``).
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import yaml

from .policy.hardware import parse_bytes as _parse_bytes

TINY_MODEL = "tiny-mixtral"  # the embedded default model's name (model.tiny.ensure_tiny_mixtral builds it)
TASKS = ("generate", "score")
DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
EXECUTORS = ("serial", "cgopipe")
EXPERT_FFNS = ("auto", "torch", "triton", "grouped_mm", "mm_loop")
ON_ERROR = ("fail", "record")
SOURCES = ("jsonl", "mtbench")
TRUNCATE = ("error", "left")
SCORE_MODES = ("loglikelihood", "multiple_choice", "perplexity")
MAX_LOGPROBS = 20  # the most alternatives per token generation.logprobs asks for (vLLM's and OpenAI's limit)
IN_MEMORY = "memory"  # DataSource.source of a job whose requests the caller holds (the Python API; not a YAML value)


class ConfigError(ValueError):
    """A job configuration problem; the message names the YAML file and the dotted key."""


# ================================================================================================
# job fields: the value parsers a field names, and job_field (module docstring: "Job fields declared once")
# ================================================================================================
def _p_bool(v, key, ctx):
    if not isinstance(v, bool):
        raise ctx.err(key, f"expected true or false, got {_describe(v)}")
    return v


def _p_list(item, one_ok: bool = True):
    """A list of items parsed by ``item`` (a lone item too, when ``one_ok``) -> tuple."""
    def parse(v, key, ctx):
        if one_ok and not isinstance(v, list):
            v = [v]
        if not isinstance(v, list):
            raise ctx.err(key, f"expected a list, got {_describe(v)}")
        return tuple(item(x, f"{key}[{i}]", ctx) for i, x in enumerate(v))

    return parse


def _p_int(lo=None, hi=None):
    def parse(v, key, ctx):
        if isinstance(v, bool) or not isinstance(v, int):
            hint = ""
            if isinstance(v, str) and _FLOAT_RE.match(v.strip()):
                hint = " (YAML read it as a string; write a plain integer such as 1000, not 1e3)"
            elif isinstance(v, float) and v.is_integer():
                hint = f" (write {int(v)} without the decimal point)"
            raise ctx.err(key, f"expected an integer, got {_describe(v)}{hint}")
        if lo is not None and v < lo:
            raise ctx.err(key, f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ctx.err(key, f"must be <= {hi}, got {v}")
        return v
    return parse


def _p_float(lo=None, hi=None, lo_open=False):
    def parse(v, key, ctx):
        if isinstance(v, str) and _FLOAT_RE.match(v.strip()):
            # YAML 1.1 reads 1e-4 as the string '1e-4': accepted on purpose (module docstring).
            v = float(v.strip())
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ctx.err(key, f"expected a number, got {_describe(v)}")
        v = float(v)
        if v != v or v in (float("inf"), float("-inf")):
            raise ctx.err(key, f"expected a finite number, got {v}")
        if lo is not None and (v <= lo if lo_open else v < lo):
            raise ctx.err(key, f"must be {'>' if lo_open else '>='} {lo}, got {v}")
        if hi is not None and v > hi:
            raise ctx.err(key, f"must be <= {hi}, got {v}")
        return v
    return parse


def _opt(parse):
    """Accept null as None, otherwise delegate."""
    def p(v, key, ctx):
        return None if v is None else parse(v, key, ctx)
    return p



_SAME = object()  # job_field's vllm_default when the API default is the job default


def job_field(default: Any, parse: "_Parser", type_doc: str, doc: str, *, vllm: Optional[str] = None,
              vllm_default: Any = _SAME, to_job: Optional[Callable[[Any], Any]] = None, sampling: bool = False,
              when_set: bool = False):
    """A job key declared once: a dataclass field whose metadata every other place reads.

    Args:
        default: the value when the key is absent (immutable).
        parse: ``parse(value, dotted_key, ctx)`` -> the checked value; raises ``ctx.err(key, ...)``.
        type_doc, doc: the type and notes columns of the key's row in docs/REFERENCE.md (:func:`reference_rows`).
        vllm: the key's name in vLLM's ``SamplingParams`` and in a batch file's request body (None: neither has it);
            ``lightning_moe.api.SamplingParams`` has one keyword per such field.
        vllm_default: that keyword's default (default: ``default``).
        to_job: the vLLM value -> the job value (None from it: the key is not set); default: the value as given.
        sampling: the key changes nothing when decoding is greedy (temperature 0): a batch file's greedy requests
            run together whatever their value.
        when_set: the key is recorded (results provenance, batch groups) only when it differs from its default, so
            results written before the key existed still match; every key added later sets it.
    """
    meta = {"parse": parse, "type_doc": type_doc, "doc": doc, "vllm": vllm,
            "vllm_default": default if vllm_default is _SAME else vllm_default, "to_job": to_job or (lambda v: v),
            "sampling": sampling, "when_set": when_set}
    return field(default=default, metadata=meta)


def _negate(v: Any) -> Any:
    """vLLM's ``ignore_eos`` -> ``stop_at_eos``: a boolean negated, anything else left for the parser to refuse."""
    return not v if isinstance(v, bool) else v


def _nonempty_list(v: Any) -> Any:
    """vLLM's ``stop`` / ``stop_token_ids``: None, ``""`` and ``[]`` ask for nothing (None), one string is a list of
    one, a tuple a list; anything else is left for the parser."""
    if v is None or (isinstance(v, (str, list, tuple)) and len(v) == 0):
        return None
    return [v] if isinstance(v, str) else list(v) if isinstance(v, tuple) else v


# ================================================================================================
# dataclasses
# ================================================================================================
@dataclass(frozen=True)
class DataSource:
    """Where the requests come from (``data:`` section)."""

    source: str = "jsonl"  # "jsonl" (data.path), "mtbench" (80 MT-Bench first-turn questions) or IN_MEMORY (the API)
    path: Optional[str] = None  # absolute path of the JSONL file; required for jsonl, optional question.jsonl for mtbench
    chat_template: bool = False  # wrap prompts with the tokenizer's chat template (default: True for mtbench, False for jsonl)
    system_prompt: Optional[str] = None  # system message prepended when chat_template is on
    chat_template_kwargs: Optional[dict] = None  # variables the chat template reads (Qwen3: {enable_thinking: false})
    limit: Optional[int] = None  # read only the first `limit` requests of the file (None = all)
    truncate: str = "error"  # prompt longer than the context: "error" (or error record) | "left" (drop oldest tokens)


@dataclass(frozen=True)
class GenerationConfig:
    """Decoding parameters (``generation:`` section); used by task generate. Each field is a :func:`job_field`: its
    parser, default, doc line and vLLM name are declared here once, and every other place reads them (module
    docstring, "Job fields declared once")."""

    max_new_tokens: int = job_field(
        128, _p_int(lo=1), "int >= 1", "tokens generated per request at most", vllm="max_tokens")
    temperature: float = job_field(
        0.0, _p_float(lo=0.0), "float >= 0",
        "0 = greedy; `1e-4` (read by YAML as a string) is accepted as a number", vllm="temperature")
    top_p: float = job_field(
        1.0, _p_float(lo=0.0, hi=1.0, lo_open=True), "float in (0, 1]",
        "nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p; 1 = off",
        vllm="top_p", sampling=True)
    seed: int = job_field(
        0, _p_int(lo=0, hi=2**63 - 1), "int >= 0",
        "sampling is seeded per request id: same output whatever the batch", vllm="seed", sampling=True)
    stop_at_eos: bool = job_field(
        True, _p_bool, "bool", "finish a sequence when it emits the tokenizer's EOS id",
        vllm="ignore_eos", vllm_default=False, to_job=_negate)
    stop: tuple[str, ...] = job_field(
        (), _p_list(lambda v, key, ctx: _p_str(v, key, ctx, allow_empty=True) or _p_str(v, key, ctx)),
        "str or list of str",
        "finish when the text contains one (found whatever tokens it spans); the text is cut before it, "
        "`finish_reason: stop`", vllm="stop", vllm_default=None, to_job=_nonempty_list, when_set=True)
    stop_token_ids: tuple[int, ...] = job_field(
        (), _p_list(_p_int(lo=0)), "int or list of int",
        "finish at one of these tokens (kept in `output_ids`), `finish_reason: stop`; each must be in the model's "
        "vocabulary `[0, vocab_size)` (checked before any weight is read)",
        vllm="stop_token_ids", vllm_default=None, to_job=_nonempty_list, when_set=True)
    logprobs: Optional[int] = job_field(
        None, _opt(_p_int(lo=0, hi=MAX_LOGPROBS)), f"int 0..{MAX_LOGPROBS} \\| null",
        "per generated token its log-probability (fp32 log-softmax of the raw logits, before temperature and top-p, "
        "as vLLM's default) and the k best alternatives: record fields `logprobs` and, for k >= 1, `top_logprobs`; "
        "null: nothing computed", vllm="logprobs", when_set=True)
    top_k: int = job_field(
        0, lambda v, key, ctx: max(_p_int(lo=-1)(v, key, ctx), 0), "int >= -1",
        "sample among the k most likely tokens only; 0 or -1 (vLLM's off) = off, -1 read as 0",
        vllm="top_k", sampling=True, when_set=True)
    min_p: float = job_field(
        0.0, _p_float(lo=0.0, hi=1.0), "float in [0, 1]",
        "drop the tokens whose probability is below min_p times the most likely token's; 0 = off",
        vllm="min_p", sampling=True, when_set=True)

    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0)."""
        return self.temperature == 0.0


@dataclass(frozen=True)
class ScoreConfig:
    """Scoring parameters (``score:`` section); required by task score."""

    mode: str  # "loglikelihood" | "multiple_choice" | "perplexity"
    stride: Optional[int] = None  # perplexity only: rolling-window stride in tokens (None = one window, must fit)
    length_normalize: bool = False  # multiple_choice: also rank choices by log-prob per byte of the choice text


@dataclass(frozen=True)
class CheckpointConfig:
    """Partial-generation checkpoints (``checkpoint:`` section): how often the new tokens of every sequence in flight
    are appended to the results' sidecar (``OutputConfig.partial_path``), whichever schedule comes first; both null:
    only when a stop signal (SIGTERM / SIGINT) arrives."""

    enabled: bool = True  # false: no partials are written (a kill or a stop loses the sequences in flight)
    every_steps: Optional[int] = None  # append after every this many decode steps (>= 1); null = no step schedule
    every_seconds: Optional[float] = 60.0  # append once this many seconds passed since the last append (> 0); null = no time schedule


@dataclass(frozen=True)
class RayConfig:
    """Running the job's shards as Ray tasks (``ray:`` section; ``moe-batch run --ray ADDRESS|local --shards N``)."""

    address: str = "local"  # "local" (start a Ray runtime on this machine), "auto" (the local cluster), "host:port" or "ray://host:port"
    shards: int = 2  # shards (Ray tasks) the job is split into by id hash (>= 1)
    max_retries: int = 3  # times a shard whose task failed (worker killed, node lost, error) is submitted again (>= 0)
    cpus_per_shard: int = 1  # CPUs each shard's task asks Ray for (a GPU job's task also asks for its `gpus` GPUs)


@dataclass(frozen=True)
class OutputConfig:
    """Where results go (``output:`` section)."""

    path: str  # absolute path of results.jsonl (one JSON record per request, appended, resumable)

    @property
    def report_path(self) -> str:
        """``<dir>/<stem>.report.json`` beside the results file (run report, written atomically)."""
        root, _ext = os.path.splitext(self.path)
        return root + ".report.json"

    @property
    def meta_path(self) -> str:
        """``<dir>/<stem>.meta.json`` beside the results file: what its records depend on (model, dtype, decoding or
        scoring settings, prompt formatting), written with the first record and checked on every resume."""
        root, _ext = os.path.splitext(self.path)
        return root + ".meta.json"

    @property
    def partial_path(self) -> str:
        """``<dir>/<stem>.partial.jsonl`` beside the results file: the tokens generated so far by sequences without a
        record (one ``{"id", "start", "ids"}`` line per sequence per checkpoint, appended and fsync'd)."""
        root, _ext = os.path.splitext(self.path)
        return root + ".partial.jsonl"


@dataclass(frozen=True)
class Job:
    """One validated batch job (a job YAML)."""

    model: str  # checkpoint directory (absolute) or "tiny-mixtral"
    data: DataSource  # request source
    output: Optional[OutputConfig]  # results file; None for a job whose requests and records stay in memory (the API)
    task: str = "generate"  # "generate" | "score"
    generation: GenerationConfig = field(default_factory=GenerationConfig)  # decoding parameters
    score: Optional[ScoreConfig] = None  # scoring parameters; set iff task == "score"
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # partial-generation checkpoints (generate)
    device: str = "cuda"  # "cpu" | "cuda" | "cuda:N"
    dtype: str = "bfloat16"  # compute/weight dtype: "float32" | "bfloat16" | "float16"
    executor: str = "serial"  # "serial" | "cgopipe" (YAML default: cgopipe on cuda, serial on cpu)
    batch_size: int = 16  # sequences per batch of the serial executor (>= 1)
    expert_ffn: str = "auto"  # cgopipe's expert FFN: "torch" (reference loop, tokens identical to serial), "triton"
    #   (fused grouped kernel, no host syncs, ~1e-2 relative in bf16), "grouped_mm" (torch's grouped GEMM, the same
    #   contract), "mm_loop" (one library GEMM per expert: one host sync per call), "auto" = on cuda with triton
    #   importable, per call the kernel the hardware profile measured fastest at that call's token count (decode
    #   steps: of triton and grouped_mm; triton where it has no measurement); on the cpu the torch loop
    policy: Any = "auto"  # "auto" | absolute path of a policy YAML | dict of explicit policy fields | None
    hardware: Optional[str] = None  # hardware preset name (e.g. "h200") or absolute path of a profile YAML
    gpu_memory: Optional[int] = None  # GPU memory the planner may use, bytes (YAML accepts "24GiB")
    cpu_memory: Optional[int] = None  # host memory the planner may use, bytes (YAML accepts "64GB")
    gpus: int = 1  # GPUs of one host (expert parallelism, >= 1): > 1 plans per GPU (gpu_memory is per GPU) and `moe-batch
    #   run` starts one process per GPU (executor: serial; device cpu runs the processes on the CPU over gloo)
    on_error: str = "fail"  # bad request: "fail" (stop before heavy work) | "record" (write an error record)
    shard: Optional[tuple[int, int]] = None  # (index, count), index 0-based in 0..count-1; None = all requests
    ray: Optional[RayConfig] = None  # run the shards as Ray tasks (app.ray_jobs); None = this process runs the job
    name: str = "job"  # job name (YAML file stem by default), used in reports
    config_path: Optional[str] = None  # absolute path of the YAML this job came from (None for job_from_dict)
    source: Optional[str] = None  # the job as error messages name it: the YAML path as the user typed it
    #   ("jobs/x.yaml"), or job_from_dict's source_name ("LLM", "moe-batch run-batch"); see :attr:`label`

    @property
    def label(self) -> str:
        """What every error about this job starts with: :attr:`source` (the path as typed), else the name."""
        return self.source or self.name

    @property
    def torch_dtype(self):
        """The ``torch.dtype`` for :attr:`dtype` (imports torch lazily)."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def is_tiny(self) -> bool:
        """True when the model is the embedded tiny Mixtral."""
        return self.model == TINY_MODEL

    def to_dict(self) -> dict:
        """A JSON-serializable dict of every field (for run reports)."""
        d = dataclasses.asdict(self)
        if self.shard is not None:
            d["shard"] = f"{self.shard[0]}/{self.shard[1]}"
        return d


# ================================================================================================
# what the job fields' metadata gives (job_field): the API keywords, batch-file body keys, records, docs
# ================================================================================================
def vllm_fields(cls: Optional[type] = None) -> list:
    """The ``dataclasses.Field`` s of ``cls`` (None: :class:`GenerationConfig`, looked up at each call) that have a
    vLLM name (``metadata["vllm"]``), in declaration order: one keyword of ``lightning_moe.api.SamplingParams`` and one
    request-body key of a batch file each."""
    return [f for f in dataclasses.fields(cls or GenerationConfig) if f.metadata.get("vllm")]


def generation_from_vllm(values: Mapping[str, Any], cls: Optional[type] = None) -> dict:
    """A ``generation:`` section (unchecked) from values under their vLLM names: each converted by its field's
    ``to_job``; a name absent from ``values``, or a value that converts to None, sets nothing."""
    gen = {}
    for f in vllm_fields(cls):
        if f.metadata["vllm"] in values:
            v = f.metadata["to_job"](values[f.metadata["vllm"]])
            if v is not None:
                gen[f.name] = v
    return gen


def _at_default(f: dataclasses.Field, v: Any) -> bool:
    """``v`` (a parsed value, or its JSON form: a list for a tuple) equals the field's default."""
    return v == f.default or (isinstance(v, list) and isinstance(f.default, tuple) and tuple(v) == f.default)


def recorded(gen: Mapping[str, Any], cls: Optional[type] = None, greedy_defaults: bool = False) -> dict:
    """``gen`` (a ``generation:`` section) as records of it keep it (tuples as lists): a ``when_set`` field at its
    default left out, so results written before that field existed still match. ``greedy_defaults``: when decoding is
    greedy (temperature 0), every ``sampling`` field first set to its default (it changes nothing). Used for the
    results' provenance (app.engine, meta.json) and a batch file's groups (app.batch_files, with greedy_defaults)."""
    fields = {f.name: f for f in dataclasses.fields(cls or GenerationConfig)}
    greedy = greedy_defaults and gen.get("temperature", fields["temperature"].default) == 0
    out = {}
    for k, v in gen.items():
        f = fields[k]
        v = f.default if greedy and f.metadata.get("sampling") else v
        if not (f.metadata.get("when_set") and _at_default(f, v)):
            out[k] = list(v) if isinstance(v, tuple) else v
    return out


def _default_doc(v: Any) -> str:
    return "null" if v is None else "none" if v == () else str(v).lower() if isinstance(v, bool) else str(v)


def reference_rows(cls: Optional[type] = None, section: str = "generation") -> list[str]:
    """The rows of docs/REFERENCE.md's job-key table for ``cls``'s fields (``| `section.key` | type | default | doc
    (vLLM: `name`) |``), from their metadata; tests/test_job_fields.py checks the document holds exactly these."""
    def notes(f):
        vllm = f.metadata.get("vllm")
        return f.metadata["doc"] + (f" (vLLM: `{vllm}`)" if vllm else "")

    return [f"| `{section}.{f.name}` | {f.metadata['type_doc']} | {_default_doc(f.default)} | {notes(f)} |"
            for f in dataclasses.fields(cls or GenerationConfig)]


# ================================================================================================
# value parsers
# ================================================================================================
_TYPE_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "a list",
               dict: "a mapping", type(None): "null"}


def _describe(v: Any) -> str:
    return f"{v!r} ({_TYPE_NAMES.get(type(v), type(v).__name__)})"


_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_SHARD_RE = re.compile(r"^\s*(-?\d+)\s*/\s*(-?\d+)\s*$")


class _Ctx:
    """Error context: the source label (file name), the base dir for relative paths, overridden keys, and the line
    of each dotted key in the file (:func:`_key_lines`; empty for a mapping that is not from a file)."""

    def __init__(self, source: str, base_dir: str, overridden: frozenset = frozenset(),
                 lines: Optional[Mapping[str, int]] = None):
        self.source = source
        self.base_dir = base_dir
        self.overridden = overridden
        self.lines = lines or {}

    def line(self, key: str) -> Optional[int]:
        """The file line of ``key``, else of its nearest enclosing key (a list item ``a.b[1]``: its list's; a missing
        key: its section's); None for an overridden key or one outside the file."""
        if key in self.overridden:
            return None
        while key:
            if key in self.lines:
                return self.lines[key]
            key = key[:key.rindex("[")] if key.endswith("]") else key.rpartition(".")[0]  # a list item: its list
        return None

    def err(self, key: str, msg: str) -> ConfigError:
        where = f"{key} (from override)" if key in self.overridden else key
        line = self.line(key)
        return ConfigError(f"{self.source}{f':{line}' if line else ''}: {where}: {msg}")

    def resolve(self, p: str, key: str = "") -> str:
        """``p`` as an absolute path: relative to the current directory when ``key`` came from a command-line
        override (every command-line path is), else to the job file's directory."""
        p = os.path.expanduser(p)
        base = os.getcwd() if key in self.overridden else self.base_dir
        return os.path.normpath(p if os.path.isabs(p) else os.path.join(base, p))


def _key_lines(text: str) -> dict:
    """The 1-based line of every dotted key of a YAML document's nested mappings (``data.path`` -> 4), from
    ``yaml.compose``'s node marks; {} when the text does not compose."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode):
                    lines[prefix + str(k.value)] = k.start_mark.line + 1
                    walk(v, f"{prefix}{k.value}.")

    walk(root, "")
    return lines


def _p_str(v, key, ctx, *, allow_empty=False):
    if not isinstance(v, str):
        raise ctx.err(key, f"expected a string, got {_describe(v)}")
    if not allow_empty and not v.strip():
        raise ctx.err(key, "expected a non-empty string")
    return v


# apply_chat_template's own arguments: a template variable of the same name would be taken by the call instead
_TEMPLATE_RESERVED = ("conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                      "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                      "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs")


def _p_template_kwargs(v, key, ctx):
    """A mapping of chat-template variables: identifier names (not apply_chat_template's own arguments) to JSON
    values (strings, numbers, booleans, null, lists and mappings of them)."""
    if not isinstance(v, dict):
        raise ctx.err(key, f"expected a mapping of template variables (e.g. {{enable_thinking: false}}), got "
                           f"{_describe(v)}")

    def json_like(x):
        if isinstance(x, (str, int, float, bool)) or x is None:
            return True
        if isinstance(x, list):
            return all(json_like(i) for i in x)
        return isinstance(x, dict) and all(isinstance(k, str) and json_like(i) for k, i in x.items())

    for k, x in v.items():
        if not isinstance(k, str) or not k.isidentifier():
            raise ctx.err(key, f"template variable names must be identifiers, got {k!r}")
        if k in _TEMPLATE_RESERVED:
            raise ctx.err(f"{key}.{k}", "an argument of apply_chat_template, not a template variable")
        if not json_like(x):
            raise ctx.err(f"{key}.{k}", f"expected a JSON value, got {_describe(x)}")
    return dict(v)


def _p_choice(options):
    def parse(v, key, ctx):
        if not isinstance(v, str) or v not in options:
            raise ctx.err(key, f"expected one of {', '.join(repr(o) for o in options)}, got {_describe(v)}")
        return v
    return parse


def _p_device(v, key, ctx):
    if isinstance(v, str) and (v in DEVICES or re.fullmatch(r"cuda:\d+", v)):
        return v
    raise ctx.err(key, f"expected 'cpu', 'cuda' or 'cuda:N' (N a GPU index), got {_describe(v)}")


def parse_bytes(v: Any) -> int:
    """A job's memory size: an int (bytes) or a string such as ``"24GiB"``, ``"16GB"``, ``"512 MiB"``
    (policy.hardware.parse_bytes; 0 is an error). Raises ValueError (message without file/key)."""
    return _parse_bytes(v, positive=True)


def _p_bytes(v, key, ctx):
    try:
        return parse_bytes(v)
    except ValueError as e:
        raise ctx.err(key, str(e)) from None


def parse_shard(v: Any) -> tuple[int, int]:
    """Parse a shard spec ``"I/N"`` (or a 2-list ``[I, N]``) into ``(index, count)``.

    ``index`` is 0-based: valid shards of ``N`` are ``0/N`` .. ``(N-1)/N`` (same as the CLI's ``--shard I/N``).
    Raises ValueError (message without file/key) on a malformed spec or an index out of range.
    """
    if isinstance(v, str) and (m := _SHARD_RE.match(v)):
        i, n = int(m.group(1)), int(m.group(2))
    elif isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        i, n = v
    else:
        raise ValueError(f"expected 'I/N' (e.g. '0/4', index 0-based), got {_describe(v)}")
    if n < 1:
        raise ValueError(f"shard count must be >= 1, got {n}")
    if not 0 <= i < n:
        raise ValueError(f"shard index is 0-based and must be in 0..{n - 1}, got {i} (in {i}/{n})")
    return i, n


def _p_shard(v, key, ctx):
    try:
        return parse_shard(v)
    except ValueError as e:
        raise ctx.err(key, str(e)) from None


def _p_input_file(v, key, ctx):
    p = ctx.resolve(_p_str(v, key, ctx), key)
    if not os.path.exists(p):
        raise ctx.err(key, f"file not found: {p}")
    if not os.path.isfile(p):
        raise ctx.err(key, f"not a regular file: {p}")
    return p


def _p_output_file(v, key, ctx):
    p = ctx.resolve(_p_str(v, key, ctx), key)
    if os.path.isdir(p):
        raise ctx.err(key, f"is a directory, expected a results file path: {p}")
    return p


def _p_model(v, key, ctx):
    s = _p_str(v, key, ctx)
    if s == TINY_MODEL:
        return s
    p = ctx.resolve(s, key)
    if not os.path.isdir(p):
        from .policy.registry import REGISTRY  # registry names are configs for `plan`, not weights

        hint = (f"; {s!r} is a registry config that `moe-batch plan --model` takes, while run needs a checkpoint "
                f"directory" if s.lower() in REGISTRY else "")
        raise ctx.err(key, f"checkpoint directory not found: {p} (use {TINY_MODEL!r} for the embedded tiny model{hint})")
    if not os.path.isfile(os.path.join(p, "config.json")):
        raise ctx.err(key, f"not a Hugging Face checkpoint directory (no config.json): {p}")
    return p


def _p_policy(v, key, ctx):
    if v is None or v == "auto":
        return v
    if isinstance(v, dict):
        for k in v:
            if not isinstance(k, str):
                raise ctx.err(key, f"policy field names must be strings, got {_describe(k)}")
        glued = _glued_keys(v)
        if glued:
            raise ctx.err(key, f"YAML read {glued[0]!r} as a field name without a value: write "
                               f"{_unglue('{' + ','.join(glued) + '}')} (YAML needs a space after the colon)")
        return copy.deepcopy(v)
    if isinstance(v, str):
        return _p_input_file(v, key, ctx)
    raise ctx.err(key, f"expected 'auto', a policy YAML path or a mapping of policy fields, got {_describe(v)}")


_PRESET_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def _p_hardware(v, key, ctx):
    s = _p_str(v, key, ctx)
    if os.sep in s or "/" in s or s.lower().endswith((".yaml", ".yml", ".json")):
        return _p_input_file(s, key, ctx)
    if not _PRESET_RE.match(s):
        raise ctx.err(key, f"expected a preset name (e.g. 'h200') or a profile YAML path, got {s!r}")
    return s.lower()


# ================================================================================================
# schema: section -> {key: (parser, required)}
# ================================================================================================
_Parser = Callable[[Any, str, _Ctx], Any]

_DATA_KEYS: dict[str, _Parser] = {
    "source": _p_choice(SOURCES),
    "path": _opt(_p_input_file),
    "chat_template": _p_bool,
    "system_prompt": _opt(lambda v, k, c: _p_str(v, k, c, allow_empty=True)),
    "chat_template_kwargs": _opt(_p_template_kwargs),
    "limit": _opt(_p_int(lo=1)),
    "truncate": _p_choice(TRUNCATE),
}
_GEN_KEYS: dict[str, _Parser] = {f.name: f.metadata["parse"] for f in dataclasses.fields(GenerationConfig)}
_SCORE_KEYS: dict[str, _Parser] = {
    "mode": _p_choice(SCORE_MODES),
    "stride": _opt(_p_int(lo=1)),
    "length_normalize": _p_bool,
}
_CHECKPOINT_KEYS: dict[str, _Parser] = {
    "enabled": _p_bool,
    "every_steps": _opt(_p_int(lo=1)),
    "every_seconds": _opt(_p_float(lo=0.0, lo_open=True)),
}
_OUTPUT_KEYS: dict[str, _Parser] = {
    "path": _p_output_file,
}
_RAY_KEYS: dict[str, _Parser] = {
    "address": _p_str,
    "shards": _p_int(lo=1),
    "max_retries": _p_int(lo=0),
    "cpus_per_shard": _p_int(lo=1),
}
_SECTIONS = {"data": _DATA_KEYS, "generation": _GEN_KEYS, "score": _SCORE_KEYS, "checkpoint": _CHECKPOINT_KEYS,
             "output": _OUTPUT_KEYS, "ray": _RAY_KEYS}
_TOP_KEYS: dict[str, _Parser] = {
    "name": _p_str,
    "model": _p_model,
    "task": _p_choice(TASKS),
    "device": _p_device,
    "dtype": _p_choice(DTYPES),
    "executor": _p_choice(EXECUTORS),
    "batch_size": _p_int(lo=1),
    "expert_ffn": _p_choice(EXPERT_FFNS),
    "policy": _p_policy,
    "hardware": _opt(_p_hardware),
    "gpu_memory": _opt(_p_bytes),
    "cpu_memory": _opt(_p_bytes),
    "gpus": _p_int(lo=1),
    "on_error": _p_choice(ON_ERROR),
    "shard": _opt(_p_shard),
}
_ALL_TOP = list(_TOP_KEYS) + list(_SECTIONS)


def _check_keys(d: Mapping, allowed, prefix: str, ctx: _Ctx) -> None:
    for k in d:
        if not isinstance(k, str) or k not in allowed:
            close = difflib.get_close_matches(str(k), list(allowed), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ctx.err(f"{prefix}{k}", f"unknown key{hint}; allowed keys: {', '.join(allowed)}")


def _section(raw: Mapping, name: str, ctx: _Ctx) -> Optional[dict]:
    """Parse one section mapping into a dict of parsed values (None when absent or null)."""
    if name not in raw or raw[name] is None:
        return None
    sec = raw[name]
    if not isinstance(sec, dict):
        raise ctx.err(name, f"expected a mapping of keys, got {_describe(sec)}")
    keys = _SECTIONS[name]
    _check_keys(sec, keys, f"{name}.", ctx)
    return {k: keys[k](v, f"{name}.{k}", ctx) for k, v in sec.items()}


def _apply_overrides(raw: dict, overrides: Mapping[str, Any], ctx_source: str) -> tuple[dict, frozenset]:
    raw = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = raw
        for i, p in enumerate(parts[:-1]):
            sub = node.get(p)
            if sub is None:
                sub = node[p] = {}
            if not isinstance(sub, dict):
                raise ConfigError(f"{ctx_source}: {'.'.join(parts[:i + 1])} (from override {dotted}): "
                                  f"is {_describe(sub)}, not a mapping")
            node = sub
        if value is None:
            node.pop(parts[-1], None)  # None = remove the key (back to the default)
        else:
            node[parts[-1]] = value
    return raw, frozenset(overrides)


def _glued_keys(v: Any) -> list:
    """The keys of ``v``'s mappings (nested ones too) that YAML made of ``key:value`` written without the space after
    the colon (``{mu:8}`` is the mapping ``{"mu:8": None}``): a string key holding ``:`` that maps to null."""
    if isinstance(v, list):
        return [k for x in v for k in _glued_keys(x)]
    if not isinstance(v, dict):
        return []
    return [k for k, x in v.items() if isinstance(k, str) and ":" in k.strip(":") and x is None] + \
        [k for x in v.values() for k in _glued_keys(x)]


def _unglue(text: str) -> str:
    """``{mu:8,n:2}`` -> ``{mu: 8, n: 2}``: a space after every ``:`` and ``,`` not followed by one."""
    return re.sub(r"([:,])(?=[^\s])", r"\1 ", text)


def parse_override(text: str) -> tuple[str, Any]:
    """Parse a CLI override ``"dotted.key=value"``; the value is read as YAML (``"0.5"`` -> 0.5, ``"true"`` -> True).

    Raises ValueError when there is no ``=`` or the key is empty, and when a flow mapping was written without the
    space YAML needs after a colon (``policy={mu:8,n:2}``: the message gives ``policy={mu: 8, n: 2}``).
    """
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"override must look like key=value (e.g. generation.max_new_tokens=8), got {text!r}")
    parsed = yaml.safe_load(value) if value.strip() else None
    glued = _glued_keys(parsed)
    if glued:
        raise ValueError(f"--set {text}: YAML read {glued[0]!r} as a key without a value: write "
                         f"'{key.strip()}={_unglue(value.strip())}' (YAML needs a space after the colon)")
    return key.strip(), parsed


# ================================================================================================
# entry points
# ================================================================================================
_MEMORY_DATA_KEYS = ("chat_template", "system_prompt", "chat_template_kwargs", "truncate")  # data keys of an in-memory job


def job_from_dict(d: Mapping[str, Any], source_name: str = "<job>", base_dir: Optional[str] = None,
                  overrides: Optional[Mapping[str, Any]] = None, name: Optional[str] = None,
                  config_path: Optional[str] = None, in_memory: bool = False,
                  key_lines: Optional[Mapping[str, int]] = None, notify: bool = False) -> Job:
    """Validate a job mapping (as YAML would give it) into a :class:`Job`.

    Args:
        d: the job mapping.
        source_name: label used in error messages in place of a file name.
        base_dir: directory relative paths resolve against (default: the current directory).
        overrides: ``{"dotted.key": value}`` applied over ``d`` before validation; a None value removes the key.
        name: job name when ``d`` has no ``name`` key (default: ``"job"``).
        config_path: recorded as :attr:`Job.config_path`.
        in_memory: the caller holds the requests and takes the records (the Python API, ``lightning_moe.api``):
            ``data`` may hold only chat_template, system_prompt, chat_template_kwargs and truncate (``data.source``
            becomes IN_MEMORY),
            ``output`` is not allowed (:attr:`Job.output` is None); every other key is checked as for a YAML.
        key_lines: the file line of each dotted key (``load_job``: from the YAML text), put in the messages as
            ``source:line: key:``.
        notify: print a one-line notice on stderr for a key that has no effect with the job's other keys
            (``gpu_memory`` on ``device: cpu`` with ``executor: serial``, which uses no GPU).

    Raises:
        ConfigError: unknown key, wrong type or value, missing required key, missing input file or checkpoint
            directory, or inconsistent keys; the message starts with ``source_name: dotted.key:`` (``source_name:line:
            dotted.key:`` where ``key_lines`` has the key or its section).
    """
    ctx = _Ctx(source_name, os.path.abspath(base_dir or os.getcwd()), lines=key_lines)
    raw = _job_keys(d, ctx, overrides, in_memory)
    top = {k: _TOP_KEYS[k](v, k, ctx) for k, v in raw.items() if k in _TOP_KEYS}
    data_src, output = _data_and_output(raw, ctx, in_memory)
    gen = GenerationConfig(**(_section(raw, "generation", ctx) or {}))
    ckpt = CheckpointConfig(**(_section(raw, "checkpoint", ctx) or {}))
    score = _score_section(raw, ctx, top.get("task", "generate"), data_src.source)
    ray_cfg = _ray_section(raw, ctx, top, in_memory)
    _executor_keys(top, ctx, in_memory, notify)
    top.setdefault("name", name or "job")
    return Job(data=data_src, output=output, generation=gen, score=score, checkpoint=ckpt, config_path=config_path,
               source=source_name, ray=ray_cfg,
               **{k: v for k, v in top.items()})


def _ray_section(raw: dict, ctx: _Ctx, top: dict, in_memory: bool) -> Optional[RayConfig]:
    """The job's ``ray`` section (None without one): not for in-memory requests, not beside ``shard``."""
    ray_sec = _section(raw, "ray", ctx)
    if ray_sec is None:
        return None
    if in_memory:
        raise ctx.err("ray", "not used when the requests are given in memory (the Python API runs in this process)")
    if top.get("shard") is not None:
        raise ctx.err("ray", "a job runs either as Ray shards or as one shard (shard:), not both")
    return RayConfig(**ray_sec)


def _job_keys(d: Any, ctx: _Ctx, overrides: Optional[Mapping[str, Any]], in_memory: bool) -> dict:
    """The job mapping ``d`` with ``overrides`` applied, its top-level keys checked: none unknown, the required ones
    there, an in-memory job's ``data`` and ``output`` as the Python API allows them."""
    if not isinstance(d, dict):
        raise ConfigError(f"{ctx.source}: expected a mapping of job keys at the top level, got {_describe(d)}")
    raw = dict(d)
    if overrides:
        raw, overridden = _apply_overrides(raw, overrides, ctx.source)
        ctx.overridden = overridden
    _check_keys(raw, _ALL_TOP, "", ctx)
    for req in ("model",) if in_memory else ("model", "data", "output"):
        if raw.get(req) is None:
            raise ctx.err(req, f"required key is missing (allowed top-level keys: {', '.join(_ALL_TOP)})")
    if in_memory:
        if raw.get("output") is not None:
            raise ctx.err("output", "not used when the requests are given in memory (the records are returned)")
        if isinstance(raw.get("data"), dict):
            _check_keys(raw["data"], _MEMORY_DATA_KEYS, "data.", ctx)
    return raw


def _data_and_output(raw: dict, ctx: _Ctx, in_memory: bool) -> tuple[DataSource, Optional[OutputConfig]]:
    """The job's ``data`` and ``output`` sections (an in-memory job: data source IN_MEMORY, no output)."""
    data = _section(raw, "data", ctx) or {}
    source = IN_MEMORY if in_memory else data.get("source", "jsonl")
    if source == "jsonl" and data.get("path") is None:
        raise ctx.err("data.path", "required for source: jsonl (a JSONL file of requests)")
    data.setdefault("chat_template", source == "mtbench")
    data_src = DataSource(**data, **({"source": IN_MEMORY} if in_memory else {}))
    if in_memory:
        return data_src, None
    out = _section(raw, "output", ctx) or {}
    if "path" not in out:
        raise ctx.err("output.path", "required key is missing (the results .jsonl file)")
    if data_src.path is not None and os.path.abspath(out["path"]) == os.path.abspath(data_src.path):
        raise ctx.err("output.path", f"is the same file as data.path ({data_src.path}); it would be overwritten")
    return data_src, OutputConfig(**out)


def _score_section(raw: dict, ctx: _Ctx, task: str, source: str) -> Optional[ScoreConfig]:
    """The job's ``score`` section: required for ``task: score`` (with its mode; ``stride`` only for perplexity; not
    for MT-Bench), refused for a generate job."""
    sc = _section(raw, "score", ctx)
    if task != "score":
        if sc is not None:
            raise ctx.err("score", "only valid with task: score (task is 'generate')")
        return None
    if sc is None:
        raise ctx.err("score", "required for task: score (score.mode: loglikelihood | multiple_choice | perplexity)")
    if "mode" not in sc:
        raise ctx.err("score.mode", f"required key is missing (one of {', '.join(SCORE_MODES)})")
    if sc.get("stride") is not None and sc["mode"] != "perplexity":
        raise ctx.err("score.stride", f"only applies to mode: perplexity (mode is {sc['mode']!r})")
    if source == "mtbench":
        raise ctx.err("data.source", "mtbench has no continuations/choices to score; use task: generate")
    return ScoreConfig(**sc)


def _executor_keys(top: dict, ctx: _Ctx, in_memory: bool, notify: bool) -> None:
    """Set ``top``'s device (default cuda) and executor (default: cgopipe on CUDA, else serial) and check they agree
    with ``gpus``; with ``notify``, a notice for ``gpu_memory`` where it has no effect."""
    device = top.get("device", "cuda")
    executor = top.get("executor", "cgopipe" if device.startswith("cuda") else "serial")
    # executor: cgopipe on device: cpu runs the same pipeline with synchronous copies (tests, debugging)
    if top.get("gpus", 1) > 1 and executor != "serial":
        # the expert-parallel executor is built on the serial executor's math (pipeline/expert_parallel.py)
        raise ctx.err("gpus", f"gpus > 1 runs the serial executor's expert-parallel form; set executor: serial "
                              f"(executor is {executor!r}; CGOPipe over several GPUs is not built yet)")
    if top.get("gpus", 1) > 1 and in_memory:
        raise ctx.err("gpus", "gpus > 1 starts one process per GPU, which an in-memory job (the Python API) cannot")
    if notify and device == "cpu" and executor == "serial" and top.get("gpu_memory") is not None:
        print(f"moe-batch: note: {str(ctx.err('gpu_memory', 'ignored: device: cpu with executor: serial uses no GPU'))}"
              f" (with executor: cgopipe it sizes the CPU run's simulated GPU tier)", file=sys.stderr, flush=True)
    top["device"] = device
    top["executor"] = executor


def generation_from_dict(d: Mapping[str, Any], source_name: str = "<generation>") -> GenerationConfig:
    """Validate a ``generation:`` mapping on its own, as :func:`job_from_dict` does inside a job (the Python API's
    SamplingParams, checked when it is made). Raises ConfigError starting with ``source_name: generation.key:``."""
    ctx = _Ctx(source_name, os.getcwd())
    return GenerationConfig(**(_section({"generation": dict(d)}, "generation", ctx) or {}))


def load_job(path: str, overrides: Optional[Mapping[str, Any]] = None, notify: bool = True) -> Job:
    """Load and validate a job YAML (``yaml.safe_load``) into a :class:`Job`.

    Relative paths inside the file resolve against the file's directory. ``overrides`` maps dotted keys to
    values (e.g. ``{"generation.max_new_tokens": 8, "shard": "0/4"}``) applied before validation. ``notify``: print
    :func:`job_from_dict`'s notices (a key without effect) on stderr.

    Raises:
        ConfigError: the file is missing or not valid YAML, or any check of :func:`job_from_dict` fails; the
            message starts with ``<path as given>: dotted.key:``.
    """
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: job file not found")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        d = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if d is None:
        raise ConfigError(f"{path}: the file is empty (expected a mapping of job keys)")
    stem = os.path.splitext(os.path.basename(path))[0]
    return job_from_dict(d, source_name=path, base_dir=os.path.dirname(os.path.abspath(path)),
                         overrides=overrides, name=stem, config_path=os.path.abspath(path), key_lines=_key_lines(text),
                         notify=notify)
