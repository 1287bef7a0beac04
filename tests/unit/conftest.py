"""Fixtures of the unit tests that several files share."""

from __future__ import annotations

import json

import pytest

from tests.unit.large_models import MODELS


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A folder per public model holding only its config.json."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, hf in MODELS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(hf))
        out[name] = root / name
    return out
