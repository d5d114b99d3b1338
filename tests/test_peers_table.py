"""benchmarks/peers/make_table.py: the llama-batched-bench parser (on captured real output) and the table."""

import json
import os

import pytest

from benchmarks.peers import make_table

SAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "llama_batched_bench_sample.txt")


@pytest.fixture(scope="module")
def rows():
    with open(SAMPLE) as f:
        return make_table.parse_batched_bench(f.read())


def test_parses_the_markdown_table_and_the_jsonl_lines(rows):
    md, js = rows[:6], rows[6:]
    assert len(md) == 6 and len(js) == 2
    assert [r["pl"] for r in md] == [1, 2, 4, 8, 16, 32] and [r["pl"] for r in js] == [1, 4]
    first = md[0]
    assert first == pytest.approx({"pp": 80, "tg": 32, "pl": 1, "n_kv": 112, "t_pp": 0.001, "speed_pp": 55172.41,
                                   "t_tg": 0.005, "speed_tg": 6707.19, "t": 0.006, "speed": 18003.54,
                                   "gen_tok_s": 32 / 0.006})
    assert isinstance(first["pl"], int) and isinstance(first["t"], float)
    # a number wider than its column (104255.76 in the 8-wide S_PP column) still parses
    assert md[5]["speed_pp"] == 104255.76
    assert js[1]["t"] == pytest.approx(0.217387) and js[1]["n_kv"] == 448


def test_best_row_is_the_highest_generated_rate_not_llamas_total_rate(rows):
    best = make_table.best_batched_bench(rows[:6], pp=80, tg=32)
    assert best["pl"] == 32 and best["gen_tok_s"] == pytest.approx(32 * 32 / 0.094)
    assert make_table.best_batched_bench(rows, pp=80, tg=128) is None
    # S t/s counts prompt tokens too: B=1 has a higher S t/s than B=2 and B=4 here, gen_tok_s orders by output
    assert all(r["gen_tok_s"] == pytest.approx(r["pl"] * r["tg"] / r["t"]) for r in rows)


def test_log_lines_headers_and_garbage_are_skipped():
    text = ("llama_batched_bench: n_kv_max = 8192\n|    PP |     TG |    B |\n|-------|--------|\n"
            "| 1 | 2 | 3 |\n{\"not\": \"a row\"}\n{broken json\n")
    assert make_table.parse_batched_bench(text) == []


def _row(peer, weights, tok_s, gen=128, status="ok", **kw):
    return {"peer": peer, "weights": weights, "model": "mixtral h4096 x14336 E8 L4", "gen_len": gen,
            "tok_s": tok_s, "status": status, "N": 8, "cap": "12GiB", **kw}


def test_table_ratios_pair_ours_with_peers_of_the_same_weight_class(tmp_path):
    rows = [_row("ours", "bf16", 1000.0), _row("ours", "int4", 3000.0), _row("llama.cpp", "bf16", 250.0),
            _row("llama.cpp", "Q4_0", 600.0), _row("accelerate", "bf16", 100.0),
            _row("deepspeed", "bf16", None, status="skipped", reason="no wheel"),
            _row("accelerate", "bf16", 50.0, gen=32)]
    for i, r in enumerate(rows):
        (tmp_path / f"r{i}.json").write_text(json.dumps(r))
    (tmp_path / "other.json").write_text(json.dumps({"not": "a row"}))
    table = make_table.make_table(make_table.load_rows([str(tmp_path)]))
    lines = {tuple(c.strip() for c in ln.strip("|").split("|")[:4]): ln for ln in table.splitlines()
             if ln.startswith("| mixtral")}
    assert "**4.00**" in lines[("mixtral h4096 x14336 E8 L4", "128", "llama.cpp", "bf16")]
    assert "**5.00**" in lines[("mixtral h4096 x14336 E8 L4", "128", "llama.cpp", "Q4_0")]
    assert "**10.00**" in lines[("mixtral h4096 x14336 E8 L4", "128", "accelerate", "bf16")]
    assert "**skipped**: no wheel" in lines[("mixtral h4096 x14336 E8 L4", "128", "deepspeed", "bf16")]
    # no ours row at gen 32: no ratio
    assert "**" not in lines[("mixtral h4096 x14336 E8 L4", "32", "accelerate", "bf16")]
    assert len(lines) == 7


def test_ours_note_gives_the_hrm_phases_and_their_binding_stages():
    """The device run's ours row (H200, 4-layer Mixtral width, int4): measured end-to-end over the report's
    prediction, and the HRM's per-phase rates and binding stages beside the measured ones."""
    r = _row("ours", "int4", 11929.6)
    r["extra"] = {"policy": {"mu": 334, "n": 2, "resident_experts": 32, "n_gpu_attn": 2},
                  "predicted_end_to_end_tok_s": 84217.7, "prefill_tok_s": 22215.2, "decode_tok_s": 19864.4,
                  "predicted": {"prefill_tokens_per_s": 215424.0, "decode_tokens_per_s": 118614.8,
                                "prefill_binding": "gpu", "decode_binding": "gpu", "hardware": "h200"}}
    note = make_table.note(r)
    assert "measured/predicted 0.14" in note
    assert "HRM h200: prefill 215,424 tok/s gpu-bound, decode 118,615 gpu-bound; measured 22,215 / 19,864" in note
    del r["extra"]["predicted"]  # a row written before the block was kept: no HRM part
    assert "HRM" not in make_table.note(r) and "measured/predicted 0.14" in make_table.note(r)


def test_convert_command_answers_the_pre_tokenizer_that_llama_cpp_does_not_know(tmp_path):
    """convert_gguf.py --pre-tokenizer: convert_hf_to_gguf.py runs with TextModel.get_vocab_base_pre answering the
    name (a stand-in llama.cpp tree whose lookup raises, as the real one does on our synthetic tokenizers)."""
    import subprocess
    import sys

    from benchmarks.peers import convert_gguf
    (tmp_path / "conversion").mkdir()
    (tmp_path / "gguf-py").mkdir()
    (tmp_path / "conversion" / "__init__.py").write_text("from .base import TextModel\n")
    (tmp_path / "conversion" / "base.py").write_text(
        "class TextModel:\n    def get_vocab_base_pre(self, tokenizer):\n"
        "        raise NotImplementedError('BPE pre-tokenizer was not recognized')\n")
    (tmp_path / "convert_hf_to_gguf.py").write_text(
        "import sys\nfrom conversion import TextModel\nprint(sys.argv[1:], TextModel().get_vocab_base_pre(None))\n")
    assert convert_gguf.convert_command(tmp_path, None) == [sys.executable, str(tmp_path / "convert_hf_to_gguf.py")]
    out = subprocess.run(convert_gguf.convert_command(tmp_path, "qwen2") + ["CKPT", "--outtype", "bf16"],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['CKPT', '--outtype', 'bf16'] qwen2"
    plain = subprocess.run(convert_gguf.convert_command(tmp_path, None) + ["CKPT"], capture_output=True, text=True)
    assert plain.returncode != 0 and "not recognized" in plain.stderr


def test_the_batch_search_frees_a_failed_batch_before_trying_a_smaller_one():
    """run_accelerate.run_batches: what an out-of-memory batch held (its frames' tensors, kept alive by the
    exception's traceback and by reference cycles) is released before the next, smaller batch runs; a batch that
    fits sets N."""
    import weakref

    import torch

    from benchmarks.peers import run_accelerate

    class Tok:
        pad_token_id, eos_token_id = 0, 0

        def apply_chat_template(self, msgs, add_generation_prompt=True, tokenize=True, **kw):
            return [1, 2, 3]

        def __call__(self, text, **kw):
            return {"input_ids": [1, 2, 3]}

    held = []

    def generate(ids, mask, n):
        if held:  # every earlier failed batch's workspace must be gone by now
            assert all(r() is None for r in held), "a failed batch's tensors are still alive"
        if ids.shape[0] > 2:
            workspace = torch.empty(1 << 16)
            held.append(weakref.ref(workspace))
            err = torch.OutOfMemoryError("CUDA out of memory (a test)")
            err.cycle = err  # a reference cycle: only the garbage collector frees it
            err.keep = workspace
            raise err
        return torch.cat([ids, torch.ones(ids.shape[0], n, dtype=ids.dtype)], 1)

    records = [{"prompt": f"p{i}"} for i in range(8)]
    res = run_accelerate.run_batches(generate, Tok(), "cpu", records, gen=4, max_batch=8, batches=1, budget=10)
    assert res["N"] == 2 and res["tried"] == {8: "oom", 4: "oom", 2: "ok"} and len(held) == 2
