"""The model's output head, as the loss head (train/loss_head.py) and the planner see it: whether its
logits can be scored a chunk of tokens at a time, and what the model does to them after the head.

The loss head scores inside the head module's own forward and returns log-probabilities where the model
returned logits, so every transformation a model applies to its logits after the head must be one the
loss head does itself: Gemma 2/3's final softcapping, Granite's and Cohere's scaling. Any other (read
from the model class's source) and the head is scored from the full logits instead, as is a head that
trains or is not a plain projection (a LoRA layer on lm_head).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

from torch import nn


@dataclass
class Transform:
    """What the model does to its logits after the head, done by the scoring head instead."""

    scale: float = 1.0  # Granite divides by logits_scaling, Cohere multiplies by logit_scale
    softcap: float | None = None  # Gemma 2/3: cap · tanh(logits / cap)
    neutral: tuple[tuple[object, str, object], ...] = ()  # (config, attribute, value while scoring)


_KNOWN_AFTER_HEAD = re.compile(r"final_logit_softcapping|logits_scaling|logit_scale|\.float\(\)|loss|labels|"
                               r"slice_indices|logits_to_keep|return|CausalLMOutput|logits=logits|"
                               r"^logits = torch\.tanh\(logits\)$")  # the middle of Gemma's softcapping


def _transform_of(model: nn.Module) -> Transform | None:
    """The model's transformation of its logits after the head, or None when it does one the head does not know."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        source = ""
    after = source.split("lm_head(", 1)[1].splitlines()[1:] if "lm_head(" in source else []
    for line in after:
        code = line.split("#")[0].strip()
        if re.match(r"(lm_)?logits\s*=", code) and not _KNOWN_AFTER_HEAD.search(code):
            return None
        if code.startswith("return"):
            break
    t = Transform()
    neutral = []
    for cfg in {id(config): config, id(text): text}.values():
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            t.softcap = float(cap)
            neutral.append((cfg, "final_logit_softcapping", None))
        if getattr(cfg, "logits_scaling", None) not in (None, 1, 1.0) and "logits_scaling" in source:
            t.scale /= float(cfg.logits_scaling)
            neutral.append((cfg, "logits_scaling", 1.0))
        if getattr(cfg, "logit_scale", None) not in (None, 1, 1.0) and "logit_scale" in source:
            t.scale *= float(cfg.logit_scale)
            neutral.append((cfg, "logit_scale", 1.0))
    t.neutral = tuple(neutral)
    return t


def head_transform(model: nn.Module, head: nn.Module | None) -> tuple[Transform | None, str]:
    """(the transformation the loss head applies, "") when ``head`` (the transformers ``model``'s output
    embedding, possibly row-sharded) can be scored chunk by chunk; else (None, why not)."""
    if head is None:
        return None, "the model has no output embedding"
    if any(p.requires_grad for p in head.parameters()):
        return None, "the output projection is trained"
    # nn.Linear includes FSDP2's FSDPLinear; a row-sharded head has blocks; peft's LoRA layers have a base_layer
    if not (isinstance(head, nn.Linear) or hasattr(head, "blocks")) or hasattr(head, "base_layer"):
        return None, f"the output projection is a {type(head).__name__}"
    transform = _transform_of(model)
    if transform is None:
        return None, f"{type(model).__name__} changes its logits after the head in a way the loss head does not know"
    return transform, ""
