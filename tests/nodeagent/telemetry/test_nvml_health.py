"""NvmlSource's health signals, read through a fake of NVML at the pynvml boundary."""

from __future__ import annotations

import pytest

from agentprotocol import GpuSample
from nodeagent.telemetry.nvml import NvmlSource
from tests.nodeagent.telemetry.fake_nvml import FakeNvml


@pytest.fixture
def fake(monkeypatch) -> FakeNvml:
    return FakeNvml(gpus=4).install(monkeypatch)


def _by_index(source: NvmlSource) -> dict[int, GpuSample]:
    return {s.gpu_index: s for s in source.sample()}


def test_a_healthy_host_reports_nothing_wrong_and_sends_no_health_keys_but_its_link(fake):
    source = NvmlSource()
    samples = source.sample()
    assert [s.gpu_index for s in samples] == [0, 1, 2, 3]
    for sample in samples:
        assert sample.healthy is True
        assert (sample.fatal_xid, sample.ecc_errors, sample.lost) == (0, 0, False)
        assert (sample.pcie_width, sample.pcie_width_max, sample.pcie_gen) == (16, 16, 5)
    # the signals that show nothing wrong stay off the wire; the link is always there
    payload = samples[0].to_payload()
    assert "fatal_xid" not in payload and "lost" not in payload and "remap_failed" not in payload
    assert payload["throttle_reasons"] == 1 and payload["pcie_gen_max"] == 5


def test_an_xid_79_on_gpu_2_marks_gpu_2_only_and_stays_until_the_agent_restarts(fake):
    source = NvmlSource()
    # given the driver reports Xid 79 (fallen off the bus) on GPU 2, and an application Xid
    # (13) on GPU 0
    fake.xid(2, 79)
    fake.xid(0, 13)
    # when the agent samples
    samples = _by_index(source)
    # then GPU 2 carries the fatal Xid, GPU 0 only the count, the others nothing
    assert (samples[2].fatal_xid, samples[2].xid_errors, samples[2].healthy) == (79, 1, False)
    assert (samples[0].fatal_xid, samples[0].xid_errors, samples[0].healthy) == (0, 1, True)
    assert samples[1].healthy and samples[3].healthy
    # the first fatal Xid is kept: a later one does not replace it, and it is sent every time
    fake.xid(2, 48)
    assert _by_index(source)[2].fatal_xid == 79
    assert _by_index(source)[2].to_payload()["fatal_xid"] == 79


def test_ecc_remap_retirement_throttle_pcie_and_a_lost_gpu_are_read(fake):
    source = NvmlSource()
    gpus = fake.gpus
    assert isinstance(gpus, list)
    gpus[0].ecc = 12
    gpus[1].remap = (3, 1, 0, 1)  # row remapping failed
    gpus[2].remap = (1, 0, 1, 0)  # a remap pending the next reset
    gpus[3].throttle = 0x40 | 0x4  # HW thermal slowdown (+ the SW power cap, normal)
    gpus[3].pcie_width, gpus[3].pcie_gen = 8, 4
    samples = _by_index(source)
    assert (samples[0].ecc_errors, samples[0].healthy) == (12, False)
    assert (samples[1].remap_failed, samples[1].healthy) == (True, False)
    assert (samples[2].retire_pending, samples[2].remap_failed) == (True, False)
    assert samples[3].throttle_reasons == 0x44
    assert (samples[3].pcie_width, samples[3].pcie_width_max) == (8, 16)
    assert (samples[3].pcie_gen, samples[3].pcie_gen_max) == (4, 5)
    # a GPU fallen off the bus answers GPU_IS_LOST to every call: reported lost, the others
    # still read
    gpus[1].lost = True
    samples = _by_index(source)
    assert (samples[1].lost, samples[1].healthy) == (True, False)
    assert samples[0].ecc_errors == 12 and not samples[2].lost
