"""The planner's solve cache (milp.plan's ``solve_cache``): a HiGHS solve met again is answered from the cache with
the column values HiGHS gave, so a plan made again is the same policy and estimate; the key is the solver's whole
input, so a plan whose model differs in any input solves it."""

import dataclasses
import os

import numpy as np
import pytest

from lightning_moe.policy import hardware, milp
from lightning_moe.policy.hardware import resolve_hardware
from lightning_moe.policy.policy import Budgets, Workload
from lightning_moe.policy.registry import resolve_spec

GiB = 1 << 30
HW = os.path.join(os.path.dirname(hardware.__file__), "profiles", "h100-host.yaml")


def _case(gpu_gib: int = 12, gen: int = 8):
    spec = resolve_spec("mixtral-8x7b").with_layers(2)
    lens = [20 + (i * 37) % 90 for i in range(60)] + [300 + i for i in range(20)]
    wl = dataclasses.replace(Workload.from_lengths(lens, gen_len=gen, name="c"), num_requests=200)
    return spec, resolve_hardware(HW), wl, Budgets(gpu_memory=gpu_gib * GiB, cpu_memory=100 * GiB, dtype="bf16",
                                                  weight_quant="bf16")


def _runs(monkeypatch) -> list:
    """Records every HiGHS run (the solves the cache did not answer)."""
    runs, run = [], milp._run_highs
    monkeypatch.setattr(milp, "_run_highs", lambda *a, **k: runs.append(1) or run(*a, **k))
    return runs


def _same(a, b) -> None:
    (pa, ea), (pb, eb) = a, b
    assert pa == pb
    assert dataclasses.replace(ea, notes=()) == dataclasses.replace(eb, notes=())


def test_a_plan_made_again_is_answered_by_the_cache_and_is_the_same(tmp_path, monkeypatch):
    spec, hw, wl, b = _case()
    runs = _runs(monkeypatch)
    fresh = milp.plan(spec, hw, wl, b, job_fit=True)  # no cache: every solve runs
    n_solves = len(runs)
    first = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
    assert len(runs) == 2 * n_solves and len(list(tmp_path.glob("*.sol"))) > 0
    again = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
    assert len(runs) == 2 * n_solves  # nothing solved
    assert "from the solve cache" in again[1].notes[-1] and "from the solve cache" not in first[1].notes[-1]
    _same(first, fresh)
    _same(again, fresh)


@pytest.mark.parametrize("change", ["gpu_memory", "gen_len", "hardware", "time_limit"])
def test_a_plan_of_other_inputs_solves_and_matches_its_own_fresh_plan(tmp_path, monkeypatch, change):
    """A key that missed an input (the budget, the workload, the hardware, the solver's time limit) would answer
    another plan's solves: here the cache holds a first plan's, and a plan differing in one input must run
    every one of its solves and equal that plan without a cache."""
    spec, hw, wl, b = _case()
    milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
    kw = {}
    if change == "gpu_memory":
        b = dataclasses.replace(b, gpu_memory=16 * GiB)
    elif change == "gen_len":
        wl = dataclasses.replace(wl, gen_len=9)
    elif change == "hardware":
        hw = dataclasses.replace(hw, pcie_h2d=hw.pcie_h2d * 0.9)
    else:
        kw["time_limit"] = 19.0
    runs = _runs(monkeypatch)
    cached = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path), **kw)
    n_solves = len(runs)
    assert n_solves > 0 and "from the solve cache" not in cached[1].notes[-1]
    _same(cached, milp.plan(spec, hw, wl, b, job_fit=True, **kw))


def _damage(path, how: str, other) -> None:
    data = path.read_bytes()
    if how == "empty":  # np.load's EOFError crashed the plan before entries carried a digest
        path.write_bytes(b"")
    elif how == "cut":
        path.write_bytes(data[:len(data) - 8])
    elif how == "flipped":  # one bit of one value: well-formed, silently wrong without the digest
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:])
    elif how == "other_key":  # another solve's entry (its own digest) under this key
        path.write_bytes(other.read_bytes())
    elif how == "magic":
        path.write_bytes(b"X" + data[1:])
    else:  # unreadable: a directory where the file was
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize("how", ["empty", "cut", "flipped", "other_key", "magic", "unreadable"])
def test_a_damaged_entry_is_solved_again(tmp_path, monkeypatch, how):
    """An entry that is empty, cut short, has a byte flipped, holds another key's entry, has no magic or cannot be
    read is not an answer: exactly that solve runs again (the others are answered), the plan is the one without a
    cache, and the entry is written again (a third plan runs nothing)."""
    spec, hw, wl, b = _case()
    first = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
    files = sorted(tmp_path.glob("*.sol"))
    assert len(files) >= 2
    _damage(files[0], how, files[1])
    runs = _runs(monkeypatch)
    again = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
    assert len(runs) == 1
    _same(again, first)
    if how != "unreadable":  # a directory cannot be replaced by a file: that key stays unanswered
        milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
        assert len(runs) == 1


def test_the_key_names_the_columns():
    """The solution is read back by column name (PuLP orders the columns by name): two models of equal arrays whose
    columns are other variables (another micro-batch size's z_16 for z_8) must not share an entry."""
    a = {"cost": np.array([1.0, 2.0]), "ints": np.array([0], dtype=np.int32)}
    key = milp._cache_path("c", ["N", "z_8"], a, 20.0)
    assert key != milp._cache_path("c", ["N", "z_16"], a, 20.0)
    assert key == milp._cache_path("c", ["N", "z_8"], dict(a), 20.0)
    assert key != milp._cache_path("c", ["N", "z_8"], {**a, "cost": np.array([1.0, 2.5])}, 20.0)
    assert key != milp._cache_path("c", ["N", "z_8"], a, 19.0)


def test_an_unwritable_cache_plans_without_it(tmp_path, monkeypatch):
    """A cache that cannot be written (here a file where the directory should be; root ignores permission bits)
    neither fails the plan nor changes it: every solve runs, the plan is the one without a cache."""
    spec, hw, wl, b = _case()
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    runs = _runs(monkeypatch)
    got = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(blocker / "solves"))
    n = len(runs)
    assert n > 0 and blocker.read_bytes() == b"not a directory"
    _same(got, milp.plan(spec, hw, wl, b, job_fit=True))
    assert len(runs) == 2 * n


def test_a_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """The disk fills while an entry is written: the plan goes on, no entry and no temporary file are left."""
    spec, hw, wl, b = _case()

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(milp.os, "replace", full)
    got = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    _same(got, milp.plan(spec, hw, wl, b, job_fit=True))


def test_each_writer_renames_its_own_temporary_file(tmp_path, monkeypatch):
    """Two writers of one entry at once (two processes planning the same job; threads of one process): while one is
    between its write and its rename, the other writes and renames the same entry. Each renames its own whole
    temporary file (a name shared by the writers -- path.PID.tmp -- let the second take the first's file away, or
    truncate it under it), and the entry read back is whole."""
    path = str(tmp_path / ("0" * 64 + milp.SOLVE_CACHE_SUFFIX))
    x = np.arange(5, dtype=np.float64)
    replace, seen = os.replace, []

    def racing(src, dst):
        if not seen:
            seen.append(src)
            milp._save_solution(dst, x)  # the other writer, start to end, inside this one's write and rename
            assert os.path.exists(src) and os.path.getsize(src) == len(milp._ENTRY_MAGIC) + 32 + 8 * len(x)
        replace(src, dst)

    monkeypatch.setattr(milp.os, "replace", racing)
    milp._save_solution(path, x)
    assert np.array_equal(milp._cached_solution(path, len(x)), x)
    assert sorted(p.name for p in tmp_path.iterdir()) == [os.path.basename(path)]


def test_a_solve_not_proven_optimal_is_not_kept(tmp_path, monkeypatch):
    """A solve HiGHS stopped at its time limit (a feasible answer, not proven optimal) is not kept: read back it would
    be called proven optimal, and a later plan with time to spare would not solve it to the end."""
    spec, hw, wl, b = _case()
    run = milp._run_highs

    def stopped(*a, **k):
        found, _, status, x = run(*a, **k)
        return found, False, "Time limit reached", x

    monkeypatch.setattr(milp, "_run_highs", stopped)
    _, est = milp.plan(spec, hw, wl, b, job_fit=True, solve_cache=str(tmp_path))
    assert "NOT proven optimal" in est.notes[-1]
    assert list(tmp_path.glob("*" + milp.SOLVE_CACHE_SUFFIX)) == []


def test_default_solve_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("LIGHTNING_MOE_SOLVE_CACHE", "off")
    assert milp.default_solve_cache() is None
    monkeypatch.setenv("LIGHTNING_MOE_SOLVE_CACHE", str(tmp_path / "s"))
    assert milp.default_solve_cache() == str(tmp_path / "s")
    monkeypatch.delenv("LIGHTNING_MOE_SOLVE_CACHE")
    monkeypatch.setenv("LIGHTNING_MOE_CACHE", str(tmp_path))
    assert milp.default_solve_cache() == str(tmp_path / "milp-solves")


def test_an_entry_is_readable_by_the_users_who_share_the_cache(tmp_path):
    """An entry gets the mode a plain open() would give under this umask (mkstemp's 0600 kept by the rename left
    another user sharing $LIGHTNING_MOE_SOLVE_CACHE unable to read it: each re-solved and overwrote the other's)."""
    path = str(tmp_path / ("1" * 64 + milp.SOLVE_CACHE_SUFFIX))
    old = os.umask(0o022)
    try:
        milp._save_solution(path, np.arange(3, dtype=np.float64))
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert np.array_equal(milp._cached_solution(path, 3), np.arange(3, dtype=np.float64))
