"""Recovery modes from Python: a damaged record in the middle of the active
segment refuses the default open, `recovery="skip-corrupted"` opens it and
says what it skipped, and a bad mode is an InvalidInputError."""

import glob
import os

import numpy as np
import pytest

import trajlog


def write_store(path, n=6):
    with trajlog.Store(path) as store:
        for i in range(n):
            rng = np.random.default_rng(i)
            store.append(
                trace_id=f"t{i}",
                session_id=f"s{i}",
                prompt_token_ids=rng.integers(1, 50_000, 500, dtype=np.uint32),
                completion_token_ids=rng.integers(1, 50_000, 2000, dtype=np.uint32),
                durable=True,
            )


def flip_in_the_middle(path):
    (seg,) = glob.glob(os.path.join(path, "seg-*.tlog"))
    data = bytearray(open(seg, "rb").read())
    end = len(data.rstrip(b"\0"))
    data[end // 2] ^= 0x10
    open(seg, "wb").write(bytes(data))
    return seg


def test_default_refuses_damage_and_skip_corrupted_keeps_the_rest(tmp_path):
    path = str(tmp_path / "store")
    write_store(path)
    seg = flip_in_the_middle(path)
    before = open(seg, "rb").read()

    for read_only in (False, True):
        with pytest.raises(trajlog.CorruptError, match="skip-corrupted"):
            trajlog.Store(path, read_only=read_only)
    assert open(seg, "rb").read() == before, "a refused open changes nothing"

    store = trajlog.Store(path, read_only=True, recovery="skip-corrupted")
    report = store.recovery_report()
    assert len(report) == 1 and "skipped" in report[0], report
    kept = [f"t{i}" for i in range(6) if store.get(f"t{i}") is not None]
    assert len(kept) == 5, kept
    store.close()

    with pytest.raises(trajlog.CorruptError):
        trajlog.Store(path, recovery="absolute", read_only=True)


def test_an_intact_store_reports_nothing_and_a_bad_mode_is_refused(tmp_path):
    path = str(tmp_path / "store")
    write_store(path, n=2)
    with trajlog.Store(path, recovery="absolute") as store:
        assert store.recovery_report() == []
        assert store.get("t1") is not None
    with pytest.raises(trajlog.InvalidInputError, match="tolerate-torn-tail"):
        trajlog.Store(path, recovery="lenient")
    with pytest.raises(trajlog.InvalidInputError, match="recovery"):
        trajlog.Store(path, recovery=3)
