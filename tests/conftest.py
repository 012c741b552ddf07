"""Fixtures shared by the io tests (test_io.py, test_io_fixed.py), and which modules the
``OFFLOAD_BACKEND=numba`` pass of ``make test`` leaves to the native pass."""
from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

import pytest

# OpenMP threads that finished their work sleep at once instead of spinning first (libgomp
# spins 300,000 times after each parallel region by default): with three pytest workers on
# two cores (and the ranks and interpreters the tests spawn, which inherit this) the spinning
# ate about half of the CPU, and the same modules ran in 46 s instead of 85 s. It changes no
# result, only how idle threads wait. Set before torch (imported by offload below) starts its
# OpenMP runtime; `make test` sets it too. See [Note: OpenMP spin] in offload/kernels/_threads.py.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from offload.io import probe_direct  # noqa: E402


@pytest.fixture
def workdir(tmp_path):
    """A directory that accepts O_DIRECT: tmp_path, else one under /var/tmp (tmp_path may be
    a tmpfs that refuses it on kernels before 6.6)."""
    ok, why = probe_direct(tmp_path)
    if ok:
        yield tmp_path
        return
    if os.path.isdir("/var/tmp") and probe_direct("/var/tmp")[0]:
        d = tempfile.mkdtemp(prefix="offload-test-io-", dir="/var/tmp")
        yield pathlib.Path(d)
        shutil.rmtree(d, ignore_errors=True)
        return
    pytest.skip(f"{tmp_path} refuses O_DIRECT ({why}) and so does /var/tmp; these tests exercise the direct path")


# These modules run no optimizer kernel (io engines, the planner and its CLI, the step log,
# swap files stepped with a compute they are given, the wheel, the code's shape, the README's
# commands), so the second pass of `make test` (OFFLOAD_BACKEND=numba, which exists to run the
# kernels' fallback through everything that steps) would only repeat them: they run once, in
# the native pass, and keep the two passes within the suite's time budget.
_NO_KERNEL = {
    "test_bench_io", "test_cli_numeric", "test_code_shape", "test_io", "test_io_fixed", "test_memory",
    "test_plan", "test_plan_slots", "test_readme", "test_report_cli", "test_report_robust",
    "test_swap_clean", "test_swap_pipeline", "test_swap_store", "test_wheel",
    "test_agreement", "test_swap_session", "test_state_fields", "test_step_context", "test_report_append",
    "test_kernel_bits", "test_uring_native", "test_swap_previous", "test_numba_cache",
    "test_numba_tiles_pool",  # the threads that run the numba kernel, driven with Python stand-ins
    "test_no_compiler", "test_native_cache",  # setup.py's build with stand-in compilers
}


# Modules that pick their backends by name (every backend, or the torch reference that a
# store's bits are checked against, or none at all): the numba pass would run them again
# unchanged, so they run in the native pass only.
_BACKENDS_BY_NAME = {
    "test_native_compressed", "test_compressed_backends", "test_compressed_flat", "test_bench_scripts",
    "test_shard_train", "test_shard_models", "test_plan_stage3", "test_compressed_plan", "test_quant_scheme",
    "test_rule_step_names", "test_shard_buckets", "test_shard_window", "test_shard_llama",
    "test_shard_bf16_accumulate", "test_q8_buckets", "test_numba_signals",
}
# Lifecycle, faults, ranks and streams of the stores (restarts after kill, forks, checkpoints
# across ranks, emulated CUDA streams, the native build): the kernel in them is incidental,
# and what the numba kernels give in every store is checked by the modules the numba pass
# keeps (test_optim, test_flat_state, test_swap_optim, test_rules_optim, test_compressed_*,
# test_state_dict_parity, ...). Keeps `make test` near its 10-minute budget.
_KERNEL_INCIDENTAL = {
    "test_swap_restart", "test_checkpoint_dir", "test_flat_swap_edges", "test_swap_lifecycle",
    "test_clients", "test_swap_resume", "test_cuda", "test_native_build", "test_swap_faults",
    "test_hf_integration", "test_adversarial", "test_cli_info", "test_hf_checkpoint",
    "test_compressed_checkpoint", "test_rules_ranks", "test_zero", "test_shard_checkpoint", "test_release_grads",
    "test_shard_nvme", "test_shard_meta", "test_shard_weights", "test_shard_one_rank", "test_shard_groups",
    "test_host_checkpoint_packed", "test_stateless_checkpoint", "test_manifest_checksum", "test_swap_manifest_seal", "test_hf_groups_seal",
    "test_shard_cuda",  # stage 3's emulated streams; each gloo rank would JIT the numba kernels again (~25 s)
    "test_state_dict_hooks", "test_exact_reencode",  # state_dict layouts and the load encoder (torch code)
    "test_hf_checkpoint_crash", "test_rules_resume", "test_params_written", "test_state_assign",
    "test_shard_misuse",  # torch's module calls on a sharded model: the guards, not the kernel
    "test_zero_params_agree", "test_scaler_ranks", "test_step_agreement",  # the ranks' params agreed on at construction, torch's ZeroRedundancyOptimizer
    "test_shard_checkpointing",  # the recompute's gathers and hooks (activation checkpointing)
    "test_master_in_state", "test_dcp_state_dict", "test_dcp_ranks", "test_dcp_stage3",  # the store's entries and DCP's dicts
    "test_deepspeed_ops", "test_deepspeed_calls", "test_torchao_compat",  # other libraries' calls mapped to our classes
    "test_shard_transformers",  # transformers' save and groups over a sharded model
    "test_disk_refusals",  # read-only and full file systems: the probes, the preflight, close()
    # kill -9 after a commit, a forked child's close, signals between unlinks and while the
    # command imports torch, a closed stdout pipe: the store's commits and the process's
    # handling, in subprocesses that would each compile the numba kernels again (~70 s of
    # the numba pass, forty-second session). The numba kernels under a signal are kept:
    # test_cli_adversarial (the demo's SIGTERM) and test_numba_signals.
    "test_commit_before_counts", "test_fork_keep_swap", "test_signals_around_removal", "test_cli_signals",
    "test_cli_pipe",
    "test_history_fuzz_tools",  # the fuzzers' own run: numba's seeds are run by hand (bench/RESULTS.md)
}
# ...and the numba kernels' own compressed tests, which pick numba by name: the numba pass only.
_NUMBA_BY_NAME = {"test_numba_compressed", "test_numba_zero_division", "test_numba_f32x8"}


def _numba_pass() -> bool:
    return os.environ.get("OFFLOAD_BACKEND", "").strip().lower() == "numba"


def _skipped_in_this_pass() -> set:
    return (_NO_KERNEL | _BACKENDS_BY_NAME | _KERNEL_INCIDENTAL) if _numba_pass() else _NUMBA_BY_NAME


def pytest_ignore_collect(collection_path, config):
    """The pass that would only skip a module (see the sets above) does not import it either,
    unless the module was named on the command line (where it then shows as skipped)."""
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    if collection_path.stem not in _skipped_in_this_pass():
        return None
    named = {pathlib.Path(a.split("::", 1)[0]).resolve() for a in config.args}
    return None if collection_path.resolve() in named else True


def pytest_collection_modifyitems(config, items):
    numba_pass = _numba_pass()
    skipped = _skipped_in_this_pass()
    if numba_pass:
        skip = pytest.mark.skip(reason="runs no kernel, or picks its backends by name: covered by the "
                                       "native pass of `make test`")
    else:
        skip = pytest.mark.skip(reason="tests the numba kernels by name: covered by the numba pass of "
                                       "`make test`")
    for item in items:
        if pathlib.Path(str(item.fspath)).stem in skipped:
            item.add_marker(skip)
        elif numba_pass and item.get_closest_marker("backends_by_name") is not None:
            # one test of a module the numba pass keeps (_BACKENDS_BY_NAME, for a single test)
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    """Every test starts with Python's own Ctrl-C handler. The Ctrl-C tests (the pager's,
    the uring engine's close) raise SIGINT and expect a KeyboardInterrupt; under xdist on a
    busy machine two of them once saw none (twenty-ninth session, not reproduced in one
    process), as if an earlier test in the same worker had left another handler. A test
    that leaves one is reported here instead of failing a later one."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    if before is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pytest.fail(f"the test left SIGINT's handler as {after!r}", pytrace=False)
