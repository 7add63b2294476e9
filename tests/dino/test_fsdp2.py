"""``--trainer.strategy fsdp2`` (``ssl_xcit.parallel.fsdp``): the strategy name, each family's blocks, and every
family and option equal to DDP on 2 gloo processes (the quickstart and distillation cases run in the default
suite with ``test_ddp.py``'s launch)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import torchrun

from ssl_xcit.models import create_model
from ssl_xcit.parallel.fsdp import FSDP2Strategy, blocks

WORKER = Path(__file__).with_name("fsdp2_worker.py")


def test_fsdp2_is_a_registered_strategy_name():
    trainer = L.Trainer(strategy="fsdp2", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy)


@pytest.mark.parametrize("strategy", ["fsdp2", "fsdp2_whole"])
def test_16_mixed_under_the_registered_name_is_refused_in_one_line(strategy):
    """Lightning refuses 16-mixed only for a ``ModelParallelStrategy`` instance: under the registered name a
    GradScaler (given as a plugin, or CUDA's) went through, and each rank would decide from its own shards
    whether a step overflowed. The refusal comes before any process group or model setup."""
    from lightning.pytorch.plugins import MixedPrecision
    from torch.utils.data import DataLoader

    from ssl_xcit.dino.module import DINO
    from ssl_xcit.errors import UserError

    scaler = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, plugins=[scaler], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)  # fmt: skip
    model = DINO("vit_tiny_patch16_224", backbone_kwargs={"depth": 1, "patch_size": 8}, out_dim=8)
    with pytest.raises(UserError, match=r"^16-mixed is not supported under --trainer.strategy fsdp2") as err:
        trainer.fit(model, DataLoader(range(4)))
    assert "bf16-mixed" in str(err.value) and "\n" not in str(err.value)
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize(
    "name,kwargs,expected",
    [
        ("xcit_nano_12_p8", {"depth": 3}, ["XCABlock"] * 3 + ["ClassAttentionBlock"] * 2),
        ("cait_xxs24", {"depth": 2}, ["LayerScaleBlock"] * 2 + ["LayerScaleBlockClassAttn"] * 2),
        ("vit_tiny_patch16_224", {"depth": 2}, ["Block"] * 2),
        ("crossformerpp_small", {"depths": (1, 2, 1, 1)}, ["CrossFormerBlock"] * 5),
        ("bixt_ti_l64_p16", {"depth": 3}, ["BiXTBlock"] * 3),
    ],
)
def test_each_family_is_sharded_block_by_block(name, kwargs, expected):
    """The fully_shard units of each family are its transformer blocks, in order, every stage's included."""
    found = blocks(create_model(name, **kwargs))
    assert [type(b).__name__ for b in found] == expected


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fsdp2")
    torchrun(WORKER, str(out), "xcit,cait,vit,crossformerpp,bixt,gram,ibot,bf16,ac", timeout=1200)
    return out


def _pair(out: Path, case: str) -> list[tuple[dict, dict]]:
    load = lambda s, r: torch.load(out / case / s / f"rank{r}.pt", weights_only=True)  # noqa: E731
    return [(load("ddp", r), load("fsdp2", r)) for r in range(2)]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("case", ["cait", "vit", "crossformerpp", "bixt", "gram", "ibot"])
def test_fsdp2_equals_ddp_for_every_family_and_option(family_runs, case):
    """CaiT, ViT, CrossFormer++, BiXT, and XCiT with Gram anchoring (the Gram teacher sharded and refreshed
    shard by shard) or iBOT: FSDP2's losses, centres and networks are DDP's within float32 reduction order."""
    for ddp, fsdp in _pair(family_runs, case):
        assert fsdp["param_types"] == ["DTensor"] and fsdp["global_step"] == ddp["global_step"] == 2
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
        torch.testing.assert_close(fsdp["centers"], ddp["centers"], rtol=1e-5, atol=1e-7)
        for network in ("student", "teacher", "gram"):
            assert fsdp[network].keys() == ddp[network].keys()
            for key, value in ddp[network].items():
                torch.testing.assert_close(fsdp[network][key], value, rtol=1e-5, atol=1e-7, msg=key)
    assert bool(ddp["gram"]) == (case == "gram")  # the Gram teacher was compared where it exists


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp2_bf16_mixed_computes_in_bf16_and_keeps_float32_master_weights(family_runs):
    """DINOv3's policy: the blocks see bf16 weights, the sharded parameters stay float32; the run follows
    DDP's bf16 autocast run to bf16 precision (not bit-equal: the weights are rounded, not only the matmuls)."""
    for ddp, fsdp in _pair(family_runs, "bf16"):
        assert fsdp["compute_dtypes"] == ["torch.bfloat16"] and ddp["compute_dtypes"] == ["torch.float32"]
        assert fsdp["param_dtypes"] == ["torch.float32"]
        assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=2e-2)
        for key, value in ddp["student"].items():
            torch.testing.assert_close(fsdp["student"][key], value, rtol=0.05, atol=5e-3, msg=key)


@pytest.mark.slow
@pytest.mark.distributed
def test_activation_checkpointing_under_ddp_and_fsdp2_equals_the_run_without(family_runs):
    """XCiT (BatchNorms synchronised across ranks inside its blocks) with checkpointed blocks, under DDP and
    under FSDP2, ends where DDP without checkpointing does."""
    for (plain, _), (ddp, fsdp) in zip(_pair(family_runs, "xcit"), _pair(family_runs, "ac"), strict=True):
        for run in (ddp, fsdp):
            assert run["losses"] == pytest.approx(plain["losses"], rel=1e-6)
            for network in ("student", "teacher"):
                for key, value in plain[network].items():
                    torch.testing.assert_close(run[network][key], value, rtol=1e-5, atol=1e-7, msg=key)


def test_bf16_mixed_keeps_batchnorm_in_float32_on_one_process():
    """XCiT's BatchNorms (patch embedding, LPI) under DINOv3's bf16 policy: their weights were gathered in
    bf16 while their running statistics stay float32, and a 1-process run (plain BatchNorm: nothing synced)
    stopped at the first forward ("expected scalar type BFloat16 but found Float"). Each BatchNorm is now a
    unit of its own in float32; the blocks still compute in bf16. A real 1-rank gloo group, destroyed after."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ssl_xcit.parallel.fsdp import _policy, shard_backbone

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        backbone = create_model("xcit_nano_12_p8", depth=1)
        norms = [m for m in backbone.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert norms
        seen: dict[str, torch.dtype] = {}

        def record(name: str):
            def hook(module, args) -> None:
                seen.setdefault(name, next(module.parameters()).dtype)

            return hook

        for name, m in (("norm", norms[0]), ("block", blocks(backbone)[0])):
            m.register_forward_pre_hook(record(name))
        shard_backbone(backbone, init_device_mesh("cpu", (1,)), _policy("bf16-mixed"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = backbone(torch.randn(2, 3, 16, 16))
        out.float().sum().backward()
        assert seen == {"norm": torch.float32, "block": torch.bfloat16}
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in backbone.parameters())
    finally:
        dist.destroy_process_group()
