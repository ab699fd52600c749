import os
import pathlib

import pytest

DATA = pathlib.Path(__file__).parent / "data"
ORACLES = ["tiny_dense", "tiny_dsa"]


@pytest.fixture(scope="session")
def data_dir():
    return DATA


def oracle_dir(name):
    return DATA / name
