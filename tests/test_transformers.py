"""FISMO with a Hugging Face ``Trainer``: the recipe of ``docs/torch.md``, and a checkpoint resumed bit for bit.

A GPT-2 language model of 1,080 parameters built from its config (nothing is
downloaded), 32 random sequences of 8 tokens, float32 on the CPU.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="the Trainer recipe needs transformers (CI installs it)")
pytest.importorskip("accelerate", reason="transformers' Trainer needs accelerate (CI installs it)")

from fismo_core.backends.torch import FISMO, param_groups  # noqa: E402

STEPS, SAVE_AT = 6, 3


def _model() -> torch.nn.Module:
    """A one-layer GPT-2 (hidden size 8, vocabulary 16), seeded, without dropout (so that runs can be compared)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    """32 random sequences of 8 tokens; the labels are the inputs (the model shifts them)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 16, (32, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _args(output_dir: str) -> "transformers.TrainingArguments":
    return transformers.TrainingArguments(
        output_dir=output_dir, max_steps=STEPS, per_device_train_batch_size=4, save_strategy="steps",
        save_steps=SAVE_AT, logging_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
    )


def _trainer(output_dir: str) -> "transformers.Trainer":
    """The recipe: the optimizer built from ``param_groups(model)``, passed with its scheduler as ``optimizers``."""
    model = _model()
    opt = FISMO(param_groups(model), lr=0.02)
    scheduler = transformers.get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=STEPS)
    return transformers.Trainer(model=model, args=_args(output_dir), train_dataset=_Tokens(), optimizers=(opt, scheduler))


def _differences(a, b, path: str = "") -> list[str]:
    """Where two nested state dicts differ, bit for bit (an empty list: nowhere)."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path} keys"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [path]
    return [] if a == b else [path]


def test_trainer_with_fismo_resumes_bit_for_bit(tmp_path) -> None:
    """Trained 6 steps in one go, or 3 steps, a checkpoint, and 3 more in a fresh ``Trainer`` resumed from it
    (``train(resume_from_checkpoint=...)``): the same parameters and optimizer states, bit for bit."""
    full = _trainer(str(tmp_path / "full"))
    initial = {k: v.clone() for k, v in full.model.state_dict().items()}
    full.train()
    opt = full.optimizer.optimizer if hasattr(full.optimizer, "optimizer") else full.optimizer  # accelerate wraps it
    fismo_params = opt.param_groups[0]["params"]
    assert opt.param_groups[0]["algorithm"] == "fismo" and len(fismo_params) == 4  # attention and MLP matrices
    assert all(int(opt.state[p]["step"]) == STEPS for p in fismo_params)
    assert not torch.equal(opt.state[fismo_params[0]]["P"], torch.eye(8))  # the factors moved: they matter below
    assert any(not torch.equal(v, initial[k]) for k, v in full.model.state_dict().items())

    resumed = _trainer(str(tmp_path / "resumed"))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{SAVE_AT}"))
    assert resumed.state.global_step == STEPS
    assert not _differences(resumed.model.state_dict(), full.model.state_dict())
    assert not _differences(resumed.optimizer.state_dict(), full.optimizer.state_dict())


def test_trainer_without_the_optimizers_argument_says_what_to_do(tmp_path) -> None:
    """``optimizer_cls_and_kwargs=(FISMO, {...})`` hands FISMO the Trainer's weight-decay groups, biases
    included: it fails on the first bias, with an error that gives the recipe."""
    trainer = transformers.Trainer(
        model=_model(), args=_args(str(tmp_path)), train_dataset=_Tokens(), optimizer_cls_and_kwargs=(FISMO, {"lr": 0.02})
    )
    with pytest.raises(ValueError, match=r"shape \(8,\): FISMO optimises matrices.*optimizers=\(FISMO\(param_groups\(model\)\)"):
        trainer.create_optimizer()
