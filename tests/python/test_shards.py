"""The Parquet shards are read by pyarrow, DuckDB and Hugging Face datasets,
and the tokens they hold equal what went in through `trajlog ingest`."""

import json

import numpy as np
import pyarrow.dataset as ds


def f32_bits(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32).tolist()


def check_step(row, want):
    assert list(row["prompt_ids"]) == want["prompt_token_ids"]
    assert list(row["completion_ids"]) == want["completion_token_ids"]
    assert f32_bits(row["logprobs"]) == f32_bits(want["logprobs"])
    assert row["session_id"] == want["session_id"]


def check_trajectory(row, traces):
    tokens = list(row["token_ids"])
    mask = list(row["loss_mask"])
    lps = np.asarray(row["logprobs"], dtype=np.float32)
    assert len(mask) == len(tokens) == len(lps)
    for i, trace_id in enumerate(row["trace_ids"]):
        want = traces[trace_id]
        start, n = row["call_starts"][i], row["completion_lens"][i]
        assert tokens[:start] == want["prompt_token_ids"], trace_id
        assert tokens[start : start + n] == want["completion_token_ids"], trace_id
        assert f32_bits(lps[start : start + n]) == f32_bits(want["logprobs"])
        assert all(m == 1 for m in mask[start : start + n])
    return len(row["trace_ids"])


def test_pyarrow_reads_steps_and_trajectories_exactly(compacted_store):
    store, traces = compacted_store
    steps = ds.dataset(str(store / "shards" / "steps")).to_table().to_pylist()
    assert len(steps) == len(traces)
    for row in steps:
        check_step(row, traces[row["trace_id"]])
    trajs = ds.dataset(str(store / "shards" / "trajectories")).to_table().to_pylist()
    covered = sum(check_trajectory(r, traces) for r in trajs)
    assert covered == len(traces)
    # Sessions with a break are split into two rows.
    breaks = sum(1 for r in steps if r["tito_break"])
    assert breaks == 3
    assert len(trajs) == 12 + breaks
    import pyarrow.parquet as pq

    for table in ("steps", "trajectories"):
        for f in (store / "shards" / table).glob("*.parquet"):
            meta = pq.ParquetFile(f).metadata
            assert meta.metadata[b"trajlog.shard_format_version"] == b"4"
            assert meta.metadata[b"trajlog.table"] == table.encode()
            assert meta.row_group(0).column(0).compression == "ZSTD"


def test_duckdb_queries_the_shards(compacted_store):
    import duckdb

    store, traces = compacted_store
    steps_glob = str(store / "shards" / "steps" / "*.parquet")
    rows = duckdb.sql(f"SELECT trace_id, prompt_ids, completion_ids, logprobs, session_id FROM '{steps_glob}'").fetchall()
    assert len(rows) == len(traces)
    for trace_id, prompt, completion, logprobs, session_id in rows:
        check_step(
            {"prompt_ids": prompt, "completion_ids": completion, "logprobs": logprobs, "session_id": session_id},
            traces[trace_id],
        )
    traj_glob = str(store / "shards" / "trajectories" / "*.parquet")
    query = (
        f"SELECT group_id, count(*) AS rows, sum(num_calls) AS calls, "
        f"sum(list_sum(loss_mask)) AS trained_tokens FROM '{traj_glob}' GROUP BY group_id ORDER BY group_id"
    )
    groups = duckdb.sql(query).fetchall()
    print(query)
    print(groups)
    assert [g[0] for g in groups] == ["task-0", "task-1", "task-2"]
    assert sum(g[2] for g in groups) == len(traces)
    completion_tokens = sum(len(t["completion_token_ids"]) for t in traces.values())
    assert sum(g[3] for g in groups) == completion_tokens


def test_hf_datasets_loads_the_shards(compacted_store, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    from datasets import load_dataset

    store, traces = compacted_store
    steps = load_dataset(
        "parquet", data_files=str(store / "shards" / "steps" / "*.parquet"), split="train", cache_dir=str(tmp_path / "c")
    )
    assert steps.num_rows == len(traces)
    for row in steps:
        check_step(row, traces[row["trace_id"]])
    trajs = load_dataset(
        "parquet",
        data_files=str(store / "shards" / "trajectories" / "*.parquet"),
        split="train",
        cache_dir=str(tmp_path / "c"),
    )
    assert sum(check_trajectory(r, traces) for r in trajs) == len(traces)


def test_duckdb_queries_the_raw_bodies_as_json(compacted_store):
    """Shard format 3: `raw_request` and `raw_response` are plain JSON text
    columns, out of `extra` (format-spec/shard.md §2.1)."""
    import duckdb

    store, traces = compacted_store
    steps_glob = str(store / "shards" / "steps" / "*.parquet")
    rows = duckdb.sql(
        f"SELECT trace_id, raw_request, raw_response, extra, "
        f"json_extract(raw_response, '$.usage.completion_tokens')::INTEGER FROM '{steps_glob}'"
    ).fetchall()
    assert len(rows) == len(traces)
    for trace_id, raw_request, raw_response, extra, completion_tokens in rows:
        want = traces[trace_id]
        assert json.loads(raw_request) == want["raw_request"]
        if want["raw_response"] is None:
            # A JSON null stays in `extra`; the column is SQL NULL.
            assert raw_response is None and completion_tokens is None
            assert json.loads(extra)["raw_response"] is None
        else:
            assert json.loads(raw_response) == want["raw_response"]
            assert completion_tokens == len(want["completion_token_ids"])
        assert "raw_request" not in json.loads(extra)
        assert "\x00key_order" not in json.loads(extra)
