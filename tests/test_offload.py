"""shfx.Offload: the NVMe tier's spec, its validation and its docstring examples (and those of
the SSD store, shfx.runtime.ssd)."""

from __future__ import annotations

import dataclasses
import doctest
import inspect

import pytest

import shfx
import shfx.offload
import shfx.runtime.ssd
from shfx import Offload


def test_defaults_keep_everything_on_the_host():
    spec = Offload()
    assert (spec.optimizer, spec.params, spec.path, spec.host_window) == ("host", "host", None, "auto")
    assert not spec.uses_nvme and spec.read_bps is None and spec.write_bps is None
    assert str(spec) == "Offload(host)"


def test_nvme_spec_parses_rates_and_is_frozen():
    spec = Offload(optimizer="nvme", params="nvme", gradients="nvme", path="/mnt/nvme/shfx", nvme_read="3GB/s", nvme_write=2e9, host_window=2)
    assert spec.uses_nvme and (spec.read_bps, spec.write_bps) == (3e9, 2e9)
    assert str(spec) == (
        "Offload(parameters, gradients and optimizer states on NVMe at /mnt/nvme/shfx, host window 2, "
        "emulated read 3.00 GB/s write 2.00 GB/s)"
    )
    assert Offload(params="nvme", gradients="nvme", optimizer="nvme", path="/x", host_budget="1GiB").host_budget_bytes == 1 << 30
    assert Offload(optimizer="nvme", path="/x", nvme_read="500MB/s").write_bps is None  # the real disk's speed
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.path = "/elsewhere"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(optimizer="disk"), r"optimizer must be 'host' or 'nvme', got 'disk'"),
        (dict(params="gpu"), r"params must be 'host' or 'nvme', got 'gpu'"),
        (dict(optimizer="nvme"), r"Offload\(optimizer='nvme'\) needs a path.*path='/mnt/nvme/shfx'"),
        (dict(params="nvme", gradients="nvme", optimizer="nvme"), r"Offload\(params='nvme', gradients='nvme', optimizer='nvme'\) needs a path"),
        (dict(params="nvme", path="/x"), r"parameter tier puts a group's image, master, gradient and optimizer states on the SSD together.*gradients='nvme', optimizer='nvme'"),
        (dict(gradients="nvme", optimizer="nvme", path="/x"), r"pass params='nvme', gradients='nvme', optimizer='nvme'"),
        (dict(optimizer="nvme", path="/x", image_window=2), r"image_window sets the parameter tier's image buffers: it needs params='nvme'"),
        (dict(params="nvme", gradients="nvme", optimizer="nvme", path="/x", image_window=0), r"image_window must be an int >= 1"),
        (dict(params="nvme", gradients="nvme", optimizer="nvme", path="/x", host_budget="lots"), r"host_budget"),
        (dict(nvme_read="3GB/s"), r"nvme_read='3GB/s'\) sets the NVMe tier but nothing is on it.*optimizer='nvme'.*drop nvme_read"),
        (dict(path="/x", nvme_write="1GB/s"), r"drop nvme_write, path"),
        (dict(host_window=2), r"drop host_window"),
        (dict(optimizer="nvme", path="/x", nvme_read="fast"), r"cannot read Offload nvme_read 'fast'.*'12GB/s'"),
        (dict(optimizer="nvme", path="/x", nvme_write=-1), r"nvme_write must be > 0"),
        (dict(optimizer="nvme", path="/x", host_window=0), r"host_window must be an int >= 1.*or 'auto', got 0"),
        (dict(optimizer="nvme", path="/x", host_window=True), r"host_window must be an int >= 1"),
        (dict(optimizer="nvme", path=""), r"path is empty"),
        (dict(optimizer="nvme", path=3), r"path must be a directory path"),
    ],
)
def test_bad_specs_say_what_to_change(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        Offload(**kwargs)


def test_compile_takes_it():
    # (issue 12 part 3: tests/test_nvme_runtime.py trains with it) compile documents the keyword
    # and the spec's docstring says how it relates to the policy's fields
    assert "offload" in inspect.signature(shfx.api.CompiledModel).parameters
    assert "offload: ``shfx.Offload(" in " ".join(shfx.compile.__doc__.split())
    assert "sets the policy's fields" in " ".join(Offload.__doc__.split())


@pytest.mark.parametrize("module", [shfx.offload, shfx.runtime.ssd])
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, report=False)
    assert result.attempted > 0 and result.failed == 0, f"run doctest on {module.__name__}"
