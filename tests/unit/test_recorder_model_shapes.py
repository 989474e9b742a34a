"""What the recorder tells the per-layer activation theory: the dimensions a model declares and
the batch and sequence length of its first forward, written only when known for certain."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from memlens.recorder import record
from memlens.recorder.model_inspection import input_dimensions, model_dimensions
from memlens.sidecar import ModelConfig, ModelInputs

NONE = ModelConfig()


def declared(**dims: int) -> ModelConfig:
    return ModelConfig(**dims)  # type: ignore[arg-type]


class Declares(nn.Module):
    def __init__(self, **dims: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        for key, value in dims.items():
            setattr(self, key, value)

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.proj(x.float()[..., :8] if x.dim() == 3 else torch.zeros(x.shape[0], 8))


def test_a_hugging_face_style_config_is_copied_ints_only() -> None:
    model = Declares()
    model.config = SimpleNamespace(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                   n_head=True, vocab_size=32000, d_model=None)
    assert model_dimensions(model) == declared(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                               vocab_size=32000)


def test_root_attributes_count_and_weight_shapes_are_never_guessed_from() -> None:
    # the names a model declares are written as the Hugging Face names
    assert model_dimensions(Declares(d_model=64, n_heads=4)) == declared(hidden_size=64, num_attention_heads=4)
    # an embedding's width is not declared a hidden size (nor is a submodule's attribute)
    plain = nn.Sequential(nn.Embedding(100, 32), nn.TransformerEncoderLayer(32, 4, batch_first=True))
    assert model_dimensions(plain) == NONE
    assert model_dimensions(Declares(d_model=0, n_heads=-1)) == NONE
    # a wrapper (DataParallel here, DistributedDataParallel alike) declares what its module does
    assert model_dimensions(nn.DataParallel(Declares(d_model=64))) == declared(hidden_size=64)


def test_token_ids_give_batch_and_sequence_input_ids_first() -> None:
    ids = torch.zeros(4, 128, dtype=torch.long)
    position_ids = torch.zeros(1, 128, dtype=torch.long)
    found = input_dimensions(Declares(), (), {"position_ids": position_ids, "input_ids": ids}, NONE)
    assert found == ModelInputs(batch_size=4, seq_len=128, shape=[4, 128], dtype="torch.int64")
    assert input_dimensions(Declares(), (ids,), None, NONE).batch_size == 4  # type: ignore[union-attr]
    # float 2-D inputs (features) and boolean masks tell nothing
    assert input_dimensions(Declares(), (torch.zeros(4, 128), torch.ones(4, 128, dtype=torch.bool)), None, NONE) is None


def test_embeddings_count_only_when_their_width_is_the_declared_hidden_size() -> None:
    hidden = torch.zeros(2, 16, 64)
    assert input_dimensions(Declares(), ([hidden],), None, declared(hidden_size=64)).seq_len == 16  # type: ignore[union-attr]
    assert input_dimensions(Declares(), (hidden,), None, declared(hidden_size=32)) is None  # (batch, channels, length)?
    assert input_dimensions(Declares(), (hidden,), None, NONE) is None  # no declared hidden size
    seq_first = Declares(d_model=64)
    seq_first.batch_first = False  # (seq, batch, hidden): the first dimension is not the batch
    assert input_dimensions(seq_first, (hidden,), None, declared(hidden_size=64)) is None


def test_the_sidecar_has_the_model_config_and_its_first_inputs(tmp_path: Path) -> None:
    model = Declares(d_model=64, n_heads=4)
    with record(tmp_path / "run.pickle", model=model, device="cpu") as rec:
        for batch in (3, 5):  # the first call's shape is the one kept
            with rec.step():
                model(torch.zeros(batch, 10, dtype=torch.long))
    sidecar = json.loads((tmp_path / "run.memlens.json").read_text())
    assert sidecar["model"]["config"] == {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": None,
                                          "num_layers": None, "layers_module": None, "vocab_size": None,
                                          "intermediate_size": None}
    assert sidecar["model"]["inputs"]["batch_size"] == 3 and sidecar["model"]["inputs"]["seq_len"] == 10


def test_nothing_known_nothing_written(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 8))
    with record(tmp_path / "run.pickle", model=model, device="cpu") as rec, rec.step():
        model(torch.zeros(2, 8))
    sidecar = json.loads((tmp_path / "run.memlens.json").read_text())
    assert set(sidecar["model"]["config"].values()) == {None} and sidecar["model"]["inputs"] is None
