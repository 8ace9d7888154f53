"""The hf_trainer configuration of benchmarks/throughput.py: transformers' Trainer with FSDP2, run in its workers."""

from __future__ import annotations

import argparse
import statistics
import time


def run_hf_trainer(args: argparse.Namespace, env, out_dir: str) -> dict:
    """transformers' Trainer with FSDP2 on the blocks fsdp-opt packs, the same wrap, precision and global batch."""
    import torch
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from fsdp_opt.data.blocks import build_blocks
    from fsdp_opt.data.formats import select_texts
    from fsdp_opt.data.sources import load_rows
    from fsdp_opt.model.parallelize import find_block_classes, local_state_bytes, resolve_precision
    from fsdp_opt.model.shapes import Shape, flops_per_token, model_config
    from fsdp_opt.model.sources import load_model_config, load_tokenizer, resolve_model
    from fsdp_opt.planner.inputs import Inputs, state_bytes
    from fsdp_opt.runtime.distributed import peak_memory_bytes

    source = resolve_model(args.model)
    config, tokenizer = load_model_config(source), load_tokenizer(source)
    texts, _ = select_texts(load_rows(args.dataset), "text", 0, None)
    blocks = build_blocks(texts, tokenizer, args.max_length, packing="concat")
    precision = resolve_precision(args.precision, env.device)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    wrap = sorted(k.__name__ for k in find_block_classes(model))
    mean_targets = float(blocks.target_counts().float().mean())

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(blocks)

        def __getitem__(self, i: int) -> dict:
            b = blocks.batch(torch.tensor([i]), torch.device("cpu"))
            return {k: v[0] for k, v in b.items()}

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    class FSDPTrainer(Trainer):
        """Trainer as it is, except on CPU: accelerate turns its FSDP plugin on only for accelerator devices and
        would fall back to DDP on gloo, so here the same FSDP2 plugin is switched on after the accelerator is made."""

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            if not self.is_fsdp_enabled and state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    cpu = env.device.type == "cpu"
    targs = TrainingArguments(
        output_dir=out_dir,
        use_cpu=cpu,
        ddp_backend="gloo" if cpu else None,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accum_steps,
        max_steps=args.warmup + args.steps,
        learning_rate=1e-4,
        fp16=precision == "fp16",
        bf16=precision == "bf16",
        fsdp=True,
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": wrap,
            "activation_checkpointing": True,
            "reshard_after_forward": True,
        },
        report_to=[],
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = FSDPTrainer(model=model, args=targs, train_dataset=Rows(), callbacks=[Clock()])
    trainer.train()
    from torch.distributed.fsdp import FSDPModule

    if not any(isinstance(m, FSDPModule) for m in trainer.model.modules()):
        raise RuntimeError(f"Trainer did not shard the model with FSDP2 ({type(trainer.model_wrapped).__name__})")
    # One more backward without a step, as for the engine, so gradients sit next to parameters and Adam state.
    batch = {k: v.to(env.device) for k, v in blocks.batch(torch.arange(args.batch_size), env.device).items()}
    trainer.model(**batch).loss.backward()
    state = local_state_bytes(
        trainer.model, trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    )
    shape = Shape.of(model_config(args.model))
    inputs = Inputs(gpus=env.world_size, nodes=env.num_nodes, precision=precision, cuda=not cpu)
    timed = times[args.warmup :]
    global_batch = args.batch_size * env.world_size * args.accum_steps
    return {
        "useful_tokens_per_s": global_batch * mean_targets * len(timed) / sum(timed),
        "step_time_s": statistics.median(timed),
        "flops_per_token": flops_per_token(model, args.max_length),
        "global_batch": global_batch,
        "peak_state_bytes_per_rank": state["total"],
        "predicted_state_bytes_per_rank": sum(state_bytes(shape, "FULL_SHARD", inputs).values()),
        "peak_memory_bytes_per_rank": peak_memory_bytes(env.device),
        "precision": precision,
        "strategy": "FULL_SHARD (Trainer, FSDP2)",
        "note": "useful tokens: steps x global batch x the mean target tokens of a packed block",
    }
