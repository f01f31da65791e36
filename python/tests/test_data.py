"""TrajectoryDataset: partitions across ranks and workers, determinism,
resume, exact content, collate; a real torch DataLoader when torch is present."""

import numpy as np
import pytest

import trajlog
from trajlog.data import TrajectoryDataset, collate


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "s"
    rng = np.random.default_rng(3)
    calls = {}
    with trajlog.Store(path) as store:
        for s in range(23):
            sid = f"task-{s // 4}:{s % 4}"
            prompt = rng.integers(0, 1000, size=int(rng.integers(5, 40))).tolist()
            for step in range(3):
                completion = rng.integers(0, 1000, size=int(rng.integers(1, 20))).tolist()
                lp = (-rng.random(len(completion))).astype(np.float32)
                tid = f"{sid}/{step}"
                store.append(trace_id=tid, session_id=sid, prompt_token_ids=prompt, completion_token_ids=completion, logprobs=lp, timestamp=float(step))
                calls[tid] = (list(prompt), completion, lp)
                prompt = prompt + completion + [7]
            store.seal(sid)
        store.compact()
    return str(path / "shards" / "trajectories"), calls


def key(sample):
    return (sample["session_id"], int(sample["segment_index"]))


def as_np(x):
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


def test_samples_are_exact(shards):
    path, calls = shards
    seen = 0
    for sample in TrajectoryDataset(path, shuffle=False):
        tokens = as_np(sample["token_ids"]).tolist()
        lps = as_np(sample["logprobs"])
        for i, tid in enumerate(sample["trace_ids"]):
            prompt, completion, lp = calls[tid]
            s, n = int(as_np(sample["call_starts"])[i]), int(as_np(sample["completion_lens"])[i])
            assert tokens[:s] == prompt and tokens[s : s + n] == completion
            assert lps[s : s + n].view(np.uint32).tolist() == lp.view(np.uint32).tolist()
            seen += 1
    assert seen == len(calls)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ranks_get_equal_counts_and_cover_everything(shards, world):
    path, _ = shards
    everything = {key(s) for s in TrajectoryDataset(path, seed=1)}
    per_rank = [[key(s) for s in TrajectoryDataset(path, rank=r, world_size=world, seed=1)] for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1, "equal counts per rank"
    assert len(per_rank[0]) == -(-len(everything) // world)
    flat = [k for p in per_rank for k in p]
    assert set(flat) == everything, "ranks cover the data"
    assert len(flat) - len(set(flat)) == len(flat) - len(everything) < world, "only the wrap-around padding repeats"


def test_workers_are_disjoint_and_cover_the_rank(shards):
    path, _ = shards
    ds = TrajectoryDataset(path, rank=1, world_size=2, seed=5)
    whole = [key(s) for s in ds._iter_worker(0, 1)]
    parts = [[key(s) for s in TrajectoryDataset(path, rank=1, world_size=2, seed=5)._iter_worker(w, 3)] for w in range(3)]
    assert sorted(k for p in parts for k in p) == sorted(whole)
    assert all(not set(a) & set(b) for i, a in enumerate(parts) for b in parts[i + 1 :])


def test_order_is_deterministic_per_seed_and_epoch(shards):
    path, _ = shards
    a = [key(s) for s in TrajectoryDataset(path, seed=7)]
    b = [key(s) for s in TrajectoryDataset(path, seed=7)]
    c = [key(s) for s in TrajectoryDataset(path, seed=8)]
    assert a == b and a != c
    ds = TrajectoryDataset(path, seed=7)
    ds.set_epoch(1)
    assert [key(s) for s in ds] != a


def test_resume_yields_exactly_the_remaining_samples(shards):
    path, _ = shards
    full = [key(s) for s in TrajectoryDataset(path, rank=0, world_size=2, seed=2)]
    ds = TrajectoryDataset(path, rank=0, world_size=2, seed=2)
    it = iter(ds)
    first = [key(next(it)) for _ in range(5)]
    state = ds.state_dict()
    resumed = TrajectoryDataset(path, rank=0, world_size=2, seed=2)
    resumed.load_state_dict(state)
    assert first + [key(s) for s in resumed] == full
    with pytest.raises(ValueError):
        TrajectoryDataset(path, world_size=3).load_state_dict(state)


def test_collate_pads_and_packs_with_matching_masks(shards):
    path, _ = shards
    batch = list(TrajectoryDataset(path, shuffle=False))[:4]
    padded = collate(batch, mode="pad", pad_id=0)
    lens = [len(as_np(s["token_ids"])) for s in batch]
    assert as_np(padded["token_ids"]).shape == (4, max(lens))
    for i, n in enumerate(lens):
        assert as_np(padded["attention_mask"])[i].sum() == n
        assert as_np(padded["loss_mask"])[i, :n].tolist() == as_np(batch[i]["loss_mask"]).tolist()
        assert as_np(padded["loss_mask"])[i, n:].sum() == 0
    packed = collate(batch, mode="pack", token_budget=sum(lens[:2]) + 1)
    assert as_np(packed["token_ids"]).shape[1] == sum(lens[:2])
    assert as_np(packed["cu_seqlens"]).tolist() == [0, lens[0], lens[0] + lens[1]]
    assert len(packed["overflow"]) == 2
    with pytest.raises(ValueError):
        collate(batch, mode="pack")


def test_a_real_torch_dataloader_with_several_workers(shards):
    torch = pytest.importorskip("torch")
    path, _ = shards
    ds = TrajectoryDataset(path, seed=4)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=3)
    got = [key(s) for s in loader]
    assert got == [key(s) for s in TrajectoryDataset(path, seed=4)._iter_worker(0, 1)]
    assert isinstance(next(iter(loader))["loss_mask"], torch.Tensor)
