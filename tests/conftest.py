import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")

STACK = (
    "tests/unit/test_compat.py",
    "tests/unit/test_mcore_internals.py",
    "tests/distributed/test_schedules_parallel.py",
    "tests/distributed/test_flux_tp.py",
    "tests/distributed/test_sd3_tp.py",
    "tests/distributed/test_checkpoint_tp.py",
    "tests/distributed/test_context_parallel.py",
    "tests/distributed/test_context_parallel_schedules.py",
    "tests/distributed/test_pipeline_parallel.py",
    "tests/distributed/test_pipeline_transfers.py",
    "tests/unit/test_convert_cli.py",
    "tests/unit/test_wan_convert.py",
    "tests/unit/test_sd3_model.py::test_round_trip_through_the_cli_is_bit_exact",
)
"""The tests marked ``stack``: what ``.ci/run`` also runs on the current stack (Python 3.12, torch 2.14,
megatron-core 0.19): the compatibility checks, the distributed equivalence tests (the schedules at world size 2,
TP, CP, PP through megatron's pipeline scheduler, checkpoint resharding) and the conversion round trips. Whole
files, or one test by its node id."""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (and TE where noted); skipped otherwise")
    config.addinivalue_line("markers", "distributed: spawns gloo ranks")
    config.addinivalue_line("markers", "slow: an end-to-end run of more than a few seconds (every distributed test is "
                                       "slow too: `pytest -m 'not slow'` is the quick tier)")
    config.addinivalue_line("markers", "stack: also run on the current stack by .ci/run (tests/conftest.py STACK)")
    # The dependencies' noise the package filters at import (leangrpo_mcore.compat.NOISE), as pytest filters too:
    # pytest resets the warning filters around every test and every collection.
    from leangrpo_mcore.compat import NOISE

    for noise in NOISE:
        if noise.category is not None:
            config.addinivalue_line("filterwarnings",
                                    f"ignore:{noise.message}:{noise.category.__name__}:{noise.module}\\Z")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.nodeid.split("[")[0] in STACK or item.nodeid.split("::")[0] in STACK:
            item.add_marker(pytest.mark.stack)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip)
        if "distributed" in item.keywords:
            item.add_marker(pytest.mark.slow)
            # Under pytest-xdist (`-n 2`, README) the multi-rank tests run one after another on one worker while the
            # other worker takes the single-process tests: two of them at once would oversubscribe the cores.
            item.add_marker(pytest.mark.xdist_group("distributed"))


@pytest.fixture
def one_thread():
    """One intra-op thread: the tiny models gain nothing from more, and the distributed tests' reference numbers are
    single-threaded (gloo ranks run one thread)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
