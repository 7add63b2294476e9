"""Worker of ``test_init_from_sharded.py``: a DINO under ``fsdp2`` on the gloo processes of
``torch.distributed.run`` starts from a sharded checkpoint folder (``--model.init_from FOLDER``), with
``max_steps=0`` so that the weights are the loaded ones. Every read of the folder is recorded (DCP's
``read_data``: the key and the number of elements of each item), and the networks are saved gathered whole.

    python -m torch.distributed.run --nproc_per_node=2 init_from_sharded_worker.py FOLDER OUT_DIR EMA
"""

import sys
from pathlib import Path

import lightning as L
import torch

from ssl_xcit.models import shard_reader


def main(folder: str, out_dir: str, ema: bool) -> None:
    from ssl_xcit.dino.module import DINO
    from ssl_xcit.parallel.fsdp import whole_state_dict

    reads: list[tuple[str, int]] = []
    read_data = shard_reader.ShardReader.read_data

    def spy(self, plan, planner):
        reads.extend((item.dest_index.fqn, int(torch.Size(item.lengths).numel())) for item in plan.items)
        return read_data(self, plan, planner)

    shard_reader.ShardReader.read_data = spy
    L.seed_everything(1, verbose=False)
    model = DINO("xcit_nano_12_p8", backbone_kwargs={"depth": 1}, out_dim=32, head_hidden_dim=32,
                 head_bottleneck_dim=16, init_from=folder, init_from_ema=ema)  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="fsdp2", max_steps=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    loader = torch.utils.data.DataLoader([0])  # never iterated: max_steps=0
    trainer.fit(model, loader)
    result = {
        "reads": reads,
        "student": whole_state_dict(model.student),
        "teacher": whole_state_dict(model.teacher),
        "center": model.dino_loss.center.clone(),
        "sharded": sorted({type(p).__name__ for p in model.student.parameters()}),
        "init_state": model.init_state,
    }
    torch.save(result, Path(out_dir) / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
