"""HF interop: logit parity with transformers, save/load round trips, errors, tokenizer."""

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local; never reach the hub
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from jaxrl_agent.models import (ModelConfig, from_hf_tensors, hf_param_map,  # noqa: E402
                                load_hf, load_tokenizer, save_hf, to_hf_tensors)
from tests.hf_fixtures import (CHAT_TEMPLATE, VARIANTS, VOCAB, make_hf_model,  # noqa: E402
                               make_tokenizer)

B, L = 3, 24  # L > 16 runs past the dynamic variant's max_position_embeddings


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """name -> (folder, torch model): every variant of hf_fixtures.VARIANTS, saved locally."""
    out = {}
    for i, (name, (family, kw)) in enumerate(VARIANTS.items()):
        folder = tmp_path_factory.mktemp(name)
        out[name] = (str(folder), make_hf_model(family, folder, seed=i, **kw))
    return out


@pytest.fixture(scope="module")
def loaded(hf_models):
    """name -> (model, config) loaded by load_hf."""
    return {name: load_hf(folder) for name, (folder, _) in hf_models.items()}


def _tokens(seed, shape=(B, L)):
    return np.random.RandomState(seed).randint(0, VOCAB, shape).astype(np.int32)


def _torch_logits(model, tokens, **kw):
    with torch.no_grad():
        return model(torch.tensor(tokens, dtype=torch.long), **kw).logits.float().numpy()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logit_parity(name, hf_models, loaded):
    _, ref_model = hf_models[name]
    model, cfg = loaded[name]
    family, kw = VARIANTS[name]
    assert cfg.family == family
    assert cfg.tie_word_embeddings == kw["tie_word_embeddings"]
    toks = _tokens(1)
    ref = _torch_logits(ref_model, toks)
    got = np.asarray(model(jnp.asarray(toks)).logits)
    assert got.dtype == np.float32 and got.shape == (B, L, VOCAB)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama_llama3", "qwen2_tied", "qwen3"])
def test_logit_parity_padded_and_offset_positions(name, hf_models, loaded):
    """Left-aligned rows with trailing padding (HF attention_mask / our segment ids) and
    explicit position ids (HF position_ids / our positions)."""
    _, ref_model = hf_models[name]
    model, _ = loaded[name]
    toks = _tokens(2)
    lengths = np.array([L, 9, 1])
    valid = np.arange(L)[None, :] < lengths[:, None]
    toks = np.where(valid, toks, 1)  # pad id 1
    ref = _torch_logits(ref_model, toks, attention_mask=torch.tensor(valid.astype(np.int64)))
    got = np.asarray(model(jnp.asarray(toks), segment_ids=jnp.asarray(valid.astype(np.int32)))
                     .logits)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[valid], ref[valid], atol=1e-4, rtol=0)
    # padding never changes the valid tokens: same as no mask at all (causal attention)
    plain = np.asarray(model(jnp.asarray(toks)).logits)
    np.testing.assert_allclose(plain[valid], got[valid], atol=1e-5, rtol=0)

    pos = (np.arange(L)[None, :] + np.array([[0], [5], [11]])).astype(np.int32)
    ref = _torch_logits(ref_model, toks, position_ids=torch.tensor(pos, dtype=torch.long))
    got = np.asarray(model(jnp.asarray(toks), positions=jnp.asarray(pos)).logits)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_load_transformers_round_trip(name, hf_models, loaded, tmp_path):
    _, ref_model = hf_models[name]
    model, cfg = loaded[name]
    save_hf(model, cfg, str(tmp_path))
    assert os.path.exists(tmp_path / "model.safetensors")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    back.eval()
    assert type(back) is type(ref_model)
    sd_ref, sd_back = ref_model.state_dict(), back.state_dict()
    assert set(sd_ref) == set(sd_back)
    for k in sd_ref:
        assert torch.equal(sd_ref[k], sd_back[k]), k
    toks = _tokens(3)
    np.testing.assert_array_equal(_torch_logits(back, toks), _torch_logits(ref_model, toks))
    # and our own loader reads our file back identically
    model2, cfg2 = load_hf(str(tmp_path))
    assert cfg2 == cfg
    t1, t2 = to_hf_tensors(model), to_hf_tensors(model2)
    assert list(t1) == list(t2)
    for k in t1:
        np.testing.assert_array_equal(t1[k], t2[k])


def test_sharded_save_loads_back(hf_models, loaded, tmp_path):
    _, ref_model = hf_models["qwen3"]
    model, cfg = loaded["qwen3"]
    save_hf(model, cfg, str(tmp_path), max_shard_bytes=100_000)
    files = sorted(os.listdir(tmp_path))
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors" not in files
    with open(tmp_path / "model.safetensors.index.json") as f:
        index = json.load(f)
    assert set(index["weight_map"]) == {s.hf_name for s in hf_param_map(cfg)}
    assert set(index["weight_map"].values()) == set(shards)
    for s in shards:  # each shard within the limit (no single tensor here exceeds it)
        assert sum(v.nbytes for v in load_file(str(tmp_path / s)).values()) <= 100_000
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    for k, v in ref_model.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    model2, _ = load_hf(str(tmp_path))
    toks = _tokens(4)
    np.testing.assert_array_equal(np.asarray(model2(jnp.asarray(toks)).logits),
                                  np.asarray(model(jnp.asarray(toks)).logits))
    # re-saving unsharded removes the shards (no stale file shadows the new checkpoint)
    save_hf(model2, None, str(tmp_path))
    assert not [f for f in os.listdir(tmp_path) if f.startswith("model-")]
    assert not os.path.exists(tmp_path / "model.safetensors.index.json")


def test_bfloat16_load_save(hf_models, tmp_path):
    folder, ref_model = hf_models["qwen2_tied"]
    model, cfg = load_hf(folder, dtype="bfloat16")
    assert cfg.dtype == "bfloat16"
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    toks = _tokens(5)
    got = np.asarray(model(jnp.asarray(toks)).logits)
    assert got.dtype == np.float32 and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, _torch_logits(ref_model, toks), atol=0.1)
    save_hf(model, cfg, str(tmp_path))
    assert {str(v.dtype) for v in load_file(str(tmp_path / "model.safetensors")).values()} \
        == {"bfloat16"}
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    for k, v in ref_model.state_dict().items():
        assert torch.equal(v.to(torch.bfloat16), back.state_dict()[k]), k
    model2, cfg2 = load_hf(str(tmp_path))  # dtype None -> the checkpoint's bfloat16
    assert cfg2.dtype == "bfloat16"


def test_value_head_saved_separately(hf_models, tmp_path):
    folder, ref_model = hf_models["qwen3"]
    model, cfg = load_hf(folder, value_head=True, value_stop_gradient=True, seed=3)
    assert cfg.value_head and model.value_head is not None
    save_hf(model, cfg, str(tmp_path))
    assert os.path.exists(tmp_path / "value_head.safetensors")
    assert not any("value" in k for k in load_file(str(tmp_path / "model.safetensors")))
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))  # HF ignores the extra file
    model2, cfg2 = load_hf(str(tmp_path))
    assert cfg2.value_head and cfg2.value_stop_gradient
    toks = jnp.asarray(_tokens(6))
    np.testing.assert_array_equal(np.asarray(model2(toks).values), np.asarray(model(toks).values))
    model3, cfg3 = load_hf(str(tmp_path), value_head=False)
    assert model3.value_head is None and model3(toks).values is None


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", list(VARIANTS))
def test_config_round_trip(name, loaded, hf_models):
    _, cfg = loaded[name]
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    # transformers parses our config.json into the same architecture
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert ModelConfig.from_hf(hf_cfg.to_dict()) == cfg


def test_config_old_rope_format():
    c = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
         "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0},
         "torch_dtype": "float16"}
    cfg = ModelConfig.from_hf(c)
    assert cfg.rope_theta == 5e5 and cfg.num_kv_heads == 4 and cfg.head_dim == 16
    assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    assert cfg.dtype == "float32"  # float16 is widened
    assert ModelConfig.from_hf({**c, "architectures": ["Qwen3ForCausalLM"]}).head_dim == 128


# ----------------------------------------------------------------------------- errors


def test_unknown_architecture(hf_models, tmp_path):
    with pytest.raises(ValueError, match="MistralForCausalLM.*supported.*LlamaForCausalLM"):
        ModelConfig.from_hf({"architectures": ["MistralForCausalLM"], "vocab_size": 8})
    folder, _ = hf_models["qwen2_tied"]
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    c["architectures"] = ["GPT2LMHeadModel"]
    os.makedirs(tmp_path / "m")
    with open(tmp_path / "m" / "config.json", "w") as f:
        json.dump(c, f)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf(str(tmp_path / "m"))


def test_unknown_rope_type():
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1,
                    num_heads=4, num_kv_heads=2, rope_scaling={"rope_type": "longrope"})


def _copy_with(src, dst, tensors=None, config_edit=None):
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    if config_edit:
        c.update(config_edit)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(c, f)
    if tensors is None:
        tensors = load_file(os.path.join(src, "model.safetensors"))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_missing_unexpected_and_misshaped_tensors(hf_models, tmp_path):
    folder, _ = hf_models["llama_llama3"]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"

    missing = {k: v for k, v in tensors.items() if k != name}
    _copy_with(folder, tmp_path / "missing", missing)
    with pytest.raises(ValueError, match=r"lacks tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"
                                         r".*\(128, 64\)"):
        load_hf(str(tmp_path / "missing"))

    extra = dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(128, np.float32)})
    _copy_with(folder, tmp_path / "extra", extra)
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.self_attn"
                                         r"\.q_proj\.bias'"):
        load_hf(str(tmp_path / "extra"))

    _copy_with(folder, tmp_path / "shape", config_edit={"intermediate_size": 96})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' has shape "
                                         r"\(128, 64\).*expects \(96, 64\)"):
        load_hf(str(tmp_path / "shape"))

    cfg = ModelConfig.from_hf(json.load(open(os.path.join(folder, "config.json"))))
    bad = dict(tensors, **{name: np.zeros((64, 128), np.float32)})
    with pytest.raises(ValueError, match=r"up_proj\.weight' has shape \(64, 128\).*\(128, 64\)"):
        from_hf_tensors(cfg, bad)


def test_ignored_buffers_and_tied_lm_head(hf_models, loaded):
    folder, _ = hf_models["qwen2_tied"]
    _, cfg = loaded["qwen2_tied"]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(16, np.float32)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model = from_hf_tensors(cfg, tensors)
    assert model.lm_head is None


# ----------------------------------------------------------------------------- tokenizer


@pytest.fixture(scope="module")
def tok_folder(tmp_path_factory):
    return str(make_tokenizer(tmp_path_factory.mktemp("tok"), CHAT_TEMPLATE))


@pytest.mark.parametrize("backend", ["transformers", "tokenizers"])
def test_tokenizer(tok_folder, backend):
    tok = load_tokenizer(tok_folder, backend=backend)
    assert tok.backend == backend
    ref = transformers.AutoTokenizer.from_pretrained(tok_folder)
    text = "the agent moves north and sees a key"
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == ref.eos_token_id == 0
    assert tok.pad_token_id == ref.pad_token_id == 1
    assert tok.bos_token_id == 0
    assert tok.vocab_size == len(ref)
    msgs = [{"role": "system", "content": "you are an agent"},
            {"role": "user", "content": "you see a wall at step 3"}]
    want = ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    got = tok.apply_chat_template(msgs, add_generation_prompt=True)
    assert got == list(want)
    assert got[0] == 0 and tok.decode(got).endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert got[:len(no_prompt)] == no_prompt and len(got) > len(no_prompt)


def test_tokenizer_without_chat_template(tmp_path):
    folder = str(make_tokenizer(tmp_path, None))
    for backend in ("transformers", "tokenizers"):
        tok = load_tokenizer(folder, backend=backend)
        assert tok.chat_template is None
        with pytest.raises(ValueError, match="no chat template"):
            tok.apply_chat_template([{"role": "user", "content": "hi"}])
