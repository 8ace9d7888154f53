"""GGUF files (llama.cpp, Ollama, LM Studio) from a Hugging Face model folder, through llama.cpp's own `gguf` package:
its GGUFWriter for the header, keys and tensor table, its tensor map for the names, its numpy quantisation.

    --gguf f16 | bf16 | q8_0 | q4_0   (one or more)   ->   <name>-<type>.gguf and a Modelfile beside each

The weights are read from the folder's safetensors files with plain reads (no memory map, whose pages would count in
the process's RSS), one tensor at a time and a large one in blocks of rows, changed (a family's conventions:
gguf_arch.py), quantised and written: host RAM stays near one block whatever the model's size. Before writing, the
plan says what it needs (the files' bytes, the host RAM), and a machine without the room is refused in one line.

Which tensors get which type: 1-D tensors (norms, biases, rope factors) in F32 as llama.cpp's converter keeps them;
2-D ones in the type asked; at q4_0 the embedding and the output layer in Q8_0 (llama.cpp's quantizer keeps them
wider, in a K-quant the `gguf` package cannot write); a row length that is not a multiple of 32 in F16.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from fsdp_opt.base import CheckpointError, ConfigError, size_text
from fsdp_opt.checkpoint.atomic import atomic_path
from fsdp_opt.checkpoint.gguf_arch import Tensor, architecture, plan_tensors, refusal, write_hparams
from fsdp_opt.checkpoint.gguf_vocab import PHI3_NAMES, write_vocab
from fsdp_opt.checkpoint.modelfile import write_modelfile
from fsdp_opt.runtime.hostmem import rss_bytes, total_memory_bytes

GGUF_TYPES = ("f16", "bf16", "q8_0", "q4_0")
BLOCK_ELEMENTS = 1 << 24  # a large tensor is changed and quantised this many values at a time (16M: 64 MiB in fp32)
# Host bytes per value of a block while it is read, widened to fp32, changed and quantised (numpy's quantisers make a
# few fp32 temporaries of the block), measured in tests/checkpoint/test_gguf.py with room to spare.
BYTES_PER_VALUE = 24
SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}


def ggml_type(qtype: str, tensor: Tensor):  # noqa: ANN201 - gguf's enum
    from gguf import GGMLQuantizationType as T

    if len(tensor.shape) == 1 or tensor.source is None:
        return T.F32
    if qtype in ("f16", "bf16"):
        return T.F16 if qtype == "f16" else T.BF16
    if tensor.shape[-1] % 32:
        return T.F16
    if qtype == "q4_0" and tensor.name in ("token_embd.weight", "output.weight"):
        return T.Q8_0
    return T.Q8_0 if qtype == "q8_0" else T.Q4_0


def tensor_bytes(shape: tuple[int, ...], kind) -> int:  # noqa: ANN001
    from gguf import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[kind]
    return math.prod(shape) // block * size


@dataclass
class GgufPlan:
    """What writing one GGUF needs: its file's bytes, and the host RAM above what the process holds."""

    qtype: str
    path: Path
    tensors: list[Tensor]
    file_bytes: int
    ram_bytes: int

    def line(self) -> str:
        return (
            f"gguf: {self.path.name} ({self.qtype}, {len(self.tensors)} tensors): {size_text(self.file_bytes)} on disk, "
            f"up to {size_text(self.ram_bytes)} of host RAM while it is written, tensor by tensor"
        )


def block_rows(tensor: Tensor) -> int:
    """Rows read at a time: the whole tensor when its change mixes rows (llama's q/k permutation), else blocks."""
    if tensor.change is not None and tensor.change.__name__ != "plus_one":
        return tensor.shape[0]
    row = math.prod(tensor.shape[1:]) or 1
    return max(1, min(tensor.shape[0], BLOCK_ELEMENTS // row))


def plan(config: PretrainedConfig, shapes: dict[str, tuple[int, ...]], qtype: str, path: Path) -> GgufPlan:
    tensors = plan_tensors(config, shapes)
    header = 1 << 20  # keys and the tokenizer: a few MB for a 150k vocabulary
    vocab = 64 * config.vocab_size
    data = sum(tensor_bytes(t.shape, ggml_type(qtype, t)) + 32 for t in tensors)
    largest = max(block_rows(t) * (math.prod(t.shape[1:]) or 1) for t in tensors)
    return GgufPlan(qtype, path, tensors, header + vocab + data, largest * BYTES_PER_VALUE + 4 * vocab + header)


def check_room(plans: list[GgufPlan], folder: Path, free_disk: int | None = None, host_ram: int | None = None) -> None:
    """Refuse, in one line, a set of GGUFs that does not fit the disk or the host RAM (as given, or this machine's)."""
    need = sum(p.file_bytes for p in plans)
    free = shutil.disk_usage(_existing(folder)).free if free_disk is None else free_disk
    if need > free:
        each = ", ".join(f"{p.qtype} {size_text(p.file_bytes)}" for p in plans)
        raise CheckpointError(
            f"--gguf: {size_text(need)} of GGUF ({each}) does not fit the {size_text(free)} free in {folder}: "
            "ask for fewer types (q8_0 or q4_0 alone), or free the disk"
        )
    ram = (total_memory_bytes() or 0) - rss_bytes()["rss"] if host_ram is None else host_ram
    peak = max(p.ram_bytes for p in plans)
    if ram and peak > ram:
        raise CheckpointError(
            f"--gguf: writing needs up to {size_text(peak)} of host RAM, {size_text(ram)} is left on this machine"
        )


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


class SafetensorsFolder:
    """The tensors of a Hugging Face folder's safetensors files, read with plain file reads, a block of rows at a
    time (no memory map)."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else []
        files = files or ["model.safetensors"]
        self.where: dict[str, tuple[Path, int, dict]] = {}
        for name in files:
            path = folder / name
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            for key, info in header.items():
                if key != "__metadata__":
                    self.where[key] = (path, 8 + length, info)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(info["shape"]) for k, (_, _, info) in self.where.items()}

    def rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a tensor, as float32."""
        path, base, info = self.where[name]
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise CheckpointError(f"--gguf: {name} is stored as {info['dtype']}; only F16, BF16 and F32 are read")
        shape = info["shape"]
        row = math.prod(shape[1:]) * torch.tensor([], dtype=dtype).element_size()
        begin = base + info["data_offsets"][0] + start * row
        buffer = bytearray((stop - start) * row)
        with open(path, "rb", buffering=0) as f:
            f.seek(begin)
            f.readinto(buffer)
        values = torch.frombuffer(buffer, dtype=dtype) if buffer else torch.empty(0, dtype=dtype)
        return values.float().numpy().reshape(stop - start, *shape[1:])


def _blocks(source: SafetensorsFolder, tensor: Tensor) -> Iterator[np.ndarray]:
    if tensor.source is None:
        yield tensor.make()
        return
    step = block_rows(tensor) if len(tensor.shape) > 1 else tensor.shape[0]
    for start in range(0, tensor.shape[0], step):
        block = source.rows(tensor.source, start, min(start + step, tensor.shape[0]))
        yield tensor.change(block) if tensor.change is not None else block


def write_gguf(
    folder: Path,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    gguf_plan: GgufPlan,
    log=print,  # noqa: ANN001
) -> tuple[Path, dict]:
    """One GGUF file from the model folder, tensor by tensor, through a temporary name renamed at the end."""
    import gguf

    source = SafetensorsFolder(folder)
    with atomic_path(gguf_plan.path) as tmp:
        writer = gguf.GGUFWriter(str(tmp), architecture(config))
        write_hparams(writer, config)
        extra = write_vocab(writer, tokenizer, config)
        name = model_name(gguf_plan.path, architecture(config), extra["phi3_stripping"])
        if name:
            writer.add_name(name)
        writer.add_file_type(_file_type(gguf_plan.qtype))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        kinds = [ggml_type(gguf_plan.qtype, t) for t in gguf_plan.tensors]
        for t, kind in zip(gguf_plan.tensors, kinds):
            writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), tensor_bytes(t.shape, kind), raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        out = writer.fout[0]
        for t, kind in zip(gguf_plan.tensors, kinds):
            writer.write_padding(out, out.tell())
            written = 0
            for block in _blocks(source, t):
                data = gguf.quantize(np.ascontiguousarray(block, dtype=np.float32), kind)
                data.tofile(out)
                written += data.nbytes
            if written != tensor_bytes(t.shape, kind):
                raise CheckpointError(
                    f"--gguf: {t.name} came out as {written} bytes, not {tensor_bytes(t.shape, kind)}"
                )
            writer.write_padding(out, written)
        writer.close()
    log(f"wrote {gguf_plan.path.name} ({size_text(gguf_plan.path.stat().st_size)})")
    return gguf_plan.path, extra


def model_name(path: Path, arch: str, phi3_stripping: bool) -> str | None:
    """general.name, from the file's name, as the readers read it: llama.cpp makes special tokens strip whitespace by
    it (a "phi3"/"phi-3" name: as Phi-3's do, gguf_vocab.PHI3_NAMES), so it says Phi-3 exactly when the tokenizer
    strips so; transformers' GGUF loader reads a `llama` file named "...mistral..." as Mistral, which it then fails to
    load. None: no name (llama.cpp needs none)."""
    name = path.stem.rsplit("-", 1)[0]
    if arch == "llama" and "mistral" in name.lower():
        name = ""
    if any(p in name.lower() for p in PHI3_NAMES) != phi3_stripping:
        name = f"{name} (phi-3 tokenizer)".strip() if phi3_stripping else ""
    return name or None


def _file_type(qtype: str) -> int:
    from gguf import LlamaFileType as F

    return {"f16": F.MOSTLY_F16, "bf16": F.MOSTLY_BF16, "q8_0": F.MOSTLY_Q8_0, "q4_0": F.MOSTLY_Q4_0}[qtype]


def gguf_name(folder: Path, qtype: str) -> str:
    return f"{folder.name.strip('.') or 'model'}-{qtype}.gguf"


def plan_exports(
    config: PretrainedConfig, shapes: dict[str, tuple[int, ...]], qtypes: list[str], dest: Path
) -> list[GgufPlan]:
    """The GGUFs asked for, planned; a model llama.cpp does not run is refused in one line naming the folder (before
    the gguf package is asked for: installing it would not help)."""
    why = refusal(config, str(dest))
    if why:
        raise ConfigError(why)
    try:
        import gguf  # noqa: F401 - an extra: fsdp-opt[gguf]
    except ImportError:
        raise ConfigError("--gguf: the gguf package is not installed: pip install 'fsdp-opt[gguf]'") from None
    return [plan(config, shapes, q, dest / gguf_name(dest, q)) for q in qtypes]


def write_ggufs(
    folder: Path, config: PretrainedConfig, tokenizer: PreTrainedTokenizerBase, plans: list[GgufPlan], log=print
) -> list[Path]:  # noqa: ANN001
    """Each planned GGUF (its path moved into `folder`) and its Modelfile (`Modelfile`, or `Modelfile.<type>` when
    there are several)."""
    written = []
    for i, p in enumerate(plans):
        p = GgufPlan(p.qtype, folder / p.path.name, p.tensors, p.file_bytes, p.ram_bytes)
        path, extra = write_gguf(folder, config, tokenizer, p, log)
        for note in extra["notes"] if i == 0 else []:
            log(note)
        name = "Modelfile" if len(plans) == 1 else f"Modelfile.{p.qtype}"
        written += [path, write_modelfile(path, tokenizer, extra["add_bos"], name)]
    return written
