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
