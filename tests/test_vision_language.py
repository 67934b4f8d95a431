"""A vision-language model through the engine: its language model's blocks are the units, and
what its own config says (a KV cache) is turned off as the top config's is."""

from __future__ import annotations

import torch

from tierwise.offload import Activations, Engine, flat_options
from tests.models import batches


def test_a_vision_language_models_language_model_runs_without_its_kv_cache():
    """Its text config holds its own use_cache: left on, each recomputed block saw a KV cache
    twice and k_proj, v_proj got no gradient (silently)."""
    import transformers

    def tiny_vl():
        torch.manual_seed(0)
        text = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
        vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=16, deepstack_visual_indexes=[])
        return transformers.Qwen3VLForConditionalGeneration(
            transformers.Qwen3VLConfig(text_config=text, vision_config=vision))

    b = batches(1, batch=2, seq=12)[0]
    ref = tiny_vl()
    opt = torch.optim.SGD(ref.parameters(), lr=1.0)
    ref(**b).loss.backward()
    opt.step()
    eng = Engine(tiny_vl(), activations=Activations(recompute=True), **flat_options(lr=1.0, optimizer="sgd"))
    assert eng.recomputed
    eng.step(b)
    mine = dict(eng.named_parameters_fp32())
    for n, p in ref.named_parameters():
        assert torch.equal(mine[n], p.detach()), n
    eng.close()
