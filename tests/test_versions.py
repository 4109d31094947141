"""Too-old libraries fail loudly, naming the API and the version to install (runtime/versions.py)."""

from __future__ import annotations

import pytest
import torch.distributed.checkpoint as dcp
from torch import nn

from shardtune.runtime.versions import MissingAPIError, check_apis, tied_weights_keys


def test_installed_versions_have_every_api():
    check_apis()


def test_missing_torch_api_is_named(monkeypatch):
    monkeypatch.delattr(dcp, "HuggingFaceStorageReader")
    with pytest.raises(MissingAPIError, match="lacks torch.distributed.checkpoint.HuggingFaceStorageReader.*torch>="):
        check_apis()


def test_model_without_all_tied_weights_keys_is_an_error_not_untied_weights():
    class OldModel(nn.Module):  # what transformers 4.x models look like: no all_tied_weights_keys
        pass

    with pytest.raises(MissingAPIError, match="OldModel has no all_tied_weights_keys.*transformers>=5.1"):
        tied_weights_keys(OldModel())


def test_tied_weights_of_a_transformers_model(tmp_path):
    from transformers import AutoModelForCausalLM

    from tiny import make_model

    make_model(tmp_path / "m", "llama", tied=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert tied_weights_keys(model) == {"lm_head.weight": "model.embed_tokens.weight"}
