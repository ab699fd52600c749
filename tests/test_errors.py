"""Bad input gets a clear error naming the file or field at fault, never a crash."""
import json
import shutil
import struct

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from colibri import model_init
from colibri.config import ConfigError, parse_config
from colibri.st import ContainerError
from conftest import DATA

SRC = DATA / "tiny_dense"


@pytest.fixture
def model_copy(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(SRC, dst)
    return dst


def _edit_weights(d, fn):
    path = d / "model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _config():
    return json.loads((SRC / "config.json").read_text())


@pytest.mark.parametrize("key,value", [
    ("hidden_size", 2 ** 40), ("num_hidden_layers", 0), ("vocab_size", -3), ("n_routed_experts", 2 ** 40),
    ("num_experts_per_tok", 100), ("qk_rope_head_dim", 7), ("kv_lora_rank", "32"), ("n_group", 4),
    ("rms_norm_eps", float("nan")),
])
def test_hostile_config_dims(key, value):
    raw = _config()
    raw[key] = value
    with pytest.raises(ConfigError, match=key):
        parse_config(raw, "config.json")


def test_huge_matrix_product_rejected():
    raw = _config()
    raw.update(vocab_size=2 ** 24, hidden_size=2 ** 20)
    with pytest.raises(ConfigError, match="vocab_size"):
        parse_config(raw)


def test_missing_config_field():
    raw = _config()
    del raw["kv_lora_rank"]
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        parse_config(raw)


def test_config_not_json(model_copy):
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        model_init(model_copy)


def test_rope_theta_conflict():
    raw = _config()
    raw["rope_theta"] = 5.0
    with pytest.raises(ConfigError, match="rope_theta"):
        parse_config(raw)


def test_truncated_shard(model_copy):
    p = model_copy / "model.safetensors"
    data = p.read_bytes()
    p.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ContainerError, match="model.safetensors"):
        model_init(model_copy)


def test_missing_shard(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ContainerError):
        model_init(model_copy)


def test_missing_model_dir(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        model_init(tmp_path / "nope")


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.q_a_proj.weight",
                                  "model.layers.4.mlp.experts.5.up_proj.weight",
                                  "model.norm.weight"])
def test_missing_tensor(model_copy, name):
    _edit_weights(model_copy, lambda t: t.pop(name))
    with pytest.raises(ContainerError, match=name.replace(".", r"\.")):
        model_init(model_copy)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.kv_b_proj.weight",
                                  "model.layers.3.mlp.experts.0.down_proj.weight"])
def test_wrong_shape(model_copy, name):
    def fn(t):
        t[name] = np.ascontiguousarray(t[name][:, :-1])
    _edit_weights(model_copy, fn)
    with pytest.raises(ContainerError, match=name.replace(".", r"\.")):
        model_init(model_copy)


def test_nan_weight_rejected(model_copy):
    def fn(t):
        t["model.layers.2.mlp.up_proj.weight"][3, 4] = np.nan
    _edit_weights(model_copy, fn)
    with pytest.raises(ContainerError, match="NaN"):
        model_init(model_copy)


def test_nan_expert_weight_rejected_when_streamed(model_copy):
    """Experts are read lazily: a NaN in one is reported when it is loaded, naming the tensor."""
    from colibri._core import EngineError
    def fn(t):
        for e in range(8):
            t[f"model.layers.3.mlp.experts.{e}.gate_proj.weight"][0, 0] = np.nan
    _edit_weights(model_copy, fn)
    m = model_init(model_copy)
    with pytest.raises((ContainerError, EngineError), match="experts"):
        m.generate([3, 14, 15], 2)


def test_nan_router_scores():
    from colibri._core import EngineError
    m = model_init(SRC)
    m.kv_alloc(4)
    ws = m._work(2, 2)
    n = np.full((2, m.cfg.hidden), np.nan, np.float32)
    out = np.zeros((2, m.cfg.hidden), np.float32)
    with pytest.raises(EngineError, match="NaN in the router"):
        m.moe(m.layers[3], n, 2, out, ws)


def test_unknown_dtype(model_copy):
    """Rewrite one tensor's dtype in the header to a dtype nobody knows."""
    p = model_copy / "model.safetensors"
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header["model.norm.weight"]["dtype"] = "Q9_Z"
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (n - len(hb))
    assert len(hb) == n
    p.write_bytes(raw[:8] + hb + raw[8 + n:])
    with pytest.raises(ContainerError, match="Q9_Z"):
        model_init(model_copy)


def test_garbage_header(model_copy):
    (model_copy / "model.safetensors").write_bytes(struct.pack("<Q", 2 ** 60) + b"xx")
    with pytest.raises(ContainerError, match="model.safetensors"):
        model_init(model_copy)


def test_out_of_vocab_token():
    m = model_init(SRC)
    m.kv_alloc(8)
    with pytest.raises(ValueError, match="vocabulary"):
        m.step([3, 10_000], 0)


def test_context_overflow():
    m = model_init(SRC)
    m.kv_alloc(4)
    with pytest.raises(ValueError, match="KV cache"):
        m.step([1, 2, 3, 4, 5], 0)
    with pytest.raises(ValueError, match="KV cache"):
        m.step([1], 4)


def test_absurd_context_is_refused_before_allocating():
    m = model_init(SRC)
    with pytest.raises(ValueError, match="positions"):
        m.kv_alloc(2 ** 40)


def test_fp8_checkpoint_is_refused_until_converted():
    """FP8 weights are only correct with their block scales, which the converter applies: loading
    an FP8 checkpoint directly is a clear error, never a silently wrong model."""
    with pytest.raises(ContainerError, match="convert"):
        model_init(DATA / "tiny_dense_fp8")


# -- the architecture, through the one validator (parse_config) ------------------------

@pytest.mark.parametrize("key,value,why", [
    ("model_type", "llama", "colibri runs only 'glm_moe_dsa'"),
    ("architectures", ["LlamaForCausalLM"], "names 'LlamaForCausalLM': colibri runs only GlmMoeDsa"),
    ("architectures", "GlmMoeDsaForCausalLM", "must be a list"),
])
def test_other_architecture_refused(model_copy, key, value, why):
    raw = _config()
    raw[key] = value
    with pytest.raises(ConfigError, match=f"field '{key}'.*{why}"):
        parse_config(raw, "config.json")
    (model_copy / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=rf"config\.json: field '{key}'.*{why}"):
        model_init(model_copy)


def test_config_without_model_type_accepted(model_copy):
    raw = _config()
    del raw["model_type"], raw["architectures"]
    assert parse_config(raw) == parse_config(_config())
    (model_copy / "config.json").write_text(json.dumps(raw))
    assert model_init(model_copy).cfg == parse_config(_config())


def test_nested_text_config(model_copy):
    """Some GLM checkpoints nest the text model's fields under text_config: the engine reads them
    there, and a nested config naming another architecture is refused."""
    raw = _config()
    nested = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "text_config": raw}
    (model_copy / "config.json").write_text(json.dumps(nested))
    m = model_init(model_copy)
    assert m.cfg == parse_config(raw)
    with pytest.raises(ConfigError, match=r"field 'text_config\.model_type'"):
        parse_config(dict(nested, text_config=dict(raw, model_type="qwen2")))


# -- the shard index of a plain HF checkpoint run directly ---------------------------

def _write_index(d, wmap):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))


def test_engine_index_names_missing_shard(model_copy):
    names = list(load_file(str(model_copy / "model.safetensors")))
    wmap = {n: "model.safetensors" for n in names}
    wmap[names[-1]] = "model-00002-of-00002.safetensors"
    _write_index(model_copy, wmap)
    with pytest.raises(ContainerError, match=rf"names shard model-00002-of-00002\.safetensors "
                                             rf"\(tensor '{names[-1]}'\).*missing"):
        model_init(model_copy)


def test_engine_index_skips_unnamed_adapter(model_copy):
    """An adapter.safetensors the index does not name is not read (it would otherwise shadow the
    model's own tensors: 'adapter' sorts before 'model')."""
    ref = model_init(SRC)
    ref.kv_alloc(4)
    want = ref.step([3, 14, 15], 0)
    norm = load_file(str(model_copy / "model.safetensors"))["model.norm.weight"]
    save_file({"model.norm.weight": np.zeros_like(norm)}, str(model_copy / "adapter.safetensors"))
    _write_index(model_copy, {n: "model.safetensors" for n in load_file(str(model_copy / "model.safetensors"))})
    m = model_init(model_copy)
    m.kv_alloc(4)
    np.testing.assert_array_equal(m.step([3, 14, 15], 0), want)
