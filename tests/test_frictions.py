"""A newcomer's frictions (issue 41, point 4): each is a one-line error or notice, given before any file is written.

One test per friction: gpu_memory on device cpu (a notice), an empty data file (an error), a re-run of a finished job
(validated like a fresh run), a checkpoint without tokenizer files (the files looked for), a bad
LIGHTNING_MOE_CPU_ATTENTION (an error before any file), a non-UTF-8 line (file, line and byte column), ``--set`` with a
YAML flow mapping without spaces (the corrected value), ``--set KEY VALUE`` as two arguments, one skip reason for a missing triton, and a missing
mistral-common (the embedded model's tokenizer source) on an offline host."""

import json
import os
import types
import random
import re
import shutil

import pytest
import yaml

from lightning_moe import cli
from lightning_moe.app import engine
from lightning_moe.app.batch_files import BatchFileError, read_batch_file
from lightning_moe.config import ConfigError, job_from_dict, load_job, parse_override
from lightning_moe.data.sources import DataError, load_requests
from lightning_moe.data.tokenize import TOKENIZER_FILES, load_tokenizer

TESTS = os.path.dirname(os.path.abspath(__file__))


def _job(tmp_path, model, data_text=None, **extra):
    """A CPU generate job in ``tmp_path`` (requests: ``data_text``, default three prompts); returns its YAML path."""
    if data_text is None:
        data_text = "".join(json.dumps({"id": f"q{i}", "prompt": f"alpha beta {i}"}) + "\n" for i in range(3))
    (tmp_path / "in.jsonl").write_bytes(data_text if isinstance(data_text, bytes) else data_text.encode())
    d = {"model": model, "device": "cpu", "dtype": "float32", "data": {"path": "in.jsonl"},
         "output": {"path": "out/r.jsonl"}, "generation": {"max_new_tokens": 2, "stop_at_eos": False}, **extra}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(d))
    return str(tmp_path / "job.yaml")


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("moe-batch: error: "), err
    return err


@pytest.fixture
def no_weights(monkeypatch):
    """Any weight read fails the test: the errors must come before it."""
    def boom(*a, **k):
        raise AssertionError("weights were read")

    monkeypatch.setattr(engine, "load_checkpoint", boom)


# ------------------------------------------------------------------------------------------- gpu_memory on cpu
def test_gpu_memory_on_cpu_serial_is_a_one_line_notice(tmp_path, capsys):
    """device: cpu with executor: serial uses no GPU: gpu_memory gets one notice line naming file, line and field; the
    job still loads (a GPU job tried with --set device=cpu must run). With executor: cgopipe on the CPU gpu_memory sizes
    the simulated GPU tier: no notice; nor on cuda, nor without gpu_memory."""
    p = _job(tmp_path, "tiny-mixtral", gpu_memory="8GiB")
    line = next(i for i, t in enumerate(open(p).read().splitlines(), 1) if t.startswith("gpu_memory:"))
    job = load_job(p)
    assert job.gpu_memory == 8 << 30
    err = capsys.readouterr().err
    assert err == (f"moe-batch: note: {p}:{line}: gpu_memory: ignored: device: cpu with executor: serial uses no GPU "
                   f"(with executor: cgopipe it sizes the CPU run's simulated GPU tier)\n")
    load_job(p, {"executor": "cgopipe"})
    load_job(p, {"device": "cuda"})
    load_job(p, {"gpu_memory": None})
    assert capsys.readouterr().err == ""
    load_job(p, {"gpu_memory": "2GiB"})
    assert "gpu_memory (from override): ignored" in capsys.readouterr().err
    job_from_dict({"model": "tiny-mixtral", "device": "cpu", "gpu_memory": "1GiB"}, "LLM", in_memory=True)
    assert capsys.readouterr().err == ""  # notify is the caller's: LLM() and run-batch ask once, not per call


# ------------------------------------------------------------------------------------------- empty data file
@pytest.mark.parametrize("text", ["", "\n", "  \n\n\t\n"])
def test_empty_data_file_is_an_error_before_any_file(tmp_path, tiny_dir, no_weights, capsys, text):
    """A data file without a request (empty, or blank lines only) is an error naming it (exit 2), and no results,
    meta or report file is written; an MT-Bench question file alike."""
    p = _job(tmp_path, tiny_dir, text)
    assert cli.main(["run", p, "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert err == (f"moe-batch: error: {tmp_path / 'in.jsonl'}: no requests: the file is empty or holds only blank "
                   f"lines (a job needs at least one request; check data.path)")
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=r"in\.jsonl: no requests"):
        load_requests(load_job(p, {"data.source": "mtbench"}))


def test_a_shard_without_requests_of_a_nonempty_file_still_runs(tmp_path, tiny_dir):
    """The error is for the file: a shard that the id hash leaves empty is not an error."""
    from lightning_moe.data.shard import select_shard

    p = _job(tmp_path, tiny_dir, json.dumps({"id": "only", "prompt": "alpha"}) + "\n")
    empty = next(i for i in range(8) if not select_shard(load_requests(load_job(p)), i, 8))
    assert cli.main(["run", p, "--no-progress", "--shard", f"{empty}/8"]) == 0


# ------------------------------------------------------------------------------------------- re-run validates
def test_rerun_of_a_finished_job_validates_like_a_fresh_run(tmp_path, tiny_dir, monkeypatch, capsys):
    """A finished job re-run with a bad policy key, a bad LIGHTNING_MOE_CPU_ATTENTION or a bad
    LIGHTNING_MOE_PREFILL_ATTENTION is the fresh run's one-line error (exit 2), and its files stay as they were;
    re-run clean, it says nothing to do."""
    p = _job(tmp_path, tiny_dir)
    assert cli.main(["run", p, "--no-progress"]) == 0
    files = {f: (tmp_path / "out" / f).read_bytes() for f in os.listdir(tmp_path / "out")}
    capsys.readouterr()
    assert cli.main(["run", p, "--no-progress", "--set", "policy={mu: 4, nn: 2}"]) == 2
    assert _one_line_error(capsys).startswith(f"moe-batch: error: {p}: policy: unknown key(s) nn (known: mu, n,")
    for var, known in (("LIGHTNING_MOE_CPU_ATTENTION", "auto, native, sdpa"),
                       ("LIGHTNING_MOE_PREFILL_ATTENTION", "auto, varlen, triton, efficient, sdpa")):
        monkeypatch.setenv(var, "fast")
        assert cli.main(["run", p, "--no-progress"]) == 2
        assert _one_line_error(capsys) == f"moe-batch: error: {p}: environment variable {var}='fast': expected one " \
                                          f"of {known}"
        monkeypatch.delenv(var)
    assert {f: (tmp_path / "out" / f).read_bytes() for f in os.listdir(tmp_path / "out")} == files
    assert cli.main(["run", p, "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "nothing to do" in out and "note: this job asks for" not in out
    assert cli.main(["run", p, "--no-progress", "--set", "executor=cgopipe"]) == 0  # another executor: says so
    out = capsys.readouterr().out
    assert "nothing to do" in out and "note: this job asks for executor cgopipe, the earlier run used serial" in out
    assert {f: (tmp_path / "out" / f).read_bytes() for f in os.listdir(tmp_path / "out")} == files


def test_kernel_compile_message_only_when_a_build_is_due(monkeypatch):
    """The run says it compiles the native CPU attention kernel only when no build is on disk (a later run loads it
    in well under a second and says nothing)."""
    import io

    from lightning_moe.app import engine
    job = types.SimpleNamespace(task="generate", device="cpu")
    for built, want in ((True, ""), (False, "compiling the native CPU attention kernel")):
        log = io.StringIO()
        monkeypatch.setattr(engine, "native_loaded", lambda: False)
        monkeypatch.setattr(engine, "native_built", lambda b=built: b)
        monkeypatch.setattr(engine, "native_available", lambda: True)
        engine._prepare_cpu_attention(job, None, log)
        assert (want in log.getvalue()) and (bool(log.getvalue()) == (not built))


# ------------------------------------------------------------------------------------------- tokenizer files
def test_checkpoint_without_tokenizer_files_names_the_files_looked_for(tmp_path, tiny_dir):
    """A checkpoint directory without any tokenizer file: the error names the directory and the files looked for, not
    transformers' "install sentencepiece or tiktoken"; with its tokenizer files back it loads."""
    d = tmp_path / "ckpt"
    d.mkdir()
    for n in os.listdir(tiny_dir):
        if n not in TOKENIZER_FILES:  # config.json, tokenizer_config.json, the weights, the chat template
            shutil.copy(os.path.join(tiny_dir, n), d / n)
    with pytest.raises(DataError) as e:
        load_tokenizer(str(d))
    msg = str(e.value)
    assert msg == (f"model: no tokenizer files in {d} (looked for tokenizer.json, tokenizer.model, vocab.json, "
                   f"vocab.txt, spiece.model, sentencepiece.bpe.model, tekken.json, *.tiktoken); copy them from the "
                   f"checkpoint's source, beside its config.json")
    assert "sentencepiece or tiktoken installed" not in msg
    shutil.copy(os.path.join(tiny_dir, "tokenizer.json"), d / "tokenizer.json")
    ref = load_tokenizer(tiny_dir)
    assert load_tokenizer(str(d))("alpha beta").input_ids == ref("alpha beta").input_ids


# ------------------------------------------------------------------------------------------- CPU attention env
def test_bad_cpu_attention_env_fails_before_any_file(tmp_path, tiny_dir, no_weights, monkeypatch, capsys):
    """LIGHTNING_MOE_CPU_ATTENTION with an unknown value is a one-line error naming the job and the variable before
    any results, meta or report file is written (it was found only when the CPU attention kernel was built)."""
    monkeypatch.setenv("LIGHTNING_MOE_CPU_ATTENTION", " Flash ")
    p = _job(tmp_path, tiny_dir)
    assert cli.main(["run", p, "--no-progress"]) == 2
    assert _one_line_error(capsys) == (f"moe-batch: error: {p}: environment variable LIGHTNING_MOE_CPU_ATTENTION="
                                       f"'flash': expected one of auto, native, sdpa")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="LLM: environment variable LIGHTNING_MOE_CPU_ATTENTION='flash'"):
        engine.check_kernel_env("LLM")


# ------------------------------------------------------------------------------------------- non-UTF-8 line
def test_non_utf8_line_names_file_line_and_byte_column(tmp_path, capsys):
    """A request line that is not UTF-8 (a Latin-1 byte at a random line and column): the error names the file, the
    line and the byte's column (bytes, from 1), for `moe-batch run`'s data and for run-batch's input alike."""
    rng = random.Random()
    n, bad = rng.randint(2, 40), None
    lines = []
    for i in range(1, n + 1):
        prompt = "é" * rng.randint(0, 5) + "x" * rng.randint(1, 30)  # multi-byte UTF-8 before the bad byte; never empty
        line = json.dumps({"id": i, "prompt": prompt}, ensure_ascii=False).encode()
        if i == n:  # at a character boundary, inside the JSON text
            cut = rng.choice([c for c in range(len(b'{"id": ') + len(str(i)), len(line) - 2) if line[c - 1] < 0x80])
            line, bad = line[:cut] + b"\xe9" + line[cut:], cut + 1
        lines.append(line + (b"\r\n" if rng.random() < 0.5 else b"\n") + (b"\n" if rng.random() < 0.3 else b""))
    p = _job(tmp_path, "tiny-mixtral", b"".join(lines))
    # the reference: the bad line is the n-th non-blank one; count the newlines before it
    expect_line = b"".join(lines[:-1]).count(b"\n") + 1
    with pytest.raises(DataError) as e:
        load_requests(load_job(p))
    assert str(e.value) == (f"{tmp_path / 'in.jsonl'}:{expect_line}: not UTF-8 text: byte 0xe9 at column {bad} "
                            f"(invalid continuation byte); save the file as UTF-8")
    with pytest.raises(BatchFileError, match=rf"^in\.jsonl:{expect_line}: not UTF-8 text: byte 0xe9 at column {bad} "):
        read_batch_file(str(tmp_path / "in.jsonl"), "in.jsonl", 16)


# ------------------------------------------------------------------------------------------- --set flow mapping
def test_set_flow_mapping_without_spaces_gives_the_corrected_value(tmp_path, tiny_dir, no_weights, capsys):
    """``--set policy={mu:8,n:2}`` (YAML reads the keys 'mu:8' and 'n:2') is one line giving the value with the
    spaces; the same mapping in a job file is an error at the policy key with the same hint."""
    assert parse_override("policy={mu: 8, n: 2}") == ("policy", {"mu": 8, "n": 2})
    assert parse_override("data.path=c:/x.jsonl") == ("data.path", "c:/x.jsonl")  # a plain string with a colon
    assert parse_override("generation.stop=['a:b', 'c']") == ("generation.stop", ["a:b", "c"])
    p = _job(tmp_path, tiny_dir)
    assert cli.main(["run", p, "--no-progress", "--set", "policy={mu:8,n:2}"]) == 2
    assert _one_line_error(capsys) == ("moe-batch: error: --set policy={mu:8,n:2}: YAML read 'mu:8' as a key without "
                                       "a value: write 'policy={mu: 8, n: 2}' (YAML needs a space after the colon)")
    with pytest.raises(ValueError, match=re.escape("write 'policy={mu: 8, prefill_mu: {a: 1}}'")):
        parse_override("policy={mu: 8, prefill_mu: {a:1}}")
    text = open(p).read() + "policy: {mu:8,n:2}\n"
    open(p, "w").write(text)
    with pytest.raises(ConfigError) as e:
        load_job(p)
    assert str(e.value) == (f"{p}:{text.count(chr(10))}: policy: YAML read 'mu:8' as a field name without a value: "
                            f"write {{mu: 8, n: 2}} (YAML needs a space after the colon)")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- triton skip reason
def test_one_skip_reason_for_a_missing_triton():
    """Every test that needs triton skips with the one wording "triton not installed" (pytest.importorskip's "could not
    import 'triton'" was a second wording for the same cause)."""
    offenders = []
    for root, _dirs, names in os.walk(TESTS):
        for n in names:
            if not n.endswith(".py") or n == os.path.basename(__file__):  # this file names what it looks for
                continue
            path = os.path.join(root, n)
            src = open(path, encoding="utf-8").read()
            if re.search(r"importorskip\(\s*['\"]triton", src):
                offenders.append(f"{os.path.relpath(path, TESTS)}: pytest.importorskip('triton')")
            for m in re.finditer(r"(?:reason=|pytest\.skip\()\s*f?['\"]([^'\"]*)['\"]", src):
                reason = m.group(1).lower()
                if "triton" in reason and any(w in reason for w in ("install", "import", "missing", "available")) \
                        and reason != "triton not installed":
                    offenders.append(f"{os.path.relpath(path, TESTS)}: {m.group(1)!r}")
    assert not offenders, offenders


# ------------------------------------------------------------------------------------------- mistral-common missing
def test_missing_mistral_common_is_a_one_line_error_before_any_file(tmp_path, monkeypatch, capsys):
    """Helper-30 on an offline GPU host: tiny-mixtral without the 'mistral-common' package (its tokenizer's source)
    gave a traceback. Now one line naming the package and the offline route, exit 2, no results written and no
    half-built model left in the cache."""
    import sys

    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "mistral_common", None)  # `import mistral_common` raises ImportError
    p = _job(tmp_path, "tiny-mixtral")
    assert cli.main(["run", p, "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "'mistral-common' package, which is not installed: pip install mistral-common" in err, err
    assert "A host without network" in err and "tiny-mixtral-v" in err
    assert not (tmp_path / "out").exists()
    assert [n for n in os.listdir(tmp_path / "cache")] == []  # the temporary model directory removed


def test_missing_solver_package_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    """Helper-30's GPU host without highspy: `moe-batch plan` gave a traceback; now one line naming the pip package,
    exit 2. An undeclared module still raises (a bug is not hidden)."""
    import sys

    monkeypatch.delitem(sys.modules, "lightning_moe.policy.milp", raising=False)
    monkeypatch.setitem(sys.modules, "highspy", None)  # `import highspy` raises ModuleNotFoundError
    assert cli.main(["plan", "--model", "mixtral-8x7b", "--hardware", "h100", "--prompt-len", "64",
                     "--gen-len", "8"]) == 2
    err = _one_line_error(capsys)
    assert err.startswith("moe-batch: error: the package 'highspy' (a dependency of lightning-moe) is not installed")
    monkeypatch.setattr(cli, "DECLARED_PACKAGES", {})
    with pytest.raises(ModuleNotFoundError):
        cli.main(["plan", "--model", "mixtral-8x7b", "--hardware", "h100", "--prompt-len", "64", "--gen-len", "8"])


def test_set_key_and_value_as_two_arguments_is_one_line(tmp_path, tiny_dir, no_weights, capsys):
    """Helper-31: `--set executor cgopipe` (a space for the '=') gave argparse's usage and "unrecognized arguments:
    cgopipe"; now one line saying how to write it, exit 2, before any file. `--set key=value` and a flag after
    `--set` are left to argparse."""
    p = _job(tmp_path, tiny_dir)
    assert cli.main(["run", p, "--no-progress", "--set", "executor", "cgopipe"]) == 2
    assert _one_line_error(capsys) == ("moe-batch: error: --set takes KEY=VALUE as one argument, got '--set executor': "
                                       "write --set executor=VALUE")
    assert not (tmp_path / "out").exists()
    assert cli.split_set_argument(["run", p, "--set", "executor=serial", "--no-progress"]) == ""
    assert cli.split_set_argument(["run", p, "--set", "--no-progress"]) == ""  # argparse: "expected one argument"


def test_progress_bar_shows_one_rate(tmp_path, tiny_dir, capsys):
    """Helper-33: the bar showed tqdm's smoothed rate beside the run's average ('1391.95tok/s, 80/80 records, 309.9
    tok/s'); now only the average, named so."""
    p = _job(tmp_path, tiny_dir)
    assert cli.main(["run", p]) == 0
    err = capsys.readouterr().err
    frames = [f for f in re.split(r"[\r\n]", err) if "records," in f]
    assert frames and all(f.count("tok/s") == 1 and "tok/s average" in f for f in frames), frames[-1:]
