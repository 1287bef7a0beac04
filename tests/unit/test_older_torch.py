"""What an older supported torch or transformers (torch 2.11, transformers 5.17: README's support table) lacks
is looked up where it is used and said, not a traceback: the launcher's drain time, and an image processor
that needs torchvision."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.launcher.api import LaunchConfig

from shardforge.data.images import image_processor
from shardforge.errors import DataError
from shardforge.launch import _shutdown_grace


@dataclasses.dataclass
class _LaunchConfig211:  # torch 2.11's LaunchConfig has no shutdown_timeout
    min_nodes: int = 1


def test_the_launcher_gets_the_drain_time_where_torch_has_the_field(logged_warnings):
    assert _shutdown_grace(LaunchConfig, None) == {}
    assert _shutdown_grace(LaunchConfig, 12.5) == {"shutdown_timeout": 43}
    assert not logged_warnings
    assert _shutdown_grace(_LaunchConfig211, 12.5) == {}
    assert any("no shutdown_timeout" in w and "43 s" in w for w in logged_warnings)


def test_an_image_processor_that_needs_torchvision_is_a_data_error(tmp_path, monkeypatch):
    import transformers

    (tmp_path / "preprocessor_config.json").write_text("{}")

    def needs_torchvision(*args, **kwargs):
        raise ImportError("\nAutoImageProcessor requires the Torchvision library but it was not found\n")

    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", needs_torchvision)
    with pytest.raises(DataError, match=r"cannot load this image processor.*requires the Torchvision"):
        image_processor(tmp_path)
