"""A Hugging Face ``Trainer`` run with no detfp code: the zoo runs it under the launcher.

``python -m detfp_capture --out DIR --level L -- tests/zoo/trainer_train.py OUT.json [options]``
(or under ``torchrun``: Trainer then wraps the model in DDP over gloo through ``accelerate``).
A tiny GPT-2 built from a config (nothing downloaded) is trained for a few steps by
``Trainer.train()`` on a synthetic causal-LM dataset, with Trainer's own seeding, dataloader,
AdamW, linear schedule and gradient clipping. Plants behind options: a nondeterministic op (the
first MLP's input projection through the plain script's split-K op, whose summation order is
set per run from ``--plant-step`` on), one changed token in one
batch (``--data-step``: the collator changes the batch of that step), and a resume from
Trainer's own checkpoint (``--save`` then ``--resume``), with or without its RNG state. It writes the loss bits per logged step and a SHA-256 of the final parameters
to ``OUT.json`` (rank 0), so runs with and without capture can be compared.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import struct

import torch
from plain_train import _ORDER, split_k_mm  # the zoo's planted op (tests/zoo/plain_train.py)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class _Tokens(torch.utils.data.Dataset):
    """A fixed synthetic causal-LM dataset: sample ``i`` is a seeded run of token ids."""

    def __init__(self, n: int, length: int, vocab: int) -> None:
        gens = [torch.Generator().manual_seed(i) for i in range(n)]
        self.items = [torch.randint(0, vocab, (length,), generator=g) for g in gens]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.items[i], "labels": self.items[i]}


class _Collate:
    """Stacks a batch; with a plant, changes one token of the ``plant``-th batch it builds
    (one batch per optimizer step: no accumulation, no worker processes)."""

    def __init__(self, vocab: int, plant: int | None) -> None:
        self.vocab, self.plant, self.calls = vocab, plant, 0

    def __call__(self, items: list[dict]) -> dict:
        ids = torch.stack([it["input_ids"] for it in items])
        if self.calls == self.plant:
            ids[0, 0] = (ids[0, 0] + 1) % self.vocab
        self.calls += 1
        return {"input_ids": ids, "labels": ids.clone()}


def _split_k_projection(conv: torch.nn.Module) -> None:
    """Route a GPT-2 ``Conv1D`` (``x @ weight + bias``) through the split-K op."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = split_k_mm(x.reshape(-1, x.shape[-1]), conv.weight) + conv.bias
        return flat.view(*x.shape[:-1], conv.weight.shape[1])

    conv.forward = forward


class _Order(TrainerCallback):
    """Sets the split-K op's summation order at the start of each optimizer step."""

    def __init__(self, order: str, plant_step: int) -> None:
        self.order, self.plant_step = order, plant_step

    def on_step_begin(self, args, state, control, **kwargs):
        _ORDER[0] = self.order if state.global_step >= self.plant_step else "fwd"


class _Losses(TrainerCallback):
    """The exact loss bits Trainer logs each step."""

    def __init__(self) -> None:
        self.losses: list[str] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(struct.pack("<d", float(logs["loss"])).hex())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--order", default="fwd", help="plant: the split-K op's summation order (fwd, rev)")
    p.add_argument("--plant-step", type=int, default=1)
    p.add_argument("--data-step", type=int, default=None, help="plant: one changed token in this step's batch")
    p.add_argument("--data-rank", type=int, default=None, help="plant the changed token on this rank only")
    p.add_argument("--save", default=None, help="Trainer's output_dir; a checkpoint after every step")
    p.add_argument("--resume", default=None, help="resume from this Trainer checkpoint directory")
    p.add_argument("--no-rng", action="store_true", help="resume from a copy of the checkpoint without its RNG state")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.1  # dropout on: the RNG matters
    out_dir = args.save or os.path.join(os.path.dirname(os.path.abspath(args.out)), "trainer_out")
    targs = TrainingArguments(
        output_dir=out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="steps" if args.save else "no",
        save_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    losses = _Losses()

    def model_init() -> GPT2LMHeadModel:
        model = GPT2LMHeadModel(cfg)
        _split_k_projection(model.transformer.h[0].mlp.c_fc)
        return model

    trainer = Trainer(
        model_init=model_init,
        args=targs,
        train_dataset=_Tokens(16, 12, cfg.vocab_size),
        data_collator=_Collate(cfg.vocab_size, args.data_step if args.data_rank in (None, rank) else None),
        callbacks=[losses, _Order(args.order, args.plant_step)],
    )
    resume = args.resume
    if resume and args.no_rng:
        resume = os.path.join(out_dir, "no_rng_" + os.path.basename(resume))
        shutil.copytree(args.resume, resume, ignore=shutil.ignore_patterns("rng_state*"), dirs_exist_ok=True)
    trainer.train(resume_from_checkpoint=resume)
    model = trainer.model
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses.losses, "params": h.hexdigest()}, f)


if __name__ == "__main__":
    main()
