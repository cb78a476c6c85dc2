"""Worker of test_convergence_parity: one DeepSpeed job on digits, with or without pollux.

The same script, model, data split, optimizer and seeds either way; only the ds_config
differs. ``PARITY_POLLUX=0``: a fixed total batch of 32 (``train_batch_size``), no
``"pollux"`` section, started as a plain one-process DeepSpeed job (RANK, WORLD_SIZE...
set by the test). ``PARITY_POLLUX=1``: the ``"pollux"`` section (``initial_batch_size``
32, ``max_batch_size`` 256, AdaScale, accumulation allowed), started by a node agent, so
that ``initialize`` joins the job's rendezvous and returns a PolluxEngine and the pollux
AdaptiveDataLoader.

Both loop ``for epoch in epochs(engine, PARITY_EPOCHS)``: under pollux-run that is
``engine.epochs(n)`` (statistical epochs: progress counted at the initial batch size,
so a grown batch runs more data epochs), else ``range(n)`` - the same statistical
progress either way. Each process writes one JSON object to
``$PARITY_OUT/<worker>.json``: its rank, the world size, the final validation accuracy,
every epoch's accuracy, the total batch (``engine.train_batch_size()``) of every
optimizer step and a digest of the final parameters.
"""

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from digits import datasets  # examples/digits.py: its 80/20 split

from pollux_launch.adapters.deepspeed import epochs, initialize

POLLUX = os.environ["PARITY_POLLUX"] == "1"
EPOCHS = int(os.environ.get("PARITY_EPOCHS", "20"))
BATCH, MAX_BATCH = 32, 256


def config() -> dict:
    cfg: dict = {"zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
                 "gradient_clipping": 0.0}
    if POLLUX:  # pollux owns train_batch_size, the micro batch and accumulation
        cfg["pollux"] = {"enabled": True, "initial_batch_size": BATCH,
                         "max_batch_size": MAX_BATCH, "micro_batch_size_range": [4, 64],
                         "lr_scaling": "adascale", "gradient_accumulation": True,
                         "report_interval": 5.0}
    else:
        cfg.update(train_batch_size=BATCH, train_micro_batch_size_per_gpu=BATCH,
                   gradient_accumulation_steps=1)
    return cfg


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset) -> float:
    x, y = data.tensors
    return float((model(x).argmax(dim=1) == y).float().mean())


def main() -> None:
    t0 = time.monotonic()
    train_set, val_set = datasets()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 128), torch.nn.ReLU(),
        torch.nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    engine, _, loader, _ = initialize(model=model, optimizer=optimizer,
                                      training_data=train_set, config=config())
    assert (type(engine).__name__ == "PolluxEngine") == POLLUX, type(engine)

    batches: list[int] = []  # engine.train_batch_size() of every optimizer step
    accs: list[float] = []
    for _epoch in epochs(engine, EPOCHS):  # engine.epochs(EPOCHS) under pollux-run
        for xb, yb in loader:
            steps, batch = engine.global_steps, engine.train_batch_size()
            loss = F.cross_entropy(engine(xb), yb)
            engine.backward(loss)
            engine.step()  # under pollux-run: batch changes happen in here
            if engine.global_steps != steps:  # an optimizer step, taken with `batch`
                batches.append(batch)
        accs.append(accuracy(engine.module, val_set))
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                     for p in engine.module.parameters())).hexdigest()
    result = {"engine": type(engine).__name__, "rank": engine.global_rank,
              "world": engine.dp_world_size, "acc": accs[-1], "accs": accs,
              "data_epochs": len(accs), "batches": batches, "steps": engine.global_steps,
              "params": digest, "seconds": time.monotonic() - t0}
    out = Path(os.environ["PARITY_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{os.environ.get('POLLUX_WORKER_ID', 'fixed')}.json").write_text(json.dumps(result))
    sys.exit(0)


if __name__ == "__main__":
    main()
