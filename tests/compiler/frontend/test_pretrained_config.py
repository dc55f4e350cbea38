"""`model.pretrained`: the model keys come from config.json alone; contradictions, missing weights, a
checkpoint directory inside the input and padding are refused with their rule ids; compile and explain read no
weight."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dsforge.cli import cli
from dsforge.compiler.frontend.parse import load_job
from dsforge.compiler.frontend.pretrained import PretrainedError, model_keys
from dsforge.compiler.validate import validate_file
from tests.conftest import ROOT

TINY = ROOT / "tests" / "fixtures" / "pretrained" / "tiny-llama"


def llama_config(**over: Any) -> dict[str, Any]:
    """A config.json of a small Llama as transformers writes it."""
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 64,
           "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "float32"}
    cfg.update(over)
    return cfg


def checkpoint_dir(tmp: Path, cfg: dict[str, Any], weights: str | None = "model.safetensors") -> Path:
    """An HF-shaped directory: config.json and a weights file the compiler must never open (its bytes are
    junk)."""
    d = tmp / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    if weights:
        (d / weights).write_bytes(b"not read by validate, explain or compile")
    return d


def job_file(tmp: Path, model: dict[str, Any], **training: Any) -> Path:
    doc = {"version": 1, "name": "ft", "model": model,
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"tp": 2},
           "training": {"global_batch": 4, "micro_batch": 1, "precision": "fp32", **training}}
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def rules_of(path: Path) -> list[tuple[str, str]]:
    return [(d.rule, d.message) for d in validate_file(path).diagnostics]


def test_config_json_fills_the_model_section(tmp_path: Path) -> None:
    d = checkpoint_dir(tmp_path, llama_config())
    job, diags = load_job(job_file(tmp_path, {"pretrained": "ckpt", "seq_len": 32}))
    assert job is not None, diags
    m = job.spec.model
    assert (m.arch, m.layers, m.hidden, m.heads, m.kv_heads, m.ffn_hidden, m.vocab, m.seq_len) == \
        ("llama", 4, 64, 4, 2, 128, 256, 32)
    assert (m.activation, m.position, m.tied_embeddings) == ("swiglu", "rope", False)
    assert m.pretrained == str(d)  # made absolute against the job file, as plan.json records it
    assert rules_of(tmp_path / "job.yaml") == []


def test_a_stated_value_that_contradicts_config_json_names_both(tmp_path: Path) -> None:
    checkpoint_dir(tmp_path, llama_config())
    path = job_file(tmp_path, {"pretrained": "ckpt", "heads": 8, "kv_heads": 2})
    diags = validate_file(path).diagnostics
    assert [d.rule for d in diags] == ["DSF013"]
    assert "model.heads 8" in diags[0].message and "says 4" in diags[0].message
    assert diags[0].location.line == 5  # the `heads:` line


def test_a_preset_value_that_contradicts_points_at_the_preset(tmp_path: Path) -> None:
    checkpoint_dir(tmp_path, llama_config(hidden_size=32, num_attention_heads=2, num_key_value_heads=1))
    diags = validate_file(job_file(tmp_path, {"preset": "tiny-llama", "pretrained": "ckpt"})).diagnostics
    assert {d.rule for d in diags} == {"DSF013"}
    assert all("from model preset 'tiny-llama'" in d.message and d.location.line == 4 for d in diags)


@pytest.mark.parametrize(("cfg", "weights", "rule", "words"), [
    (None, None, "DSF011", "does not exist"),
    (llama_config(model_type="bert"), "model.safetensors", "DSF012", "model_type 'bert'"),
    (llama_config(head_dim=0), "model.safetensors", "DSF012", "head_dim is 0"),
    (llama_config(attention_bias=True), "model.safetensors", "DSF012", "attention_bias"),
    (llama_config(mlp_bias=True), "model.safetensors", "DSF012", "mlp_bias"),
    (llama_config(model_type="qwen2", use_sliding_window=True, sliding_window=16), "model.safetensors",
     "DSF012", "sliding_window 16 is shorter than model.seq_len 64 (config.json's max_position_embeddings"),
    (llama_config(model_type="mistral", sliding_window=63), "model.safetensors", "DSF012",
     "sliding_window 63 is shorter than model.seq_len 64"),
    (llama_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.1),
     "model.safetensors", "DSF015", "router_jitter_noise is 0.1"),
    (llama_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.02), "model.safetensors", "DSF015", "router_aux_loss_coef 0.02"),
    (llama_config(hidden_act="gelu"), "model.safetensors", "DSF012", "SwiGLU"),
    (llama_config(num_hidden_layers="4"), "model.safetensors", "DSF012", "num_hidden_layers"),
    (llama_config(), None, "DSF014", "holds no weights"),
])
def test_unusable_directories(tmp_path: Path, cfg: dict[str, Any] | None, weights: str | None, rule: str,
                              words: str) -> None:
    if cfg is not None:
        checkpoint_dir(tmp_path, cfg, weights)
    assert [(r, words in m) for r,
            m in rules_of(job_file(tmp_path, {"pretrained": "ckpt"}))] == [(rule, True)]


def test_config_json_that_is_not_json(tmp_path: Path) -> None:
    d = checkpoint_dir(tmp_path, llama_config())
    (d / "config.json").write_text("{not json", encoding="utf-8")
    assert [r for r, _ in rules_of(job_file(tmp_path, {"pretrained": "ckpt"}))] == ["DSF011"]


def test_an_index_naming_a_missing_shard(tmp_path: Path) -> None:
    d = checkpoint_dir(tmp_path, llama_config(), weights="model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}), encoding="utf-8")
    found = rules_of(job_file(tmp_path, {"pretrained": "ckpt"}))
    assert [r for r, _ in found] == ["DSF014"] and "model-00002-of-00002" in found[0][1]


@pytest.mark.parametrize("directory", ["ckpt", "ckpt/run1"])
def test_checkpoints_never_go_into_the_pretrained_directory(tmp_path: Path, directory: str) -> None:
    checkpoint_dir(tmp_path, llama_config())
    found = rules_of(job_file(tmp_path, {"pretrained": "ckpt"}, checkpoint={"dir": directory}))
    assert [r for r, _ in found] == ["DSF160"]
    ok = rules_of(job_file(tmp_path, {"pretrained": "ckpt"}, checkpoint={"dir": "elsewhere"}))
    assert ok == []


def test_a_symlink_into_the_pretrained_directory_is_refused_too(tmp_path: Path) -> None:
    d = checkpoint_dir(tmp_path, llama_config())
    (tmp_path / "link").symlink_to(d)
    found = rules_of(job_file(tmp_path, {"pretrained": "ckpt"}, checkpoint={"dir": "link/out"}))
    assert [r for r, _ in found] == ["DSF160"]


def test_dtype_conversion_is_said(tmp_path: Path) -> None:
    checkpoint_dir(tmp_path, llama_config(dtype="bfloat16"))
    found = rules_of(job_file(tmp_path, {"pretrained": "ckpt"}))
    assert [r for r, _ in found] == ["DSF163"] and "bfloat16" in found[0][1] and "float32" in found[0][1]


@pytest.mark.slow  # imports torch and transformers for the rewrite plan (~10 s on a loaded machine)
def test_compile_and_explain_read_no_weights(tmp_path: Path) -> None:
    """The weights file holds junk bytes: a planner that opened it would fail."""
    checkpoint_dir(tmp_path, llama_config())
    path = job_file(tmp_path, {"pretrained": "ckpt", "seq_len": 32}, steps=2)
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(cli, ["compile", str(path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads((out / "plan.json").read_text(encoding="utf-8"))
    assert plan["job"]["model"]["pretrained"] == str(tmp_path / "ckpt")
    assert plan["job"]["model"]["hidden"] == 64
    result = runner.invoke(cli, ["explain", str(path)])
    assert result.exit_code == 0, result.output


def test_the_fixture_checkpoint_validates() -> None:
    doc = {"version": 1, "model": {"pretrained": str(TINY)},
           "hardware": {"preset": "cpu-local", "gpus_per_node": 2}, "parallel": {"tp": 2},
           "training": {"global_batch": 4, "micro_batch": 1, "precision": "bf16"}}
    from dsforge.compiler.frontend.parse import parse_job
    from dsforge.compiler.frontend.source import SourceMap

    spec, diags = parse_job(doc, SourceMap("<test>"))
    assert spec is not None and spec.model.hidden == 32, diags


SIZES = st.integers(1, 64)


@settings(max_examples=80, deadline=None)
@given(layers=SIZES, kv=st.integers(1, 8), per_kv=st.integers(1, 4), head_dim=st.sampled_from([8, 16, 64]),
       ffn=st.integers(1, 50_000), vocab=st.integers(1, 300_000), positions=st.integers(1, 1 << 17),
       tied=st.booleans(), family=st.sampled_from(["llama", "mistral", "qwen2"]),
       width=st.none() | st.integers(1, 8192))
def test_model_keys_describe_the_config(layers: int, kv: int, per_kv: int, head_dim: int, ffn: int,
                                        vocab: int, positions: int, tied: bool, family: str,
                                        width: int | None) -> None:
    # width None: config.json omits head_dim (hidden = heads x head_dim); else hidden is unrelated
    # (Qwen3-style)
    heads = kv * per_kv
    hidden = heads * head_dim if width is None else width
    cfg = llama_config(model_type=family, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv, hidden_size=hidden, intermediate_size=ffn, vocab_size=vocab,
                       max_position_embeddings=positions, tie_word_embeddings=tied,
                       **({} if width is None else {"head_dim": head_dim}))
    keys = model_keys(cfg, Path("config.json"))
    assert keys == {"arch": "llama", "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv,
                    "head_dim": head_dim, "qkv_bias": family == "qwen2",
                    "ffn_hidden": ffn, "vocab": vocab, "seq_len": positions, "tied_embeddings": tied,
                    "activation": "swiglu", "position": "rope"}


@settings(max_examples=100, deadline=None)
@given(key=st.sampled_from(["layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab"]),
       delta=st.integers(-3, 3))
def test_any_stated_value_is_kept_when_equal_and_refused_when_not(key: str, delta: int) -> None:
    from dsforge.compiler.frontend.pretrained import _contradictions

    found = model_keys(llama_config(), Path("config.json"))
    stated = {key: found[key] + delta}
    problems = _contradictions(stated, found, "config.json")
    assert (problems == []) == (delta == 0)
    if delta:
        assert (
            problems[0][0] == (key,)
            and str(found[key]) in problems[0][1]
            and str(found[key] + delta) in problems[0][1]
        )


def test_gpt2_config() -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64,
            "vocab_size": 256}
    keys = model_keys(gpt2, Path("c"))
    assert keys["arch"] == "gpt2" and keys["ffn_hidden"] == 256 and keys["tied_embeddings"] is True
    assert keys["position"] == "learned" and keys["seq_len"] == 64
    with pytest.raises(PretrainedError):
        model_keys({**gpt2, "activation_function": "relu"}, Path("c"))


@settings(max_examples=60, deadline=None)
@given(experts=st.integers(1, 256), top_k=st.integers(1, 8), ffn=st.integers(1, 50_000), tied=st.booleans(),
       aux=st.floats(0, 1), logits=st.booleans())
def test_mixtral_config_fills_the_moe_section(experts: int, top_k: int, ffn: int, tied: bool, aux: float,
                                              logits: bool) -> None:
    """Experts, top-k and the expert width come from config.json; the aux loss is refused only when HF adds
    it."""
    cfg = llama_config(model_type="mixtral", num_local_experts=experts, num_experts_per_tok=top_k,
                       intermediate_size=ffn, tie_word_embeddings=tied, router_aux_loss_coef=aux,
                       output_router_logits=logits, router_jitter_noise=0.0, sliding_window=None)
    if logits and aux != 0:
        with pytest.raises(PretrainedError, match="output_router_logits") as err:
            model_keys(cfg, Path("c"))
        assert err.value.rule == "DSF015"
        return
    keys = model_keys(cfg, Path("c"))
    assert keys == {"arch": "mixtral", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16,
                    "qkv_bias": False, "ffn_hidden": ffn, "vocab": 256, "seq_len": 64,
                    "tied_embeddings": tied, "activation": "swiglu", "position": "rope",
                    "moe": {"experts": experts, "top_k": top_k, "ffn_hidden": ffn, "every": 1}}


def test_a_mixtral_checkpoint_validates_under_expert_parallelism(tmp_path: Path) -> None:
    cfg = llama_config(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                       router_jitter_noise=0.0, output_router_logits=False, router_aux_loss_coef=0.02)
    checkpoint_dir(tmp_path, cfg)
    path = job_file(tmp_path, {"pretrained": "ckpt", "seq_len": 32})
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    path.write_text(yaml.safe_dump({**doc, "parallel": {"ep": 2}}, sort_keys=False), encoding="utf-8")
    job, diags = load_job(path)
    assert job is not None, diags
    m = job.spec.model
    assert m.arch == "mixtral" and m.moe is not None and (m.moe.experts, m.moe.top_k,
                                                          m.moe.ffn_hidden) == (4, 2, 128)
    assert rules_of(path) == []
    path.write_text(path.read_text(encoding="utf-8").replace("seq_len: 32", "seq_len: 32\n  moe: {top_k: 1}"))
    found = rules_of(path)
    assert [r for r, _ in found] == ["DSF013"] and "model.moe.top_k 1" in found[0][1]


@settings(max_examples=80, deadline=None)
@given(window=st.integers(1, 256), seq_len=st.none() | st.integers(1, 128),
       family=st.sampled_from(["mistral", "mixtral", "qwen2", "qwen2-off", "qwen2-layer-types", "llama"]))
def test_a_sliding_window_is_refused_only_where_it_bites(tmp_path_factory: pytest.TempPathFactory,
                                                         window: int, seq_len: int | None,
                                                         family: str) -> None:
    """Accepted (a DSF016 note) when the window covers seq_len (config.json's 128 when unstated), DSF012 when
    shorter; Qwen2 windows only with use_sliding_window or a sliding layer, Llama never."""
    tmp = tmp_path_factory.mktemp("window")
    extra: dict[str, Any] = {"sliding_window": window, "max_position_embeddings": 128}
    mtype = family.split("-")[0]
    if family == "qwen2":
        extra["use_sliding_window"] = True
    elif family == "qwen2-layer-types":
        extra["layer_types"] = ["full_attention", "sliding_attention", "full_attention", "full_attention"]
    if mtype == "mixtral":
        extra |= {"num_local_experts": 4, "num_experts_per_tok": 2}
    checkpoint_dir(tmp, llama_config(model_type=mtype, **extra))
    found = rules_of(job_file(tmp,
                              {"pretrained": "ckpt", **({} if seq_len is None else {"seq_len": seq_len})}))
    applies = family not in ("qwen2-off", "llama")
    length = 128 if seq_len is None else seq_len
    if not applies:
        assert found == []
    elif window >= length:
        assert [r for r,
                _ in found] == ["DSF016"] and f"sliding_window {window} covers model.seq_len {length}" \
            in found[0][1]
    else:
        assert [r for r, _ in found] == ["DSF012"], found
        assert f"sliding_window {window} is shorter than model.seq_len {length}" in found[0][1]


def _qwen_moe_config(mtype: str, **over: Any) -> dict[str, Any]:
    cfg = llama_config(model_type=mtype, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                       output_router_logits=False, router_aux_loss_coef=0.001, use_sliding_window=False,
                       sliding_window=None)
    if mtype == "qwen2_moe":
        cfg |= {"shared_expert_intermediate_size": 48, "qkv_bias": True}
    cfg.update(over)
    return cfg


def test_qwen_families_fill_their_keys() -> None:
    """Qwen3 (head_dim its own, no biases), Qwen2-MoE (a shared expert, q/k/v biases), Qwen3-MoE (routed
    only)."""
    qwen3 = model_keys(llama_config(model_type="qwen3", head_dim=32, tie_word_embeddings=True), Path("c"))
    assert (qwen3["arch"], qwen3["head_dim"], qwen3["qkv_bias"],
            qwen3["tied_embeddings"]) == ("qwen3", 32, False, True)
    assert "moe" not in qwen3
    q2 = model_keys(_qwen_moe_config("qwen2_moe"), Path("c"))
    assert (q2["arch"], q2["qkv_bias"], q2["ffn_hidden"]) == ("qwen2_moe", True, 128)
    assert q2["moe"] == {"experts": 8, "top_k": 2, "ffn_hidden": 32, "every": 1, "shared_experts": 1,
                         "shared_ffn_hidden": 48}
    assert model_keys(_qwen_moe_config("qwen2_moe", qkv_bias=False), Path("c"))["qkv_bias"] is False
    q3 = model_keys(_qwen_moe_config("qwen3_moe"), Path("c"))
    assert (q3["arch"], q3["qkv_bias"]) == ("qwen3_moe", False)
    assert q3["moe"] == {"experts": 8, "top_k": 2, "ffn_hidden": 32, "every": 1}
    renamed = _qwen_moe_config("qwen3_moe", num_local_experts=8)  # transformers' own name for the count
    del renamed["num_experts"]
    assert model_keys(renamed, Path("c"))["moe"]["experts"] == 8


@pytest.mark.parametrize(("cfg", "rule", "words"), [
    (_qwen_moe_config("qwen2_moe", decoder_sparse_step=2), "DSF012", "decoder_sparse_step 2"),
    (_qwen_moe_config("qwen3_moe", mlp_only_layers=[0]), "DSF012", "mlp_only_layers [0]"),
    (_qwen_moe_config("qwen3_moe", output_router_logits=True), "DSF015", "router_aux_loss_coef 0.001"),
    (llama_config(model_type="qwen3", attention_bias=True), "DSF012", "attention_bias"),
    (_qwen_moe_config("qwen2_moe", use_sliding_window=True, sliding_window=16), "DSF012",
     "sliding_window 16"),
])
def test_qwen_refusals(tmp_path: Path, cfg: dict[str, Any], rule: str, words: str) -> None:
    checkpoint_dir(tmp_path, cfg)
    found = rules_of(job_file(tmp_path, {"pretrained": "ckpt"}))
    assert [(r, words in m) for r, m in found] == [(rule, True)], found
