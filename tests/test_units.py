"""In-process checks of pure pieces: flags, wrap policy, names, schedule, scaler, clipping, FLOPs."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ASSETS
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, OPTConfig

from fsdp_opt.base import ConfigError, ModelError
from fsdp_opt.config.parse import Config, build_parser, parse_args
from fsdp_opt.config.training import TrainConfig
from fsdp_opt.data.blocks import Blocks
from fsdp_opt.data.pairs import Pairs
from fsdp_opt.data.sequences import Packing
from fsdp_opt.engine import loss as loss_module
from fsdp_opt.engine.evaluation import evaluate_loss
from fsdp_opt.engine.logprobs import scored_logps
from fsdp_opt.engine.loss import HeadLoss
from fsdp_opt.engine.optim import LossScaler, LRSchedule, build_optimizer, create_state, unscale_and_clip_
from fsdp_opt.model.loader import meta_model as build_meta_model
from fsdp_opt.model.parallelize import check_no_shared_params, find_block_classes, find_blocks
from fsdp_opt.model.shapes import flops_per_token
from fsdp_opt.model.sources import model_tag, resolve_model
from fsdp_opt.runtime.distributed import DistEnv
from fsdp_opt.tracking.metrics import set_aside

# ------------------------------------------------------------------ flags


def test_original_flags_keep_their_meaning():
    c = parse_args(
        "--num_epochs 1 --start_idx 0 --end_idx 5000 --batch_size 4 --accum_steps 16 --hf_repo user/repo".split()
    )
    assert (c.train.num_epochs, c.data.start_idx, c.data.end_idx) == (1, 0, 5000)
    assert (c.train.batch_size, c.train.accum_steps, c.hub.hf_repo) == (4, 16, "user/repo")
    assert c.model.model == "facebook/opt-1.3b" and c.data.dataset == "ash001/arxiv-abstract"
    assert (c.data.max_length, c.train.lr, c.train.max_grad_norm) == (512, 5e-6, 1.0)
    assert c.parallel.sharding_strategy == "FULL_SHARD" and c.parallel.activation_checkpointing


def test_boolean_flags_take_optional_values():
    assert parse_args(["--pad_to_max_length"]).data.pad_to_max_length is True
    assert parse_args(["--pad_to_max_length"]).data.packing == "pad"
    assert parse_args([]).data.packing == "docs" and parse_args(["--packing", "pad"]).data.pad_to_max_length is True
    assert parse_args(["--activation_checkpointing", "false"]).parallel.activation_checkpointing is False
    assert parse_args(["--sharding_strategy", "shard_grad_op"]).parallel.sharding_strategy == "SHARD_GRAD_OP"


@pytest.mark.parametrize(
    "argv,needle",
    [
        ("--start_idx 10 --end_idx 10", "--end_idx"),
        ("--batch_size 0", "--batch_size"),
        ("--accum_steps 0", "--accum_steps"),
        ("--sharding_strategy ZERO9", "--sharding_strategy"),
        ("--precision fp8", "--precision"),
        ("--lr_schedule cosine", "--lr_decay_steps"),
        ("--hf_repo nonsense", "--hf_repo"),
        ("--prefetch -1", "--prefetch"),
        ("--loss_chunk_tokens -5", "--loss_chunk_tokens"),
        ("--bogus 1", "--bogus"),
        ("--packing none", "--packing"),
        ("--packing concat --pad_to_max_length", "--pad_to_max_length"),
    ],
)
def test_bad_flags_raise_one_line_naming_the_flag(argv, needle):
    with pytest.raises(ConfigError) as err:
        parse_args(argv.split())
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_readme_documents_every_flag():
    from conftest import ROOT

    readme = (
        ROOT / "README.md"
    ).read_text()  # by name; what each does is in docs/flags.md (tests/commands/test_docs.py)
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert f"`--{action.dest}`" in readme, action.dest


def test_every_flag_has_help_and_config_round_trips():
    parser = build_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.dest
    c = parse_args(["--lr", "0.01", "--model", "tiny-opt"])
    assert Config.from_flat(c.flat()) == c


# ------------------------------------------------------------------ models and wrap policy


def test_model_tags():
    assert model_tag("facebook/opt-1.3b") == "opt_1.3B"
    assert model_tag("facebook/opt-350m") == "opt_350M"
    assert model_tag("tiny-opt") == "tiny_opt"
    assert model_tag("/data/models/My Model/") == "My_Model"


def test_resolve_model_sources(tmp_path):
    assert resolve_model("tiny-opt").kind == "builtin"
    assert resolve_model("facebook/opt-1.3b").kind == "hub"
    with pytest.raises(ModelError, match="no such folder"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def _meta(config):
    config._attn_implementation = "sdpa"
    return build_meta_model(config)


def test_wrap_policy_finds_opt_layers_and_keeps_tied_head_in_root():
    model = _meta(AutoConfig.from_pretrained(ASSETS))
    classes = find_block_classes(model)
    assert {c.__name__ for c in classes} == {"OPTDecoderLayer"}
    blocks = find_blocks(model, classes)
    assert len(blocks) == model.config.num_hidden_layers
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    block_params = {id(p) for b in blocks for p in b.parameters()}
    assert id(model.lm_head.weight) not in block_params
    check_no_shared_params(model, blocks)


@pytest.mark.parametrize(
    "config,block",
    [
        (GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64), "GPT2Block"),
        (
            LlamaConfig(
                num_hidden_layers=2,
                hidden_size=32,
                intermediate_size=64,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=100,
            ),
            "LlamaDecoderLayer",
        ),
    ],
)
def test_wrap_policy_finds_blocks_of_other_architectures(config, block):
    model = _meta(config)
    classes = find_block_classes(model)
    assert {c.__name__ for c in classes} == {block}
    assert len(find_blocks(model, classes)) == 2


def test_wrap_policy_says_when_nothing_matches():
    # an architecture outside the tested families: its blocks are the ones _no_split_modules names
    from transformers import GPTNeoXConfig

    model = _meta(
        GPTNeoXConfig(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=50)
    )
    assert {c.__name__ for c in find_block_classes(model)} == {"GPTNeoXLayer"}
    model._no_split_modules = ["NoSuchLayer"]
    with pytest.raises(ModelError, match="NoSuchLayer"):
        find_block_classes(model)


def test_shared_weight_across_units_is_refused():
    model = _meta(AutoConfig.from_pretrained(ASSETS))
    blocks = find_blocks(model, find_block_classes(model))
    blocks[0].fc1.weight = model.model.decoder.layers[1].fc1.weight
    with pytest.raises(ModelError, match="tied weights"):
        check_no_shared_params(model, blocks)


def test_flops_per_token_matches_the_opt_1_3b_figure():
    config = OPTConfig(
        hidden_size=2048,
        num_hidden_layers=24,
        ffn_dim=8192,
        num_attention_heads=32,
        vocab_size=50272,
        max_position_embeddings=2048,
        word_embed_proj_dim=2048,
    )
    model = _meta(config)
    assert sum(p.numel() for p in model.parameters()) == 1_315_758_080
    # 6N + 12*L*H*Q*T with N = 1.3B - embeddings + lm_head; about 8.17 GFLOP at T=512.
    assert flops_per_token(model, 512) == pytest.approx(8.17e9, rel=0.005)


# ------------------------------------------------------------------ optimisation pieces


def test_lr_schedule_depends_on_global_step_only():
    s = LRSchedule(1e-3, warmup_steps=10)
    assert s(0) == pytest.approx(1e-4) and s(9) == pytest.approx(1e-3) and s(500) == 1e-3
    cos = LRSchedule(1.0, warmup_steps=0, kind="cosine", decay_steps=100, min_lr_ratio=0.1)
    assert cos(0) == pytest.approx(1.0) and cos(50) == pytest.approx(0.55) and cos(100) == pytest.approx(0.1)
    lin = LRSchedule(1.0, warmup_steps=10, kind="linear", decay_steps=10)
    assert lin(15) == pytest.approx(0.5) and lin(40) == pytest.approx(0.0)


def test_loss_scaler_backs_off_counts_skips_and_grows():
    s = LossScaler(enabled=True, init_scale=1024.0, growth_interval=3)
    s.update(False)
    s.update(False)
    assert s.scale == 256.0 and s.skipped_steps == 2
    for _ in range(3):
        s.update(True)
    assert s.scale == 512.0
    r = LossScaler(enabled=True)
    r.load_state_dict(s.state_dict())
    assert (r.scale, r.skipped_steps) == (512.0, 2)
    off = LossScaler(enabled=False)
    off.update(False)
    assert off.scale == 1.0 and off.skipped_steps == 1


@pytest.mark.parametrize("amsgrad", [False, True])
def test_created_adamw_state_is_what_a_first_step_makes(amsgrad):
    """create_state makes the state a zero-gradient step makes (torch's own way to create it), without the step:
    the same keys, shapes, dtypes and devices, and a state_dict that loads back into a fresh optimizer."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    stepped, created = (build_optimizer(model, 1e-3, 0.1, torch.device("cpu")) for _ in range(2))
    for opt in (stepped, created):
        for group in opt.param_groups:
            group["amsgrad"] = amsgrad
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for group in stepped.param_groups:
        group["lr"] = 0.0
    stepped.step()
    create_state(created)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # creating it moved nothing
    assert stepped.state.keys() == created.state.keys()
    for p, want in stepped.state.items():
        got = created.state[p]
        assert got.keys() == want.keys()
        for k in want:
            assert (got[k].shape, got[k].dtype, got[k].device) == (want[k].shape, want[k].dtype, want[k].device), k
        assert float(got["step"]) == 0.0 and not got["exp_avg"].any() and not got["exp_avg_sq"].any()
    again = build_optimizer(model, 1e-3, 0.1, torch.device("cpu"))
    again.load_state_dict(created.state_dict())
    loaded = {p: dict(st) for p, st in again.state.items()}
    create_state(again)  # state present: left as it is
    assert all(again.state[p][k] is v for p, st in loaded.items() for k, v in st.items())


def test_unscale_and_clip_matches_torch_clip_grad_norm():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for pa, pb in zip(a, b):
        g = torch.randn_like(pa) * 3
        pa.grad, pb.grad = g * 128.0, g.clone()
    scaled_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in a]))
    norm = unscale_and_clip_(a, scaled_norm, 128.0, max_norm=1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert norm.item() == pytest.approx(ref.item(), rel=1e-6)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(pa.grad, pb.grad)
    assert math.isclose(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in a])).item(), 1.0, rel_tol=1e-5)


def test_global_batch_sets_accumulation_per_rank_count():
    tc = TrainConfig(batch_size=4, global_batch=128)
    assert [tc.accum_for(w) for w in (1, 2, 8, 32)] == [32, 16, 4, 1]
    assert TrainConfig(batch_size=4, accum_steps=3).accum_for(5) == 3
    with pytest.raises(
        ConfigError, match=r"--global_batch 100: not a multiple of --batch_size 4 x 2 rank\(s\) = 8; use 96 or 104"
    ):
        TrainConfig(batch_size=4, global_batch=100).accum_for(2)
    with pytest.raises(ConfigError, match="use 8,|use 8 or"):
        TrainConfig(batch_size=4, global_batch=2).accum_for(2)
    with pytest.raises(ConfigError, match="give one of them"):
        TrainConfig(global_batch=64, accum_steps=4)
    # --batch_size auto keeps the sequences per step the flags imply (a micro-batch of 4 where auto)
    assert TrainConfig(batch_size="auto", global_batch=96).samples_per_step(2) == 96
    assert TrainConfig(batch_size="auto", accum_steps=16).samples_per_step(2) == 4 * 16 * 2
    assert TrainConfig(batch_size=8, accum_steps=2).samples_per_step(4) == 64


# ------------------------------------------------------------------ the loss's output layer


@pytest.mark.parametrize("chunk", [0, 7])
def test_the_head_loss_at_the_targets_equals_whole_logits_loss_and_gradients(chunk):
    """Against a plain transformers forward and cross-entropy on the whole logits (shifted by slicing): the output
    layer run at the target positions only (rows 0 and 2 have prompts, row 1 a padded tail), whole or 7 at a time
    (chunks end mid-row, the last one is short); the token log-probabilities too, 0 where there is no target."""

    torch.manual_seed(0)
    config = OPTConfig(
        num_hidden_layers=2,
        hidden_size=32,
        ffn_dim=64,
        num_attention_heads=2,
        vocab_size=300,
        max_position_embeddings=64,
        dropout=0.0,
    )
    model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(3, 300, (3, 20))
    labels = ids.clone()
    labels[1, 15:] = -100  # a padded tail
    labels[0, :6] = labels[2, :11] = -100  # prompts
    logits = model(input_ids=ids).logits
    ref = F.cross_entropy(
        logits[:, :-1].reshape(-1, 300), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    ref_logps = torch.zeros(3, 20)
    ref_logps[:, :-1] = -F.cross_entropy(
        logits[:, :-1].reshape(-1, 300).detach(), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="none"
    ).view(3, 19)
    model.zero_grad()
    head = HeadLoss.for_run(model, chunk)
    with head.hidden_states():
        hidden = model(input_ids=ids).logits
    assert hidden.shape == (3, 20, 32)  # the model's forward skipped its output layer
    loss = head.loss_sum(hidden, labels)
    loss.backward()
    assert torch.allclose(loss, ref, rtol=1e-5)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], rtol=1e-4, atol=1e-6), n
    logps = head.token_logps(hidden.detach(), labels).view(3, 20)
    assert torch.allclose(logps, ref_logps, atol=1e-5)
    no_target = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100) == -100
    assert (logps[no_target] == 0).all() and (logps[~no_target] < 0).all()
    assert model(input_ids=ids).logits.shape == (3, 20, 300)  # the projection is back after the block


def test_the_head_loss_runs_the_output_layer_on_the_target_rows_alone_and_on_none_for_a_filler():
    """The rows the projection sees: only the positions with a target; with none (a filler micro-batch), none, yet
    the output layer still gets a gradient (zeros), as every rank's must for the same reduce-scatter."""

    torch.manual_seed(0)
    config = OPTConfig(
        num_hidden_layers=1,
        hidden_size=16,
        ffn_dim=32,
        num_attention_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
        dropout=0.0,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(config)
    head = HeadLoss.for_run(model, 0)
    ids = torch.randint(3, 50, (2, 12))
    labels = torch.full_like(ids, -100)
    labels[0, 8:] = ids[0, 8:]  # 4 answer tokens: positions 7-10 predict them
    with head.hidden_states():
        hidden = model(input_ids=ids).logits
    flat, targets, rows = head._at_targets(hidden, labels)
    assert rows.tolist() == [7, 8, 9, 10] and flat.shape == (4, 16) and targets.tolist() == ids[0, 8:].tolist()
    assert HeadLoss(model, 0, select=False)._at_targets(hidden, labels)[2] is None  # the plan's worst case: every row
    head.loss_sum(hidden, labels).backward()
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)
    with head.hidden_states():
        hidden = model(input_ids=ids).logits
    none = torch.full_like(ids, -100)
    assert head._at_targets(hidden, none)[0].shape == (0, 16)
    (head.token_logps(hidden, none).sum() * 0.0).backward()
    assert model.lm_head.weight.grad is not None and (model.lm_head.weight.grad == 0).all()


def test_the_held_out_loss_and_the_pair_scores_run_the_output_layer_at_the_targets_alone(monkeypatch):
    """evaluate_loss (the held-out loss) and pair_logps (DPO's reference and held-out passes) give what a plain
    transformers forward gives on whole logits, while the projection sees only the positions with a target."""
    torch.manual_seed(0)
    config = OPTConfig(
        num_hidden_layers=1,
        hidden_size=16,
        ffn_dim=32,
        num_attention_heads=2,
        vocab_size=50,
        max_position_embeddings=32,
        dropout=0.0,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    env = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    rows: list[int] = []
    for name in ("_chunk_loss", "_chunk_logps"):
        real = getattr(loss_module, name)
        monkeypatch.setattr(loss_module, name, lambda h, *a, real=real: rows.append(h.shape[0]) or real(h, *a))

    # two rows of 12 tokens, the second with 2 of padding; answers from position 8 and 5
    ids = torch.randint(3, 50, (2, 12), dtype=torch.int32)
    ids[1, 10:] = 1
    targets = torch.zeros(2, 12, dtype=torch.bool)
    targets[0, 8:], targets[1, 5:10] = True, True
    blocks = Blocks(ids, torch.tensor([12, 10]), pad_id=1, targets=targets)
    got = evaluate_loss(model, blocks, 2, env)
    with torch.no_grad():
        logits = model(
            input_ids=ids.long(), attention_mask=(torch.arange(12) < torch.tensor([[12], [10]])).long()
        ).logits
    logp = torch.log_softmax(logits.double(), -1)
    picked = [logp[r, t - 1, ids[r, t]] for r in range(2) for t in range(1, 12) if targets[r, t]]
    assert got["tokens"] == len(picked) == 9 and rows == [9]
    assert abs(got["loss"] + float(sum(picked)) / 9) <= 1e-5, got

    # one pair, chosen and rejected: a 6-token prompt, answers of 3 and 2 tokens, one row each (--packing pad)
    rows.clear()
    prompt = torch.randint(3, 50, (6,)).tolist()
    answers = [torch.randint(3, 50, (3,)).tolist(), torch.randint(3, 50, (2,)).tolist()]
    seqs = [prompt + a for a in answers]
    pairs = Pairs(seqs, [[k >= 6 for k in range(len(q))] for q in seqs], [0], Packing(0, 16, "pad", "sdpa"))
    scores = scored_logps(model, pairs, 1, env)
    expected = []
    for q in seqs:
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([q])).logits[0].double(), -1)
        expected.append(float(sum(lp[t - 1, q[t]] for t in range(6, len(q)))))
    assert torch.allclose(scores.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-5), (scores, expected)
    assert rows == [5]  # the answers' 3 + 2 tokens, not the 18 positions of the two rows


def test_chunks_are_refused_where_logits_are_not_a_plain_projection():
    from transformers import Gemma2Config

    config = Gemma2Config(
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        vocab_size=100,
        final_logit_softcapping=30.0,
    )
    config._attn_implementation = "eager"
    gemma = build_meta_model(config)
    with pytest.raises(ConfigError, match="--loss_chunk_tokens.*final_logit_softcapping"):
        HeadLoss(gemma, 64)
    assert HeadLoss.for_run(gemma, 0) is None  # without chunks such a model keeps its whole logits
    HeadLoss(_meta(AutoConfig.from_pretrained(ASSETS)), 64)  # OPT: a bias-free Linear, tied to the embeddings


def test_fused_adamw_of_cuda_runs_steps_dtensor_parameters_like_foreach():
    """CUDA runs build fused AdamW; the same kernel family runs on CPU, so the DTensor path is checked here."""
    import subprocess
    import sys

    from conftest import ROOT

    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "fused_adamw.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cpu_fused, cuda_fused, diff = proc.stdout.split()
    assert cpu_fused == "None" and cuda_fused == "True" and float(diff) < 1e-6


def test_resume_command_names_the_launch_that_ran():
    from fsdp_opt.runtime.stopping import resume_command

    argv = ["--end_idx", "40", "--resume_file", "old.pt"]
    assert (
        resume_command("new.pt", argv, "fsdp_finetune.py")
        == "python fsdp_finetune.py --end_idx 40 --resume_file new.pt"
    )
    wheel = resume_command("new.pt", argv, "/site/fsdp_opt/__main__.py")
    assert wheel == "python -m fsdp_opt --end_idx 40 --resume_file new.pt"


def test_the_step_logs_keep_one_record_per_step(tmp_path):
    """A session starting at global step 2 (a resume after a kill at step 4, or --overwrite from 0): the later records
    move to the .replaced.jsonl beside each log, appended; a line that is not a record stays where it was."""

    def write(name: str, steps: list[int]) -> None:
        (tmp_path / name).write_text("".join(json.dumps({"step": s, "loss": s / 10}) + "\n" for s in steps))

    write("metrics.jsonl", [1, 2, 3, 4])
    write("eval.jsonl", [2, 4])
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write("not a record\n")
    assert set_aside(tmp_path, 2) == {"metrics.jsonl": 2, "eval.jsonl": 1}
    kept = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in kept[:-1]] == [1, 2] and kept[-1] == "not a record"
    assert [json.loads(line)["step"] for line in (tmp_path / "eval.jsonl").read_text().splitlines()] == [2]
    write("metrics.jsonl", [1, 2, 3])
    assert set_aside(tmp_path, 0) == {"metrics.jsonl": 3, "eval.jsonl": 1} and set_aside(tmp_path, 0) == {}
    moved = [json.loads(line)["step"] for line in (tmp_path / "metrics.replaced.jsonl").read_text().splitlines()]
    assert moved == [3, 4, 1, 2, 3]
