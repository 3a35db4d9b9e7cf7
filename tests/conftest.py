import pytest


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """torch on one thread for the CPU tests: on a small shared CPU, OpenMP threads contending for the cores make
    the batched triangular solves of the gated delta rule (Flide's reference op and transformers' torch path alike)
    up to 1000x slower; the test models are tiny, so one thread loses nothing."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
