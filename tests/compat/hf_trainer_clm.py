"""A Hugging Face ``Trainer`` causal-LM script, torchrun style (no pollux API).

A tiny GPT-2 built from a ``GPT2Config`` in code (random weights, no download) learns a
synthetic, tokenizer-free language: each sample is an arithmetic progression of token
ids modulo the vocabulary, with a seeded random start and stride. Run it with
``torchrun --nproc-per-node N`` or ``pollux-run``; it checkpoints every ``--save-steps``
optimizer steps into ``--output-dir`` and resumes from the newest checkpoint there.

Its one change for restart-elasticity is ``gradient_accumulation_steps=
accumulation_steps(ARGS.accum)`` (``pollux_launch.constant_batch``): under ``pollux-run``,
a group restarted at another size accumulates so that ``per-device batch x WORLD_SIZE x
accumulation`` stays what it is at ``-np`` - the same global batch, optimizer steps and
LR schedule as the fixed run. Outside ``pollux-run`` it returns ``--accum`` unchanged.

Every rank prints one JSON line per start (``{"event": "start", ...}``); rank 0 writes
``--result`` at the end: optimizer steps, samples trained on (``num_input_tokens_seen`` /
sequence length, kept across resumes), the final eval loss, the world sizes it ran at.
``--step-sleep S`` sleeps S seconds after each optimizer step while ``--pace-file`` exists
(always, without ``--pace-file``), so that a test can act mid-run and then let it finish.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import time
from pathlib import Path

import torch

try:  # before any process group exists: see release_group(). (Not an import statement:
    # pollux-run would take this script for a DeepSpeed one and pass it --local_rank.)
    importlib.import_module("deepspeed.comm")
except ImportError:  # (no deepspeed: nothing of it can hold the group)
    pass
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_utils import get_last_checkpoint

from pollux_launch.constant_batch import accumulation_steps

VOCAB = 64


class Progressions(torch.utils.data.Dataset):
    """``n`` seeded sequences ``(a + b * t) mod VOCAB``, t < ``length``."""

    def __init__(self, n: int, length: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        a = torch.randint(0, VOCAB, (n, 1), generator=g)
        b = torch.randint(1, 8, (n, 1), generator=g)
        self.ids = (a + b * torch.arange(length)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Pace(TrainerCallback):
    """Sleep after each optimizer step while the pace file exists; print starts."""

    def __init__(self, sleep: float, pace_file: str | None) -> None:
        self.sleep, self.pace_file = sleep, pace_file

    def on_train_begin(self, args, state, control, **kwargs):
        print(json.dumps({
            "event": "start", "rank": int(os.environ.get("RANK", 0)),
            "world": int(os.environ.get("WORLD_SIZE", 1)),
            "accum": args.gradient_accumulation_steps, "max_steps": state.max_steps,
            "resumed_at": state.global_step, "pid": os.getpid(),
            "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}), flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if self.sleep and (self.pace_file is None or os.path.exists(self.pace_file)):
            time.sleep(self.sleep)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--result", default=None)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--per-device", type=int, default=4)
    p.add_argument("--accum", type=int, default=1, help="accumulation at the reference size")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--save-steps", type=int, default=8)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--pace-file", default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    torch.set_num_threads(1)
    config = GPT2Config(vocab_size=VOCAB, n_positions=args.seq_len, n_embd=32, n_layer=2,
                        n_head=2, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(args.seed)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.per_device,
        per_device_eval_batch_size=16,
        gradient_accumulation_steps=accumulation_steps(args.accum),
        num_train_epochs=args.epochs, learning_rate=args.lr, lr_scheduler_type="linear",
        warmup_steps=0, weight_decay=0.0, save_strategy="steps", save_steps=args.save_steps,
        logging_steps=1_000_000, eval_strategy="no", report_to=[], use_cpu=True,
        seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
        include_num_input_tokens_seen=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False, save_total_limit=2)
    trainer = Trainer(model=model, args=training,
                      train_dataset=Progressions(args.samples, args.seq_len, args.seed),
                      eval_dataset=Progressions(64, args.seq_len, args.seed + 1),
                      callbacks=[Pace(args.step_sleep, args.pace_file)])
    last = get_last_checkpoint(args.output_dir) if Path(args.output_dir).is_dir() else None
    trainer.train(resume_from_checkpoint=last)
    eval_loss = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero() and args.result:
        state = trainer.state
        result = {
            "global_step": state.global_step, "max_steps": state.max_steps,
            "samples": state.num_input_tokens_seen // args.seq_len,
            "eval_loss": eval_loss, "world": int(os.environ.get("WORLD_SIZE", 1)),
            "accum": training.gradient_accumulation_steps, "resumed_from": last,
        }
        tmp = args.result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.result)
    print("done", flush=True)


def gloo_threads() -> list[str]:
    """This process's gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``); Linux only."""
    names = []
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return [n for n in names if "gloo" in n]


def release_group() -> None:
    """Destroy the gloo group and join its threads while the interpreter is still alive.

    ``destroy_process_group()`` only drops ``torch.distributed``'s own references. The
    ``ProcessGroupGloo`` (and its worker threads ``pt_gloo_runloop``) lives on while
    anything else holds it: main()'s Trainer (its DDP wrapper, in reference cycles), and
    deepspeed, which accelerate imports only once the group exists: the default
    argument ``group=torch.distributed.GroupMember.WORLD`` of deepspeed.comm.torch's
    ``TorchBackend.barrier``/``monitored_barrier`` is evaluated at that import, a
    reference to the group for the life of the process (imported at the top of this
    script, before any group, it is None). Left so, the group outlives the interpreter: a
    worker thread that drops the last collective's Work after the main thread went on
    (``~AsyncAllgatherWork`` releasing Python tensors needs the GIL) finds Python
    finalizing, and ``take_gil`` ends it with ``pthread_exit``, whose unwinding through
    that noexcept destructor calls ``std::terminate`` - 'terminate called without an
    active exception', SIGABRT, after 'done'. A barrier only narrowed that window.
    """
    if not torch.distributed.is_initialized():
        return
    world = torch.distributed.group.WORLD
    torch.distributed.barrier()  # every rank past its last collective before teardown
    torch.distributed.destroy_process_group()
    gc.collect()  # main()'s Trainer and its DDP wrapper
    del world  # the last reference: ProcessGroupGloo's destructor (GIL released) joins
    end = time.monotonic() + 10  # its threads (a joined thread leaves /proc just after)
    while gloo_threads() and time.monotonic() < end:
        time.sleep(0.05)
    if gloo_threads():
        raise RuntimeError(f"the gloo process group outlived destroy_process_group(): "
                           f"something still holds it, and its threads {gloo_threads()} "
                           f"would race the interpreter's exit (std::terminate)")


if __name__ == "__main__":
    main()
    release_group()
