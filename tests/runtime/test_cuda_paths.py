"""The CUDA-only branches whose logic runs on CPU: the process group's arguments, one GPU per process, the plan's
attention-mask, NF4 and runtime terms, and the notebook's GPU line without a CUDA context in the kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, plan_cli

from fsdp_opt.base import GIB, ConfigError
from fsdp_opt.commands.gpu_table import CONTEXT_WORDS
from fsdp_opt.model.shapes import Shape, model_config
from fsdp_opt.planner import lora as planner_lora
from fsdp_opt.planner.inputs import CUDA_CONTEXT_BYTES, NCCL_BUFFER_BYTES, Inputs
from fsdp_opt.planner.lora import components
from fsdp_opt.planner.memory import mask_bytes, memory
from fsdp_opt.runtime.distributed import backend_for, cuda_index
from fsdp_opt.runtime.gpus import contexts_held


def test_the_cuda_group_is_not_bound_to_a_device():
    # A bound default group makes a 2-D mesh (NO_SHARD, HYBRID_SHARD) use split_group, which fails on torch 2.8 for
    # "cpu:gloo,cuda:nccl" (pytorch issue 159200).
    backend, kwargs = backend_for(torch.device("cuda", 1))
    assert backend == "cpu:gloo,cuda:nccl" and "device_id" not in kwargs
    assert backend_for(torch.device("cpu")) == ("gloo", {})


def test_more_processes_than_gpus_is_refused_in_one_line():
    assert [cuda_index(r, 2, 2) for r in range(2)] == [0, 1]
    assert cuda_index(0, 1, 8) == 0
    with pytest.raises(ConfigError) as e:
        cuda_index(2, 4, 2)  # 4 processes on 2 GPUs: two would share a GPU and NCCL would fail
    assert str(e.value).startswith("--nproc_per_node 4: this node has 2 GPU(s)") and "\n" not in str(e.value)


def test_the_attention_mask_term_pads_to_8_columns_and_has_no_copy_per_head():
    shape = Shape.of(model_config("facebook/opt-1.3b"))
    b, s, c = 4, 500, 2  # 500 is not a multiple of 8 or 16
    cuda = Inputs(batch_size=b, max_length=s, packing="docs")
    # Hand count: the boolean [b, 1, s, s] mask, plus one fp16 [b, 1, s, 504] copy (the block being recomputed).
    assert mask_bytes(shape, cuda, b, c) == b * s * s + b * s * 504 * 2
    no_ckpt = Inputs(batch_size=b, max_length=s, packing="docs", activation_checkpointing=False)
    assert mask_bytes(shape, no_ckpt, b, c) == b * s * s + 24 * b * s * 504 * 2
    assert mask_bytes(shape, Inputs(batch_size=b, max_length=512, packing="docs"), b, c) == b * 512 * 512 * 3
    cpu = Inputs(batch_size=b, max_length=s, packing="docs", cuda=False)
    assert mask_bytes(shape, cpu, b, c) == b * s * s * 3


NF4_PEAK = """
import re, warnings, torch
from pathlib import Path
warnings.simplefilter("ignore")
from fsdp_opt.model.nf4 import _to_nf4
to_nf4 = _to_nf4()
rows, cols = 4096, 4096
q = to_nf4(torch.randn(rows, cols, dtype=torch.float16))
x = torch.randn(4, cols, dtype=torch.float16)
def kib(field):
    return int(re.search(field + r":\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
Path("/proc/self/clear_refs").write_text("5")  # the peak RSS (VmHWM) starts again from the RSS now
before = kib("VmRSS")
y = torch.nn.functional.linear(x, q)
print((kib("VmHWM") - before) / (rows * cols))
"""


def test_the_nf4_dequantization_term_covers_torchaos_measured_peak(monkeypatch):
    """The plan's transient for dequantizing an NF4 weight against the process's peak RSS growth around one matmul
    with a 4096 x 4096 NF4 weight (torchao on CPU; the kernel's peak-RSS mark is reset just before it)."""
    from fsdp_opt.planner.lora import NF4_DEQUANT_BYTES

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", NF4_PEAK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    measured = float(out.stdout.strip().splitlines()[-1])
    assert measured > 8  # far above the compute-dtype copy alone (2 bytes per weight)
    assert measured <= 1.1 * NF4_DEQUANT_BYTES and NF4_DEQUANT_BYTES <= 1.5 * measured  # RSS varies by ~1 B
    shape = Shape.of(model_config("facebook/opt-1.3b"))
    largest = max(i * o for _, i, o in shape.linears)
    four = Inputs(batch_size=4, max_length=512, lora_rank=16, base_bits=4)
    with_term = components(shape, "FULL_SHARD", four, 4, 2)["gathered_weights"]
    monkeypatch.setattr(planner_lora, "NF4_DEQUANT_BYTES", 0)
    assert with_term - components(shape, "FULL_SHARD", four, 4, 2)["gathered_weights"] == 18 * largest


def test_the_plan_takes_a_t4_as_torch_reads_it_less_context_and_nccl():
    assert Inputs().gpu_memory == int(14.56 * GIB)
    shape = Shape.of(model_config("facebook/opt-1.3b"))
    two, one = memory(shape, "FULL_SHARD", Inputs(gpus=2)), memory(shape, "NO_SHARD", Inputs(gpus=1))
    rest = lambda parts: sum(v for k, v in parts.items() if k != "runtime")  # noqa: E731
    assert two["runtime"] - int(0.05 * (rest(two) - two["gradients"])) == CUDA_CONTEXT_BYTES + NCCL_BUFFER_BYTES
    assert one["runtime"] - int(0.05 * (rest(one) - one["gradients"])) == CUDA_CONTEXT_BYTES
    text = plan_cli([]).stdout
    assert "14.56 GiB each" in text


def test_the_notebooks_gpu_line_makes_no_cuda_context_in_the_kernel(tmp_path, monkeypatch):
    """Two T4s as nvidia-smi reports them; torch.cuda's calls that initialise CUDA in this process are traps."""
    from fsdp_opt.commands.notebook import gpu_summary

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '0, Tesla T4, 15360, 7.5\\n1, Tesla T4, 15360, 7.5\\n'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def trap(*a, **k):
        raise AssertionError("CUDA initialised in the kernel")

    for name in ("is_bf16_supported", "get_device_properties", "init", "get_device_capability", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, trap)
    lines = gpu_summary().splitlines()
    assert lines == [f"cuda:{i} Tesla T4, 15.00 GiB, compute 7.5, no bf16 (fp16 with loss scaling)" for i in (0, 1)]
    fake.write_text("#!/bin/sh\nprintf '0, NVIDIA A100-SXM4-40GB, 40960, 8.0\\n'\n")
    assert gpu_summary() == "cuda:0 NVIDIA A100-SXM4-40GB, 40.00 GiB, compute 8.0, bf16"


def test_the_child_process_reads_each_gpu_and_its_free_memory(tmp_path, monkeypatch):
    """from_a_child_process: the child's own query, run by a real interpreter against a stand-in torch.cuda (a T4 with
    0.3 GiB taken by the context); before, its NameError made every GPU machine fall back to nvidia-smi, which has no
    free memory: gpu_check's usable-memory row stayed empty."""
    from fsdp_opt.runtime.gpus import from_a_child_process

    stand_in = tmp_path / "torch"
    stand_in.mkdir()
    (stand_in / "__init__.py").write_text(
        "from types import SimpleNamespace as N\n"
        "cuda = N(device_count=lambda: 1,\n"
        "         get_device_properties=lambda i: N(name='Tesla T4', total_memory=15828320256, major=7, minor=5),\n"
        "         mem_get_info=lambda i: (15828320256 - 3 * 2**30 // 10, 15828320256))\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    (gpu,) = from_a_child_process()
    assert gpu["name"] == "Tesla T4" and gpu["capability"] == "7.5" and gpu["index"] == 0
    assert gpu["memory_gib"] == 15828320256 / 2**30
    assert abs(gpu["free_after_context_gib"] - (15828320256 / 2**30 - 0.3)) < 1e-9


class StandInDriver:
    """libcuda's four calls that `contexts_held` makes, answering for GPUs whose primary contexts are `active`."""

    def __init__(self, active: list[int], init_error: int = 0) -> None:
        self.active, self.init_error, self.asked = active, init_error, []

    def cuInit(self, flags):  # noqa: N802, ANN001, ANN201
        return self.init_error

    def cuDeviceGetCount(self, count):  # noqa: N802, ANN001, ANN201
        count._obj.value = len(self.active)
        return 0

    def cuDeviceGet(self, device, ordinal):  # noqa: N802, ANN001, ANN201
        device._obj.value = 100 + ordinal  # a handle, not the ordinal
        return 0

    def cuDevicePrimaryCtxGetState(self, device, flags, active):  # noqa: N802, ANN001, ANN201
        self.asked.append(device.value)
        active._obj.value = self.active[device.value - 100]
        return 0


def test_whether_a_process_holds_a_cuda_context_is_the_drivers_answer():
    """gpu_check's context row asks the driver for each GPU's primary context (torch.cuda.is_initialized() said yes on
    the H200 machine where importing transformers beside torchao had made none). A driver that does not answer, or no
    driver at all (this machine), gives None: "not known", never "none"."""
    driver = StandInDriver([0, 1])
    assert contexts_held(driver) == [False, True] and driver.asked == [100, 101]
    assert contexts_held(StandInDriver([0, 0])) == [False, False]
    assert contexts_held(StandInDriver([1], init_error=100)) is None  # CUDA_ERROR_NO_DEVICE
    if not torch.cuda.is_available():  # no driver, or one with no GPU: no answer
        assert contexts_held() is None
    assert CONTEXT_WORDS[None].startswith("not known") and CONTEXT_WORDS[False] == "none"
