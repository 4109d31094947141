"""Every path option of a fine-tune checked in the launching process, before anything opens one.

One rule per kind of path (errors.check_path): what is read must exist and be a regular file or a
directory as expected, never a FIFO or device (opening one for reading blocks or never ends); what
is written must be creatable or writable. The message names the option and the path.
"""

from __future__ import annotations

from pathlib import Path

from shardtune.config import Config, ConfigError
from shardtune.errors import check_path
from shardtune.model.hub import HubDatasetError
from shardtune.runtime.files import OutputError
from shardtune.runtime.outputs import check_output
from shardtune.train.data.cache import token_cache
from shardtune.train.data.sources import is_hub_name, local_source


def check_input_paths(cfg: Config) -> None:
    """Refuse a bad --data, --val-data, --model, --out, --log-file or token cache before the run starts."""
    for flag, value in (("data", cfg.data.train), ("val-data", cfg.data.val)):
        if value and is_hub_name(value):
            try:
                local_source(value)  # found in the Hugging Face cache or downloaded, or refused saying why
            except HubDatasetError as err:
                raise HubDatasetError(f"option '{flag}': {err}") from None
        elif value:
            check_path(value, f"option '{flag}':", "any", error=ConfigError)
    model = Path(cfg.model.path).expanduser()
    if model.exists() or model.is_symlink():  # otherwise a Hub id, resolved (or refused) by model/hub.py
        check_path(model, "option 'model':", "dir", error=ConfigError)
    out = Path(cfg.output.out).expanduser()
    check_path(out, "option 'out':", "dir", write=True, error=OutputError)
    # the rule of every output (runtime/outputs.py): not an input, nor inside one, nor in a rotated folder
    check_output(out, kind="run", name="option 'out':", inputs=(
        ("model directory", cfg.model.path), ("training data", cfg.data.train), ("validation data", cfg.data.val),
        ("--init-adapter", cfg.lora.init_adapter)))
    if cfg.output.log_file:
        check_path(cfg.output.log_file, "option 'log-file':", "file", write=True, error=OutputError)
    check_path(token_cache(cfg), "the token cache ($SHARDTUNE_CACHE/tokenized)", "dir", write=True,
               error=OutputError)
