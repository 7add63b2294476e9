"""How often FSDP2 gathers each unit in a DINO step (``ssl_xcit.parallel.fsdp.shard_module``), counted on a fake
process group of 4 ranks in this one process (its collectives do nothing: the counts, not the values, are what
these tests read). A step is what ``ssl_xcit.dino.step`` runs: the teacher on the global crops without
gradients, the student on all crops (2 global, 2 local of half the side), one backward.

With ``reshard_after_forward`` true (the strategy's default, as DINOv3's blocks) each student block of every family
(XCiT, ViT, DINOv3's ViT, CaiT, ConvNeXt, CrossFormer++, BiXT) is gathered twice a step (issue 52; 4 before): the
sharding sets ``MultiCropWrapper.lockstep_crops``, and the student's crop groups go through each block in one call
(``forward_cls_patches_list``, as DINOv3's ``forward_features_list``), one forward and one backward gather. With it
false (``SHARD_GRAD_OP``) once."""

from __future__ import annotations

import copy
import types
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_model
from torch.distributed.tensor import DTensor

from ssl_xcit.errors import UserError
from ssl_xcit.models.base import MASKING_FAMILIES
from ssl_xcit.parallel.fsdp import FSDP2Strategy, blocks, check_sharding, shard_module

WORLD = 4


@pytest.fixture
def gathers(monkeypatch):
    """A fake 4-rank process group and 1-D mesh; yields ``(mesh, counts)``, counts keyed by FSDP2 parameter group
    (one per unit) of the all-gathers actually issued."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore

    counts: Counter = Counter()
    unshard = FSDPParamGroup.unshard

    def counted(self, async_op: bool = False):
        before = self._all_gather_result
        unshard(self, async_op)
        if before is None and self._all_gather_result is not None:
            counts[id(self)] += 1

    monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield init_device_mesh("cpu", (WORLD,)), counts
    finally:
        dist.destroy_process_group()


def _sharded(model, mesh, reshard_after_forward):
    strategy = types.SimpleNamespace(reshard_after_forward=reshard_after_forward)
    model._trainer = types.SimpleNamespace(precision="32-true", world_size=WORLD, strategy=strategy)
    try:
        shard_module(model, mesh, "32-true")
    finally:
        model._trainer = None
    return model


def _group(unit):
    return unit._get_fsdp_state()._fsdp_param_group


def _units(net):
    return [m for m in net.modules() if hasattr(m, "_get_fsdp_state") and _group(m) is not None]


CROPS = [
    torch.randn(2, 3, 16, 16),
    torch.randn(2, 3, 16, 16),
    torch.randn(2, 3, 8, 8),
    torch.randn(2, 3, 8, 8),
]


def _step(model, ibot: bool = False, crops: list[torch.Tensor] = CROPS) -> None:
    with torch.no_grad():
        model.teacher(crops[:2])
    if ibot:
        grid = model.student.backbone.token_grid(*crops[0].shape[-2:])
        masks = torch.zeros(4, grid[0] * grid[1], dtype=torch.bool)
        masks[:, 0] = True
        out, _, patches = model.student.forward_with_patches(crops, masks)
        loss = out.sum() + model.student.patch_logits(patches[masks]).sum()
    else:
        out, _ = model.student(crops, return_embeddings=True)
        loss = out.sum()
    loss.backward()


@pytest.mark.parametrize("ibot", [False, True])
def test_each_student_block_is_gathered_once_per_step_when_kept_gathered(gathers, ibot):
    """``reshard_after_forward`` false: one all-gather per student block per step, over both crop
    resolutions' forwards and backwards (4 before); the teacher's blocks and head layers once; afterwards every
    unit of both networks holds only its shards (the teacher's roots included: its backbone's, its head layers)."""
    mesh, counts = gathers
    overrides = dict(ibot_loss_weight=1.0, ibot_separate_head=True) if ibot else {}
    model = _sharded(tiny_model(**overrides), mesh, False)
    heads = _units(model.teacher.head)  # each linear layer an FSDP2 root
    assert heads
    for _ in range(2):
        counts.clear()
        _step(model, ibot)
        assert [counts[id(_group(b))] for b in blocks(model.student.backbone)] == [1, 1, 1]
        assert [counts[id(_group(b))] for b in blocks(model.teacher.backbone)] == [1, 1, 1]
        assert [counts[id(_group(h))] for h in heads] == [1] * len(heads)
        # The backbones' root units: once, though forward calls forward_features calls forward_patch_tokens
        # (5 times in the student before: FSDP2 freed the root at the end of each inner call).
        assert counts[id(_group(model.student.backbone))] == counts[id(_group(model.teacher.backbone))] == 1
        assert all(_group(u).is_sharded for u in _units(model.student) + _units(model.teacher))


# (backbone, backbone_kwargs, crop sides: 2 global then 2 local, student block gathers a step)
FAMILIES = {
    "xcit": ("xcit_nano_12_p8", {"depth": 1}, (16, 8), 2),
    "vit": ("vit_tiny_patch16_224", {"depth": 2, "patch_size": 8}, (16, 8), 2),
    "dinov3": ("vit_small_patch16_dinov3", {"embed_dim": 32, "depth": 2, "num_heads": 2}, (32, 16), 2),
    "cait": ("cait_xxs24", {"depth": 1, "patch_size": 8}, (16, 8), 2),
    "crossformerpp": ("crossformerpp_small", {"depths": (1, 1, 1, 1)}, (64, 32), 2),
    "bixt": ("bixt_ti_l64_p16", {"depth": 2}, (32, 16), 2),
    "convnext": ("convnext_tiny", {"depths": (1, 1, 1, 1), "dims": (8, 16, 24, 32)}, (64, 32), 2),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_reshard_after_forward_true_gathers_list_blocks_twice(gathers, family):
    """``reshard_after_forward`` true (FULL_SHARD, the least memory): every family's blocks (XCiT's and CaiT's
    class-attention blocks too, ConvNeXt's and CrossFormer++'s in every stage) take the student's crop groups in
    one call and are gathered twice a step (4 before issue 52: each resolution's forward and its backward)."""
    name, kwargs, (big, small), expected = FAMILIES[family]
    mesh, counts = gathers
    masking = family in MASKING_FAMILIES  # also iBOT's step: the masked global crops with the local ones
    overrides = dict(ibot_loss_weight=1.0, ibot_separate_head=True) if masking else {}
    model = _sharded(tiny_model(backbone=name, backbone_kwargs=kwargs, **overrides), mesh, True)
    assert model.student.lockstep_crops and not model.teacher.lockstep_crops
    crops = [torch.randn(2, 3, s, s) for s in (big, big, small, small)]
    for ibot in (False, True) if masking else (False,):
        counts.clear()
        _step(model, ibot, crops)
        student = [counts[id(_group(b))] for b in blocks(model.student.backbone)]
        assert student == [expected] * len(student) and student
        assert [counts[id(_group(b))] for b in blocks(model.teacher.backbone)] == [1] * len(student)
        assert counts[id(_group(model.student.backbone))] == 1


def test_a_forward_without_gradients_reshards_the_student_at_once(gathers):
    """A student kept gathered for its backward is freed at once after a forward that has none (validation,
    the online k-NN): the optimiser must never step shards whose gathered copy a later forward would reuse."""
    mesh, _ = gathers
    model = _sharded(tiny_model(), mesh, False)
    with torch.no_grad():
        model.student(CROPS)
    assert all(_group(u).is_sharded for u in blocks(model.student.backbone) + [model.student.backbone])


def test_a_student_ema_is_sharded_block_by_block_like_the_student(gathers):
    """Distillation's student EMA (``Distill.student_ema``) gets the student's units (one per block, the
    backbone's root, each head layer), so the EMA update pairs equal local shards."""
    mesh, _ = gathers
    model = tiny_model()
    model.student_ema = copy.deepcopy(model.student).requires_grad_(False)
    _sharded(model, mesh, False)
    ema, student = model.student_ema, model.student
    assert [type(u).__name__ for u in _units(ema)] == [type(u).__name__ for u in _units(student)]
    assert len(blocks(ema.backbone)) == 3 and all(_group(b) is not None for b in blocks(ema.backbone))
    local = lambda net: [p.to_local().shape for p in net.parameters()]  # noqa: E731
    assert all(isinstance(p, DTensor) for p in ema.parameters()) and local(ema) == local(student)


@pytest.mark.parametrize(
    "world,replicate,reshard,message",
    [
        (4, 3, False, r"^replicate_degree 3 does not divide the 4 ranks"),
        (
            8,
            2,
            4,
            r"^reshard_after_forward 4 must be true, false or a divisor of the 4 ranks of a shard group",
        ),
        (8, 1, 3, r"^reshard_after_forward 3 must be"),
    ],
)
def test_bad_sharding_options_are_refused_in_one_line(world, replicate, reshard, message):
    with pytest.raises(UserError, match=message) as err:
        check_sharding(world, replicate, reshard)
    assert "\n" not in str(err.value)
    check_sharding(8, 2, 2)  # a divisor of the shard group of 4


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            {"reshard_after_forward": "sometimes"},
            r"^reshard_after_forward must be true, false or a number of ranks",
        ),
        ({"replicate_degree": 0}, r"^replicate_degree must be a whole number >= 1"),
    ],
)
def test_bad_strategy_arguments_are_refused(kwargs, message):
    with pytest.raises(UserError, match=message):
        FSDP2Strategy(**kwargs)


def test_strategy_arguments_from_the_command_line():
    assert FSDP2Strategy(reshard_after_forward="true").reshard_after_forward is True
    assert FSDP2Strategy(reshard_after_forward="2").reshard_after_forward == 2
    assert FSDP2Strategy().reshard_after_forward is True and FSDP2Strategy().replicate_degree == 1
