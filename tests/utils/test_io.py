from __future__ import annotations

import pytest
import torch

from ssl_xcit.utils.io import atomic_torch_save, atomic_write, atomic_write_json, sha256_file, sha256_json


def test_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "ckpt.pt"
    atomic_torch_save({"step": 1}, target)
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_write(target) as handle:
            handle.write(b"half a checkpoint")
            raise RuntimeError("killed mid-write")
    assert torch.load(target) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind


def test_json_and_hashes(tmp_path):
    path = atomic_write_json({"b": 1, "a": [1, 2]}, tmp_path / "sub" / "r.json")
    assert path.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    assert sha256_file(path) == sha256_file(path)
    (tmp_path / "x").write_bytes(b"abc")
    assert sha256_file(tmp_path / "x") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert sha256_json({"a": 1, "b": 2}) == sha256_json({"b": 2, "a": 1})


@pytest.fixture
def umask_027():
    import os

    old = os.umask(0o027)
    yield
    os.umask(old)


def _mode(path) -> int:
    import stat

    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_writes_honour_the_umask_like_open(tmp_path, umask_027):
    plain = tmp_path / "plain.json"
    with open(plain, "w") as handle:
        handle.write("{}")
    atomic_write_json({}, tmp_path / "atomic.json")
    atomic_torch_save({"x": 1}, tmp_path / "atomic.pt")
    assert _mode(plain) == 0o640
    assert _mode(tmp_path / "atomic.json") == 0o640 and _mode(tmp_path / "atomic.pt") == 0o640


def test_private_writes_are_owner_only(tmp_path, umask_027):
    from ssl_xcit.utils.io import make_dir

    path = atomic_torch_save({"w": torch.ones(2)}, tmp_path / "new_folder" / "last.ckpt", private=True)
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    existing = tmp_path / "mine"
    existing.mkdir(mode=0o755)
    existing.chmod(0o755)
    assert _mode(make_dir(existing, private=True)) == 0o755  # a folder the user made is left as it is
    assert _mode(make_dir(tmp_path / "shared")) == 0o750  # not private: mkdir's 0777 minus the umask


@pytest.mark.parametrize(
    "value, expected", [(None, False), ("", False), ("0", False), ("1", True), (" 1 ", True)]
)
def test_owner_only_follows_ssl_xcit_private(value, expected, monkeypatch):
    from ssl_xcit.utils.io import owner_only

    if value is None:
        monkeypatch.delenv("SSL_XCIT_PRIVATE", raising=False)
    else:
        monkeypatch.setenv("SSL_XCIT_PRIVATE", value)
    assert owner_only() is expected


def test_owner_only_refuses_other_values(monkeypatch):
    from ssl_xcit.errors import UserError
    from ssl_xcit.utils.io import owner_only

    monkeypatch.setenv("SSL_XCIT_PRIVATE", "yes")
    with pytest.raises(UserError, match=r"SSL_XCIT_PRIVATE must be 1 \(owner-only files\) or 0 .*got 'yes'"):
        owner_only()
