"""Dropping a file from the page cache and telling how much of it is cached, on real files: the
benchmark's cold start from disk depends on both."""
import mmap
import os

from pipeline.measure import pagecache
from pipeline.measure.cold import MAX_RESIDENT_FOR_DISK, FreshRun, measure_from_disk


def _written(path, mb=4):
    path.write_bytes(os.urandom(mb * 2**20))
    return path


def test_evict_drops_a_read_file_and_a_read_brings_it_back(tmp_path):
    assert pagecache.supported() is None
    f = _written(tmp_path / "weights.bin")
    f.read_bytes()
    assert pagecache.resident_share([f]) > 0.95
    assert pagecache.evict([f]) <= MAX_RESIDENT_FOR_DISK        # written pages are flushed first, then dropped
    assert pagecache.resident_share([f]) <= MAX_RESIDENT_FOR_DISK
    f.read_bytes()
    assert pagecache.resident_share([f]) > 0.95


def test_empty_file_has_no_resident_bytes(tmp_path):
    f = tmp_path / "empty"
    f.write_bytes(b"")
    assert pagecache.resident_bytes(f) == 0


def test_disk_run_starts_with_the_bytes_dropped_and_reads_them_from_disk(tmp_path):
    files = [_written(tmp_path / "a.bin"), _written(tmp_path / "b.bin", 2)]
    for f in files:
        f.read_bytes()
    seen = {}

    def start():
        seen["resident"] = pagecache.resident_share(files)    # what the fresh process would find cached
        for f in files:
            f.read_bytes()                                     # ...which then reads them
        return FreshRun({"read": 0.01, "deserialize": 0.02, "to_device": 0.0, "total": 0.5}, None)

    disk = measure_from_disk(files, start)
    assert seen["resident"] <= MAX_RESIDENT_FOR_DISK
    assert disk.reason is None and disk.raw_read_s > 0 and disk.artifact_bytes == 6 * 2**20
    d = disk.as_dict()
    assert d["measured"] and d["load_ms"] == 30.0 and d["total_ms"] == 500.0
    assert d["load_floor_ratio"] == round(0.03 / disk.raw_read_s, 2)


def test_bytes_that_stay_cached_are_reported_not_timed(tmp_path):
    f = _written(tmp_path / "held.bin")
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as held:
        sum(held[i] for i in range(0, len(held), mmap.PAGESIZE))   # mapped and touched: not droppable
        disk = measure_from_disk([f], lambda: (_ for _ in ()).throw(AssertionError("must not start")))
    assert disk.reason and "stayed in memory" in disk.reason
    assert disk.as_dict() == {"measured": False, "reason": disk.reason, "resident_after_drop": disk.resident_share}


def test_the_disk_read_of_a_big_artifact_times_a_sample_and_scales_it(tmp_path):
    """Issue 30: the disk's read rate from DISK_READ_SAMPLE_BYTES of the artifact, the rest priced at
    it (a 3.4 GB variant's whole read took 7.6 s); a smaller artifact is read whole."""
    from pipeline.measure.cold import disk_read_seconds
    files = [_written(tmp_path / "a.bin", 1), _written(tmp_path / "b.bin", 3)]
    pagecache.evict(files)
    seconds, read = disk_read_seconds(files, sample_bytes=2 * 2**20, chunk=2**20)
    assert read == 2 * 2**20 and seconds > 0
    seconds, read = disk_read_seconds(files, sample_bytes=64 * 2**20)
    assert read == 4 * 2**20


def test_a_sampled_disk_read_says_how_many_bytes_it_timed(tmp_path, monkeypatch):
    from pipeline.measure import cold
    files = [_written(tmp_path / "big.bin", 4)]
    monkeypatch.setattr(cold, "DISK_READ_SAMPLE_BYTES", 2**20)
    disk = measure_from_disk(files, lambda: FreshRun({"read": 0.01, "total": 0.5}, None))
    d = disk.as_dict()
    assert d["raw_read_sampled_bytes"] == 2**20 and d["raw_read_mb_s"] > 0
    monkeypatch.setattr(cold, "DISK_READ_SAMPLE_BYTES", 64 * 2**20)
    assert measure_from_disk(files, lambda: FreshRun({"total": 0.5}, None)).as_dict()["raw_read_sampled_bytes"] is None
