"""Third-party training workloads for the zoo tests: models and wrappers nobody here wrote.

One launch (``torchrun --nproc_per_node N tests/zoo/zoo_train.py PLAN.json``, or a single
process) runs every job of a plan in sequence, so the import of torch and transformers and
the process group are paid once. A job is one training run:

* model: a Hugging Face ``transformers`` model built from a tiny config with random
  weights (``gpt2``, ``llama``, ``mixtral``) or a small torch CNN (``cnn``);
* wrap: ``ddp`` (DistributedDataParallel over gloo), ``fsdp2`` (``fully_shard`` per layer
  and root), or ``none``; watch: ``bare`` (``session.watch(model)`` before wrapping),
  ``wrapped`` (``watch(ddp_model)``) or ``late`` (the wrapper exists before the Session);
* options: Hugging Face gradient checkpointing, ``torch.autocast("cpu", bfloat16)``,
  ``model.compile()``, dropout, AdamW hyperparameters;
* plants: a nondeterministic custom op (split-K style: the chunks of a matmul summed in an
  order that differs between the two runs) inside one module, one changed token on one
  rank, a checkpoint resume with or without the RNG state;
* capture: ``out`` (a trace directory) and ``level``; without ``out`` capture is off.

Each rank writes ``RESULTS/<job>.rank<r>.json``: the loss bits per step and a SHA-256 of
the final parameters, so capture on vs off can be compared bit for bit. Nothing here
sets ``torch.use_deterministic_algorithms``: users debugging nondeterminism run without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

#: Order of the split-K chunks in the current job ("fwd" or "rev"); the op reads it at run
#: time, so the dispatcher sees identical inputs and arguments in both runs.
_ORDER = ["fwd"]


@torch.library.custom_op("detfp_zoo::split_k_mm", mutates_args=())
def split_k_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` with the inner dimension summed in 4 chunks, in an order set per run."""
    k = w.shape[0]
    bounds = [(i * k // 4, (i + 1) * k // 4) for i in range(4)]
    if _ORDER[0] == "rev":
        bounds.reverse()
    out = None
    for lo, hi in bounds:
        part = x[..., lo:hi] @ w[lo:hi]
        out = part if out is None else out + part
    return out


@split_k_mm.register_fake
def _(x, w):
    return x.new_empty((*x.shape[:-1], w.shape[1]))


def _split_k_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _split_k_backward(ctx, grad):
    x, w = ctx.saved_tensors
    grad = grad.to(x.dtype)  # under autocast the incoming gradient may be bf16
    gx = grad @ w.t().to(x.dtype)
    gw = x.reshape(-1, x.shape[-1]).t() @ grad.reshape(-1, grad.shape[-1])
    return gx, gw.to(w.dtype)


split_k_mm.register_autograd(_split_k_backward, setup_context=_split_k_setup)

VOCAB, SEQ, BATCH = 64, 8, 2


def build_model(job: dict) -> tuple[torch.nn.Module, str]:
    """(model, path of the module the nondeterministic plant goes into)."""
    kind = job["model"]
    drop = float(job.get("dropout", 0.0))
    if kind == "cnn":
        model = torch.nn.Sequential(
            torch.nn.Conv2d(1, 4, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.Dropout(drop),
            torch.nn.Flatten(),
            torch.nn.Linear(4 * 6 * 6, 10),
        )
        return model, "4"
    import transformers

    transformers.logging.set_verbosity_error()
    common = dict(vocab_size=VOCAB, max_position_embeddings=SEQ * 2)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=32, n_layer=2, n_head=2, n_positions=SEQ * 2, vocab_size=VOCAB,
            resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop, bos_token_id=0, eos_token_id=0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(cfg)
        target = "transformer.h.0.mlp.c_fc"
    elif kind == "llama":
        cfg = transformers.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, attention_dropout=drop, bos_token_id=0, eos_token_id=0, **common,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
        target = "model.layers.0.mlp.up_proj"
    elif kind == "mixtral":
        cfg = transformers.MixtralConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, attention_dropout=drop,
            router_aux_loss_coef=0.01, output_router_logits=True, bos_token_id=0, eos_token_id=0, **common,
        )  # fmt: skip
        model = transformers.MixtralForCausalLM(cfg)
        target = "model.layers.0.self_attn.q_proj"
    else:
        raise SystemExit(f"zoo: unknown model {kind!r}")
    model.config.use_cache = False
    return model, target


def plant_split_k(model: torch.nn.Module, path: str) -> None:
    """Route ``path`` (a Linear or GPT-2 Conv1D) through the split-K custom op."""
    m = model.get_submodule(path)
    transposed = type(m).__name__ == "Conv1D"  # GPT-2 stores the weight as (in, out)

    def forward(x: torch.Tensor) -> torch.Tensor:
        w = m.weight if transposed else m.weight.t()
        y = split_k_mm(x, w)
        return y if m.bias is None else y + m.bias

    m.forward = forward


def batch_for(job: dict, step: int, rank: int) -> dict:
    """The step's batch on this rank; the data plant changes one element of it. Every run does
    the same ops (adding 0 or 1), so only the values differ, as with a real data difference."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    delta = int(job.get("data_rank") == rank and step == job.get("data_step"))
    if job["model"] == "cnn":
        x = torch.randn(BATCH * 2, 1, 6, 6, generator=g)
        y = torch.randint(0, 10, (BATCH * 2,), generator=g)
        x[0, 0, 0, 0] += float(delta)
        return {"x": x, "y": y}
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    ids[0, 0] = (ids[0, 0] + delta) % VOCAB
    return {"input_ids": ids, "labels": ids.clone()}


def loss_of(model: torch.nn.Module, job: dict, batch: dict) -> torch.Tensor:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if job.get("autocast") else contextlib.nullcontext()
    with ctx:
        if job["model"] == "cnn":
            return torch.nn.functional.cross_entropy(model(batch["x"]), batch["y"])
        return model(**batch).loss  # an MoE model adds its load-balancing loss into it


def wrap(model: torch.nn.Module, job: dict) -> torch.nn.Module:
    how = job.get("wrap", "none")
    if how == "ddp":
        # Small buckets (several per backward) unless compiled: dynamo's DDPOptimizer wants
        # the first bucket no larger than the others.
        cap = 25.0 if job.get("compile") else 0.01
        return torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", None), "layers", None) or getattr(
            getattr(model, "transformer", None), "h", None
        )
        for layer in layers or []:
            fully_shard(layer)
        fully_shard(model)
        return model
    return model


def params_sha(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        t = p.detach()
        if hasattr(t, "full_tensor"):
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rng_state() -> dict:
    return {"cpu": torch.get_rng_state()}


def run_job(job: dict, rank: int, world: int, results: Path) -> None:
    from detfp_capture import Session

    torch.set_num_threads(int(job.get("threads", 1)))
    torch.manual_seed(int(job.get("seed", 0)))
    _ORDER[0] = "fwd"
    model, target = build_model(job)
    if job.get("plant_step") is not None:
        plant_split_k(model, target)
    if job.get("gc"):
        model.gradient_checkpointing_enable()
    if job.get("compile"):
        model.compile()  # Inductor on CPU, in place: DDP then wraps the compiled module
    if job.get("dropout"):
        model.train()
    start = int(job.get("start_step", 0))
    steps = int(job["steps"])
    session = None
    watch = job.get("watch", "bare")
    out = job.get("out")
    if out and watch in ("bare", "wrapped"):
        session = Session(out, job["level"], append=bool(job.get("append")))
    if session is not None and watch == "bare":
        session.watch(model)
    net = wrap(model, job)
    if out and watch == "late":
        session = Session(out, job["level"])
        session.watch(model)
    if session is not None and watch == "wrapped":
        session.watch(net)
    state = None
    if job.get("load_ckpt"):  # after wrapping: FSDP2's state is sharded DTensors
        state = torch.load(f"{job['load_ckpt']}.rank{rank}.pt", weights_only=False)
        model.load_state_dict(state["model"])
    hp = job.get("adamw", {})
    opt = torch.optim.AdamW(
        model.parameters(), lr=hp.get("lr", 1e-2), weight_decay=hp.get("weight_decay", 0.01), foreach=hp.get("foreach")
    )
    if session is not None:
        session.watch_optimizer(opt)
    if state is not None:
        opt.load_state_dict(state["opt"])
        if job.get("restore_rng", True):
            torch.set_rng_state(state["rng"]["cpu"])
    losses = []
    for step in range(start, steps):
        if job.get("plant_step") is not None and step >= job["plant_step"]:
            _ORDER[0] = job.get("order", "fwd")
        batch = batch_for(job, step, rank)  # the data loader runs before the step
        ctx = session.step(step) if session is not None else contextlib.nullcontext()
        with ctx:
            loss = loss_of(net, job, batch)
            if session is not None:
                session.metric("loss", loss.detach())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(struct.pack("<d", float(loss.detach())).hex())
        if job.get("save_ckpt") is not None and step == job["save_ckpt"]:
            torch.save(
                {"model": model.state_dict(), "opt": opt.state_dict(), "rng": rng_state()},
                f"{job['ckpt']}.rank{rank}.pt",
            )
    if session is not None:
        session.close()
    res = {"losses": losses, "params": params_sha(model)}
    (results / f"{job['name']}.rank{rank}.json").write_text(json.dumps(res))


def main(argv: list[str]) -> int:
    plan = json.loads(Path(argv[0]).read_text())
    results = Path(argv[1])
    results.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    try:
        for job in plan:
            run_job(job, rank, world, results)
            if world > 1:
                dist.barrier()
    finally:
        if world > 1:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
