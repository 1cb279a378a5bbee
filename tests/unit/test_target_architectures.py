"""The transformers backend on Kimi-K2.5's real architecture: DeepSeek-V3 layers (MLA attention, MoE) alone and
nested under a multimodal wrapper that ships its own code (`trust_remote_code`), as Kimi-K2.5's checkpoint does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from eagle3_datagen.errors import ConfigurationError
from tasks.hidden_states.targets import default_aux_layers, target_num_layers
from tasks.hidden_states.transformers_backend import capture_batch, fresh_target_model

LAYERS = 6


def tiny_deepseek_v3_config() -> DeepseekV3Config:
    """Two dense layers, then MoE layers (4 routed experts, 2 per token, one shared), MLA with low-rank q and kv."""
    return DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        n_group=1, topk_group=1, first_k_dense_replace=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
    )


# What Kimi-K2.5's checkpoint looks like to transformers: a config with a DeepSeek-V3 `text_config`, and a model
# class of its own (loaded from the folder, so only with trust_remote_code) nesting the text model.
WRAPPER_CODE = '''
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PretrainedConfig, PreTrainedModel


class TinyKimiConfig(PretrainedConfig):
    model_type = "tiny_kimi_wrapper"

    def __init__(self, text_config=None, **kwargs):
        self.text_config = DeepseekV3Config(**(text_config or {})) if not isinstance(text_config,
                                                                                      DeepseekV3Config) else text_config
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.text_config


class TinyKimiForConditionalGeneration(PreTrainedModel):
    config_class = TinyKimiConfig

    def __init__(self, config):
        super().__init__(config)
        self.vision_tower = None  # the real one encodes images; text-only here
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def forward(self, input_ids=None, **kwargs):
        return self.language_model(input_ids=input_ids, **kwargs)
'''


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-deepseek-v3")
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(tiny_deepseek_v3_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wrapped_dir(deepseek_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same DeepSeek-V3 weights under the wrapper, keys prefixed `language_model.` as in Kimi-K2.5's files."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny-kimi-wrapped")
    (path / "modeling_tiny_kimi.py").write_text(WRAPPER_CODE)
    text = json.loads((deepseek_dir / "config.json").read_text())
    auto_map = {"AutoConfig": "modeling_tiny_kimi.TinyKimiConfig",
                "AutoModelForCausalLM": "modeling_tiny_kimi.TinyKimiForConditionalGeneration"}
    config = {"model_type": "tiny_kimi_wrapper", "architectures": ["TinyKimiForConditionalGeneration"],
              "text_config": text, "auto_map": auto_map}
    (path / "config.json").write_text(json.dumps(config))
    weights = load_file(deepseek_dir / "model.safetensors")
    save_file({f"language_model.{k}": v for k, v in weights.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


def _reference(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(input_ids=tokens[None], output_hidden_states=True).hidden_states


def test_deepseek_v3_layers_are_hooked_at_the_aux_layers_and_the_final_norm_checked(deepseek_dir: Path) -> None:
    target = fresh_target_model(str(deepseek_dir), "float32", "cpu")
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (LAYERS, 64, 300)
    assert default_aux_layers(LAYERS) == [2, 3, 3], "too shallow for the default: the config must name them"
    aux = [1, 3, 5]  # a dense layer's input, then MoE layers' inputs
    tokens = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(1))
    [(states, final)] = capture_batch(target, aux, [tokens])
    hf = _reference(deepseek_dir, tokens)
    for k, layer in enumerate(aux):
        torch.testing.assert_close(states[:, k * 64 : (k + 1) * 64], hf[layer][0])
    torch.testing.assert_close(torch.nn.functional.rms_norm(final, (64,), target.norm_weight, target.norm_eps),
                               hf[LAYERS][0], rtol=1e-4, atol=1e-5)


def test_a_wrapped_target_needs_the_flag_and_is_then_hooked_inside_its_wrapper(
        deepseek_dir: Path, wrapped_dir: Path) -> None:
    with pytest.raises(ConfigurationError) as refused:
        target_num_layers(str(wrapped_dir))
    assert "set model.trust_remote_code: true" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigurationError, match=r"model\.trust_remote_code"):
        fresh_target_model(str(wrapped_dir), "float32", "cpu")

    assert target_num_layers(str(wrapped_dir), trust_remote_code=True) == LAYERS
    target = fresh_target_model(str(wrapped_dir), "float32", "cpu", trust_remote_code=True)
    assert type(target.base).__name__ == "DeepseekV3Model" and target.num_layers == LAYERS
    tokens = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2))
    [(states, final)] = capture_batch(target, [1, 3, 5], [tokens])
    hf = _reference(deepseek_dir, tokens)  # the same weights, unwrapped
    torch.testing.assert_close(states[:, 64:128], hf[3][0])
    torch.testing.assert_close(torch.nn.functional.rms_norm(final, (64,), target.norm_weight, target.norm_eps),
                               hf[LAYERS][0], rtol=1e-4, atol=1e-5)
