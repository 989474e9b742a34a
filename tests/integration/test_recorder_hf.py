"""The recorder on a Hugging Face model (built in code, nothing downloaded): inputs passed by keyword,
a ModelOutput returned, module scopes named as the model names its modules."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

import memlens
from memlens.recorder import record
from memlens.sidecar.writer import sidecar_path


@pytest.mark.timeout(300)
def test_a_hugging_face_model_watched_after_start(tmp_path: Path) -> None:
    """Inputs by keyword (input_ids=, hidden_states=), a ModelOutput returned: all seen."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters())
    with record(tmp_path, device="cpu") as rec:
        rec.watch(model=model, optimizer=optimizer)
        for _ in range(2):
            with rec.step():
                ids = torch.randint(0, 64, (2, 16))
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    with open(rec.paths[-1], "rb") as handle:
        names = {a["name"] for a in pickle.load(handle)["external_annotations"]}
    assert {"memlens.backward#model.layers.0.self_attn", "memlens.backward#model.layers.0.mlp"} <= names
    sidecar = json.loads(sidecar_path(rec.paths[-1]).read_text())
    records = sidecar["tensor_roles"]["records"]
    assert any(r.get("inputs") for r in records) and any(r.get("outputs") for r in records)
    # the config's dimensions and the batch of token ids, for the activation theory and the budget
    assert sidecar["model"]["config"] == {"hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
                                          "num_layers": 1, "layers_module": None, "vocab_size": 64,
                                          "intermediate_size": 64}
    assert (sidecar["model"]["inputs"]["batch_size"], sidecar["model"]["inputs"]["seq_len"]) == (2, 16)
    device = memlens.analyze(rec.paths[-1]).devices[0]
    assert device.categories_at_peak["unknown"] < 0.05 * device.peak_allocated_bytes
