"""The chunked scoring head: equal to the full-logits reference, equal to transformers through both executors,
and no [T, V] logits tensor of a (micro-)batch is ever created."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_moe.model import layers as M
from lightning_moe.model.weights import load_checkpoint
from lightning_moe.pipeline.cgopipe import CGOPipeExecutor
from lightning_moe.pipeline.prefill import prefill_chunks
from lightning_moe.pipeline.serial import SerialExecutor
from lightning_moe.pipeline.token_scores import SCORE_CHUNK_TOKENS, next_token_targets, split_scores, token_scores
from lightning_moe.policy.policy import Policy

LENS = (1, 2, 7, 33, 5)  # packed ragged: T = 48


def _reference(x, norm, lm_head, eps, targets):
    """Full [T, V] logits, log_softmax, gather / argmax: what the chunked head must equal."""
    logp = torch.log_softmax(M.final_logits(x, norm, lm_head, eps), dim=-1)  # [T, V]
    tgt = targets.clamp(min=0)
    return logp.gather(1, tgt[:, None])[:, 0], logp.argmax(-1) == tgt


@pytest.fixture(scope="module")
def packed():
    g = torch.Generator().manual_seed(3)
    T, D, V = sum(LENS), 37, 1001  # odd D, V not a power of two
    x = torch.randn(T, D, generator=g) * 3
    norm = torch.rand(D, generator=g) + 0.5
    lm_head = torch.randn(V, D, generator=g) / D ** 0.5
    seqs = [torch.randint(0, V, (n,), generator=g).tolist() for n in LENS]
    targets = next_token_targets(seqs)
    # make about half the rows' targets the argmax, so the greedy flag is exercised both ways
    best = M.final_logits(x, norm, lm_head, 1e-5).argmax(-1)
    pick = torch.rand(T, generator=g) < 0.5
    targets = torch.where(pick & (targets >= 0), best, targets)
    return x, norm, lm_head, targets, seqs


def test_next_token_targets():
    assert next_token_targets([[5], [1, 2, 3], [7, 8]]).tolist() == [-1, 2, 3, -1, 8, -1]


@pytest.mark.parametrize("chunk", [1, 8, 13, sum(LENS), sum(LENS) + 5, SCORE_CHUNK_TOKENS])
def test_chunked_equals_full_logits(packed, chunk):
    x, norm, lm_head, targets, _ = packed
    ref_lp, ref_g = _reference(x, norm, lm_head, 1e-5, targets)
    lp, g = token_scores(x, norm, lm_head, 1e-5, targets, chunk)
    has = targets >= 0
    assert lp.dtype == torch.float32 and g.dtype == torch.bool and lp.shape == g.shape == (x.shape[0],)
    assert (lp[has] - ref_lp[has]).abs().max().item() < 1e-5
    assert torch.equal(g[has], ref_g[has])
    assert 0 < int(g[has].sum()) < int(has.sum())  # both outcomes occur


def test_split_scores_drops_last_row(packed):
    x, norm, lm_head, targets, seqs = packed
    lp, g = token_scores(x, norm, lm_head, 1e-5, targets, 8)
    out = split_scores(lp, g, LENS)
    ref_lp, ref_g = _reference(x, norm, lm_head, 1e-5, targets)
    start = 0
    for n, (a, b) in zip(LENS, out):
        assert a.shape == b.shape == (n - 1,) and a.device.type == "cpu"
        assert (a - ref_lp[start : start + n - 1]).abs().max().item() < 1e-5 if n > 1 else True
        assert torch.equal(b, ref_g[start : start + n - 1])
        start += n


def test_chunk_tokens_validated(packed):
    x, norm, lm_head, targets, _ = packed
    with pytest.raises(ValueError):
        token_scores(x, norm, lm_head, 1e-5, targets, 0)


# ---- executors against transformers -----------------------------------------------------------------
def _seqs(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lens]


def _hf_scores(model, seq):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([seq])).logits[0].float(), -1)  # [n, V]
    tgt = torch.tensor(seq[1:])
    return lp[:-1].gather(1, tgt[:, None])[:, 0], lp[:-1].argmax(-1) == tgt


def _executors(path):
    # scoring micro-batches of prefill_mu = 3 rows; at most 24 padded tokens per prefill chunk splits some of them
    pol = Policy(mu=3, n=2, prefill_mu=3, prefill_tokens=24, dtype="fp32", weight_quant="fp32")
    return [("serial", SerialExecutor(load_checkpoint(path, torch.float32), "cpu", score_chunk_tokens=4)),
            ("cgopipe", CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu", score_chunk_tokens=3))]


def test_prompt_logprobs_equal_transformers(hf_mixtral):
    """Both executors, ragged sequences, score chunks (3 / 4 rows) that split sequences: within 1e-4 of HF."""
    path, model = hf_mixtral
    seqs = _seqs((2, 9, 17, 5, 1, 11), seed=4)
    for name, ex in _executors(path):
        if name == "cgopipe":  # some micro-batch is prefilled (and scored) in several chunks
            mbs = ex._micro_batches(seqs, 0, False, ex.policy.prefill_mu)
            assert max(len(prefill_chunks(seqs, mb.rows, ex.policy)) for mb in mbs) >= 2
        out = ex.prompt_logprobs(seqs)
        if name == "cgopipe":
            ex.close()
        assert len(out) == len(seqs)
        for s, (lp, g) in zip(seqs, out):
            assert lp.dtype == torch.float32 and g.dtype == torch.bool and lp.shape == g.shape == (len(s) - 1,)
            assert lp.device.type == "cpu" and g.device.type == "cpu"
            if len(s) == 1:
                continue
            ref_lp, ref_g = _hf_scores(model, s)
            assert (lp - ref_lp).abs().max().item() < 1e-4, (name, len(s))
            assert torch.equal(g, ref_g), (name, len(s))


def test_score_chunk_tokens_validated(hf_mixtral):
    path, _ = hf_mixtral
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            SerialExecutor(load_checkpoint(path, torch.float32), "cpu", score_chunk_tokens=bad)
        with pytest.raises(ValueError):
            CGOPipeExecutor(load_checkpoint(path, torch.float32), Policy(mu=2, n=1, prefill_mu=2, dtype="fp32", weight_quant="fp32"),
                            "cpu", score_chunk_tokens=bad)


# ---- memory bound --------------------------------------------------------------------------------
class _LogitRows(TorchDispatchMode):
    """Records the largest row count of any floating tensor shaped [..., V] that an op creates."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_prompt_logprobs_never_holds_full_logits(hf_mixtral):
    """Sequences of T = 100 packed tokens in one prefill chunk: no [>chunk, V] tensor is created, whatever T."""
    path, _ = hf_mixtral
    V, chunk = 128, 16
    seqs = _seqs((60, 40), seed=5)  # T = 100 (not V, so [T, V] and [V, D] are told apart)
    pol = Policy(mu=2, n=1, prefill_mu=2, dtype="fp32", weight_quant="fp32")  # both sequences in one prefill chunk
    for name, ex in [("serial", SerialExecutor(load_checkpoint(path, torch.float32), "cpu", score_chunk_tokens=chunk)),
                     ("cgopipe", CGOPipeExecutor(load_checkpoint(path, torch.float32), pol, "cpu", score_chunk_tokens=chunk))]:
        with _LogitRows(V) as rec:
            out = ex.prompt_logprobs(seqs)
        if name == "cgopipe":
            ex.close()
        assert [len(lp) for lp, _ in out] == [59, 39]
        assert 0 < rec.rows <= chunk, (name, rec.rows)
