"""``decode_on: device`` orders nvJPEG's decode after the current CUDA stream's work on the device (a stream wait),
never by making the host wait for the whole stream. No GPU here: torch.cuda's stream API is replaced by
recorders and the decoded images are made on fake CUDA (``FakeTensorMode``)."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ssl_xcit.data import device_crops
from ssl_xcit.data.device_crops import CropBatch, decode_batch


class _Stream:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def synchronize(self) -> None:
        self.calls.append(("host waits for", self.name))

    def wait_stream(self, other: _Stream) -> None:
        self.calls.append(("wait", self.name, other.name))


def test_device_decode_waits_on_the_device_not_on_the_host(monkeypatch):
    calls: list = []
    current = _Stream("current", calls)

    @contextlib.contextmanager
    def stream(s):
        calls.append(("enter", s.name))
        yield
        calls.append(("exit", s.name))

    def decode(encoded, device):
        calls.append(("decode", len(encoded)))
        return [torch.zeros(3, 4, 5, dtype=torch.uint8, device=device) for _ in encoded], 0

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("side", calls))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: calls.append(("keep for", s.name)))
    monkeypatch.setattr(device_crops, "_decode_on", decode)
    monkeypatch.setattr(device_crops, "_SIDE_STREAMS", {}, raising=False)
    encoded = [torch.zeros(10, dtype=torch.uint8)] * 2
    batch = CropBatch(None, encoded, [(4, 5), (4, 5)], torch.zeros(4, 5), torch.zeros(4, dtype=torch.bool), 0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        out = decode_batch(batch, torch.device("cuda"))
        for _ in range(2):  # a second batch reuses the side stream
            decode_batch(batch, torch.device("cuda"))
    assert tuple(out.shape) == (2, 3, 4, 5) and out.device.type == "cuda"
    one_batch = [
        (
            "wait",
            "side",
            "current",
        ),  # the decode starts after the current stream's queued work, on the device
        ("enter", "side"),
        ("decode", 2),
        ("exit", "side"),
        ("wait", "current", "side"),  # what follows reads the images after they are written
        ("keep for", "current"),
        ("keep for", "current"),
    ]
    assert calls == one_batch * 3
