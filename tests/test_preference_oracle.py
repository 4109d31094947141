"""Preference losses against TRL (the oracle): the same tiny model, adapter, pairs and knobs, fp32, one process.

shardtune's first-step loss, TRL's metrics and every LoRA gradient must equal those of TRL's own trainers:
``DPOTrainer`` (sigmoid, ipo), ``ORPOTrainer`` and ``CPOTrainer`` with SimPO's loss (cpo_alpha 0).
The adapter starts with random non-zero B (so that policy and reference differ and A has a gradient).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import trl  # noqa: F401  (the oracle: in the test extra, so never skipped)

from closeness import rel
from dist_utils import run_ranks
from tiny import make_model, write_jsonl

# ORPO's TRL trainer puts BOS before the prompt and counts its NLL over prompt and response; shardtune counts
# responses only (as the ORPO paper): a prompt of BOS alone makes the two definitions the same.
PAIRS = [{"prompt": f"<s>Q{i}: {i} plus {i}? ", "chosen": f"{2 * i}.", "rejected": f"no idea, {i + 7}?"}
         for i in range(4)]
ORPO_PAIRS = [{"prompt": "<s>", "chosen": f"{i} plus {i} is {2 * i}.", "rejected": f"{i} plus {i} is {i + 5}, maybe"}
              for i in range(4)]


@pytest.fixture(scope="module")
def oracle_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("oracle")
    make_model(root / "model", chat_template=False)
    write_jsonl(root / "pairs.jsonl", PAIRS)
    write_jsonl(root / "orpo.jsonl", ORPO_PAIRS)
    return root


def shardtune_first_step(rank: int, world_size: int, options: dict, init_dir: str, randomize: bool = True) -> dict:
    from shardtune.config import build_config
    from shardtune.runtime import distributed
    from shardtune.runtime.memory import MemoryMonitor
    from shardtune.train.adapter import save_adapter
    from shardtune.train.job import setup

    cfg = build_config(options)
    worker = distributed.init_worker()
    memory = MemoryMonitor(worker.device)
    job = setup(cfg, worker, memory)
    params = job.strategy.trainable(job.model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in params.items():
            if "lora_B" in name and randomize:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_adapter(job.model, job.strategy, job.built.adapter_keys, Path(init_dir), cfg.model.path, job.model_dir)
    result = job.step(0)
    grads = {n: p.grad.clone() for n, p in params.items()}
    memory.close()
    return {"loss": result.loss, "metrics": result.metrics, "grads": grads}


def _trl_first_step(kind: str, model_dir: Path, init_dir: Path, data: Path, out: Path, base_reference: bool = True,
                    **knobs) -> dict:
    from datasets import load_dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                      init_dir, is_trainable=True)
    dataset = load_dataset("json", data_files=str(data), split="train")
    common = dict(output_dir=str(out), per_device_train_batch_size=len(dataset), report_to=[], use_cpu=True,
                  max_steps=1, learning_rate=0.0, bf16=False, fp16=False, gradient_checkpointing=False,
                  dataloader_drop_last=False, seed=0)
    if kind == "dpo":
        from trl import DPOConfig, DPOTrainer

        # The reference is the bare base, as shardtune's for a new adapter (given a trained adapter, TRL would
        # copy it as the reference: shardtune's --init-adapter, tested elsewhere).
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if base_reference else None
        trainer = DPOTrainer(model=model, ref_model=base, args=DPOConfig(**common, **knobs), train_dataset=dataset,
                             processing_class=tokenizer)
    elif kind == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        trainer = ORPOTrainer(model=model, args=ORPOConfig(**common, **knobs), train_dataset=dataset,
                              processing_class=tokenizer)
    else:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        trainer = CPOTrainer(model=model, args=CPOConfig(**common, loss_type="simpo", cpo_alpha=0.0, **knobs),
                             train_dataset=dataset, processing_class=tokenizer)
    batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] if isinstance(v, list) else v for k, v in trainer._metrics["train"].items()} \
        if hasattr(trainer, "_metrics") else {}
    if not metrics and getattr(trainer, "_stored_metrics", None):
        metrics = {k: v[-1] for k, v in trainer._stored_metrics["train"].items()}
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return {"loss": loss.item(), "metrics": metrics, "grads": grads}


CASES = {
    "dpo-sigmoid": ("dpo", "pairs.jsonl", {"dpo-beta": 0.3}, {"beta": 0.3, "loss_type": ["sigmoid"]}),
    "dpo-ipo": ("dpo", "pairs.jsonl", {"dpo-beta": 0.3, "dpo-loss": "ipo"}, {"beta": 0.3, "loss_type": ["ipo"]}),
    "orpo": ("orpo", "orpo.jsonl", {"orpo-lambda": 0.4}, {"beta": 0.4}),
    "simpo": ("simpo", "pairs.jsonl", {"simpo-beta": 2.0, "simpo-gamma": 0.7}, {"beta": 2.0, "simpo_gamma": 0.7}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_step_loss_gradients_and_metrics_equal_trl(oracle_root, case):
    kind, data, ours, theirs = CASES[case]
    options = {"model": str(oracle_root / "model"), "data": str(oracle_root / data), "out": str(oracle_root / case),
               "dtype": "fp32", "strategy": "single", "batch-size": 4, "steps": 1, "objective": kind,
               "lora-r": 4, "lora-targets": "q_proj,v_proj", **ours}
    init = oracle_root / f"{case}-init"
    mine = run_ranks(shardtune_first_step, 1, options, str(init), timeout=600)[0]
    ref = _trl_first_step(kind, oracle_root / "model", init, oracle_root / data, oracle_root / f"{case}-trl", **theirs)
    print(f"\n{case}: shardtune {mine['loss']:.8f}, TRL {ref['loss']:.8f}")
    assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    assert mine["loss"] != pytest.approx(0.6931471805599453, rel=1e-4) or kind != "dpo"  # policy ≠ reference
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                 "rewards/accuracies"):
        theirs_value = float(ref["metrics"][name])
        # rewards are differences of summed log-probs ~100× their size: fp32 summation order shows at 1e-5
        assert mine["metrics"][name] == pytest.approx(theirs_value, rel=1e-4, abs=1e-5), name
    assert set(mine["grads"]) == set(ref["grads"])
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, name  # every LoRA matrix has a gradient: B is not zero
        assert rel(mine["grads"][name], g) < 1e-5, (name, rel(mine["grads"][name], g))
    json.dumps(mine["metrics"])  # plain floats: what metrics.jsonl and the trackers take


def test_init_adapter_reference_is_the_initial_model_as_trl(oracle_root):
    """--init-adapter: training continues an adapter, and DPO's reference is base + that adapter, as TRL makes
    it (a frozen "ref" copy of a given adapter): the first loss is ln 2, the gradients TRL's."""
    options = {"model": str(oracle_root / "model"), "data": str(oracle_root / "pairs.jsonl"), "dtype": "fp32",
               "strategy": "single", "batch-size": 4, "steps": 1, "objective": "dpo", "lora-r": 4,
               "lora-targets": "q_proj,v_proj", "dpo-beta": 0.3}
    trained = oracle_root / "trained-adapter"
    run_ranks(shardtune_first_step, 1, {**options, "out": str(oracle_root / "sft")}, str(trained), timeout=600)
    again = oracle_root / "init-again"
    mine = run_ranks(shardtune_first_step, 1, {**options, "out": str(oracle_root / "init"),
                                               "init-adapter": str(trained)}, str(again), False, timeout=600)[0]
    from safetensors.torch import load_file

    start, given = load_file(again / "adapter_model.safetensors"), load_file(trained / "adapter_model.safetensors")
    assert set(start) == set(given) and all(torch.equal(start[k], given[k]) for k in given)  # it started there
    ref = _trl_first_step("dpo", oracle_root / "model", trained, oracle_root / "pairs.jsonl", oracle_root / "init-trl",
                          base_reference=False, beta=0.3, loss_type=["sigmoid"])
    assert mine["loss"] == pytest.approx(0.6931471805599453, rel=1e-6) and ref["loss"] == pytest.approx(mine["loss"])
    for name, g in ref["grads"].items():
        assert g.abs().sum() > 0, name
        assert rel(mine["grads"][name], g) < 1e-5, (name, rel(mine["grads"][name], g))
