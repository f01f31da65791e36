"""A trainer dataloader over trajlog's `trajectories` Parquet shards.

    from trajlog.data import TrajectoryDataset, collate
    ds = TrajectoryDataset("/data/traces/shards/trajectories", rank=rank, world_size=world, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=4,
                                         collate_fn=lambda b: collate(b, mode="pad"))
    for epoch in range(E):
        ds.set_epoch(epoch)
        for batch in loader: ...

Each sample is a dict of numpy arrays (torch tensors when torch is installed:
`torch.from_numpy`, no copy): `token_ids` (uint32 → int64 tensors for
embedding lookups are left to the trainer), `loss_mask` (uint8), `logprobs`
(float32), `call_starts`, `completion_lens`, plus the scalar columns
(`session_id`, `group_id`, `segment_index`, `num_calls`, `reward`, …).

Policies:
- Order: deterministic for (seed, epoch). With `shuffle`, row groups are
  permuted and rows are permuted within each row group (a block shuffle: reads
  stay row-group local); without, file order.
- Ranks: every rank gets the same number of samples, ceil(N / world_size). The
  order is padded by wrapping around to its start (like
  `torch.utils.data.DistributedSampler(drop_last=False)`), so up to
  world_size - 1 samples appear twice per epoch; rank r takes the r-th
  contiguous slice.
- DataLoader workers: worker w of W takes every W-th sample of its rank's
  slice, so workers never overlap and, with `batch_size=None`, the loader yields
  the rank's order exactly.
- Resume: `state_dict()` records the epoch and how many samples of the rank's
  order were consumed; `load_state_dict()` makes the next iteration yield
  exactly the remaining ones.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Iterator, Optional, Sequence

import numpy as np
import pyarrow.parquet as pq

try:  # torch is optional
    import torch
    from torch.utils.data import IterableDataset as _Base

    _HAS_TORCH = True
except ImportError:  # pragma: no cover - exercised when torch is absent
    torch = None
    _Base = object
    _HAS_TORCH = False

_LIST_COLUMNS = ("token_ids", "loss_mask", "logprobs", "call_starts", "completion_lens")


def _tensor(arr: np.ndarray):
    """A tensor sharing `arr`'s memory (Arrow's read-only buffer). torch warns
    that it cannot mark tensors read-only; the buffer must not be written
    (the collate functions only read from it)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


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
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"invalid rank/world_size: rank {rank} of {world_size}")
        self.files = sorted(
            f for f in glob.glob(os.path.join(str(shards_dir), "*.parquet")) if not os.path.basename(f).startswith(("_", "."))
        )
        if not self.files:
            raise FileNotFoundError(f"no trajectory shards (*.parquet) in {shards_dir}")
        self.rank, self.world_size, self.seed, self.shuffle = rank, world_size, seed, shuffle
        self.columns = list(columns) if columns is not None else None
        # (file index, row group, rows) of every row group: metadata only.
        self._groups = []
        for i, f in enumerate(self.files):
            meta = pq.ParquetFile(f).metadata
            for g in range(meta.num_row_groups):
                self._groups.append((i, g, meta.row_group(g).num_rows))
        self.total = sum(n for _, _, n in self._groups)
        self.epoch = 0
        self._consumed = 0

    # -- order --------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._consumed = 0

    def _global_order(self) -> np.ndarray:
        """(group index, row) pairs of the epoch, as an (N, 2) array."""
        rng = np.random.default_rng([self.seed, self.epoch])
        groups = rng.permutation(len(self._groups)) if self.shuffle else np.arange(len(self._groups))
        parts = []
        for g in groups:
            n = self._groups[g][2]
            rows = rng.permutation(n) if self.shuffle else np.arange(n)
            parts.append(np.stack([np.full(n, g), rows], axis=1))
        return np.concatenate(parts) if parts else np.empty((0, 2), dtype=np.int64)

    def _rank_order(self) -> np.ndarray:
        order = self._global_order()
        per_rank = -(-len(order) // self.world_size)
        padded = per_rank * self.world_size
        if padded > len(order) and len(order):
            order = np.concatenate([order, order[: padded - len(order)]])
        return order[self.rank * per_rank : (self.rank + 1) * per_rank]

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all workers together)."""
        return -(-self.total // self.world_size)

    # -- resume -------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "consumed": self._consumed, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("world_size", self.world_size) != self.world_size or state.get("seed", self.seed) != self.seed:
            raise ValueError("state_dict was saved with another seed or world size")
        self.epoch = int(state["epoch"])
        self._consumed = int(state["consumed"])

    # -- iteration ----------------------------------------------------------
    def _read_group(self, g: int):
        file_idx, group, _ = self._groups[g]
        return pq.ParquetFile(self.files[file_idx]).read_row_group(group, columns=self.columns)

    def _sample(self, table, row: int) -> dict:
        out: dict[str, Any] = {}
        for name in table.column_names:
            col = table.column(name)
            if name in _LIST_COLUMNS or name == "trace_ids":
                chunk = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()
                item = chunk[row].values
                if name == "trace_ids":
                    out[name] = item.to_pylist()
                else:
                    arr = item.to_numpy(zero_copy_only=True)
                    out[name] = _tensor(arr) if _HAS_TORCH and arr.dtype != np.uint32 else arr
            else:
                out[name] = col[row].as_py()
        if _HAS_TORCH and "token_ids" in out and isinstance(out["token_ids"], np.ndarray):
            # torch has no uint32 tensors for indexing: widen once here.
            out["token_ids"] = torch.from_numpy(out["token_ids"].astype(np.int64))
        return out

    def __iter__(self) -> Iterator[dict]:
        worker, workers = 0, 1
        if _HAS_TORCH:
            info = torch.utils.data.get_worker_info()
            if info is not None:
                worker, workers = info.id, info.num_workers
        return self._iter_worker(worker, workers)

    def _iter_worker(self, worker: int, workers: int) -> Iterator[dict]:
        """The samples DataLoader worker `worker` of `workers` yields."""
        order = self._rank_order()[self._consumed :]
        cached_group, table = None, None
        for g, row in order[worker::workers]:
            if g != cached_group:
                cached_group, table = g, self._read_group(int(g))
            self._consumed += 1  # meaningful in the process that iterates (workers == 1)
            yield self._sample(table, int(row))


def collate(batch: list, *, mode: str = "pad", pad_id: int = 0, token_budget: Optional[int] = None) -> dict:
    """Batch samples for training.

    - `mode="pad"`: right-pads `token_ids` (with `pad_id`), `loss_mask` (0) and
      `logprobs` (0.0) to the longest sample; adds `attention_mask`.
    - `mode="pack"`: concatenates samples into one row of at most
      `token_budget` tokens (samples that do not fit are left out and returned
      under `"overflow"`), with `position_ids` restarting at each sample and
      `cu_seqlens` (cumulative sample lengths) for variable-length attention.
    Returns torch tensors when torch is installed, else numpy arrays.
    """

    def np_of(x):
        return x.numpy() if _HAS_TORCH and isinstance(x, torch.Tensor) else np.asarray(x)

    seqs = [(np_of(s["token_ids"]).astype(np.int64), np_of(s["loss_mask"]), np_of(s["logprobs"])) for s in batch]
    out: dict[str, Any] = {}
    if mode == "pad":
        width = max((len(t) for t, _, _ in seqs), default=0)
        n = len(seqs)
        tokens = np.full((n, width), pad_id, dtype=np.int64)
        mask = np.zeros((n, width), dtype=np.uint8)
        lps = np.zeros((n, width), dtype=np.float32)
        attn = np.zeros((n, width), dtype=np.uint8)
        for i, (t, m, lp) in enumerate(seqs):
            tokens[i, : len(t)], mask[i, : len(t)], lps[i, : len(t)], attn[i, : len(t)] = t, m, lp, 1
        out.update(token_ids=tokens, loss_mask=mask, logprobs=lps, attention_mask=attn)
    elif mode == "pack":
        if not token_budget or token_budget < 1:
            raise ValueError("pack mode needs a positive token_budget")
        take, overflow, used = [], [], 0
        for s, seq in zip(batch, seqs):
            if used + len(seq[0]) <= token_budget:
                take.append(seq)
                used += len(seq[0])
            else:
                overflow.append(s)
        cat = lambda i, dt: np.concatenate([q[i] for q in take]).astype(dt) if take else np.empty(0, dt)  # noqa: E731
        out.update(
            token_ids=cat(0, np.int64)[None, :],
            loss_mask=cat(1, np.uint8)[None, :],
            logprobs=cat(2, np.float32)[None, :],
            position_ids=np.concatenate([np.arange(len(q[0])) for q in take])[None, :] if take else np.empty((1, 0), np.int64),
            cu_seqlens=np.concatenate([[0], np.cumsum([len(q[0]) for q in take])]).astype(np.int32),
        )
        out["overflow"] = overflow
    else:
        raise ValueError(f"unknown collate mode {mode!r} (pad or pack)")
    if _HAS_TORCH:
        out = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v) for k, v in out.items()}
    return out
