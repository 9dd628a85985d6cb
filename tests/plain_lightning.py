"""PyTorch Lightning's CPU DDP as its users write it: torch and Lightning only, never hpcdl.

    srun python plain_lightning.py BACKEND OUT.json

``DDPStrategy(process_group_backend=BACKEND)``: Lightning reads the ranks from Slurm and calls
``init_process_group(BACKEND)``, which finds hpcdl's groups through torch's entry points. Rank 0 writes the
final weights and the validation loss to OUT.json.
"""

import json
import os
import sys

import pytorch_lightning as pl
import torch
import torch.nn as nn
from pytorch_lightning.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(seed: int, n: int) -> DataLoader:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 0).long()) % 4  # learnable
    return DataLoader(TensorDataset(x, y), batch_size=16)


def main() -> None:
    backend, out = sys.argv[1], sys.argv[2]
    pl.seed_everything(0)
    model = Classifier()
    trainer = pl.Trainer(accelerator="cpu", devices=1, num_nodes=int(os.environ.get("SLURM_NNODES", "1")),
                         strategy=DDPStrategy(process_group_backend=backend), max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, data(1, 512), data(2, 128))
    import torch.distributed as dist

    if trainer.global_rank == 0:
        found = {"backend": backend, "torch_backend": dist.get_backend() if dist.is_initialized() else None,
                 "world": trainer.world_size, "val_loss": float(trainer.callback_metrics["val_loss"]),
                 "weights": {k: v.tolist() for k, v in model.state_dict().items()}}
        with open(out + ".tmp", "w") as f:
            json.dump(found, f)
        os.replace(out + ".tmp", out)
    # Lightning leaves the default group to the interpreter's exit, where torch's gloo group aborted one rank in
    # CI ('terminate called without an active exception', after fit had ended): end it here, as a script should.
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
