"""The check the trainer plugins' parallel tests share: the plain HF directory a parallel run saved against
the one-process run's (every weight, trained, and the logits of both loaded with from_pretrained)."""

from __future__ import annotations

from pathlib import Path


def assert_saved_dirs_match(tmp_path: Path, vocab: int, label: str) -> None:
    """``tmp_path/tp`` and ``tmp_path/ref`` (both from ``tmp_path/init``) hold the same trained weights (rtol
    1e-4) and give the same logits (rtol 1e-4, atol 1e-5)."""
    import torch
    from transformers import AutoModelForCausalLM

    models = {n: AutoModelForCausalLM.from_pretrained(tmp_path / n).eval() for n in ("tp", "ref")}
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "init")
    weights = {n: m.state_dict() for n, m in models.items()}
    assert set(weights["tp"]) == set(weights["ref"])
    for key, value in weights["ref"].items():
        torch.testing.assert_close(weights["tp"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert not torch.equal(weights["ref"]["lm_head.weight"], start.state_dict()["lm_head.weight"])  # trained
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = {n: m(input_ids=tokens).logits for n, m in models.items()}
    err = float((logits["tp"] - logits["ref"]).abs().max() / logits["ref"].abs().max())
    print(f"PARITY {label} saved logits rel {err:.2e}", flush=True)
    torch.testing.assert_close(logits["tp"], logits["ref"], rtol=1e-4, atol=1e-5)


#: The harness that runs an example unchanged and records its whole gradients (and save_hf's directory).
CAPTURE = Path(__file__).parent / "fixtures" / "capture_grads.py"


def assert_gradients_match(got: Path, want: Path, label: str, steps: int = 4) -> None:
    """Every optimizer step's gradient of every parameter, whole (``CAPTURE`` wrote ``got/grads.pt`` and
    ``want/grads.pt``), equals the one-process run's: max abs difference within 1e-4 of the tensor's largest
    value."""
    import torch

    runs = [torch.load(d / "grads.pt") for d in (got, want)]
    assert len(runs[0]) == len(runs[1]) == steps, [len(r) for r in runs]
    worst_abs = worst_rel = 0.0
    for step, (mine, ref) in enumerate(zip(*runs)):
        assert set(mine) == set(ref), (step, sorted(set(mine) ^ set(ref)))
        for name, value in ref.items():
            assert mine[name].shape == value.shape, (step, name)
            top = float(value.abs().max())
            assert top > 0, (step, name)  # a gradient that vanished would compare equal to anything
            diff = float((mine[name] - value).abs().max())
            worst_abs, worst_rel = max(worst_abs, diff), max(worst_rel, diff / top)
            assert diff <= 1e-4 * top, f"{label} step {step} {name}: max abs diff {diff:.2e} of {top:.2e}"
    print(f"PARITY {label} gradients ({len(runs[1][0])} parameters x {steps} steps): max abs "
          f"{worst_abs:.2e}, max rel {worst_rel:.2e}", flush=True)


def assert_same_as_save_hf(saved: Path, captured: Path) -> None:
    """The trainer's own save wrote what ``parallel_model.save_hf`` writes of the same model (``CAPTURE``
    wrote that to ``captured/save_hf``): the same config.json and every tensor bit for bit."""
    import json

    import torch
    from safetensors.torch import load_file

    mine, ref = (load_file(d / "model.safetensors") for d in (saved, captured / "save_hf"))
    assert sorted(mine) == sorted(ref)
    for key, value in ref.items():
        assert mine[key].dtype == value.dtype and torch.equal(mine[key], value), key
    configs = [json.loads((d / "config.json").read_text()) for d in (saved, captured / "save_hf")]
    assert configs[0] == configs[1]
