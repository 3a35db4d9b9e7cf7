import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Every test under tests/gpu needs CUDA: marked `gpu`, skipped (with the reason) on a machine without one."""
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
