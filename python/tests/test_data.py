"""TrajectoryDataset: partitions across ranks and workers, determinism,
resume (in process, with a torch DataLoader's workers, with torchdata's
StatefulDataLoader), the row-group plan of workers, current rewards from the
side table, token-balanced micro-batches, exact content, collate."""

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
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
            if s % 5 == 4:  # several compactions: several shard files, row groups of 5, 5, 5, 5, 3 rows
                store.compact(merge_fanout=None)  # (merging would make them one file)
        store.compact(merge_fanout=None)
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
    with pytest.raises(ValueError, match="world_size"):
        TrajectoryDataset(path, world_size=3, seed=2).load_state_dict(state)
    # A version-1 state (before workers were planned) still loads.
    old = TrajectoryDataset(path, rank=0, world_size=2, seed=2)
    old.load_state_dict({"epoch": 0, "seed": 2, "consumed": 5, "world_size": 2})
    assert [key(s) for s in old] == full[5:]


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
    assert as_np(collate(batch, mode="pack")["token_ids"]).shape[1] == sum(lens), "no budget: every sample"
    with pytest.raises(ValueError, match="token_budget"):
        collate(batch, mode="pack", token_budget=0)


# -- workers: the row-group plan, the order a DataLoader yields, resume -------


def loader_order(ds, workers, batch_size, drop_last=False):
    """The keys a torch DataLoader yields, per batch, built from the plan the
    way torch delivers batches: round robin over workers, each worker's
    batches of batch_size from its own samples, an exhausted worker skipped."""
    w = max(workers, 1)
    b = batch_size or 1
    per_worker = []
    for k in range(w):
        keys = [key(s) for s in ds._iter_worker(k, w)]
        batches = [keys[i : i + b] for i in range(0, len(keys), b)]
        per_worker.append([x for x in batches if len(x) == b or not drop_last])
    out, r = [], 0
    while any(r < len(p) for p in per_worker):
        out.extend(p[r] for p in per_worker if r < len(p))
        r += 1
    return out


def test_each_worker_reads_only_its_row_groups_and_workers_cover_the_rank(shards):
    path, _ = shards
    for world, rank, workers in [(1, 0, 2), (1, 0, 3), (2, 1, 2), (3, 0, 4)]:
        whole = [key(s) for s in TrajectoryDataset(path, rank=rank, world_size=world, seed=5)._iter_worker(0, 1)]
        reads, parts = [], []
        for w in range(workers):
            ds = TrajectoryDataset(path, rank=rank, world_size=world, seed=5)
            calls = []
            original = ds._read_group
            ds._read_group = lambda g, original=original, calls=calls: calls.append(g) or original(g)
            parts.append([key(s) for s in ds._iter_worker(w, workers)])
            reads.append(calls)
        assert sorted(k for p in parts for k in p) == sorted(whole), "every sample of the rank exactly once"
        for w, calls in enumerate(reads):
            assert len(calls) == len(set(calls)), f"worker {w} read a row group twice: {calls}"
        flat = [g for calls in reads for g in calls]
        assert len(flat) == len(set(flat)), f"a row group read by two workers: {reads}"
        sizes = sorted(len(p) for p in parts)
        assert sizes[-1] - sizes[0] <= 5, f"balanced to within one row group (5 rows here): {sizes}"
        for p in parts:  # each worker walks the rank order
            assert p == [k for k in whole if k in set(p)]


def batch_keys(batch):
    """The sample keys of a DataLoader batch (collated dict, or one sample)."""
    if isinstance(batch["session_id"], str):
        return [(batch["session_id"], int(batch["segment_index"]))]
    return list(zip(batch["session_id"], (int(i) for i in batch["segment_index"])))


SCALARS = ["session_id", "segment_index"]


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("batch_size", [None, 1, 4])
def test_a_plain_dataloader_resumes_exactly_from_the_batches_count(shards, workers, batch_size):
    torch = pytest.importorskip("torch")
    path, _ = shards
    make = lambda: TrajectoryDataset(path, rank=0, world_size=2, seed=4, columns=SCALARS)  # noqa: E731
    ds = make()
    ds.set_epoch(1)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=workers)
    full = [batch_keys(b) for b in loader]
    assert full == loader_order(ds, workers, batch_size), "the documented order"
    assert ds.batches_per_epoch(loader=loader) == len(full)
    assert sorted(k for b in full for k in b) == sorted(key(s) for s in ds._iter_worker(0, 1))
    for taken in sorted({1, 2, len(full) // 2, len(full) - 1, len(full)}):
        state = ds.state_dict(batches=taken, loader=loader)
        resumed = make()
        resumed.load_state_dict(state)
        resumed.set_epoch(1)  # the loaded epoch: keeps the position
        assert resumed.batches_per_epoch(num_workers=workers, batch_size=batch_size) == len(full) - taken
        got = [batch_keys(b) for b in torch.utils.data.DataLoader(resumed, batch_size=batch_size, num_workers=workers)]
        assert got == full[taken:], f"resumed after {taken} batches"
        # Resuming a resumed run: count batches from the loaded state.
        if 0 < taken < len(full) - 1:
            again = make()
            again.load_state_dict(resumed.state_dict(batches=1, num_workers=workers, batch_size=batch_size))
            got = [batch_keys(b) for b in torch.utils.data.DataLoader(again, batch_size=batch_size, num_workers=workers)]
            assert got == full[taken + 1 :]


def test_state_dict_errors_name_what_is_wrong(shards):
    path, _ = shards
    ds = TrajectoryDataset(path, seed=4)
    state = ds.state_dict(batches=3, num_workers=2, batch_size=2)
    with pytest.raises(ValueError, match="num_workers=2"):
        other = TrajectoryDataset(path, seed=4)
        other.load_state_dict(state)
        list(other._iter_worker(0, 3))
    with pytest.raises(ValueError, match="seed"):
        TrajectoryDataset(path, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="more than the"):
        ds.state_dict(batches=len(ds) + 1, num_workers=0, batch_size=1)
    with pytest.raises(ValueError, match="batch_size"):
        ds.state_dict(batches=1, num_workers=2)
    with pytest.raises(ValueError, match="invalid batch_size: 0"):
        ds.batches_per_epoch(num_workers=2, batch_size=0)


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("batch_size", [None, 3])
def test_torchdata_stateful_dataloader_resumes_exactly(shards, workers, batch_size):
    pytest.importorskip("torch")
    sdl = pytest.importorskip("torchdata.stateful_dataloader")
    path, _ = shards
    make = lambda: TrajectoryDataset(path, rank=1, world_size=2, seed=9, columns=SCALARS)  # noqa: E731
    full = [batch_keys(b) for b in sdl.StatefulDataLoader(make(), batch_size=batch_size, num_workers=workers)]
    assert full == loader_order(make(), workers, batch_size)
    for taken in sorted({1, len(full) // 2, len(full) - 1}):
        loader = sdl.StatefulDataLoader(make(), batch_size=batch_size, num_workers=workers)
        it = iter(loader)
        first = [batch_keys(next(it)) for _ in range(taken)]
        state = loader.state_dict()
        del it
        resumed = sdl.StatefulDataLoader(make(), batch_size=batch_size, num_workers=workers)
        resumed.load_state_dict(state)
        assert first + [batch_keys(b) for b in resumed] == full, f"resumed after {taken} batches"


def test_a_real_torch_dataloader_yields_tensors(shards):
    torch = pytest.importorskip("torch")
    path, _ = shards
    loader = torch.utils.data.DataLoader(TrajectoryDataset(path, seed=4), batch_size=None, num_workers=2)
    sample = next(iter(loader))
    assert isinstance(sample["loss_mask"], torch.Tensor) and sample["token_ids"].dtype == torch.int64



@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_batches_collated_in_workers_arrive_whole_as_plain_dicts(shards, mode):
    """A batch collated in a worker crosses as one shared buffer and arrives
    as a plain dict equal, bit for bit, to collating the same samples here."""
    torch = pytest.importorskip("torch")
    import functools

    path, _ = shards
    budget = None if mode == "pad" else 60  # pack: some samples overflow
    fn = functools.partial(collate, mode=mode, token_budget=budget) if mode == "pack" else functools.partial(collate, mode=mode)
    ds = TrajectoryDataset(path, seed=5)
    got = list(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=fn))
    raw = list(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=lambda b: b))
    assert len(got) == len(raw) > 2
    overflowed = 0
    for batch, samples in zip(got, raw):
        want = fn(samples)
        assert type(batch) is dict and list(batch) == list(want)
        tensors = [k for k in want if k != "overflow"]
        spans = sorted((batch[k].data_ptr(), batch[k].data_ptr() + batch[k].numel() * batch[k].element_size()) for k in tensors if batch[k].numel())
        assert not spans or spans[-1][1] - spans[0][0] <= sum(-(-(end - start) // 64) * 64 for start, end in spans), "one buffer"
        for k in tensors:
            assert batch[k].dtype == want[k].dtype and batch[k].shape == want[k].shape, k
            assert batch[k].numpy().tobytes() == want[k].numpy().tobytes(), k
        if mode == "pack":
            overflowed += len(batch["overflow"])
            assert [key(s) for s in batch["overflow"]] == [key(s) for s in want["overflow"]]
    assert mode == "pad" or overflowed > 0

def _in_arena(t) -> bool:
    """Whether tensor `t`'s memory lies in a region of the arena that this process mapped."""
    from trajlog.data import _Arena

    ptr = t.untyped_storage().data_ptr()
    for region in _Arena.current._maps.values():
        base = np.frombuffer(region, dtype=np.uint8)
        if base.ctypes.data <= ptr < base.ctypes.data + len(base):
            return True
    return False


@pytest.fixture()
def fresh_arena(monkeypatch):
    """A new arena of 4 slots for one test (restored after)."""
    pytest.importorskip("torch")
    from trajlog.data import _Arena

    monkeypatch.setattr(_Arena, "current", None)
    monkeypatch.setattr(_Arena, "SLOTS", 4)
    _Arena.ensure()
    if _Arena.current is None:
        pytest.skip("no memfd here")
    return _Arena.current


def _slot_states(arena) -> list:
    import os

    return list(os.pread(arena.fd, arena.SLOTS, arena._states_at))


def test_worker_batches_view_arena_slots_freed_when_dropped(shards, fresh_arena):
    """Batches collated in workers arrive as views of arena slots, bit-equal
    to collating here; a slot stays taken while its batch lives, and more
    batches held than slots fall back to shared memory, still exact."""
    import functools
    import gc

    import torch

    path, _ = shards
    fn = functools.partial(collate, mode="pad")
    ds = TrajectoryDataset(path, seed=5)
    # Plain dicts: torch's own way across, no slots held.
    raw = list(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=lambda b: [dict(s) for s in b]))
    got = list(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=fn))
    assert len(got) == len(raw) > fresh_arena.SLOTS
    in_arena = [_in_arena(b["token_ids"]) for b in got]
    assert 0 < sum(in_arena) <= fresh_arena.SLOTS < len(got), in_arena
    assert sorted(_slot_states(fresh_arena)) == [1] * fresh_arena.SLOTS, "every slot held"
    for batch, samples in zip(got, raw):
        want = fn(samples)
        assert type(batch) is dict and list(batch) == list(want)
        for k in want:
            assert batch[k].dtype == want[k].dtype and batch[k].numpy().tobytes() == want[k].numpy().tobytes(), k
    del got, batch
    gc.collect()
    assert _slot_states(fresh_arena) == [0] * fresh_arena.SLOTS, "slots freed with their batches"
    # Freed slots are used again.
    again = list(torch.utils.data.DataLoader(ds, batch_size=3, num_workers=2, collate_fn=fn))
    assert any(_in_arena(b["token_ids"]) for b in again)
    for batch, samples in zip(again, raw):
        assert batch["logprobs"].numpy().tobytes() == fn(samples)["logprobs"].numpy().tobytes()


def test_worker_samples_cross_exactly(shards, fresh_arena):
    """batch_size=None with workers: every sample arrives bit-equal to the
    same sample read in process, its tensors one arena buffer when a slot is free."""
    torch = pytest.importorskip("torch")
    path, _ = shards
    here = {key(s): s for s in TrajectoryDataset(path, seed=6)}
    seen, through_arena = 0, 0
    for s in torch.utils.data.DataLoader(TrajectoryDataset(path, seed=6), batch_size=None, num_workers=2):
        want = here[key(s)]
        assert type(s) is dict and sorted(s) == sorted(want)
        for k, v in want.items():
            if hasattr(v, "numpy"):
                assert s[k].dtype == v.dtype and s[k].numpy().tobytes() == v.numpy().tobytes(), k
            elif isinstance(v, np.ndarray):
                assert np.asarray(s[k]).tobytes() == v.tobytes(), k
            else:
                assert s[k] == v, k
        through_arena += _in_arena(s["token_ids"])
        seen += 1
    assert seen == len(here) and through_arena > 0


def test_views_kept_from_a_dropped_batch_stay_exact(shards, fresh_arena):
    """A collate_fn that keeps only some tensors of `collate`'s batch: its
    slot is not reused while those tensors live."""
    import functools

    import torch

    path, _ = shards
    fn = functools.partial(collate, mode="pad")
    ds = TrajectoryDataset(path, seed=7)
    raw = list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=lambda b: [dict(s) for s in b]))
    got = list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2, collate_fn=lambda b: {"t": fn(b)["token_ids"], "lp": fn(b)["logprobs"]}))
    assert len(got) == len(raw) > fresh_arena.SLOTS
    for batch, samples in zip(got, raw):
        want = fn(samples)
        assert batch["t"].numpy().tobytes() == want["token_ids"].numpy().tobytes()
        assert batch["lp"].numpy().tobytes() == want["logprobs"].numpy().tobytes()


def test_slots_of_an_abandoned_iterator_are_swept(shards, fresh_arena):
    """Batches a dropped iterator's workers had sent never arrive; the main
    process frees their slots once those workers have exited."""
    import functools
    import gc

    import torch

    path, _ = shards
    ds = TrajectoryDataset(path, seed=8)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=2, collate_fn=functools.partial(collate, mode="pad"), prefetch_factor=2)
    it = iter(loader)
    next(it)
    del it  # workers shut down with prefetched batches in flight
    gc.collect()
    for _ in range(2):  # enough batches received for a sweep (SWEEP_EVERY)
        assert sum(1 for _ in loader) > 0
    gc.collect()
    assert fresh_arena.SWEEP_EVERY <= 2 * len(list(TrajectoryDataset(path, seed=8)))
    assert _slot_states(fresh_arena) == [0] * fresh_arena.SLOTS


# -- rewards current at read time ---------------------------------------------


@pytest.fixture()
def rewarded(tmp_path):
    """A compacted store whose sessions carry shard rewards, and the keys of
    its samples: 5 sessions, session 'b' with a TI/TO break (two samples)."""
    path = tmp_path / "s"
    with trajlog.Store(path) as store:
        for sid in ["a:0", "b:0", "c:0", "d:0", "e:0"]:
            prompt = [1, 2, 3]
            for step in range(2):
                completion = [10 + step, 11]
                store.append(trace_id=f"{sid}/{step}", session_id=sid, prompt_token_ids=prompt,
                             completion_token_ids=completion, logprobs=np.zeros(2, np.float32), timestamp=float(step))
                store.set_reward(0.5, trace_id=f"{sid}/{step}")
                # b's second call does not extend its first: a new chain (segment 1).
                prompt = [9, 9] if sid == "b:0" else prompt + completion
            store.seal(sid)
        store.compact()
    return path / "shards"


def versioned(table, key, version="1"):
    """`table` with the side table format version a trajlog table carries."""
    return table.replace_schema_metadata({key: version})


def write_rewards(path, rows, version="1"):
    table = pa.table(
        {
            "session_id": pa.array([r[0] for r in rows], pa.string()),
            "trace_id": pa.array([r[1] for r in rows], pa.string()),
            "reward": pa.array([r[2] for r in rows], pa.float64()),
        },
        schema=pa.schema([pa.field("session_id", pa.string(), nullable=False), pa.field("trace_id", pa.string()), pa.field("reward", pa.float64())]),
    )
    pq.write_table(versioned(table, "trajlog.rewards_format_version", version) if version else table, path)


def rewards_by_key(ds):
    return {key(s): (s["trace_ids"], s["reward"]) for s in ds}


def test_rewards_follow_the_side_table_rule(rewarded):
    shards_dir = rewarded
    before = rewards_by_key(TrajectoryDataset(shards_dir / "trajectories", shuffle=False))
    assert {r for _, r in before.values()} == {0.5}, "the shards hold the rewards at compaction"
    assert ("b:0", 1) in before and before[("b:0", 1)][0] == ["b:0/1"]
    write_rewards(
        shards_dir / "_rewards.parquet",
        [
            ("a:0", None, 2.0),  # a session reward: wins over everything
            ("a:0", "a:0/1", -1.0),
            ("b:0", None, None),  # no session reward: each sample's last trace decides
            ("b:0", "b:0/0", 3.0),  # segment 0 ends with b:0/0; segment 1 (b:0/1) is not listed
            ("c:0", None, None),
            ("c:0", "c:0/1", None),  # listed with a null reward: the reward is null
            ("d:0", None, None),  # listed, nothing else: the shard's reward
        ],
    )
    ds = TrajectoryDataset(shards_dir / "trajectories", shuffle=False)
    got = {k: r for k, (_, r) in rewards_by_key(ds).items()}
    assert got == {("a:0", 0): 2.0, ("b:0", 0): 3.0, ("b:0", 1): 0.5, ("c:0", 0): None, ("d:0", 0): 0.5, ("e:0", 0): 0.5}
    # Re-read at each iteration: a later compaction's table is seen by the next epoch.
    write_rewards(shards_dir / "_rewards.parquet", [("e:0", None, 7.0)])
    ds.set_epoch(1)
    assert {k: r for k, (_, r) in rewards_by_key(ds).items()}[("e:0", 0)] == 7.0
    assert {r for _, r in rewards_by_key(TrajectoryDataset(shards_dir / "trajectories", rewards=None)).values()} == {0.5}
    # Only the reward column asked for: the rule still applies.
    only = TrajectoryDataset(shards_dir / "trajectories", columns=["reward"], shuffle=False)
    assert sorted(s["reward"] for s in only) == [0.5, 0.5, 0.5, 0.5, 0.5, 7.0]
    assert set(next(iter(only))) == {"reward"}


def test_rewards_set_after_compaction_reach_the_samples_through_the_engine(rewarded):
    """The engine's own side table (format-spec/shard.md §8), end to end: a
    reward set after compaction is what the next compaction's readers see."""
    store_dir = rewarded.parent
    traj = rewarded / "trajectories"
    with trajlog.Store(store_dir) as store:
        store.set_reward(9.0, session_id="a:0")
        store.set_reward(4.0, trace_id="b:0/0")  # b's segment 0 ends with b:0/0
        store.set_reward(6.0, trace_id="c:0/0")  # not the last trace of c's only segment
        store.compact()
    got = {key(s): s["reward"] for s in TrajectoryDataset(traj, shuffle=False)}
    assert got == {("a:0", 0): 9.0, ("b:0", 0): 4.0, ("b:0", 1): 0.5, ("c:0", 0): 0.5, ("d:0", 0): 0.5, ("e:0", 0): 0.5}
    side = pq.read_table(rewarded / "_rewards.parquet").to_pylist()
    assert sorted({r["session_id"] for r in side}) == ["a:0", "b:0", "c:0"], side


def test_rewards_side_table_errors_name_the_problem(rewarded, tmp_path):
    traj = rewarded / "trajectories"
    with pytest.raises(FileNotFoundError, match="rewards side table not found"):
        TrajectoryDataset(traj, rewards=str(tmp_path / "missing.parquet"))
    write_rewards(rewarded / "_rewards.parquet", [("a:0", "a:0/1", 1.0)])
    with pytest.raises(ValueError, match="'a:0' has trace rows but no session row"):
        list(TrajectoryDataset(traj))
    pq.write_table(
        versioned(pa.table({"session_id": ["a:0"], "reward": [1.0]}), "trajlog.rewards_format_version"),
        rewarded / "_rewards.parquet",
    )
    with pytest.raises(ValueError, match="missing column 'trace_id'"):
        list(TrajectoryDataset(traj))
    # Another format version, or none, is refused rather than read as version 1.
    write_rewards(rewarded / "_rewards.parquet", [("a:0", None, 4.0)], version="2")
    with pytest.raises(ValueError, match="rewards_format_version is '2', this trajlog reads \"1\""):
        list(TrajectoryDataset(traj))
    write_rewards(rewarded / "_rewards.parquet", [("a:0", None, 4.0)], version=None)
    with pytest.raises(ValueError, match="rewards_format_version is missing"):
        list(TrajectoryDataset(traj))
    other = tmp_path / "r.parquet"
    write_rewards(other, [("a:0", None, 4.0)])
    assert {key(s): s["reward"] for s in TrajectoryDataset(traj, rewards=str(other))}[("a:0", 0)] == 4.0


# -- token-balanced micro-batches ----------------------------------------------


def mb_tokens(mb):
    return sum(len(as_np(s["token_ids"])) for s in mb)


@pytest.mark.parametrize("keep_groups", [False, True])
@pytest.mark.parametrize("world,budget,per_step", [(1, 300, None), (2, 200, 8), (3, 150, 6), (4, 400, None)])
def test_token_balanced_micro_batches(shards, world, budget, per_step, keep_groups):
    path, _ = shards
    make = lambda r, epoch=0: TrajectoryDataset(path, rank=r, world_size=world, seed=3, token_budget=budget,  # noqa: E731
                                                samples_per_step=per_step, keep_groups=keep_groups)
    everything = sorted(key(s) for s in TrajectoryDataset(path, shuffle=False))
    groups = {key(s): s["group_id"] for s in TrajectoryDataset(path, shuffle=False)}
    ranks = [make(r) for r in range(world)]
    counts = [ds.micro_batches_per_step() for ds in ranks]
    assert all(c == counts[0] for c in counts), f"equal micro-batch counts per step on every rank: {counts}"
    runs = [list(ds) for ds in ranks]
    assert all(len(run) == sum(counts[0]) == len(ds) for run, ds in zip(runs, ranks))
    seen = sorted(key(s) for run in runs for mb in run for s in mb)
    assert seen == everything, "every sample exactly once per epoch over the ranks"
    steps = np.cumsum([0] + counts[0])  # micro-batch index -> step
    where, together = {}, {}
    for r, run in enumerate(runs):
        for i, mb in enumerate(run):
            assert mb_tokens(mb) <= budget or len(mb) == 1, "over budget only as a lone sample"
            step = int(np.searchsorted(steps, i, side="right")) - 1
            for s in mb:
                where.setdefault(groups[key(s)], set()).add((r, step))
                together.setdefault(groups[key(s)], set()).add((r, i))
                # The token counts come from call_starts/completion_lens: check them.
                assert len(as_np(s["token_ids"])) == int(as_np(s["call_starts"])[-1] + as_np(s["completion_lens"])[-1])
    if keep_groups:
        assert all(len(places) == 1 for places in where.values()), f"a group on one rank in one step: {where}"
    else:
        assert any(len(places) > 1 for places in together.values()), "groups are split when not asked (the check can fail)"
    again = [[[key(s) for s in mb] for mb in make(r)] for r in range(world)]
    assert again == [[[key(s) for s in mb] for mb in run] for run in runs], "deterministic"
    later = [make(r) for r in range(world)]
    for ds in later:
        ds.set_epoch(1)
    assert [[[key(s) for s in mb] for mb in ds] for ds in later] != again


def test_groups_that_fit_the_budget_share_a_micro_batch(shards):
    path, _ = shards
    groups = {}
    for s in TrajectoryDataset(path, shuffle=False):
        groups.setdefault(s["group_id"], []).append(key(s))
    # One rank: no rank has to split a micro-batch to match another's count.
    mbs = list(TrajectoryDataset(path, seed=1, token_budget=500, samples_per_step=8, keep_groups=True))
    assert len(mbs) > 2
    for mb in mbs:
        keys = {key(s) for s in mb}
        for members in groups.values():
            assert set(members) <= keys or not set(members) & keys, "a group that fits stays whole"
    split = list(TrajectoryDataset(path, seed=1, token_budget=500, samples_per_step=8))
    assert any(len({s["group_id"] for s in mb}) > 1 for mb in split), "without keep_groups they mix (the check can fail)"


def test_token_balanced_micro_batches_with_a_dataloader_and_resume(shards):
    torch = pytest.importorskip("torch")
    path, _ = shards
    make = lambda: TrajectoryDataset(path, rank=1, world_size=2, seed=3, token_budget=200, samples_per_step=8)  # noqa: E731
    expected = [[key(s) for s in mb] for mb in make()]
    ds = make()
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda mb: mb)
    got = [[key(s) for s in mb] for mb in loader]
    assert got == expected, "with batch_size=None the loader yields the rank's micro-batches in order"
    packed = collate(next(iter(loader)), mode="pack")
    assert as_np(packed["cu_seqlens"])[-1] == as_np(packed["token_ids"]).shape[1]
    for taken in (1, len(got) // 2):
        resumed = make()
        resumed.load_state_dict(ds.state_dict(batches=taken, loader=loader))
        tail = [[key(s) for s in mb] for mb in torch.utils.data.DataLoader(resumed, batch_size=None, num_workers=2, collate_fn=lambda mb: mb)]
        assert tail == got[taken:]
    with pytest.raises(ValueError, match="batch_size=None"):
        ds.state_dict(batches=1, num_workers=2, batch_size=4)


def test_drop_last_drops_each_workers_partial_batch_and_resumes(shards):
    torch = pytest.importorskip("torch")
    path, _ = shards
    make = lambda: TrajectoryDataset(path, seed=6, columns=SCALARS)  # noqa: E731
    ds = make()
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, drop_last=True)
    full = [batch_keys(b) for b in loader]
    assert full == loader_order(ds, 2, 4, drop_last=True) and all(len(b) == 4 for b in full)
    assert ds.batches_per_epoch(loader=loader) == len(full)
    resumed = make()
    resumed.load_state_dict(ds.state_dict(batches=3, loader=loader))
    assert [batch_keys(b) for b in torch.utils.data.DataLoader(resumed, batch_size=4, num_workers=2, drop_last=True)] == full[3:]


def test_the_readme_duckdb_recipes_follow_the_same_rule(rewarded):
    duckdb = pytest.importorskip("duckdb")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```sql\n")[1:]]
    steps_sql, traj_sql = [b for b in blocks if "_rewards.parquet" in b]
    write_rewards(
        rewarded / "_rewards.parquet",
        [("a:0", None, 2.0), ("a:0", "a:0/1", -1.0), ("b:0", None, None), ("b:0", "b:0/0", 3.0),
         ("c:0", None, None), ("c:0", "c:0/1", None), ("d:0", None, None)],
    )
    store_dir = str(rewarded.parent)
    con = duckdb.connect()
    rows = con.execute(traj_sql.replace("DIR", store_dir)).fetchall()
    expected = {key(s): s["reward"] for s in TrajectoryDataset(rewarded / "trajectories")}
    assert {(sid, int(seg)): r for sid, seg, r in rows} == expected
    steps = {tid: r for tid, _, _, r in con.execute(steps_sql.replace("DIR", store_dir)).fetchall()}
    assert steps == {**{f"{s}:0/{i}": 0.5 for s in "abcde" for i in (0, 1)}, "a:0/1": -1.0, "b:0/0": 3.0, "c:0/1": None}


def test_small_compactions_are_merged(tmp_path):
    """Once `merge_fanout` small compactions are on disk the next one writes
    them again together: the files stay few and the dataset holds every
    session once."""
    path = tmp_path / "s"
    with trajlog.Store(path) as store:
        merged = []
        for s in range(5):
            store.append(trace_id=f"{s}/0", session_id=f"task-{s}:0", prompt_token_ids=[1, 2], completion_token_ids=[3, s], logprobs=[-0.5, -0.25])
            store.seal(f"task-{s}:0")
            r = store.compact(merge_fanout=3)
            merged.append(r["merged_generations"])
            assert r["collected_generations"] == []
        # The 4th compaction merges the three before it; the 5th finds two.
        assert merged == [[], [], [], [1, 2, 3], []]
        assert store.get("0/0").is_compacted
        assert store.compact(merge_fanout=None)["merged_generations"] == []
    files = sorted(p.name for p in (path / "shards" / "steps").glob("part-*.parquet"))
    assert [f.split("-")[1] for f in files] == ["000004", "000005"], files
    ds = TrajectoryDataset(str(path / "shards" / "trajectories"))
    assert sorted(sample["session_id"] for sample in ds) == [f"task-{s}:0" for s in range(5)]


def two_step_sessions(store, n):
    """Sessions task-0:0 … task-{n-1}:0, sealed, of two calls each (trace ids
    "s/0", "s/1"); step 1's prompt does not extend step 0's: two chains."""
    for s in range(n):
        for step in range(2):
            store.append(trace_id=f"{s}/{step}", session_id=f"task-{s}:0", prompt_token_ids=[1, 2, step], completion_token_ids=[3, s], logprobs=[-0.5, -0.25], timestamp=float(step))
        store.seal(f"task-{s}:0")


def test_deleted_sessions_are_collected_out_of_the_shards(tmp_path):
    """A compaction rewrites an earlier one whose rows are dead enough: the
    dataset built afterwards holds exactly the sessions left."""
    path = tmp_path / "s"
    with trajlog.Store(path) as store:
        two_step_sessions(store, 4)
        assert store.compact()["collected_generations"] == []
        store.delete_session("task-0:0")
        kept = store.compact(collect_dead=None)
        assert kept["collected_generations"] == [] and kept["shards"] == []
        r = store.compact(collect_dead=0.0)
        assert r["collected_generations"] == [1]
        assert (r["moved_calls"], r["dropped_rows"], r["calls"]) == (6, 2, 0)
        assert r["collected_bytes"] > 0 and r["collect_skipped"] == []
        assert store.get("0/0") is None and store.get("1/1").is_compacted
    files = sorted(p.name for p in (path / "shards" / "trajectories").glob("part-*.parquet"))
    assert files and all(not f.startswith("part-000001-") for f in files), files
    ds = TrajectoryDataset(str(path / "shards" / "trajectories"))
    sessions = sorted(sample["session_id"] for sample in ds)
    # Each session is two chains: step 1's prompt does not extend step 0's.
    assert sessions == sorted(["task-1:0", "task-2:0", "task-3:0"] * 2)


@pytest.fixture()
def deleted(tmp_path):
    """A compacted store of 6 sessions (two samples each: step 1's prompt does
    not extend step 0's), two of them deleted after compaction and not
    collected: their rows are still in the files, listed in
    `_deleted.parquet`."""
    path = tmp_path / "s"
    with trajlog.Store(path) as store:
        two_step_sessions(store, 6)
        store.compact()
        assert pq.read_table(path / "shards" / "_deleted.parquet").num_rows == 0
        for s in (1, 4):
            store.delete_session(f"task-{s}:0")
        r = store.compact(collect_dead=None)
        assert r["collected_generations"] == []
    return path / "shards"


def test_sessions_deleted_after_compaction_leave_the_dataset_before_collection(deleted):
    traj = deleted / "trajectories"
    side = pq.read_table(deleted / "_deleted.parquet").to_pylist()
    assert sorted({r["session_id"] for r in side}) == ["task-1:0", "task-4:0"]
    assert sum(r["path"].startswith("steps/") for r in side) == 4 and sum(r["path"].startswith("trajectories/") for r in side) == 4
    left = sorted(["task-0:0", "task-2:0", "task-3:0", "task-5:0"] * 2)
    ds = TrajectoryDataset(traj)
    assert ds.total == 8 and ds.deleted_rows == 4
    assert sorted(s["session_id"] for s in ds) == left
    assert sorted(s["session_id"] for s in TrajectoryDataset(traj, deletions=None)) == sorted(left + ["task-1:0", "task-4:0"] * 2)
    # Ranks: equal counts over what is left; token mode: every sample once.
    ranks = [[key(s) for s in TrajectoryDataset(traj, rank=r, world_size=3, seed=2)] for r in range(3)]
    assert all(len(r) == 3 for r in ranks)
    assert {k[0] for r in ranks for k in r} == set(left)
    mbs = list(TrajectoryDataset(traj, token_budget=16))
    assert sorted(s["session_id"] for mb in mbs for s in mb) == left
    # A later collection drops the rows; the table then lists nothing.
    with trajlog.Store(deleted.parent) as store:
        assert store.compact(collect_dead=0.0)["collected_generations"] == [1]
    assert pq.read_table(deleted / "_deleted.parquet").num_rows == 0
    assert sorted(s["session_id"] for s in TrajectoryDataset(traj)) == left


def test_deletions_apply_by_file_and_row_across_row_groups(deleted, tmp_path):
    """The reader's rule on its own: rows listed by (file, row number over
    the row groups) are left out, whatever the row groups, in every mode."""
    traj = tmp_path / "t"
    traj.mkdir()
    src = next((deleted / "trajectories").glob("part-*.parquet"))
    table = pq.read_table(src)
    pq.write_table(table, traj / src.name, row_group_size=2)
    pq.write_table(table, traj / "part-000009-0000.parquet", row_group_size=3)
    gone = {(src.name, 1), (src.name, 2), (src.name, 5), ("part-000009-0000.parquet", 0), ("part-000009-0000.parquet", 11)}
    side = tmp_path / "d.parquet"
    rows = sorted(gone)
    listed = pa.table({"path": [f"trajectories/{f}" for f, _ in rows] + ["steps/x.parquet"], "row": pa.array([r for _, r in rows] + [0], pa.int64()),
                       "session_id": ["x"] * (len(rows) + 1), "trace_id": [None] * len(rows) + ["x/0"]})
    pq.write_table(versioned(listed, "trajlog.deletions_format_version"), side)
    everything = [(f, r) for f in (src.name, "part-000009-0000.parquet") for r in range(table.num_rows)]
    keys = table.select(["session_id", "segment_index"]).to_pylist()
    want = sorted((keys[r]["session_id"], keys[r]["segment_index"]) for f, r in everything if (f, r) not in gone)
    for kwargs in ({}, {"shuffle": False}, {"token_budget": 12}, {"world_size": 2, "rank": 1}):
        ds = TrajectoryDataset(traj, deletions=str(side), **kwargs)
        assert ds.total == len(want) and ds.deleted_rows == len(gone)
        got = [key(s) for item in ds for s in (item if "token_budget" in kwargs else [item])]
        if "world_size" in kwargs:
            got += [key(s) for s in TrajectoryDataset(traj, deletions=str(side), world_size=2, rank=0)]
            assert len(got) == 2 * -(-len(want) // 2)
            got = sorted(set(got))
            assert got == sorted(set(want))
        else:
            assert sorted(got) == want, kwargs
    # A state saved over other rows (a row more deleted) is refused, not
    # resumed at a shifted position; over the same rows it resumes.
    ds = TrajectoryDataset(traj, deletions=str(side), seed=4)
    it = iter(ds)
    taken = [key(next(it)) for _ in range(5)]
    state = ds.state_dict()
    again = TrajectoryDataset(traj, deletions=str(side), seed=4)
    again.load_state_dict(state)
    assert taken + [key(s) for s in again] == [key(s) for s in TrajectoryDataset(traj, deletions=str(side), seed=4)]
    with pytest.raises(ValueError, match="saved over other shard rows"):
        TrajectoryDataset(traj, deletions=None, seed=4).load_state_dict(state)
    with pytest.raises(FileNotFoundError, match="deletions side table not found"):
        TrajectoryDataset(traj, deletions=str(tmp_path / "missing.parquet"))
    key_ = "trajlog.deletions_format_version"
    pq.write_table(versioned(pa.table({"path": ["trajectories/x"], "row": pa.array([1], pa.int32())}), key_), side)
    with pytest.raises(ValueError, match="expected path string and row int64"):
        TrajectoryDataset(traj, deletions=str(side))
    pq.write_table(versioned(pa.table({"file": ["x"]}), key_), side)
    with pytest.raises(ValueError, match="missing column path or row"):
        TrajectoryDataset(traj, deletions=str(side))
    # Another format version, or none, is refused rather than read as version 1.
    pq.write_table(versioned(listed, key_, "2"), side)
    with pytest.raises(ValueError, match="deletions_format_version is '2'"):
        TrajectoryDataset(traj, deletions=str(side))
    pq.write_table(listed, side)
    with pytest.raises(ValueError, match="deletions_format_version is missing"):
        TrajectoryDataset(traj, deletions=str(side))


def test_the_readme_duckdb_deletion_recipes_agree_with_the_dataset(deleted):
    duckdb = pytest.importorskip("duckdb")
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in readme.split("```sql\n")[1:]]
    steps_sql, traj_sql = [b for b in blocks if "_deleted.parquet" in b]
    con = duckdb.connect()
    store_dir = str(deleted.parent)
    got = sorted((sid, int(seg)) for sid, seg in con.execute(traj_sql.replace("DIR", store_dir)).fetchall())
    assert got == sorted(key(s) for s in TrajectoryDataset(deleted / "trajectories"))
    steps = sorted(t for (t,) in con.execute(steps_sql.replace("DIR", store_dir)).fetchall())
    assert steps == sorted(f"{s}/{k}" for s in (0, 2, 3, 5) for k in (0, 1))
