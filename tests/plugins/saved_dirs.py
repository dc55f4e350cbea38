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
