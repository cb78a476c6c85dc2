"""Native torch.distributed elastic training with the GoodputTuner.

::

    import pollux_launch.adapters.torch as pollux

    job = pollux.init()
    loader = pollux.AdaptiveDataLoader(dataset, batch_size=64, max_batch_size=512,
                                       local_bsz_bounds=(16, 128))
    trainer = pollux.ElasticTrainer(model, optimizer, loader)
    for epoch in trainer.epochs(30):
        for x, y in loader:
            trainer.step(loss_fn(trainer.model(x), y))

See ``trainer.py`` for what happens at step boundaries (rescales, batch-size decisions,
LR scaling) and ``data.py`` for the exactly-once elastic sampler.
"""

from .data import AdaptiveDataLoader, ElasticSampler
from .job import ElasticJob, Placement, WorkerRemoved, current_job, init
from .trainer import ElasticTrainer

__all__ = [
    "AdaptiveDataLoader", "ElasticJob", "ElasticSampler", "ElasticTrainer", "Placement",
    "WorkerRemoved", "current_job", "init",
]
