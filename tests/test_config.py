"""lightning_moe.config: job YAML loading and validation (every error names file and dotted key)."""

import os
import textwrap

import pytest

from lightning_moe.config import (ConfigError, DataSource, GenerationConfig, Job, OutputConfig, job_from_dict,
                                  load_job, parse_bytes, parse_override, parse_shard)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def jobdir(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    return tmp_path


def write_job(jobdir, body: str, name="x.yaml"):
    p = jobdir / name
    p.write_text(textwrap.dedent(body))
    return str(p)


BASE = """\
model: tiny-mixtral
data:
  path: data/p.jsonl
output:
  path: out/r.jsonl
"""


def test_minimal_job_defaults_and_relative_paths(jobdir):
    p = write_job(jobdir, BASE)
    j = load_job(p)
    assert isinstance(j, Job) and j.model == "tiny-mixtral" and j.is_tiny
    assert j.data == DataSource(source="jsonl", path=str(jobdir / "data" / "p.jsonl"))
    assert j.output == OutputConfig(path=str(jobdir / "out" / "r.jsonl"))
    assert j.output.report_path == str(jobdir / "out" / "r.report.json")
    assert j.generation == GenerationConfig() and j.generation.greedy
    assert (j.task, j.device, j.dtype, j.executor, j.on_error, j.shard) == ("generate", "cuda", "bfloat16", "cgopipe", "fail", None)
    assert j.policy == "auto" and j.name == "x" and j.config_path == p
    import torch

    assert j.torch_dtype is torch.bfloat16
    with pytest.raises(Exception):
        j.task = "score"  # frozen


def test_executor_default_follows_device(jobdir):
    j = load_job(write_job(jobdir, BASE + "device: cpu\n"))
    assert j.executor == "serial"
    assert load_job(write_job(jobdir, BASE + "device: cpu\nexecutor: cgopipe\n")).executor == "cgopipe"
    assert load_job(write_job(jobdir, BASE + "device: cuda\n")).executor == "cgopipe"


def test_unknown_keys_named_with_allowed_list(jobdir):
    with pytest.raises(ConfigError) as e:
        load_job(write_job(jobdir, BASE + "bogus: 1\n"))
    msg = str(e.value)
    assert msg.startswith(f"{jobdir}/x.yaml:6: bogus: unknown key")  # the file, the key's line, the key and "allowed keys:" in msg and "generation" in msg
    with pytest.raises(ConfigError, match=r"x\.yaml:7: generation\.temprature: unknown key \(did you mean 'temperature'\?\)"):
        load_job(write_job(jobdir, BASE + "generation:\n  temprature: 0.5\n"))
    with pytest.raises(ConfigError, match=r"x\.yaml:4: data\.prompts: unknown key.*allowed keys: source, path"):
        load_job(write_job(jobdir, BASE.replace("  path: data/p.jsonl", "  path: data/p.jsonl\n  prompts: 3")))


def test_1e_minus_4_string_is_converted_for_float_fields(jobdir):
    # PyYAML (YAML 1.1) reads `1e-4` as the string '1e-4'; float fields accept it on purpose.
    j = load_job(write_job(jobdir, BASE + "generation:\n  temperature: 1e-4\n  top_p: 1.0e-1\n"))
    assert j.generation.temperature == pytest.approx(1e-4) and isinstance(j.generation.temperature, float)
    assert j.generation.top_p == pytest.approx(0.1)
    assert not j.generation.greedy


def test_bad_number_strings_and_int_fields(jobdir):
    with pytest.raises(ConfigError, match=r"x\.yaml:7: generation\.temperature: expected a number, got 'hot' \(a string\)"):
        load_job(write_job(jobdir, BASE + "generation:\n  temperature: hot\n"))
    with pytest.raises(ConfigError, match=r"generation\.max_new_tokens: expected an integer, got '1e3' \(a string\).*write a plain integer"):
        load_job(write_job(jobdir, BASE + "generation:\n  max_new_tokens: 1e3\n"))
    with pytest.raises(ConfigError, match=r"generation\.max_new_tokens: expected an integer, got True \(a boolean\)"):
        load_job(write_job(jobdir, BASE + "generation:\n  max_new_tokens: true\n"))
    with pytest.raises(ConfigError, match=r"batch_size: expected an integer, got 8\.0 \(a number\) \(write 8"):
        load_job(write_job(jobdir, BASE + "batch_size: 8.0\n"))
    with pytest.raises(ConfigError, match=r"generation\.temperature: expected a number, got True"):
        load_job(write_job(jobdir, BASE + "generation:\n  temperature: yes\n"))
    with pytest.raises(ConfigError, match=r"generation\.top_p: must be > 0\.0"):
        load_job(write_job(jobdir, BASE + "generation:\n  top_p: 0\n"))
    with pytest.raises(ConfigError, match=r"batch_size: must be >= 1, got 0"):
        load_job(write_job(jobdir, BASE + "batch_size: 0\n"))
    with pytest.raises(ConfigError, match=r"data\.chat_template: expected true or false, got 'yes please'"):
        load_job(write_job(jobdir, BASE.replace("  path: data/p.jsonl", "  path: data/p.jsonl\n  chat_template: yes please")))
    with pytest.raises(ConfigError, match=r"dtype: expected one of 'float32', 'bfloat16', 'float16', got 'fp8'"):
        load_job(write_job(jobdir, BASE + "dtype: fp8\n"))
    with pytest.raises(ConfigError, match=r"generation: expected a mapping of keys, got 5"):
        load_job(write_job(jobdir, BASE + "generation: 5\n"))


def test_memory_sizes():
    assert parse_bytes(1024) == 1024
    assert parse_bytes("24GiB") == 24 * 2**30
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5gib") == int(1.5 * 2**30)
    for bad in ("24Gb!", "lots", True, -5, 0, "12 XB", 3.5):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_memory_in_job(jobdir):
    j = load_job(write_job(jobdir, BASE + "gpu_memory: 24GiB\ncpu_memory: 1000000\n"))
    assert j.gpu_memory == 24 * 2**30 and j.cpu_memory == 10**6
    with pytest.raises(ConfigError, match=r"x\.yaml:6: gpu_memory: expected a size like '24GiB'.*got '24 gigs'"):
        load_job(write_job(jobdir, BASE + "gpu_memory: 24 gigs\n"))


def test_shard_is_zero_based(jobdir):
    assert parse_shard("0/3") == (0, 3) and parse_shard("2/3") == (2, 3) and parse_shard([1, 4]) == (1, 4)
    for bad in ("3/3", "-1/3", "1/0", "1-3", "a/b", [1, 2, 3]):
        with pytest.raises(ValueError):
            parse_shard(bad)
    assert load_job(write_job(jobdir, BASE + 'shard: "1/3"\n')).shard == (1, 3)
    with pytest.raises(ConfigError, match=r"x\.yaml:6: shard: shard index is 0-based and must be in 0\.\.2, got 3"):
        load_job(write_job(jobdir, BASE + 'shard: "3/3"\n'))


def test_missing_files_named(jobdir):
    with pytest.raises(ConfigError, match=r"x\.yaml:3: data\.path: file not found: .*nope\.jsonl"):
        load_job(write_job(jobdir, BASE.replace("data/p.jsonl", "data/nope.jsonl")))
    with pytest.raises(ConfigError, match=r"x\.yaml:1: model: checkpoint directory not found: .*no_such_model"):
        load_job(write_job(jobdir, BASE.replace("tiny-mixtral", "no_such_model")))
    with pytest.raises(ConfigError, match=r"'mixtral-8x7b' is a registry config that `moe-batch plan --model` takes"):
        load_job(write_job(jobdir, BASE.replace("tiny-mixtral", "mixtral-8x7b")))
    (jobdir / "ckpt").mkdir()
    with pytest.raises(ConfigError, match=r"model: not a Hugging Face checkpoint directory \(no config.json\)"):
        load_job(write_job(jobdir, BASE.replace("tiny-mixtral", "ckpt")))
    (jobdir / "ckpt" / "config.json").write_text("{}")
    assert load_job(write_job(jobdir, BASE.replace("tiny-mixtral", "ckpt"))).model == str(jobdir / "ckpt")
    with pytest.raises(ConfigError, match=r"x\.yaml:6: policy: file not found: .*pol\.yaml"):
        load_job(write_job(jobdir, BASE + "policy: pol.yaml\n"))
    with pytest.raises(ConfigError, match=r"x\.yaml:6: hardware: file not found: .*prof\.yaml"):
        load_job(write_job(jobdir, BASE + "hardware: prof.yaml\n"))
    with pytest.raises(ConfigError, match=r"job file not found"):
        load_job(str(jobdir / "missing.yaml"))


def test_policy_and_hardware_forms(jobdir):
    (jobdir / "pol.yaml").write_text("mu: 4\n")
    (jobdir / "prof.yaml").write_text("name: x\n")
    j = load_job(write_job(jobdir, BASE + "policy: pol.yaml\nhardware: prof.yaml\n"))
    assert j.policy == str(jobdir / "pol.yaml") and j.hardware == str(jobdir / "prof.yaml")
    j = load_job(write_job(jobdir, BASE + "policy: {mu: 8, n: 2}\nhardware: H200\n"))
    assert j.policy == {"mu": 8, "n": 2} and j.hardware == "h200"
    with pytest.raises(ConfigError, match=r"policy: expected 'auto', a policy YAML path or a mapping"):
        load_job(write_job(jobdir, BASE + "policy: 3\n"))


def test_required_and_cross_field_checks(jobdir):
    with pytest.raises(ConfigError, match=r"x\.yaml: model: required key is missing"):
        load_job(write_job(jobdir, BASE.replace("model: tiny-mixtral\n", "")))
    with pytest.raises(ConfigError, match=r"x\.yaml:2: data\.path: required for source: jsonl"):
        load_job(write_job(jobdir, BASE.replace("  path: data/p.jsonl\n", "  source: jsonl\n")))
    with pytest.raises(ConfigError, match=r"x\.yaml: score: required for task: score"):
        load_job(write_job(jobdir, BASE + "task: score\n"))
    with pytest.raises(ConfigError, match=r"x\.yaml:6: score: only valid with task: score"):
        load_job(write_job(jobdir, BASE + "score: {mode: perplexity}\n"))
    with pytest.raises(ConfigError, match=r"score\.stride: only applies to mode: perplexity"):
        load_job(write_job(jobdir, BASE + "task: score\nscore: {mode: loglikelihood, stride: 8}\n"))
    with pytest.raises(ConfigError, match=r"output\.path: is the same file as data\.path"):
        load_job(write_job(jobdir, BASE.replace("out/r.jsonl", "data/p.jsonl")))
    j = load_job(write_job(jobdir, BASE + "task: score\nscore: {mode: perplexity, stride: 64}\n"))
    assert j.score.mode == "perplexity" and j.score.stride == 64


def test_mtbench_source_defaults_to_chat_template(jobdir):
    j = load_job(write_job(jobdir, "model: tiny-mixtral\ndata: {source: mtbench}\noutput: {path: r.jsonl}\n"))
    assert j.data.source == "mtbench" and j.data.path is None and j.data.chat_template is True
    with pytest.raises(ConfigError, match=r"data\.source: mtbench has no continuations"):
        load_job(write_job(jobdir, "model: tiny-mixtral\ntask: score\nscore: {mode: loglikelihood}\n"
                                   "data: {source: mtbench}\noutput: {path: r.jsonl}\n"))


def test_invalid_yaml_and_non_mapping(jobdir):
    with pytest.raises(ConfigError, match=r"x\.yaml:\d+: invalid YAML"):
        load_job(write_job(jobdir, "model: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"x\.yaml: expected a mapping of job keys"):
        load_job(write_job(jobdir, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"x\.yaml: the file is empty"):
        load_job(write_job(jobdir, "\n"))


def test_overrides(jobdir):
    p = write_job(jobdir, BASE)
    j = load_job(p, {"generation.max_new_tokens": 8, "shard": "0/2", "device": "cpu"})
    assert j.generation.max_new_tokens == 8 and j.shard == (0, 2) and j.executor == "serial"
    with pytest.raises(ConfigError, match=r"x\.yaml: generation\.max_new_tokens \(from override\): expected an integer"):
        load_job(p, {"generation.max_new_tokens": "many"})
    with pytest.raises(ConfigError, match=r"generation\.bogus \(from override\): unknown key"):
        load_job(p, {"generation.bogus": 1})
    assert parse_override("generation.temperature=0.5") == ("generation.temperature", 0.5)
    assert parse_override("data.chat_template=true") == ("data.chat_template", True)
    with pytest.raises(ValueError):
        parse_override("novalue")


def test_job_from_dict_uses_source_name(tmp_path):
    (tmp_path / "p.jsonl").write_text("")
    d = {"model": "tiny-mixtral", "data": {"path": "p.jsonl"}, "output": {"path": "r.jsonl"}}
    j = job_from_dict(d, "test-job", base_dir=str(tmp_path))
    assert j.data.path == str(tmp_path / "p.jsonl") and j.config_path is None
    with pytest.raises(ConfigError, match=r"^test-job: generation\.seed: must be >= 0"):
        job_from_dict({**d, "generation": {"seed": -1}}, "test-job", base_dir=str(tmp_path))
    assert j.to_dict()["data"]["path"] == str(tmp_path / "p.jsonl")


@pytest.mark.parametrize("name", ["score_mc.yaml", "score_ll.yaml", "score_ppl.yaml", "generate_cpu.yaml"])
def test_example_jobs_load(name):
    j = load_job(os.path.join(REPO, "jobs", name))
    assert j.device == "cpu" and j.dtype == "float32" and j.model == "tiny-mixtral"
    assert j.output.path.startswith(os.path.join(REPO, "results") + os.sep)


def test_expert_ffn_key(jobdir):
    from lightning_moe.pipeline.cgopipe import expert_ffn_for

    j = load_job(write_job(jobdir, BASE + "device: cpu\n"))
    assert j.expert_ffn == "auto" and expert_ffn_for(j) == "torch"  # auto on the CPU: the reference loop
    assert expert_ffn_for(load_job(write_job(jobdir, BASE + "device: cpu\nexpert_ffn: triton\n"))) == "triton"
    with pytest.raises(ConfigError, match=r"x\.yaml:6: expert_ffn: .*cuda-graph"):
        load_job(write_job(jobdir, BASE + "expert_ffn: cuda-graph\n"))


def test_gpus_key(jobdir):
    assert load_job(write_job(jobdir, BASE)).gpus == 1
    assert load_job(write_job(jobdir, BASE + "device: cpu\ngpus: 2\n")).gpus == 2
    for bad, msg in (("gpus: 0\n", "gpus"), ("gpus: two\n", "gpus"), ("gpus: 2\n", "executor: serial"),
                     ("gpus: 2\ndevice: cpu\nexecutor: cgopipe\n", "executor: serial")):
        with pytest.raises(ConfigError, match=msg):
            load_job(write_job(jobdir, BASE + bad))


def test_overridden_paths_resolve_against_the_current_directory(jobdir, tmp_path_factory, monkeypatch):
    """A path in the YAML is relative to the YAML's directory; a path given on the command line (--set) is relative
    to the current directory, as every command-line path."""
    p = write_job(jobdir, BASE)
    elsewhere = tmp_path_factory.mktemp("cwd")
    (elsewhere / "q.jsonl").write_text('{"id": "a", "prompt": "hi"}\n')
    monkeypatch.chdir(elsewhere)
    j = load_job(p)
    assert j.output.path == str(jobdir / "out" / "r.jsonl") and j.data.path == str(jobdir / "data" / "p.jsonl")
    j = load_job(p, {"output.path": "res/t.jsonl", "data.path": "q.jsonl"})
    assert j.output.path == str(elsewhere / "res" / "t.jsonl") and j.data.path == str(elsewhere / "q.jsonl")


def test_errors_name_the_key_line(jobdir):
    """A field error names the file, the line of the key and the key (``file:line: key: ...``, as the JSONL errors do);
    a nested key its own line, a missing key its section's line, a command-line override no line."""
    from lightning_moe.config import _key_lines

    p = write_job(jobdir, BASE + "generation:\n  max_new_tokens: 8\n  temperature: hot\n")
    with pytest.raises(ConfigError, match=r"^.*x\.yaml:8: generation\.temperature: expected a number"):
        load_job(p)
    with pytest.raises(ConfigError, match=r"x\.yaml: generation\.temperature \(from override\): expected a number"):
        load_job(write_job(jobdir, BASE), {"generation.temperature": "cold"})
    assert _key_lines("a: 1\nb:\n  c: {d: 2}\n  e: [1, 2]\n") == {"a": 1, "b": 2, "b.c": 3, "b.c.d": 3, "b.e": 4}
    assert _key_lines("a: [unclosed\n") == {}
