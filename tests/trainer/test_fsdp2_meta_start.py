"""The meta-device start under FSDP2 (``ssl_xcit.parallel.meta_start``): networks built on the meta device start
from exactly the weights of a whole construction under the same seed, shard by shard, on 2 gloo processes (the
quickstart's XCiT and a ViT with iBOT in the default suite, every other family and XCiT with Gram anchoring
slow); and the recorder and replay on one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import torchrun

from ssl_xcit.parallel.meta_start import meta_start, record, replay

WORKER = Path(__file__).with_name("fsdp2_meta_start_worker.py")


def _check(out: Path, case: str) -> None:
    for rank in range(2):
        result = torch.load(out / case / f"rank{rank}.pt", weights_only=True)
        plain, whole, meta = result["plain"], result["whole"], result["meta"]
        assert meta["built_on_meta"] and not whole["built_on_meta"]
        assert meta["types"] == ["DTensor"] and meta["devices"] == ["cpu"]
        # The RNG after setup is the whole construction's (Lightning re-seeds after it): same draws later.
        assert torch.equal(meta["draw"], whole["draw"])
        assert plain["nets"].keys() == meta["nets"].keys() == whole["nets"].keys()
        for net, state in plain["nets"].items():
            assert meta["nets"][net].keys() == state.keys()
            for key, value in state.items():  # bitwise: the same draws in the same order
                assert torch.equal(meta["nets"][net][key], value), (case, net, key)
                assert torch.equal(whole["nets"][net][key], value), (case, net, key)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_meta_start_gives_the_whole_constructions_weights(tmp_path):
    torchrun(WORKER, str(tmp_path), "quickstart,vit", timeout=300)
    for case in ("quickstart", "vit"):
        _check(tmp_path, case)


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_meta_start_every_family_gram_and_distillation(tmp_path):
    cases = ("cait", "convnext", "crossformerpp", "bixt", "dinov3", "gram_ibot")
    torchrun(WORKER, str(tmp_path), ",".join(cases + ("gram_source", "distill")), timeout=1200)
    for case in cases:
        _check(tmp_path, case)
    for rank in range(2):  # the fixed Gram teacher, read memory-mapped into the shards at fit start
        result = torch.load(tmp_path / "gram_source" / f"rank{rank}.pt", weights_only=True)
        assert result["meta"]["initialised"] and result["meta"]["types"] == ["DTensor"]
        assert result["meta"]["gram_after"].keys() == result["source"].keys()
        for key, value in result["source"].items():
            assert torch.equal(result["meta"]["gram_after"][key], value), key
    for rank in range(2):  # a distillation teacher, read into the shards after sharding (heads whole)
        result = torch.load(tmp_path / "distill" / f"rank{rank}.pt", weights_only=True)
        meta, whole = result["meta"], result["whole"]
        assert meta["on_meta"] and not whole["on_meta"] and meta["types"] == whole["types"] == ["DTensor"]
        assert meta["teacher"].keys() == whole["teacher"].keys()
        assert {k for k in meta["teacher"] if k.startswith("backbone.")} <= result["source"].keys()
        for key, value in meta["teacher"].items():
            assert torch.equal(value, whole["teacher"][key]), key
            assert torch.equal(value, result["source"][key]), key


def test_replay_draws_what_the_construction_drew_and_keeps_only_what_is_needed():
    """A timm ViT: PyTorch's default init of each layer, then timm's (trunc_normal_, whose rejection loop
    depends on the values) over the same weights. The replay gives the construction's values; the first draws, overwritten
    whole, are never kept: the most bytes alive at once are one weight's, not the module's."""
    from ssl_xcit.models import create_model

    torch.manual_seed(3)
    ref = create_model("vit_tiny_patch16_224", depth=4)
    torch.manual_seed(3)
    with record() as recipe:
        net = create_model("vit_tiny_patch16_224", depth=4)
    assert all(p.is_meta for p in net.parameters())
    got: dict[str, torch.Tensor] = {}
    sinks: dict = {}
    for name, p in net.state_dict(keep_vars=True).items():
        sinks.setdefault(p.untyped_storage()._cdata, []).append(
            (p, lambda v, n=name: got.__setitem__(n, v.clone()))
        )
    peak = replay(recipe, sinks)
    assert got.keys() == ref.state_dict().keys()
    for key, value in ref.state_dict().items():
        assert torch.equal(got[key], value), key
    sizes = [t.numel() * t.element_size() for t in ref.state_dict().values()]
    assert max(sizes) <= peak <= 2 * max(sizes) < sum(sizes) / 4


def test_a_tensor_whose_data_the_meta_device_lost_is_an_error_not_garbage():
    """``torch.tensor(data)`` on the meta device keeps no data and makes no op to record: its replay refuses."""
    with record() as recipe:
        module = torch.nn.Module()
        module.register_buffer("table", torch.tensor([1.5, 2.0]))
        module.register_buffer("zeros", torch.zeros(3))
    sinks = {t.untyped_storage()._cdata: [(t, lambda v: None)] for t in module.buffers()}
    with pytest.raises(
        RuntimeError, match=r"1 tensors of the meta-device construction have no recorded value"
    ):
        replay(recipe, sinks)


def test_meta_start_is_scoped_and_a_plain_construction_is_untouched():
    from ssl_xcit.dino.module import DINO

    kwargs = dict(backbone="vit_tiny_patch16_224", backbone_kwargs={"depth": 1, "patch_size": 8}, out_dim=8,
                  head_hidden_dim=8, head_bottleneck_dim=4)  # fmt: skip
    with meta_start():
        meta = DINO(**kwargs)
    plain = DINO(**kwargs)
    assert all(p.is_meta for p in meta.parameters() if p is not None)
    assert not any(p.is_meta for p in plain.parameters())
    assert meta._meta_recipe is not None and plain._meta_recipe is None


def test_one_process_materialises_whole_networks_equal_to_a_plain_construction():
    """Without FSDP2 (``configure_model`` with no trainer) the recipe gives the whole networks, Gram teacher and
    iBOT heads included, bitwise."""
    from ssl_xcit.dino.module import DINO

    kwargs = dict(backbone="xcit_nano_12_p8", backbone_kwargs={"depth": 1}, out_dim=16, head_hidden_dim=16,
                  head_bottleneck_dim=8, ibot_loss_weight=1.0, gram_loss_weight=1.0)  # fmt: skip
    torch.manual_seed(0)
    ref = DINO(**kwargs).state_dict()
    torch.manual_seed(0)
    with meta_start():
        model = DINO(**kwargs)
    model.configure_model()
    got = model.state_dict()
    assert got.keys() == ref.keys() and any(k.startswith("gram_teacher.") for k in got)
    for key, value in ref.items():
        assert torch.equal(got[key], value), key


def _rss_anon_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    raise RuntimeError("no RssAnon")


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_a_teacher_file_is_read_memory_mapped_with_the_checkpoint_readers_values(tmp_path, suffix):
    """A Gram or distillation teacher under FSDP2 is read memory-mapped: the values are ``read_checkpoint``'s,
    and reading the file (64 MiB) and cutting a quarter of its tensor takes a quarter's private memory, not the
    file's (mapped pages are the file's, RssFile, not RssAnon)."""
    from safetensors.torch import save_file

    from ssl_xcit.dino.mapped_source import read_mapped_checkpoint
    from ssl_xcit.models.checkpoint import read_checkpoint

    big = torch.randn(4096, 4096)
    state = {"blocks.0.weight": big, "blocks.0.bias": torch.arange(5, dtype=torch.int64)}
    path = tmp_path / f"teacher{suffix}"
    save_file(state, str(path)) if suffix == ".safetensors" else torch.save(state, path)
    del big, state
    before = _rss_anon_kib()
    mapped = read_mapped_checkpoint(str(path))
    quarter = mapped["blocks.0.weight"][:1024].clone()
    grown = _rss_anon_kib() - before
    assert grown < 40 * 1024, grown  # a quarter is 16 MiB; the whole tensor 64 MiB
    whole = read_checkpoint(path)
    assert mapped.keys() == whole.keys()
    for key, value in whole.items():
        assert torch.equal(mapped[key], value) and mapped[key].dtype == value.dtype, key
    assert torch.equal(quarter, whole["blocks.0.weight"][:1024])


def test_a_file_the_mapped_reader_cannot_read_gives_none(tmp_path):
    from ssl_xcit.dino.mapped_source import read_mapped_checkpoint

    (tmp_path / "x.pth").write_bytes(b"not a checkpoint")
    assert read_mapped_checkpoint(str(tmp_path / "x.pth")) is None
    assert read_mapped_checkpoint(str(tmp_path / "missing.pth")) is None
    assert read_mapped_checkpoint("timm:vit_small_patch16_224") is None
