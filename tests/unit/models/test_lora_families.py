"""PEFT LoRA adapters on other families' own layer names (Phi-3's fused qkv_proj and gate_up_proj)."""

from __future__ import annotations

import pytest
import torch

from corolla.errors import UnsupportedModel
from corolla.models import lora
from corolla.models.head import ModelHead
from corolla.models.span import Span
from tiny_models import load_reference


@pytest.fixture(scope="module")
def phi3_adapter(tiny_models, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"], init_lora_weights=False
    )
    peft_model = get_peft_model(load_reference(tiny_models["phi3"]), config)
    folder = tmp_path_factory.mktemp("adapters") / "phi3-lora"
    peft_model.save_pretrained(folder)
    return folder, peft_model.eval()


def test_a_phi3_adapter_on_fused_projections_matches_peft(tiny_models, phi3_adapter):
    folder, peft_model = phi3_adapter
    path = tiny_models["phi3"]
    head, spans = ModelHead.load(path), [Span.load(path, 0, 3), Span.load(path, 3, 6)]
    for span in spans:
        lora.attach(span.blocks, span.start, lora.load_adapter(folder, range(span.start, span.end), "a"))
    input_ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    hidden = head.embed(input_ids)
    with lora.use_adapters("a"):
        for span in spans:
            hidden = span(hidden)
    with torch.no_grad():
        expected = peft_model(input_ids).logits
        base = peft_model.get_base_model()
        with peft_model.disable_adapter():
            plain = base(input_ids).logits
    assert (expected - plain).abs().max() > 1e-2  # the adapter changes the outputs
    torch.testing.assert_close(head.logits(hidden), expected, atol=1e-4, rtol=1e-4)


def test_an_adapter_for_a_layer_the_block_lacks_is_refused(tiny_models, phi3_adapter):
    folder, _ = phi3_adapter
    span = Span.load(tiny_models["llama"], 0, 1)  # Llama has q_proj/k_proj/v_proj, no qkv_proj
    with pytest.raises(UnsupportedModel, match="block 0 has no layer (self_attn.qkv_proj|mlp.gate_up_proj)"):
        lora.attach(span.blocks, 0, lora.load_adapter(folder, range(0, 1), "a"))
