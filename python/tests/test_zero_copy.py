"""The arrays handed out lie inside the mapped segment files, own no data,
are read-only, and stay valid after the store is closed."""

import gc

import numpy as np

import trajlog


def mapped_regions(path_part):
    regions = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and path_part in parts[5]:
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                regions.append((lo, hi, parts[5]))
    return regions


def inside(arr, regions):
    addr = arr.__array_interface__["data"][0]
    end = addr + arr.nbytes
    return any(lo <= addr and end <= hi and path.endswith(".tlog") for lo, hi, path in regions)


def test_arrays_view_the_mapped_segment_and_outlive_the_store(tmp_path):
    store = trajlog.Store(tmp_path / "s")
    prompt = np.arange(1000, dtype=np.uint32)
    store.append(trace_id="t0", session_id="s", prompt_token_ids=prompt, completion_token_ids=np.arange(50, dtype=np.uint32), logprobs=np.full(50, -0.5, dtype=np.float32))
    store.append(trace_id="t1", session_id="s", prompt_token_ids=np.concatenate([prompt, np.arange(50, dtype=np.uint32), [7, 7]]), completion_token_ids=[1, 2, 3], logprobs=[-1.0, -2.0, -3.0])
    store.flush()
    first, second = store.get("t0"), store.get("t1")
    regions = mapped_regions(str(tmp_path / "s"))
    assert regions, "the segment is mapped"
    views = [first.completion_token_ids, first.logprobs, first.prompt_token_ids, second.completion_token_ids, second.prompt_suffix]
    for a in views:
        assert inside(a, regions), "array memory lies inside the mapped segment file"
        assert a.flags.owndata is False
        assert a.flags.writeable is False
    assert first.prompt_is_view and not second.prompt_is_view
    assert second.prompt_suffix.tolist() == [7, 7]
    assert second.prompt_token_ids.tolist() == prompt.tolist() + list(range(50)) + [7, 7]
    store.close()
    del store, first, second
    gc.collect()
    # Still valid, still the same bytes, after the store is closed.
    assert views[0].tolist() == list(range(50))
    assert views[1].tolist() == [-0.5] * 50
    assert views[3].tolist() == [1, 2, 3]


def buffer_inside(buf, regions):
    return any(lo <= buf.address and buf.address + buf.size <= hi and path.endswith(".tlog") for lo, hi, path in regions)


def test_session_arrow_buffers_point_into_the_mapping(tmp_path):
    import pyarrow as pa

    store = trajlog.Store(tmp_path / "s")
    prompt = np.arange(300, dtype=np.uint32)
    comp0 = np.arange(40, dtype=np.uint32) + 7
    lp0 = np.linspace(-3, 0, 40, dtype=np.float32)
    store.append(trace_id="a", session_id="s", prompt_token_ids=prompt, completion_token_ids=comp0, logprobs=lp0, model="m", weight_version=3)
    prompt1 = np.concatenate([prompt, comp0, [5, 6]]).astype(np.uint32)
    store.append(trace_id="b", session_id="s", prompt_token_ids=prompt1, completion_token_ids=[9, 8], logprobs=None)
    store.flush()
    table = store.session_arrow("s")
    assert isinstance(table, pa.Table)
    assert table.num_rows == 2
    assert table.column("trace_id").to_pylist() == ["a", "b"]
    assert table.schema.field("completion_token_ids").type == pa.list_(pa.field("item", pa.uint32(), nullable=False))
    assert table.column("model").to_pylist() == ["m", None]
    assert table.column("weight_version").to_pylist() == [3, None]
    assert table.column("relation").to_pylist() == ["root", "extends"]
    assert table.column("prompt_prefix_len").to_pylist() == [0, 340]
    # Bit-exact values.
    assert table.column("prompt_token_ids").to_pylist() == [prompt.tolist(), prompt1.tolist()]
    assert table.column("completion_token_ids").to_pylist() == [comp0.tolist(), [9, 8]]
    lp = table.column("logprobs")
    assert lp.to_pylist()[1] is None
    got = np.asarray(lp.chunk(0).values.to_numpy(zero_copy_only=True))
    assert got.view(np.uint32).tolist() == lp0.view(np.uint32).tolist()

    regions = mapped_regions(str(tmp_path / "s"))
    completion = table.column("completion_token_ids")
    views = [
        completion.chunk(0).values.buffers()[1],
        completion.chunk(1).values.buffers()[1],
        lp.chunk(0).values.buffers()[1],
        table.column("prompt_token_ids").chunk(0).values.buffers()[1],
    ]
    for buf in views:
        assert buffer_inside(buf, regions), "Arrow buffer lies inside the mapped segment file"
    # The delta prompt of "b" is materialized, not a view.
    assert not buffer_inside(table.column("prompt_token_ids").chunk(1).values.buffers()[1], regions)

    store.close()
    del store
    gc.collect()
    assert table.column("completion_token_ids").to_pylist() == [comp0.tolist(), [9, 8]]
    assert table.combine_chunks().column("prompt_token_ids").to_pylist()[1] == prompt1.tolist()


def test_session_arrow_of_an_unknown_session_is_empty_with_the_schema(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        table = store.session_arrow("nobody")
        assert table.num_rows == 0
        assert "completion_token_ids" in table.schema.names


def test_session_arrow_reads_compacted_calls(tmp_path):
    with trajlog.Store(tmp_path / "s") as store:
        for i in range(3):
            store.append(trace_id=f"t{i}", session_id="s", prompt_token_ids=list(range(10 * (i + 1))), completion_token_ids=[i, i + 1], logprobs=[-0.25, -0.5])
        store.seal("s")
        store.flush()
        store.compact()
        table = store.session_arrow("s")
        assert table.column("completion_token_ids").to_pylist() == [[0, 1], [1, 2], [2, 3]]
        assert table.column("prompt_token_ids").to_pylist()[2] == list(range(30))
        assert table.column("logprobs").to_pylist() == [[-0.25, -0.5]] * 3
