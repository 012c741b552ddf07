"""numba's kernel cache is dropped when a source of offload/kernels changed
(offload/kernels/_numba_cache.py): numba itself checks only the file defining a kernel."""
import os
import types

from offload.kernels import _numba_cache


def _dispatcher(path):
    return types.SimpleNamespace(_cache=types.SimpleNamespace(_cache_path=str(path)))


def _touch(d, *names):
    for n in names:
        (d / n).write_bytes(b"x")


def test_stale_kernels_are_removed_once_and_others_kept(tmp_path):
    ours = ["numba_backend._adam_f32-68.py311.nbi", "numba_backend._adam_f32-68.py311.1.nbc",
            "numba_rules.sgd_serial-116.py311.nbi", "numba_compressed.run_serial-306.py311.7.nbc"]
    foreign = ["elsewhere.kernel-3.py311.nbi", "numba_rules.notes.txt"]
    _touch(tmp_path, *ours, *foreign)
    _numba_cache.drop_stale(_dispatcher(tmp_path))  # no stamp yet: the sources are unknown
    assert sorted(os.listdir(tmp_path)) == sorted(foreign + [_numba_cache._STAMP])
    stamp = (tmp_path / _numba_cache._STAMP).read_text().strip()
    assert stamp == _numba_cache._digest(os.path.dirname(_numba_cache.__file__))

    _touch(tmp_path, *ours)  # compiled from these sources: kept
    _numba_cache.drop_stale(_dispatcher(tmp_path))
    assert set(ours) <= set(os.listdir(tmp_path))

    (tmp_path / _numba_cache._STAMP).write_text("0" * 64 + "\n")  # the sources changed since
    _numba_cache.drop_stale(_dispatcher(tmp_path))
    assert not set(ours) & set(os.listdir(tmp_path))
    assert (tmp_path / _numba_cache._STAMP).read_text().strip() == stamp


def test_no_cache_directory_is_left_alone(tmp_path):
    _numba_cache.drop_stale(_dispatcher(tmp_path / "missing"))
    _numba_cache.drop_stale(types.SimpleNamespace())  # a dispatcher without a cache
    assert not (tmp_path / "missing").exists()


def test_the_package_checks_before_its_kernels_load():
    from offload.kernels import _numba_bits
    cache_dir = _numba_bits.lowp_bits._cache._cache_path
    stamp = os.path.join(cache_dir, _numba_cache._STAMP)
    if os.path.isfile(stamp):  # numba caches in a writable directory only
        with open(stamp) as f:
            assert f.read().strip() == _numba_cache._digest(os.path.dirname(_numba_cache.__file__))
