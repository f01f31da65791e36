"""A trainer dataloader over trajlog's `trajectories` Parquet shards.

    from trajlog.data import TrajectoryDataset, collate
    ds = TrajectoryDataset("/data/traces/shards/trajectories", rank=rank, world_size=world, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=4,
                                         collate_fn=lambda b: collate(b, mode="pad"))
    if checkpoint:
        ds.load_state_dict(checkpoint)         # resume mid-epoch, exactly
    for epoch in range(ds.epoch, E):
        ds.set_epoch(epoch)                    # the loaded epoch keeps its position
        for n, batch in enumerate(loader, start=1):
            ...
            checkpoint = ds.state_dict(batches=n, loader=loader)   # n since the epoch's start or the load

Each sample is a dict of numpy arrays (torch tensors when torch is installed:
`torch.from_numpy`, no copy): `token_ids` (uint32 widened to int64 under
torch), `loss_mask` (uint8), `logprobs` (float32), `call_starts`,
`completion_lens`, plus the scalar columns (`session_id`, `group_id`,
`segment_index`, `num_calls`, `reward`, …). `reward` is the current reward
(see Rewards below), not necessarily the one written at compaction.

Policies:

- Order: deterministic for (seed, epoch). With `shuffle`, row groups are
  permuted and rows are permuted within each row group (a block shuffle: reads
  stay row-group local); without, file order. This is the *rank order*.
- Ranks: every rank gets the same number of samples, ceil(N / world_size). The
  order is padded by wrapping around to its start (like
  `torch.utils.data.DistributedSampler(drop_last=False)`), so up to
  world_size - 1 samples appear twice per epoch; rank r takes the r-th
  contiguous slice.
- DataLoader workers (the *plan* for W workers): the rank order is cut into
  runs of rows from one row group; runs are handed out in rank order, each to
  the worker with the fewest samples so far (ties: the lowest worker id). So
  each row group of the rank's slice is read and decoded by one worker, once
  per epoch (the wrap-around padding on the last rank may read its row group a
  second time), workers differ by at most one run in samples, and every worker
  walks the rank order from its start. Worker w yields its samples in rank
  order.
- The order a DataLoader yields: torch hands out batches round robin (worker 0's
  first batch, worker 1's first batch, …, worker 0's second batch, …; each
  worker builds its batches of `batch_size` from its own samples, its last one
  possibly partial; a worker that has run out is skipped). So for (seed, epoch,
  world_size, rank, num_workers, batch_size) the order is fixed. With
  `num_workers=0` (or 1) it is the rank order.
- Resume: `state_dict()` records the epoch and, per plan worker, how many of its
  samples were consumed, and which worker the loader serves next;
  `load_state_dict()` makes the next iteration yield exactly the samples not
  yet yielded, in the order the uninterrupted run would have yielded them.
  In a multi-worker torch DataLoader the samples are consumed in the worker
  processes, so the main process cannot count them: the trainer says how many
  batches it took, `ds.state_dict(batches=n, loader=loader)` (counted from the
  start of the epoch, or from the state loaded last). torchdata's
  `StatefulDataLoader` needs nothing: it calls `state_dict()` inside each
  worker and gives each worker its own state back. A state records a digest
  of the files and of the rows the deletions side table left out; one saved
  over other rows (a compaction ran since) is refused rather than resumed at
  a shifted place.
- Rewards: the engine publishes `shards/_rewards.parquet` (beside
  `trajectories/` and `steps/`) listing sessions whose rewards changed after
  they were compacted. Each `__iter__` re-reads it, so every epoch sees the
  current rewards. Rule for a sample: if its session has a session row, the
  reward is that session reward when not null, else the side table's reward of
  the sample's last trace id when listed, else the shard's; a session not
  listed keeps the shard's reward.
- Deletions: the engine publishes `shards/_deleted.parquet` listing, per shard
  file, the rows whose calls were deleted or replaced after compaction (until
  a collection rewrites the file). The dataset reads it when it is built and
  leaves those rows out of every epoch: a new dataset (as after any
  compaction, which may also add and remove files) sees later deletions.
- Token-balanced micro-batches (`token_budget=N`): the dataset yields lists of
  samples instead of samples; see `TrajectoryDataset.__init__`.
"""

from __future__ import annotations

import glob
import hashlib
import math
import mmap
import os
import sys
import threading
import weakref
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

try:
    import fcntl
except ImportError:  # not POSIX: no arena (see _Arena)
    fcntl = None
try:  # torch is optional
    import torch
    from torch.utils.data import IterableDataset as _Base

    _HAS_TORCH = True
except ImportError:  # pragma: no cover - exercised when torch is absent
    torch = None
    _Base = object
    _HAS_TORCH = False

#: Shard files a dataset keeps open per process (see TrajectoryDataset._file).
_OPEN_FILES_MAX = 64
_LIST_COLUMNS = ("token_ids", "loss_mask", "logprobs", "call_starts", "completion_lens")

#: The rewards side table's file name, in the `shards/` directory.
REWARDS_FILE = "_rewards.parquet"
#: The deletions side table's file name, in the `shards/` directory.
DELETIONS_FILE = "_deleted.parquet"
#: Version of the dicts `state_dict()` returns (1: the int `consumed` of the
#: rank order, without workers; still accepted).
STATE_VERSION = 2


def _tensor(arr: np.ndarray):
    """A tensor sharing `arr`'s memory (Arrow's read-only buffer). torch warns
    that it cannot mark tensors read-only; the buffer must not be written
    (the collate functions only read from it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


_NUMPY_OF_ARROW = {pa.uint8(): np.uint8, pa.uint32(): np.uint32, pa.int32(): np.int32, pa.int64(): np.int64, pa.float32(): np.float32}


def _numpy_view(arr) -> np.ndarray:
    """A zero-copy numpy view of a primitive Arrow array without nulls.
    (pyarrow's `to_numpy` imports pandas on first use: ~0.3 s in every fresh
    DataLoader worker.)"""
    dtype = _NUMPY_OF_ARROW.get(arr.type)
    if dtype is None or arr.null_count:
        return arr.to_numpy(zero_copy_only=True)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * np.dtype(dtype).itemsize)


def _worker_info():
    """(torch worker id, number of workers), or None outside a DataLoader worker."""
    if not _HAS_TORCH:
        return None
    info = torch.utils.data.get_worker_info()
    return None if info is None else (info.id, info.num_workers)


def _check_side_table_version(pf, path: str, what: str, key: str) -> None:
    """Refuse a side table of another format version (format-spec/shard.md §8,
    §9): its rows could mean something else, and a trainer would read wrong
    rewards or drop the wrong rows without a word."""
    kv = pf.metadata.metadata or {}  # the file's key-value metadata
    version = kv.get(key.encode())
    if version is None:
        raise ValueError(f"{what} side table {path}: {key} is missing (not a table trajlog wrote)")
    if version != b"1":
        raise ValueError(
            f"{what} side table {path}: {key} is {version.decode(errors='replace')!r}, this trajlog reads \"1\"; "
            "use a matching trajlog"
        )


def load_rewards(path: str) -> dict:
    """The rewards side table as {session_id: (session_reward, {trace_id: reward})},
    for the sessions it lists. Schema: `session_id` string not null, `trace_id`
    string (null on the session row), `reward` float64 (nullable). A table of
    another format version (`trajlog.rewards_format_version`) is refused."""
    # ParquetFile.read, not pq.read_table: the latter imports pyarrow.dataset
    # and with it pandas (~0.9 s in every fresh DataLoader worker).
    pf = pq.ParquetFile(path)
    _check_side_table_version(pf, path, "rewards", "trajlog.rewards_format_version")
    table = pf.read()
    for name in ("session_id", "trace_id", "reward"):
        if name not in table.column_names:
            raise ValueError(f"rewards side table {path}: missing column {name!r} (has {table.column_names})")
    sessions: dict = {}
    has_session_row: set = set()
    for sid, tid, reward in zip(*(table.column(n).to_pylist() for n in ("session_id", "trace_id", "reward"))):
        if sid is None:
            raise ValueError(f"rewards side table {path}: null session_id")
        entry = sessions.setdefault(sid, [None, {}])
        if tid is None:
            if sid in has_session_row:
                raise ValueError(f"rewards side table {path}: two session rows for session {sid!r}")
            has_session_row.add(sid)
            entry[0] = reward
        else:
            entry[1][tid] = reward
    missing = sorted(set(sessions) - has_session_row)
    if missing:
        raise ValueError(
            f"rewards side table {path}: session {missing[0]!r} has trace rows but no session row "
            f"(every listed session has one; {len(missing)} such sessions)"
        )
    return {sid: (entry[0], entry[1]) for sid, entry in sessions.items()}


def load_deletions(path: str, table: str = "trajectories") -> dict:
    """The deletions side table's rows of one table ("trajectories" or
    "steps") as {file name: sorted numpy array of row numbers}. Schema: `path`
    string (`steps/NAME` or `trajectories/NAME`), `row` int64 (0-based, over
    the file's row groups), `session_id` string, `trace_id` string (null on a
    trajectories row). A table of another format version
    (`trajlog.deletions_format_version`) is refused."""
    pf = pq.ParquetFile(path)
    _check_side_table_version(pf, path, "deletions", "trajlog.deletions_format_version")
    if not {"path", "row"} <= set(pf.schema_arrow.names):
        raise ValueError(f"deletions side table {path}: missing column path or row (has {pf.schema_arrow.names})")
    t = pf.read(columns=["path", "row"])
    if t.schema.field("path").type != pa.string() or t.schema.field("row").type != pa.int64():
        raise ValueError(f"deletions side table {path}: expected path string and row int64, found {t.schema}")
    if t.column("path").null_count or t.column("row").null_count:
        raise ValueError(f"deletions side table {path}: null path or row")
    import pyarrow.compute as pc  # (no pandas import)

    prefix = table + "/"
    t = t.filter(pc.starts_with(t.column("path"), prefix))
    rows = _numpy_view(t.column("row").combine_chunks()) if t.num_rows else np.empty(0, np.int64)
    if len(rows) and rows.min() < 0:
        raise ValueError(f"deletions side table {path}: row {int(rows.min())} is negative")
    files = pc.dictionary_encode(t.column("path").combine_chunks())
    codes = _numpy_view(files.indices) if t.num_rows else np.empty(0, np.int32)
    order = np.argsort(codes, kind="stable")
    cuts = np.flatnonzero(np.diff(codes[order])) + 1
    out: dict = {}
    for part in np.split(order, cuts) if len(order) else []:
        name = files.dictionary[int(codes[part[0]])].as_py()[len(prefix):]
        out[name] = np.unique(rows[part].astype(np.int64))
    return out


def current_reward(rewards: Optional[dict], session_id: str, trace_ids: Sequence[str], shard_reward):
    """The rule: a listed session's session reward if not null, else its last
    trace's listed reward, else the shard's; an unlisted session: the shard's."""
    if not rewards or session_id not in rewards:
        return shard_reward
    session_reward, traces = rewards[session_id]
    if session_reward is not None:
        return session_reward
    if trace_ids and trace_ids[-1] in traces:
        return traces[trace_ids[-1]]
    return shard_reward


def _ffd(sizes: Sequence[int], budget: int) -> list:
    """First-fit decreasing: bins (lists of indices into `sizes`) of total size
    at most `budget`, except an item larger than the budget, alone in its bin.
    Ties in size keep index order, so the result is deterministic."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    bins: list = []
    room: list = []
    for i in order:
        for b, r in enumerate(room):
            if sizes[i] <= r:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(budget - sizes[i])
    return bins


def _split_until(bins: list, lengths: np.ndarray, done) -> None:
    """Split micro-batches (lists of positions) until `done(len(bins))`: the
    one with the most tokens among those holding two samples or more gives
    every other sample, by size, to a new one; with none left to split, an
    empty micro-batch is added."""
    while not done(len(bins)):
        splittable = [b for b in range(len(bins)) if len(bins[b]) > 1]
        if not splittable:
            bins.append([])
            continue
        b = max(splittable, key=lambda b: (int(lengths[bins[b]].sum()), -b))
        ranked = sorted(bins[b], key=lambda i: (-int(lengths[i]), i))
        bins[b], extra = ranked[0::2], ranked[1::2]
        bins.append(extra)


class TrajectoryDataset(_Base):
    def __init__(
        self,
        shards_dir: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        columns: Optional[Sequence[str]] = None,
        rewards: Optional[str] = "auto",
        deletions: Optional[str] = "auto",
        token_budget: Optional[int] = None,
        samples_per_step: Optional[int] = None,
        keep_groups: bool = False,
    ):
        """`shards_dir` is `DIR/shards/trajectories`.

        `rewards`: "auto" reads `shards_dir/../_rewards.parquet` when it exists,
        a path reads that file (it must exist), None keeps the shards' rewards.

        `deletions`: "auto" reads `shards_dir/../_deleted.parquet` when it
        exists and leaves out the rows it lists (trajectories of deleted
        sessions, or holding a call replaced after compaction), a path reads
        that file (it must exist), None reads every row. Read once, here.

        `token_budget=N` switches to token-balanced micro-batches: the dataset
        then yields lists of samples (use `DataLoader(batch_size=None)`). Each
        epoch's order (the block shuffle) is cut into steps of
        `samples_per_step` samples over all ranks (None: the whole epoch is one
        step; a step closes once it holds `samples_per_step` samples and
        world_size units, and a last step with fewer units than ranks joins
        the one before).
        A step's samples are packed first-fit decreasing into micro-batches of
        at most N tokens (a sample longer than N gets a micro-batch of its
        own), the micro-batch count is raised to a multiple of world_size by
        splitting the fullest micro-batches, and the micro-batches are dealt to
        ranks, largest first, to the rank with the fewest tokens that still has
        room, so every rank gets the same number per step. With `keep_groups`,
        a GRPO group (`group_id`) is the unit of a step and of a rank: whole
        groups are dealt to ranks (largest first, to the rank with the fewest
        tokens), so all of a group's samples are on one rank in one step; each
        rank then packs first-fit decreasing, a group that fits the budget as
        one item (so it usually shares one micro-batch), a larger one sample by
        sample, and ranks with fewer micro-batches than the most split their
        fullest ones (which can separate a group's samples, on that rank).
        Every sample appears exactly once per epoch over all ranks (no
        wrap-around padding); a rank can get an empty micro-batch only when
        it has fewer samples in a step than the micro-batches every rank must
        yield (the trainer still steps). `micro_batches_per_step()`
        gives the counts. Deterministic per (seed, epoch). Packing a step
        costs about (its samples x its micro-batches) Python steps, so give
        big epochs a `samples_per_step` (the global batch).
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank/world_size: rank {rank} of {world_size}")
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"invalid token_budget: {token_budget} (a positive number of tokens)")
        if samples_per_step is not None and samples_per_step < 1:
            raise ValueError(f"invalid samples_per_step: {samples_per_step} (a positive number of samples)")
        if token_budget is None and (samples_per_step is not None or keep_groups):
            raise ValueError("samples_per_step and keep_groups apply to token-balanced micro-batches: set token_budget")
        self.shards_dir = str(shards_dir)
        self.files = sorted(
            f for f in glob.glob(os.path.join(self.shards_dir, "*.parquet")) if not os.path.basename(f).startswith(("_", "."))
        )
        if not self.files:
            raise FileNotFoundError(f"no trajectory shards (*.parquet) in {shards_dir}")
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.columns = list(columns) if columns is not None else None
        if rewards == "auto":
            candidate = os.path.join(self.shards_dir, "..", REWARDS_FILE)
            self._rewards_path, self._rewards_required = os.path.normpath(candidate), False
        elif rewards is None:
            self._rewards_path, self._rewards_required = None, False
        else:
            if not os.path.isfile(rewards):
                raise FileNotFoundError(f"rewards side table not found: {rewards}")
            self._rewards_path, self._rewards_required = str(rewards), True
        self.token_budget, self.samples_per_step, self.keep_groups = token_budget, samples_per_step, keep_groups
        _Arena.ensure()  # before DataLoader workers fork: they inherit it
        if deletions == "auto":
            candidate = os.path.normpath(os.path.join(self.shards_dir, "..", DELETIONS_FILE))
            deleted = load_deletions(candidate) if os.path.exists(candidate) else {}
        elif deletions is None:
            deleted = {}
        else:
            if not os.path.isfile(deletions):
                raise FileNotFoundError(f"deletions side table not found: {deletions}")
            deleted = load_deletions(str(deletions))
        # (file index, row group, rows kept) of every row group: metadata
        # only; `_kept[g]`: the row numbers kept of group g, None for all.
        self._groups = []
        self._kept: list = []
        self._open: dict = {}  # (pid, file index) -> ParquetFile; see _file
        self.deleted_rows = 0
        for i in range(len(self.files)):
            meta = self._file(i).metadata
            gone = deleted.get(os.path.basename(self.files[i]))
            start = 0
            for g in range(meta.num_row_groups):
                n = meta.row_group(g).num_rows
                kept = None
                if gone is not None:
                    lo, hi = np.searchsorted(gone, [start, start + n])
                    if hi > lo:
                        kept = np.setdiff1d(np.arange(n), gone[lo:hi] - start, assume_unique=True)
                        self.deleted_rows += n - len(kept)
                self._groups.append((i, g, n if kept is None else len(kept)))
                self._kept.append(kept)
                start += n
        self.total = sum(n for _, _, n in self._groups)
        # What the order is drawn from (the files and the rows left out): a
        # state saved over other rows cannot be resumed exactly.
        digest = hashlib.blake2b(digest_size=8)
        for i, f in enumerate(self.files):
            digest.update(os.path.basename(f).encode() + b"\0")
            gone = deleted.get(os.path.basename(f))
            if gone is not None:
                digest.update(np.ascontiguousarray(gone, dtype="<i8").tobytes())
            digest.update(b"\n")
        self._rows_key = digest.hexdigest()
        self._lengths = None  # per row group: token counts (token mode)
        self._group_ids = None  # per row group: group_id values (keep_groups)
        if token_budget is not None:
            self._read_token_metadata()
        self.epoch = 0
        self._base: Optional[dict] = None  # where an iteration starts: None = the epoch's start
        self._live: Optional[dict] = None  # this process's progress since its last __iter__
        self._plan_cache: Optional[tuple] = None  # ((epoch, workers), (items, parts))
        self._mb_cache: Optional[tuple] = None  # (epoch, micro-batches per step)

    # -- order --------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch. A new epoch starts at its beginning; the
        current one (after `load_state_dict`) keeps the loaded position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._base = None
            self._live = None

    def _global_order(self) -> np.ndarray:
        """(group index, row) pairs of the epoch, as an (N, 2) array."""
        rng = np.random.default_rng([self.seed, self.epoch])
        groups = rng.permutation(len(self._groups)) if self.shuffle else np.arange(len(self._groups))
        parts = []
        for g in groups:
            n = self._groups[g][2]
            rows = rng.permutation(n) if self.shuffle else np.arange(n)
            if self._kept[g] is not None:  # row numbers of the rows kept
                rows = self._kept[g][rows]
            parts.append(np.stack([np.full(n, g), rows], axis=1))
        return np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.int64)

    def _rank_order(self) -> np.ndarray:
        order = self._global_order()
        per_rank = -(-len(order) // self.world_size)
        padded = per_rank * self.world_size
        if padded > len(order) and len(order):
            order = np.concatenate([order, order[: padded - len(order)]])
        return order[self.rank * per_rank : (self.rank + 1) * per_rank]

    def _items(self):
        """The rank's items of the epoch, in order: the rank order itself, an
        (N, 2) array of (group, row) pairs, or in token mode a list of
        micro-batches, each a (k, 2) array."""
        if self.token_budget is None:
            return self._rank_order()
        return [mb for step in self._rank_micro_batches() for mb in step]

    def _plan(self, workers: int) -> tuple:
        """(items, [item indices of worker w for w in range(workers)])."""
        key = (self.epoch, workers)
        if self._plan_cache is None or self._plan_cache[0] != key:
            items = self._items()
            parts: list = [[] for _ in range(workers)]
            if self.token_budget is None:
                # Runs of one row group, in order, each to the least-loaded worker.
                cuts = (np.flatnonzero(items[1:, 0] != items[:-1, 0]) + 1).tolist()
                loads = [0] * workers
                for start, end in zip([0] + cuts, cuts + [len(items)]):
                    if end > start:
                        w = min(range(workers), key=lambda j: (loads[j], j))
                        parts[w].append(np.arange(start, end))
                        loads[w] += end - start
                parts = [np.concatenate(p) if p else np.empty(0, dtype=np.int64) for p in parts]
            else:
                # Micro-batches round robin: with batch_size=None the loader
                # yields the rank's micro-batches in order.
                for i in range(len(items)):
                    parts[i % workers].append(i)
            self._plan_cache = (key, (items, parts))  # one epoch and worker count at a time
        return self._plan_cache[1]

    def __len__(self) -> int:
        """Samples (micro-batches in token mode) this rank yields per epoch,
        all workers together."""
        if self.token_budget is not None:
            return sum(self.micro_batches_per_step())
        return -(-self.total // self.world_size)

    # -- token-balanced micro-batches -----------------------------------------
    def _read_token_metadata(self) -> None:
        """Token count of every row (last call start + last completion length:
        `token_ids` ends with the last completion, format-spec/shard.md §3)
        and, with keep_groups, its group id; small columns only."""
        self._lengths, self._group_ids = [], []
        wanted = ["call_starts", "completion_lens"] + (["group_id"] if self.keep_groups else [])
        for file_idx, group, _ in self._groups:
            t = self._file(file_idx).read_row_group(group, columns=wanted)
            starts, lens = t.column("call_starts").to_pylist(), t.column("completion_lens").to_pylist()
            self._lengths.append(np.array([s[-1] + n[-1] if s else 0 for s, n in zip(starts, lens)], dtype=np.int64))
            self._group_ids.append(t.column("group_id").to_pylist() if self.keep_groups else None)

    def _rank_micro_batches(self) -> list:
        """This rank's micro-batches of the epoch, per step: [[(k, 2) array]]."""
        if self._mb_cache is not None and self._mb_cache[0] == self.epoch:
            return self._mb_cache[1]
        order = self._global_order()
        first_row = np.concatenate([[0], np.cumsum([len(x) for x in self._lengths])])
        lengths = np.concatenate(self._lengths)[first_row[order[:, 0]] + order[:, 1]] if len(order) else np.empty(0, np.int64)
        # Units: samples, or groups in order of first appearance.
        if self.keep_groups:
            members: dict = {}
            for i, (g, r) in enumerate(order):
                members.setdefault(self._group_ids[g][r], []).append(i)
            units = list(members.values())
        else:
            units = [[i] for i in range(len(order))]
        # Steps: consecutive units, at least samples_per_step samples and
        # world_size units each (a unit is never split).
        steps, current, count = [], [], 0
        per_step = self.samples_per_step or len(order) or 1
        for u in units:
            current.append(u)
            count += len(u)
            if count >= per_step and len(current) >= self.world_size:
                steps.append(current)
                current, count = [], 0
        if current:
            if steps and len(current) < self.world_size:
                steps[-1].extend(current)
            else:
                steps.append(current)
        mine = []
        for step in steps:
            if self.keep_groups:
                bins = self._groups_to_ranks_then_pack(step, lengths)[self.rank]
            else:
                bins = self._pack_then_deal(step, lengths)[self.rank]
            # Within a rank: micro-batches in the order of their first sample.
            bins = sorted((sorted(b) for b in bins), key=lambda b: b[0] if b else -1)
            mine.append([order[b] if b else np.empty((0, 2), dtype=np.int64) for b in bins])
        self._mb_cache = (self.epoch, mine)
        return mine

    def _pack_then_deal(self, step: list, lengths: np.ndarray) -> list:
        """Per rank, its micro-batches (lists of positions in the epoch's
        order) of one step: the step's samples packed first-fit decreasing,
        the count raised to a multiple of world_size by splitting the fullest
        micro-batch that holds two samples or more, then dealt largest first to
        the rank with the fewest tokens among those still short of their share."""
        world = self.world_size
        sizes = [int(lengths[u].sum()) for u in step]
        bins = [[i for j in b for i in step[j]] for b in _ffd(sizes, self.token_budget)]
        _split_until(bins, lengths, lambda n: n % world == 0)
        tokens = [int(lengths[b].sum()) for b in bins]
        per_rank = len(bins) // world
        loads, out = [0] * world, [[] for _ in range(world)]
        for b in sorted(range(len(bins)), key=lambda b: (-tokens[b], b)):
            r = min((r for r in range(world) if len(out[r]) < per_rank), key=lambda r: (loads[r], r))
            loads[r] += tokens[b]
            out[r].append(bins[b])
        return out

    def _groups_to_ranks_then_pack(self, step: list, lengths: np.ndarray) -> list:
        """Per rank, its micro-batches of one step when GRPO groups are kept
        together: whole groups dealt to ranks largest first (to the rank with
        the fewest tokens), then each rank packs first-fit decreasing — a
        group that fits the budget as one item, a larger one sample by sample —
        and ranks short of the most micro-batches split their fullest ones."""
        world, budget = self.world_size, self.token_budget
        tok = [int(lengths[u].sum()) for u in step]
        loads, units = [0] * world, [[] for _ in range(world)]
        for j in sorted(range(len(step)), key=lambda j: (-tok[j], step[j][0])):
            r = min(range(world), key=lambda r: (loads[r], r))
            loads[r] += tok[j]
            units[r].append(j)
        out = []
        for mine in units:
            items = []
            for j in sorted(mine, key=lambda j: step[j][0]):
                items.extend([step[j]] if tok[j] <= budget else [[i] for i in step[j]])
            out.append([[i for k in b for i in items[k]] for b in _ffd([int(lengths[it].sum()) for it in items], budget)])
        most = max(len(bins) for bins in out)
        for bins in out:
            _split_until(bins, lengths, lambda n: n >= most)
        return out

    def micro_batches_per_step(self) -> list:
        """Micro-batches per step this epoch (the same on every rank)."""
        if self.token_budget is None:
            raise ValueError("micro_batches_per_step needs token_budget")
        return [len(s) for s in self._rank_micro_batches()]

    # -- resume -------------------------------------------------------------
    def _fixed(self) -> dict:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
            "token_budget": self.token_budget,
            "samples_per_step": self.samples_per_step,
            "keep_groups": self.keep_groups,
            "rows": self._rows_key,
        }

    def _start_state(self, workers: int) -> dict:
        return {"num_workers": workers, "consumed": [0] * workers, "next_worker": 0}

    def state_dict(
        self,
        batches: Optional[int] = None,
        *,
        loader: Any = None,
        num_workers: Optional[int] = None,
        batch_size: Any = "unset",
        drop_last: Optional[bool] = None,
    ) -> dict:
        """Where to resume.

        Without `batches`: this process's own progress. That is exact when the
        samples are consumed here (iterating the dataset directly, or a
        DataLoader with num_workers=0), and inside a DataLoader worker (then
        it is that worker's share, which torchdata's StatefulDataLoader
        gathers). In the main process of a multi-worker DataLoader it only
        knows the state the iteration started from: pass `batches`.

        With `batches=n`: the state after the loader yielded n batches since
        the start of the epoch (or since the state loaded last), computed from
        torch's round robin over the plan. `loader` supplies num_workers,
        batch_size and drop_last, or give them (batch_size None: unbatched).
        """
        if batches is None:
            if loader is not None:
                raise ValueError("state_dict(loader=...) needs batches= (how many batches the loader yielded)")
            state = self._live if self._live is not None else self._base
            if state is None:
                state = self._start_state(1)
            out = {**self._fixed(), "num_workers": state["num_workers"], "next_worker": state.get("next_worker", 0)}
            if "worker" in state:  # inside a DataLoader worker: only its own share is known
                out["worker"] = state["worker"]
                out["consumed"] = state["consumed"][state["worker"]]
            else:
                out["consumed"] = list(state["consumed"])
            return out
        if batches < 0:
            raise ValueError(f"invalid batches: {batches} (batches yielded, at least 0)")
        workers, b, drop_last = self._loader_args(loader, num_workers, batch_size, drop_last)
        base = self._base if self._base is not None else self._start_state(workers)
        self._check_workers(base, workers)
        if "worker" in base:
            raise ValueError("the loaded state is one DataLoader worker's (torchdata); resume it with StatefulDataLoader")
        _, parts = self._plan(workers)
        sizes = [len(p) for p in parts]
        consumed, nxt = list(base["consumed"]), base["next_worker"]

        def left(w):
            rest = sizes[w] - consumed[w]
            return rest // b if drop_last else -(-rest // b)

        remaining = [left(w) for w in range(workers)]
        if batches > sum(remaining):
            raise ValueError(
                f"batches={batches} is more than the {sum(remaining)} batches left in epoch {self.epoch} "
                f"(num_workers={num_workers}, batch_size={batch_size})"
            )
        for _ in range(batches):
            w = next(w for w in ((nxt + k) % workers for k in range(workers)) if remaining[w])
            consumed[w] += min(b, sizes[w] - consumed[w])
            remaining[w] -= 1
            nxt = (w + 1) % workers
        return {**self._fixed(), "num_workers": workers, "consumed": consumed, "next_worker": nxt}

    def batches_per_epoch(
        self, *, loader: Any = None, num_workers: Optional[int] = None, batch_size: Any = "unset", drop_last: Optional[bool] = None
    ) -> int:
        """The batches a DataLoader yields from the start state (the epoch's
        start, or the loaded state) to the end of the epoch: each worker's
        samples in batches of batch_size, its last one partial unless
        drop_last. More than ceil(len(ds) / batch_size) with several workers."""
        workers, b, drop_last = self._loader_args(loader, num_workers, batch_size, drop_last)
        base = self._base if self._base is not None else self._start_state(workers)
        self._check_workers(base, workers)
        if "worker" in base:
            raise ValueError("the loaded state is one DataLoader worker's (torchdata); StatefulDataLoader counts its own batches")
        _, parts = self._plan(workers)
        rest = [len(p) - c for p, c in zip(parts, base["consumed"])]
        return sum(r // b if drop_last else -(-r // b) for r in rest)

    def _loader_args(self, loader, num_workers, batch_size, drop_last) -> tuple:
        """(plan workers, samples per batch, drop_last) from a loader or the arguments."""
        if loader is not None:
            num_workers = loader.num_workers if num_workers is None else num_workers
            batch_size = loader.batch_size if batch_size == "unset" else batch_size
            drop_last = loader.drop_last if drop_last is None else drop_last
        if num_workers is None or batch_size == "unset":
            raise ValueError("pass the loader, or num_workers and batch_size (None: unbatched)")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"invalid batch_size: {batch_size}")
        if self.token_budget is not None and batch_size is not None:
            raise ValueError("token_budget micro-batches are batches already: use batch_size=None")
        return max(int(num_workers), 1), 1 if batch_size is None else int(batch_size), bool(drop_last)

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`'s dict: the next iteration yields what the
        interrupted one had not yet yielded. Raises ValueError naming the field
        when the state was saved with other settings."""
        fixed = self._fixed()
        for name in ("seed", "world_size", "rank", "shuffle", "token_budget", "samples_per_step", "keep_groups"):
            if name in state and state[name] != fixed[name]:
                raise ValueError(f"state_dict was saved with {name}={state[name]!r}; this dataset has {name}={fixed[name]!r}")
        if "rows" in state and state["rows"] != fixed["rows"]:
            raise ValueError(
                "state_dict was saved over other shard rows (the files or the deletions side table changed since: a "
                "compaction ran); its position cannot be resumed exactly: resume with the same files and table, or start the epoch again"
            )
        self.epoch = int(state["epoch"])
        if state.get("version", 1) == 1:  # rank order consumed, one reader
            base = {"num_workers": 1, "consumed": [int(state["consumed"])], "next_worker": 0}
        elif "worker" in state:
            workers, worker = int(state["num_workers"]), int(state["worker"])
            consumed: list = [None] * workers
            consumed[worker] = int(state["consumed"])
            base = {"num_workers": workers, "consumed": consumed, "next_worker": 0, "worker": worker}
        else:
            base = {
                "num_workers": int(state["num_workers"]),
                "consumed": [int(c) for c in state["consumed"]],
                "next_worker": int(state["next_worker"]),
            }
            if len(base["consumed"]) != base["num_workers"]:
                raise ValueError(f"state_dict: consumed has {len(base['consumed'])} entries for num_workers={base['num_workers']}")
        self._base, self._live = base, None

    @staticmethod
    def _is_start(state: dict) -> bool:
        return state["next_worker"] == 0 and not any(state["consumed"])

    def _check_workers(self, state: dict, workers: int) -> None:
        if state["num_workers"] != workers and not self._is_start(state):
            raise ValueError(
                f"state_dict was taken for num_workers={state['num_workers']}; this loader has num_workers={workers} "
                "(0 and 1 are the same plan): resume with the same number of workers"
            )

    # -- iteration ----------------------------------------------------------
    def _file(self, file_idx: int):
        """This process's open `ParquetFile` of shard `file_idx`: its footer
        (every row group's metadata) is parsed once, not at each row group
        read (that was ~30% of a pass). A forked DataLoader worker opens its
        own; at most `_OPEN_FILES_MAX` stay open."""
        pid = os.getpid()
        if self._open and next(iter(self._open))[0] != pid:
            self._open = {}  # inherited through fork: the parent's
        key = (pid, file_idx)
        f = self._open.get(key)
        if f is None:
            if len(self._open) >= _OPEN_FILES_MAX:
                self._open.pop(next(iter(self._open)))
            f = self._open[key] = pq.ParquetFile(self.files[file_idx])
        return f

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_open"] = {}  # open files do not cross to spawned workers
        return state

    def _read_group(self, g: int):
        file_idx, group, _ = self._groups[g]
        columns = self.columns
        if columns is not None and self._rewards_path and "reward" in columns:
            columns = list(dict.fromkeys(columns + ["session_id", "trace_ids"]))  # the reward rule needs them
        # In a worker, decode on this thread: W workers each fanning out to
        # pyarrow's pool oversubscribe the cores (measured 2.26 s against
        # 1.28 s a pass, 2 workers on 2 cores).
        return self._file(file_idx).read_row_group(group, columns=columns, use_threads=_worker_info() is None)

    def _load_rewards(self) -> Optional[dict]:
        if self._rewards_path is None or (self.columns is not None and "reward" not in self.columns):
            return None
        if not os.path.exists(self._rewards_path):
            if self._rewards_required:
                raise FileNotFoundError(f"rewards side table not found: {self._rewards_path}")
            return None
        return load_rewards(self._rewards_path)

    def _columns_of(self, table) -> dict:
        """A row group decoded once for per-row slicing: a list column as
        (offsets, values), the values a zero-copy view of Arrow's buffer (a
        torch tensor under torch; `token_ids` then widened to int64 once per
        row group: torch has no uint32 indexing), `trace_ids` and scalar
        columns as Python lists. A sample's arrays are views of these, so a
        sample keeps its row group's column buffers alive."""
        cols = {}
        for name in table.column_names:
            col = table.column(name).combine_chunks()
            if name in _LIST_COLUMNS:
                values = _numpy_view(col.values)
                if _HAS_TORCH and name == "token_ids":
                    values = values.astype(np.int64)
                if _HAS_TORCH and values.dtype != np.uint32:  # torch barely supports uint32: those stay numpy
                    # One tensor per row group; a sample is a slice of it (a
                    # view: no copy, and no per-sample warning filter).
                    values = _tensor(values)
                cols[name] = (_numpy_view(col.offsets).tolist(), values)
            else:
                cols[name] = col.to_pylist()
        return cols

    def _sample(self, cols: dict, row: int, rewards: Optional[dict]) -> dict:
        out: dict[str, Any] = {}
        for name, col in cols.items():
            if isinstance(col, tuple):
                offsets, values = col
                out[name] = values[offsets[row] : offsets[row + 1]]
            else:
                out[name] = col[row]
        if rewards and "reward" in out:
            out["reward"] = current_reward(rewards, out["session_id"], out["trace_ids"], out["reward"])
        if self.columns is not None and len(out) != len(self.columns):
            out = {k: v for k, v in out.items() if k in self.columns}
        return out if _worker_info() is None else _WorkerDict(out)

    def __iter__(self) -> Iterator:
        info = _worker_info()
        workers = 1 if info is None else info[1]
        base = self._base if self._base is not None else self._start_state(workers)
        self._check_workers(base, workers)
        if info is None:
            worker = 0
        elif "worker" in base:  # torchdata gave this worker its own state back
            worker = base["worker"]
        else:  # the loaded state's next worker is served first: torch starts at worker 0
            worker = (info[0] + base["next_worker"]) % workers
        return self._iter_worker(worker, workers)

    def _iter_worker(self, worker: int, workers: int) -> Iterator:
        """The items plan worker `worker` of `workers` yields, from the start
        state (the epoch's start or the loaded state)."""
        base = self._base if self._base is not None else self._start_state(workers)
        self._check_workers(base, workers)
        start = base["consumed"][worker] if base["num_workers"] == workers else 0
        if start is None:
            raise ValueError(f"the loaded state is DataLoader worker {base['worker']}'s, not worker {worker}'s")
        live = {"num_workers": workers, "consumed": list(base["consumed"]) if base["num_workers"] == workers else [0] * workers}
        live["consumed"][worker] = start
        live["next_worker"] = base.get("next_worker", 0) if base["num_workers"] == workers else 0
        if _worker_info() is not None:
            live["worker"] = worker
        self._live = live
        items, parts = self._plan(workers)
        return self._generate(items, parts[worker][start:], live, worker)

    def _generate(self, items, mine, live, worker) -> Iterator:
        rewards = self._load_rewards()
        cache: dict = {}
        sample_mode = self.token_budget is None
        for i in mine:
            samples = []
            for g, row in (items[i],) if sample_mode else items[i]:
                g = int(g)
                if g not in cache:
                    if len(cache) >= 8:  # token mode revisits a step's row groups; keep a few
                        cache.pop(next(iter(cache)))
                    cache[g] = self._columns_of(self._read_group(g))
                samples.append(self._sample(cache[g], int(row), rewards))
            live["consumed"][worker] += 1
            live["next_worker"] = (worker + 1) % live["num_workers"]
            yield samples[0] if sample_mode else samples


def collate(batch: list, *, mode: str = "pad", pad_id: int = 0, token_budget: Optional[int] = None) -> dict:
    """Batch samples for training.

    - `mode="pad"`: right-pads `token_ids` (with `pad_id`), `loss_mask` (0) and
      `logprobs` (0.0) to the longest sample; adds `attention_mask`.
    - `mode="pack"`: concatenates samples into one row of at most
      `token_budget` tokens (samples that do not fit are left out and returned
      under `"overflow"`), with `position_ids` restarting at each sample and
      `cu_seqlens` (cumulative sample lengths) for variable-length attention.
      `token_budget=None` takes every sample (for micro-batches the dataset
      already packed with `token_budget`).
    Returns torch tensors when torch is installed, else numpy arrays. The
    arrays are views of one buffer. In a DataLoader worker of a
    `TrajectoryDataset` that buffer is a slot of shared memory the main
    process already maps (`_Arena`): the batch crosses as the slot's place,
    without a copy, and arrives as a plain dict of tensors viewing the slot,
    which is reused once they are all gone. (torch would move each tensor
    through a fresh shared-memory segment and a file descriptor of its own.)
    """

    def np_of(x):
        return x.numpy() if _HAS_TORCH and isinstance(x, torch.Tensor) else np.asarray(x)

    seqs = [(np_of(s["token_ids"]), np_of(s["loss_mask"]), np_of(s["logprobs"])) for s in batch]
    rest: dict[str, Any] = {}
    if mode == "pad":
        width = max((len(t) for t, _, _ in seqs), default=0)
        shape = (len(seqs), width)
        arrays = _BatchArrays([("token_ids", np.int64, shape), ("loss_mask", np.uint8, shape), ("logprobs", np.float32, shape), ("attention_mask", np.uint8, shape)])
        tokens, mask, lps, attn = arrays.numpy()
        tokens.fill(pad_id)
        mask.fill(0)
        lps.fill(0.0)
        attn.fill(0)
        for i, (t, m, lp) in enumerate(seqs):
            tokens[i, : len(t)], mask[i, : len(t)], lps[i, : len(t)], attn[i, : len(t)] = t, m, lp, 1
    elif mode == "pack":
        if token_budget is not None and token_budget < 1:
            raise ValueError(f"invalid token_budget: {token_budget} (a positive number of tokens, or None for no limit)")
        limit = math.inf if token_budget is None else token_budget
        take, overflow, used = [], [], 0
        for s, seq in zip(batch, seqs):
            if used + len(seq[0]) <= limit:
                take.append(seq)
                used += len(seq[0])
            else:
                overflow.append(s)
        arrays = _BatchArrays([("token_ids", np.int64, (1, used)), ("loss_mask", np.uint8, (1, used)), ("logprobs", np.float32, (1, used)),
                               ("position_ids", np.int64, (1, used)), ("cu_seqlens", np.int32, (len(take) + 1,))])
        tokens, mask, lps, positions, cu = arrays.numpy()
        cu[0] = 0
        at = 0
        for i, (t, m, lp) in enumerate(take):
            end = at + len(t)
            tokens[0, at:end], mask[0, at:end], lps[0, at:end] = t, m, lp
            positions[0, at:end] = np.arange(len(t))
            cu[i + 1] = at = end
        rest["overflow"] = overflow
    else:
        raise ValueError(f"unknown collate mode {mode!r} (pad or pack)")
    return arrays.batch(rest)


def _place(items) -> tuple:
    """Lay `(name, nbytes, dtype, shape)` items out in one buffer, each
    64-byte aligned: ([(name, offset, nbytes, dtype, shape)], total bytes)."""
    layout, size = [], 0
    for name, nbytes, dtype, shape in items:
        layout.append((name, size, nbytes, dtype, shape))
        size += -(-nbytes // 64) * 64
    return layout, size


class _BatchArrays:
    """A collated batch's arrays, laid out in one buffer (each array 64-byte
    aligned): a torch tensor under torch (in a DataLoader worker, a slot of
    the dataset's arena when one is free, see `_Arena`), else a numpy array."""

    def __init__(self, specs: list):
        self.layout, size = _place((name, math.prod(shape) * np.dtype(dt).itemsize, np.dtype(dt), shape) for name, dt, shape in specs)
        self.slot = None
        if _HAS_TORCH:
            self.slot = _Arena.claim(size) if _worker_info() is not None else None
            raw = self.slot.array if self.slot is not None else np.empty(size, dtype=np.uint8)
        else:
            raw = np.empty(size, dtype=np.uint8)
        self.raw = raw
        self._np = [raw[off : off + n].view(dt).reshape(shape) for _, off, n, dt, shape in self.layout]

    def numpy(self) -> list:
        """Writable numpy views of the arrays, in layout order."""
        return self._np

    def batch(self, rest: dict) -> dict:
        """The batch dict: the arrays (tensors under torch), then `rest`."""
        if not _HAS_TORCH:
            return {**{name: a for (name, *_), a in zip(self.layout, self._np)}, **rest}
        layout = [(name, off, n, _TORCH_DTYPE[dt], shape) for name, off, n, dt, shape in self.layout]
        out = _views(self.raw, layout, rest)
        if _worker_info() is None:
            return out
        batch = _WorkerDict(out)
        if self.slot is not None:
            batch.placed = (self.slot, layout, tuple(out[name] for name, *_ in layout))
        return batch


_TORCH_DTYPE = {}
_PACKED_DTYPES: frozenset = frozenset()
_NUMPY_OF_TORCH: dict = {}
if _HAS_TORCH:
    _TORCH_DTYPE = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32, np.dtype(np.uint8): torch.uint8, np.dtype(np.float32): torch.float32}
    _NUMPY_OF_TORCH = {t: n for n, t in _TORCH_DTYPE.items()}
    _NUMPY_OF_TORCH.update({torch.int16: np.int16, torch.int8: np.int8, torch.float64: np.float64, torch.float16: np.float16})
    _PACKED_DTYPES = frozenset(
        [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float64, torch.float32, torch.float16, torch.bfloat16]
    )


def _views(raw: np.ndarray, layout: list, rest: dict) -> dict:
    """The batch dict over one uint8 numpy buffer: a tensor viewing its part
    per array (numpy views then `from_numpy`: a third of the cost of torch's
    slice and views), then `rest`."""
    out = {}
    for name, off, n, dtype, shape in layout:
        np_dtype = _NUMPY_OF_TORCH.get(dtype)
        part = raw[off : off + n]
        out[name] = torch.from_numpy(part.view(np_dtype).reshape(shape)) if np_dtype else torch.from_numpy(part).view(dtype).view(shape)
    out.update(rest)
    return out


class _WorkerDict(dict):
    """A sample or batch made in a DataLoader worker. Pickled, to cross to
    the main process, as one buffer of its tensors plus its other values, and
    unpickled as a plain dict of views of that buffer.

    The buffer is an arena slot (`_Arena`) when one is free: a batch that
    `collate` built in a slot (`placed`) is sent as it is, anything else is
    copied into one when pickled (so a sample that a worker collates costs
    nothing extra). With no free slot, it is one shared-memory tensor
    (torch's way, one segment instead of one per tensor)."""

    __slots__ = ("placed",)

    def __init__(self, *args):
        super().__init__(*args)
        self.placed = None  # (slot, layout, the views as built) for a batch built in a slot

    def __copy__(self):  # torch's default_convert (batch_size=None) copies, then updates
        clone = _WorkerDict(self)
        clone.placed = self.placed
        return clone

    def __reduce__(self):
        if self.placed is not None:
            slot, layout, views = self.placed
            names = [name for name, *_ in layout]
            if not slot.sent[0] and all(self.get(n) is v for n, v in zip(names, views)):
                slot.sent[0] = True  # the main process frees it now
                rest = {k: v for k, v in self.items() if k not in names}
                return (_from_arena, slot.message(layout, rest))
        layout, size = _place((k, v.numel() * v.element_size(), v.dtype, tuple(v.shape)) for k, v in self.items() if _packable(v))
        rest = {k: v for k, v in self.items() if not _packable(v)}
        slot = _Arena.claim(size)
        dest = slot.array if slot is not None else np.empty(size, dtype=np.uint8)
        for name, off, n, _, _ in layout:
            if n:
                dest[off : off + n] = self[name].contiguous().view(-1).view(torch.uint8).numpy()
        if slot is not None:
            slot.sent[0] = True
            return (_from_arena, slot.message(layout, rest))
        buf = torch.from_numpy(dest).share_memory_()
        return (_from_shared, (buf, layout, rest))


def _packable(value) -> bool:
    """Whether a worker's value crosses inside the one buffer (a CPU tensor of a plain dtype)."""
    return isinstance(value, torch.Tensor) and value.dtype in _PACKED_DTYPES and value.device.type == "cpu"


def _from_shared(buf, layout: list, rest: dict) -> dict:
    """A batch a worker sent in shared memory (no arena slot was free)."""
    if _Arena.current is not None:
        _Arena.current.received(None)  # counts toward a sweep: the slots may be held by exited workers
    return _views(buf.numpy(), layout, rest)


def _from_arena(token: bytes, index: int, offset: int, capacity: int, size: int, layout: list, rest: dict) -> dict:
    """A batch a worker left in arena slot `index`, as views of the slot
    itself (this process maps each region once); the slot is freed when the
    last of them is gone."""
    arena = _Arena.current
    if arena is None or arena.token != token:
        raise RuntimeError("a batch from a DataLoader worker arrived in a process that does not share its dataset's arena")
    raw = np.frombuffer(arena.region(offset, capacity), dtype=np.uint8, count=size)
    arena.received(index)
    weakref.finalize(raw, arena.release, index, os.getpid())
    return _views(raw, layout, rest)


class _Slot:
    """A claimed arena slot, in the worker: `array` (a fresh view of its
    region, `size` bytes) is what the batch is built in. Freed by the worker
    when `array` is gone unless it was sent (`sent[0]`); then the main process
    frees it."""

    __slots__ = ("arena", "index", "offset", "capacity", "array", "sent")

    def __init__(self, arena: "_Arena", index: int, offset: int, capacity: int, size: int):
        self.arena, self.index, self.offset, self.capacity = arena, index, offset, capacity
        self.array = np.frombuffer(arena.region(offset, capacity), dtype=np.uint8, count=size)
        self.sent = [False]
        weakref.finalize(self.array, _Slot._unsent, arena, index, self.sent, os.getpid())

    @staticmethod
    def _unsent(arena: "_Arena", index: int, sent: list, pid: int) -> None:
        if not sent[0]:
            arena.release(index, pid)

    def message(self, layout: list, rest: dict) -> tuple:
        return (self.arena.token, self.index, self.offset, self.capacity, self.array.nbytes, layout, rest)


class _Arena:
    """Shared memory that hands batches from forked DataLoader workers to the
    main process without a copy or a fresh mapping.

    torch moves a tensor out of a worker through a fresh shared-memory segment
    whose file descriptor goes over a socket: on this project's 2-core VM that
    cost 2-5 ms a batch of 32 (new pages faulted in on both sides, a
    descriptor handed over per tensor), more than decoding the batch.
    Instead, `TrajectoryDataset()` creates (once per process) a memfd before
    the workers fork, so they inherit it. A worker claims a free slot (a
    page-aligned region that every process maps once, so its pages are faulted
    in once), collates into it and sends the slot's place; the main process
    hands out tensors that view the slot, and frees it when the last of them
    is gone (a finalizer on the view's base array). No descriptor crosses and
    nothing is copied or mapped per batch.

    The memfd's first page is the header: the end of the allocated regions
    (u64 at 0), then SLOTS (offset, capacity) pairs (u64, at 64), then SLOTS
    state bytes (0 free, 1 taken), then SLOTS claiming pids (u32). Workers
    claim under a POSIX record lock on the header (held per process, so
    forked workers exclude each other); the holder frees a slot by writing its
    state byte. The syscalls order the reads of a batch before the release. A
    slot that does not fit a batch gets a new region of the next power of two
    (the old region's pages stay with the memfd). When no slot is free (a
    trainer holding many batches) or the arena would pass ARENA_MAX bytes, the
    worker falls back to torch's shared memory: slower, never blocked. Batches
    that never reach the main process (an iterator dropped mid-epoch: torch
    discards what its workers had sent) leave their slots taken by a worker
    that has exited; every SWEEP_EVERY batches it receives, the main process
    frees such slots that it does not hold (the creating process only). Linux (memfd) and the fork start
    method only; elsewhere torch's way is used."""

    SLOTS = 64
    HEADER = 4096
    ARENA_MAX = 1 << 30
    SWEEP_EVERY = 32
    current: Optional["_Arena"] = None  # this process's arena (inherited by forked workers)

    def __init__(self):
        self.fd = os.memfd_create("trajlog-batches", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.HEADER)
        self.pid = os.getpid()
        self.token = os.urandom(8)
        self._states_at = 64 + 16 * self.SLOTS  # header: state bytes, then claiming pids
        self._pids_at = self._states_at + self.SLOTS
        self._maps: dict = {}  # offset -> this process's mmap of the region there
        self._maps_pid = self.pid
        # Reentrant: a finalizer (release) can run on this thread while it holds the lock.
        self._lock = threading.RLock()
        self._held: set = set()  # slots whose batches this process holds
        self._received = 0

    @classmethod
    def ensure(cls) -> None:
        """Create this process's arena if it has none (before workers fork)."""
        if cls.current is None and _HAS_TORCH and fcntl is not None and hasattr(os, "memfd_create") and sys.platform.startswith("linux"):
            try:
                cls.current = cls()
            except OSError:
                cls.current = None

    @classmethod
    def claim(cls, size: int) -> Optional[_Slot]:
        """A slot of at least `size` bytes, in a forked worker; None when not possible."""
        arena = cls.current
        if arena is None or arena.pid == os.getpid() or size > cls.ARENA_MAX // 4:
            return None
        try:
            return arena._claim(size)
        except OSError:
            return None

    def region(self, offset: int, capacity: int):
        """This process's mapping of the region at `offset` (regions never move or change size)."""
        with self._lock:
            if self._maps_pid != os.getpid():
                self._maps, self._maps_pid = {}, os.getpid()  # the parent's, inherited through fork
            region = self._maps.get(offset)
            if region is None:
                region = self._maps[offset] = mmap.mmap(self.fd, capacity, offset=offset)
            return region

    def _claim(self, size: int) -> Optional[_Slot]:
        with self._lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, self.HEADER, 0)
            try:
                head = os.pread(self.fd, self.HEADER, 0)
                if len(head) != self.HEADER:
                    return None
                table = np.frombuffer(head, dtype="<u8", count=2 * self.SLOTS, offset=64).reshape(self.SLOTS, 2).tolist()
                free = [i for i in range(self.SLOTS) if head[self._states_at + i] == 0]
                fitting = [i for i in free if table[i][1] >= max(size, 1)]
                if fitting:
                    index = min(fitting, key=lambda i: table[i][1])
                    offset, capacity = table[index]
                elif free:
                    # A new region: an unallocated slot, else the largest free one moves.
                    index = min(free, key=lambda i: (table[i][1] > 0, -table[i][1]))
                    capacity = max(1 << (max(size, 1) - 1).bit_length(), 1 << 16)
                    offset = int.from_bytes(head[0:8], "little") or self.HEADER
                    if offset + capacity > self.ARENA_MAX:
                        return None
                    if os.fstat(self.fd).st_size < offset + capacity:
                        os.ftruncate(self.fd, offset + capacity)
                    os.pwrite(self.fd, (offset + capacity).to_bytes(8, "little"), 0)
                    os.pwrite(self.fd, offset.to_bytes(8, "little") + capacity.to_bytes(8, "little"), 64 + 16 * index)
                else:
                    return None
                os.pwrite(self.fd, b"\x01", self._states_at + index)
                os.pwrite(self.fd, os.getpid().to_bytes(4, "little"), self._pids_at + 4 * index)
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, self.HEADER, 0)
        return _Slot(self, index, offset, capacity, size)

    def release(self, index: int, pid: int) -> None:
        """Free slot `index`: only in the process that held it (a forked child
        inherits finalizers of its parent's batches; they are not its to free)."""
        if pid == os.getpid():
            with self._lock:
                self._held.discard(index)
                try:
                    os.pwrite(self.fd, b"\x00", self._states_at + index)
                except OSError:
                    pass

    def received(self, index: Optional[int]) -> None:
        """The main process holds slot `index` now (None: a batch that came
        without a slot); now and then, sweep."""
        with self._lock:
            if index is not None:
                self._held.add(index)
            self._received += 1
            if self._received % self.SWEEP_EVERY == 0 and self.pid == os.getpid():  # the creator only: a forked child
                # does not know what its parent holds
                try:
                    self._sweep()
                except OSError:
                    pass

    def _sweep(self) -> None:
        """Free the slots taken by workers that have exited whose batches this
        process does not hold: torch never delivers a batch of a worker it has
        shut down. (Called with `_lock` held.)"""
        head = os.pread(self.fd, self.HEADER, 0)
        for i in range(self.SLOTS):
            if head[self._states_at + i] != 1 or i in self._held:
                continue
            pid = int.from_bytes(head[self._pids_at + 4 * i : self._pids_at + 4 * i + 4], "little")
            if pid == os.getpid() or _alive(pid):
                continue
            os.pwrite(self.fd, b"\x00", self._states_at + i)

    def taken(self) -> int:
        """Slots taken now (for tests and diagnostics)."""
        return sum(os.pread(self.fd, self.SLOTS, self._states_at))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
