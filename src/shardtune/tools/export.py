"""Write base + LoRA adapter as one GGUF file for llama.cpp and Ollama, streaming one tensor at a time.

The merge is ``merge.py``'s (``merge_sources`` and its per-tensor iterator): each base tensor is read,
merged in fp32, renamed to llama.cpp's name with the gguf package's own tensor-name map, converted and
written a block of rows at a time before the next is read, so the model is never whole in memory and
no tensor has a converted copy of all of it. Each tensor is read through its own safetensors handle,
so the weight files' pages do not stay mapped in this process once written. A QLoRA adapter merges into
the unquantized base on disk (the fine-tune quantized it only in memory), so no uint8 4-bit weights
reach the file. The GGUF layout is computed from the safetensors headers before any data is read.

What llama.cpp's convert_hf_to_gguf.py does per family, and so does this:
  llama, mistral   arch "llama"; q/k projection rows permuted into llama.cpp's rotary order
  qwen2, qwen3     arch "qwen2"/"qwen3"; no change
  gemma, gemma2    arch "gemma"/"gemma2"; norm weights + 1 (Hugging Face stores w - 1); no lm_head
  gemma3_text      arch "gemma3"; as gemma2, plus the sliding-window keys of gguf_gemma3.py
  gemma3           the multimodal checkpoint's text model, as gemma3_text (no vision tower)
Rope scaling: linear as two metadata keys; Llama 3's ``llama3`` (llama and mistral) as the extra
``rope_freqs`` tensor of per-frequency divisors (convert_hf_to_gguf's LlamaModel.generate_extra_tensors).
Tensor types: 1-D tensors (norms, biases) stay F32; matrices are F16, BF16 or Q8_0 (--quant); a Q8_0
matrix whose rows are not a multiple of its 32-value blocks is written F16, as llama.cpp does.

The file is written under a temporary name beside ``out`` and renamed when complete; an existing
``out`` is replaced only with ``force``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import torch

from shardtune.model.directory import check_model_dir, load_tokenizer
from shardtune.runtime.cpu_tuning import MMAP_THRESHOLD, tune_malloc
from shardtune.runtime.failure import stage
from shardtune.runtime.files import staged_file
from shardtune.runtime.outputs import check_output, claim_output
from shardtune.runtime.progress import progress
from shardtune.tools import gguf_gemma3
from shardtune.tools.gguf_model import FAMILIES, TIED_ARCHS, ExportError, Family, add_hparams, llama3_rope_freqs
from shardtune.tools.merge import MergeSources, check_finite, merge_sources, merged_tensors

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("shardtune")

QUANTS = ("f16", "bf16", "q8_0")


def export_gguf(model: str | Path, adapter: str | Path | None, out: str | Path, quant: str = "f16",
                force: bool = False, modelfile: bool = True) -> dict:
    """Write ``out`` (.gguf) and, with ``modelfile``, an Ollama Modelfile beside it. Returns sizes and times."""
    import gguf

    from shardtune.tools.gguf_vocab import add_tokenizer

    if quant not in QUANTS:
        raise ExportError(f"--quant {quant!r} is not one of {', '.join(QUANTS)}")
    out = Path(out).expanduser()
    model_file = modelfile_of(out)
    inputs = (("model directory", model), ("adapter", adapter))
    for path in (out, model_file) if modelfile else (out,):
        check_output(path, kind="file", inputs=inputs, overwrite=force, flag="--force", name="--out")
    model_dir = check_model_dir(model)
    config = json.loads((model_dir.path / "config.json").read_text())
    family = FAMILIES.get(config.get("model_type"))
    if family is None:
        raise ExportError(f"{model_dir.path / 'config.json'}: model_type {config.get('model_type')!r} is not one this "
                          f"GGUF export knows ({', '.join(FAMILIES)})")
    if family.arch == "GEMMA3":
        config = gguf_gemma3.text_config(model_dir)
        if (problem := gguf_gemma3.problem(config)) is not None:
            raise ExportError(f"{model_dir.path / 'config.json'}: {problem}; llama.cpp's gemma3 would not run this "
                              "model as transformers does, so this GGUF export does not write it")
    load_tokenizer(model_dir)  # what the GGUF's vocabulary and the Modelfile are made from: refused now, named
    arch = getattr(gguf.MODEL_ARCH, family.arch)
    sources = merge_sources(model_dir, Path(adapter)) if adapter else MergeSources({}, _stored_names(model_dir), {})
    layout = _layout(model_dir, sources, config, family, quant)

    # Each merged matrix is a fresh fp32 copy: with malloc's threshold fixed (cpu_tuning.py), freeing it gives
    # it back to the system at once instead of leaving the heap grown by it.
    tune_malloc()
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    add_hparams(writer, config, family, quant, name=model_dir.path.name)
    add_tokenizer(writer, model_dir.path, config["vocab_size"])
    rope_freqs = llama3_rope_freqs(config) if family.permute_qk else None
    if rope_freqs is not None:  # written first: tensor data follows the order of the tensor infos
        writer.add_tensor_info(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", rope_freqs.shape,
                               rope_freqs.dtype, rope_freqs.nbytes, raw_dtype=gguf.GGMLQuantizationType.F32)
    for item in layout:
        writer.add_tensor_info(item.gguf_name, item.shape, item.np_dtype, item.nbytes, raw_dtype=item.qtype)

    start = time.perf_counter()
    with claim_output(out, kind="file", command="export", inputs=inputs, overwrite=force, flag="--force",
                      name="--out"):
        with staged_file(out) as tmp, stage("write"):
            _write_gguf(writer, tmp, layout, model_dir, sources, family, config, quant, rope_freqs)
        seconds = time.perf_counter() - start
        result = {"out": str(out), "quant": quant, "bytes": out.stat().st_size, "tensors": len(layout),
                  "seconds": round(seconds, 3)}
        if modelfile:
            from shardtune.tools.modelfile import write_modelfile

            result["modelfile"] = write_modelfile(model_dir.path, out, model_file)
    log.info("exported %s (%s, %.1f MB, %.1f s)", out, quant, result["bytes"] / 2**20, seconds)
    return result


def modelfile_of(gguf_file: Path) -> Path:
    """The Ollama Modelfile of an exported GGUF, named after it: two exports in one folder stay apart."""
    return gguf_file.with_name(f"{gguf_file.stem}.Modelfile")


def _write_gguf(writer, tmp: Path, layout: list[_Item], model_dir, sources: MergeSources, family: Family, config: dict,
                quant: str, rope_freqs) -> None:
    """The GGUF file at ``tmp``: header, metadata and tensor infos by gguf's writer, then each merged
    tensor's data appended a block at a time."""
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()  # the tensor data is appended below, a block at a time
        by_name, scratch = {item.name: item for item in layout}, _Scratch()
        with open(tmp, "r+b") as data, progress(f"export {quant}", len(layout), unit="tensor") as bar:
            data.seek(0, os.SEEK_END)
            if rope_freqs is not None:
                _append_tensor(data, [rope_freqs], rope_freqs.nbytes, writer.data_alignment)
            for name, tensor in _merged_one_by_one(model_dir, sources, set(by_name)):
                item = by_name[name]
                blocks = _blocks(tensor, item, family, config, scratch, changed=name in sources.changes)
                _append_tensor(data, blocks, item.nbytes, writer.data_alignment)
                bar.advance()
                del tensor
    finally:
        writer.close()


@dataclass
class _Item:
    name: str  # the checkpoint's tensor name
    gguf_name: str
    shape: tuple[int, ...]
    qtype: object  # gguf.GGMLQuantizationType
    np_dtype: object
    nbytes: int


def _stored_names(model_dir) -> dict[str, str]:
    from safetensors import safe_open

    names = {}
    for file in model_dir.weight_files:
        with safe_open(str(file), framework="pt") as f:
            names.update({k: file.name for k in f.keys()})
    return names


def _layout(model_dir, sources: MergeSources, config: dict, family: Family, quant: str) -> list[_Item]:
    """Every tensor the file will hold, in writing order, from the safetensors headers alone."""
    import gguf
    import numpy as np
    from safetensors import safe_open

    arch = getattr(gguf.MODEL_ARCH, family.arch)
    tmap = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    tied = config.get("tie_word_embeddings", False) or family.arch in TIED_ARCHS
    left_out = 0
    matrix_type = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
                   "q8_0": gguf.GGMLQuantizationType.Q8_0}[quant]
    items = []
    for file in model_dir.weight_files:
        with safe_open(str(file), framework="pt") as f:
            for name, source in sources.names_in(file.name, list(f.keys())):
                text = gguf_gemma3.text_name(name) if family.multimodal else name
                if text is None:
                    left_out += 1
                    continue
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from rope_theta by every reader
                if text == "lm_head.weight" and tied and name not in sources.extra:
                    continue  # the embedding serves as the output layer
                gguf_name = tmap.get_name(text, try_suffixes=(".weight", ".bias"))
                if gguf_name is None:
                    raise ExportError(f"{file}: tensor {name} has no llama.cpp name for architecture "
                                      f"{gguf.MODEL_ARCH_NAMES[arch]!r}; this GGUF export cannot write it")
                shape = tuple(f.get_slice(source).get_shape())
                qtype = matrix_type if len(shape) == 2 else gguf.GGMLQuantizationType.F32
                if qtype == gguf.GGMLQuantizationType.Q8_0 and shape[-1] % 32:
                    qtype = gguf.GGMLQuantizationType.F16
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                nbytes = int(np.prod(shape)) // block * type_size
                items.append(_Item(name, gguf_name, shape, qtype, np.float32, nbytes))
    if left_out:
        log.warning("%s: the GGUF holds the text model only; the vision tower and projector (%d tensors) are left "
                    "out (llama.cpp reads them from a separate mmproj file, which this export does not write)",
                    model_dir.path, left_out)
    return items


def _merged_one_by_one(model_dir, sources: MergeSources, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, merged tensor) for each tensor in ``wanted``, in file order, each read through its own handle.

    safetensors maps the whole file while a handle is open, and every page read through it stays
    resident in this process until the handle closes; a handle per tensor keeps that to the tensor
    being written instead of growing to the whole weight file.
    """
    from safetensors import safe_open

    for file in model_dir.weight_files:
        with safe_open(str(file), framework="pt") as f:
            names = [(n, s) for n, s in sources.names_in(file.name, list(f.keys())) if n in wanted]
        for pair in names:
            with safe_open(str(file), framework="pt") as f:
                ((name, tensor),) = merged_tensors(f, [pair], sources.changes)
            yield name, tensor
            del tensor


def _append_tensor(data: BinaryIO, blocks: Iterable[np.ndarray], nbytes: int, alignment: int) -> None:
    """One tensor's data at the end of ``data``, laid out as ``GGUFWriter.write_tensor_data`` lays it out.

    The writer takes each tensor as one array, which for a matrix means a converted copy of all of it
    beside the stored one; writing the blocks ourselves keeps that to one block. The layout is the GGUF
    format's: each tensor starts at a multiple of the file's alignment (the writer's ``data_alignment``),
    in the order of the tensor infos, and is padded with zeros to the next multiple.
    """
    data.write(bytes(-data.tell() % alignment))
    written = 0
    for block in blocks:
        data.write(block.data)
        written += block.nbytes
    if written != nbytes:  # the tensor infos already promised nbytes: a mismatch would corrupt the file
        raise ExportError(f"internal error: {written} bytes of tensor data where its tensor info says {nbytes}")
    data.write(bytes(-written % alignment))


def _blocks(tensor: torch.Tensor, item: _Item, family: Family, config: dict,
            scratch: _Scratch, changed: bool = False) -> Iterator[np.ndarray]:
    """The merged tensor as the file stores it (llama.cpp's per-family changes, then its type), in blocks of rows.

    Each block is converted on its own, so the largest tensor (the embedding) never has a converted
    copy of all of it beside the stored one; a bf16 block that needs no change is a view of the stored
    tensor. Every conversion is per value (per row of 32-value blocks for Q8_0), so the bytes are those
    of converting the whole tensor at once.
    """
    import gguf

    if family.norm_plus_one and item.name.endswith("norm.weight"):
        tensor = tensor.float() + 1  # 1-D: small
    order = _rotary_order(tensor.shape[0], item, family, config)
    step = max(1, _BLOCK_VALUES // math.prod(tensor.shape[1:])) if tensor.dim() > 1 else tensor.shape[0]
    want = {gguf.GGMLQuantizationType.F16: torch.float16,
            gguf.GGMLQuantizationType.BF16: torch.bfloat16}.get(item.qtype, torch.float32)  # Q8_0 from fp32
    for start in range(0, tensor.shape[0], step):
        block = tensor[start:start + step]
        if order is not None:
            block = torch.index_select(tensor, 0, order[start:start + step],
                                       out=scratch.take("rows", tensor.dtype, block.shape))
        if block.dtype != want or not block.is_contiguous():
            block = scratch.take("converted", want, block.shape).copy_(block)
        if changed and want != torch.float32:  # merged values (checked finite in fp32) may not fit f16
            dtype = str(want).removeprefix("torch.")
            check_finite(item.name, block, f"in {dtype}: the merged values do not fit it; export with --quant bf16")
        if item.qtype == gguf.GGMLQuantizationType.BF16:
            yield block.view(torch.int16).numpy()
        elif item.qtype == gguf.GGMLQuantizationType.Q8_0:
            # quantize's temporaries are the size of its input: slices under malloc's threshold are served
            # from (and given back to) its heap, where a whole block would map fresh pages every time
            rows = max(1, _Q8_VALUES // math.prod(block.shape[1:]))
            for part in block.split(rows):
                yield gguf.quants.quantize(part.numpy(), item.qtype)
        else:
            yield block.numpy()


class _Scratch:
    """Buffers reused from block to block and tensor to tensor, one per use and dtype, grown as needed.

    Under ``tune_malloc`` every allocation above its threshold is a fresh mapping whose pages fault in
    (and are zeroed) on first write; converting into the same buffer each time skips that. A block
    taken from here is valid until the next ``take`` for the same use and dtype: ``_append_tensor``
    writes each block before the next is made.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, use: str, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        n = math.prod(shape)
        buffer = self._buffers.get((use, dtype))
        if buffer is None or buffer.numel() < n:
            buffer = self._buffers[(use, dtype)] = torch.empty(n, dtype=dtype)
        return buffer[:n].view(shape)


def _rotary_order(n_rows: int, item: _Item, family: Family, config: dict) -> torch.Tensor | None:
    """For a q/k projection of a family llama.cpp permutes: the stored row of each row it writes.

    Hugging Face's rotary layout holds each head's two halves apart; llama.cpp's interleaves them
    (convert_hf_to_gguf's LlamaModel.permute). None for every other tensor: rows as stored.
    """
    if not (family.permute_qk and item.name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                          "k_proj.bias"))):
        return None
    heads = config["num_attention_heads"]
    if ".k_proj." in item.name:
        heads = config.get("num_key_value_heads") or heads
    return torch.arange(n_rows).reshape(heads, 2, n_rows // heads // 2).swapaxes(1, 2).reshape(-1)


_BLOCK_VALUES = 1 << 20  # values converted at a time: bounds each conversion's temporaries to a slice of the tensor
_Q8_VALUES = MMAP_THRESHOLD // 8  # values quantized at a time: fp32 temporaries of half malloc's threshold
