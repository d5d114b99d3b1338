"""Expert parallelism (issue 21) on the CPU: 2 processes over gloo give exactly one process's tokens (fp32, the tiny
model, greedy), experts split evenly and unevenly; through `moe-batch run` with `gpus: 2` too."""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.expert_parallel import ExpertParallelExecutor, expert_owners
from lightning_moe.pipeline.sampling import DecodeSampling
from lightning_moe.pipeline.serial import SerialExecutor


def _prompts(n, seed=0, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 30, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (m,), generator=g).tolist() for m in lens]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, tiny_dir, split, combine, out_path, threads):
    torch.set_num_threads(threads)  # the reference's: a GEMM's blocking (and its rounding) may follow the thread count
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        w = load_checkpoint(tiny_dir, torch.float32)
        owners = expert_owners(w.spec.num_experts, world, split)
        ex = ExpertParallelExecutor(w, rank, world, owners, "cpu", combine=combine)
        sp = DecodeSampling(max_new_tokens=8, stop_at_eos=False)
        out = ex.generate(_prompts(6), sp)
        scores = ex.prompt_logprobs(_prompts(3, seed=1))
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"tokens": [o for o, _ in out], "logp": [lp.tolist() for lp, _ in scores],
                           "owned": ex.owned, "h2d": ex.stats.h2d_bytes}, f)
    finally:
        torch.distributed.destroy_process_group()


def _run_two(tmp_path, tiny_dir, split, combine=True):
    out = str(tmp_path / f"ep-{split}-{combine}.json")
    mp.spawn(_worker, args=(2, _free_port(), tiny_dir, split, combine, out, torch.get_num_threads()), nprocs=2, join=True)
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference(tiny_dir):
    ex = SerialExecutor(load_checkpoint(tiny_dir, torch.float32), "cpu")
    out = ex.generate(_prompts(6), DecodeSampling(max_new_tokens=8, stop_at_eos=False))
    return [o for o, _ in out], [lp.tolist() for lp, _ in ex.prompt_logprobs(_prompts(3, seed=1))]


@pytest.mark.parametrize("split", [None, [3, 5]])
def test_two_processes_give_one_process_tokens(tmp_path, tiny_dir, reference, split):
    """e % 2 (4 experts each), and uneven: process 0 holds experts 0-2, process 1 experts 3-7."""
    got = _run_two(tmp_path, tiny_dir, split)
    assert got["owned"] == ([0, 2, 4, 6] if split is None else [0, 1, 2])
    assert got["tokens"] == reference[0]
    assert got["logp"] == reference[1]  # bit for bit: the all_reduce adds zeros


def test_without_the_combine_the_tokens_differ(tmp_path, tiny_dir, reference):
    got = _run_two(tmp_path, tiny_dir, [3, 5], combine=False)
    assert got["tokens"] != reference[0]


def test_expert_owners():
    assert expert_owners(8, 2) == (0, 1, 0, 1, 0, 1, 0, 1)
    assert expert_owners(8, 2, [3, 5]) == (0, 0, 0, 1, 1, 1, 1, 1)
    assert expert_owners(4, 1) == (0, 0, 0, 0)
    for bad in ([4, 5], [8, 0], [8]):
        with pytest.raises(ValueError, match="split"):
            expert_owners(8, 2, bad)


def test_moe_batch_run_with_gpus_2(tmp_path, tiny_dir):
    """`moe-batch run` on a job with gpus: 2, device cpu: two processes over gloo, rank 0 writes the results; the
    records equal a one-process run's."""
    from lightning_moe.app.engine import run_job
    from lightning_moe.config import job_from_dict
    from lightning_moe.data.writer import read_results

    data = tmp_path / "in.jsonl"
    with open(data, "w") as f:
        for i, p in enumerate(["1 + 1 =", "the cat sat on", "2 * 3 =", "hello there, how are", "x"]):
            f.write(json.dumps({"id": f"r{i}", "prompt": p}) + "\n")

    def job(out, **kw):
        d = {"model": tiny_dir, "data": {"source": "jsonl", "path": str(data)}, "output": {"path": str(tmp_path / out)},
             "device": "cpu", "dtype": "float32", "executor": "serial", "batch_size": 2,
             "generation": {"max_new_tokens": 6, "temperature": 0.0, "stop_at_eos": False}, **kw}
        return job_from_dict(d, "test.yaml", base_dir=str(tmp_path))

    one = job("one.jsonl")
    run_job(one, progress=False)
    two = job("two.jsonl", gpus=2)
    rep = run_job(two, progress=False)
    assert rep["status"] == "done" and rep["expert_parallel"]["processes"] == 2
    a = {r["id"]: r["output_ids"] for r in read_results(one.output.path)}
    b = [r for r in read_results(two.output.path)]
    assert len(b) == 5 and {r["id"]: r["output_ids"] for r in b} == a  # written once, by rank 0
    assert json.load(open(two.output.report_path))["status"] == "done"
    assert not os.path.exists(two.output.partial_path)


def test_gpus_2_for_a_family_it_cannot_run_is_one_line_before_any_process(tmp_path, capsys):
    """gpus: 2 on gpt-oss (clamped SwiGLU: expert parallelism is silu only): exit 2, one line naming the job file and
    gpus, before a process is started or a weight read (it was a traceback from a spawned process)."""
    import yaml

    from tests.support import make_checkpoint as mk

    from lightning_moe import cli

    ck = mk.write_checkpoint(str(tmp_path / "ck"), mk.Dims.from_registry("gpt-oss-20b", 2).tiny(),
                             log=open(os.devnull, "w"))["path"]
    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": ck, "data": {"source": "jsonl", "path": str(data)}, "device": "cpu",
                                   "output": {"path": str(tmp_path / "out.jsonl")}, "executor": "serial", "gpus": 2}))
    capsys.readouterr()
    assert cli.main(["run", str(job)]) == 2
    err = capsys.readouterr().err
    assert f"{job}: gpus: 2: expert parallelism: gpt_oss: expert activation 'clamped_swiglu' (silu only)" in err, err
    assert "expert-parallel processes" not in err and not os.path.exists(tmp_path / "out.jsonl")
