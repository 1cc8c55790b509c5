import pytest
import torch

from . import DEVICE


def pytest_collection_modifyitems(items):
    for item in items:
        if "/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if DEVICE == "cuda" and not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs CUDA"))
