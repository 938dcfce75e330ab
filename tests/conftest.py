import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "2")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (and TE where noted); skipped otherwise")
    config.addinivalue_line("markers", "distributed: spawns gloo ranks")
    config.addinivalue_line("markers", "slow: an end-to-end run of more than a few seconds (every distributed test is "
                                       "slow too: `pytest -m 'not slow'` is the quick tier)")


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
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
