"""``ModelSpec``: the size and shape of a model, from numbers, a live module or a config.json.

The budget needs P (the parameter count) and, for the finer items, the architecture: hidden
size, layers, heads, vocabulary and the 2-D weights (``Matrix``) that LoRA, Adafactor, Muon
and GaLore act on. Unknown fields stay ``None``; the estimate says which items they leave out.
The architecture assumed when P is computed from numbers is a LLaMA-style decoder (gated MLP,
RMSNorm, no biases, untied head) unless told otherwise; GPT-2 style configs are read too.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from memlens.errors import MemlensUsageError

if TYPE_CHECKING:
    from memlens.files import OpenedFile

# A transformers config.json is a few kilobytes.
CONFIG_MAX_BYTES = 16 << 20

# Short names people type for the LLaMA-style projection names the spec uses.
TARGET_ALIASES: dict[str, str] = {
    "q": "q_proj",
    "query": "q_proj",
    "k": "k_proj",
    "key": "k_proj",
    "v": "v_proj",
    "value": "v_proj",
    "o": "o_proj",
    "out": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
ALL_LINEAR = "all-linear"

# HF config classes whose default tie_word_embeddings is False (PretrainedConfig's default is True).
_UNTIED_BY_DEFAULT = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "olmo", "phi3"})
# GPT-2 style families: plain MLP, biases on linears and norms, learned positions.
_GPT2_STYLE = frozenset({"gpt2", "gpt_neo", "gptj", "opt"})

_LORA_NAME = re.compile(r"(^|\.)lora_[A-Za-z_]*(\.|$)")


@dataclass(frozen=True)
class Matrix:
    """A group of ``count`` weight matrices of one shape (rows = out features, cols = in features).

    ``in_blocks`` marks the transformer blocks' projections (what LoRA, Muon and GaLore act on),
    as opposed to embeddings and the output head.
    """

    name: str
    rows: int
    cols: int
    count: int = 1
    in_blocks: bool = True
    trainable: bool = True

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.count


@dataclass(frozen=True)
class ModelSpec:
    """What the budget needs to know about a model.

    ``n_params`` counts the base model (LoRA adapters found in a module are ``adapter_params``);
    ``n_trainable`` counts the base parameters that train (``None``: all of them).
    """

    n_params: int
    hidden_size: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    vocab_size: int | None = None
    ffn_size: int | None = None
    tie_embeddings: bool = False
    matrices: tuple[Matrix, ...] = ()
    params_per_layer: int | None = None
    n_trainable: int | None = None
    adapter_params: int = 0
    adapter_matrices: tuple[Matrix, ...] = ()
    param_bytes_by_dtype: Mapping[str, int] = field(default_factory=dict)
    source: str = "numbers"
    # Parameters outside every 2-D weight (norms, biases), when the layout says how many.
    vector_params: int | None = None
    # What the spec assumed where a size was not given, said in the budget's notes.
    assumptions: tuple[str, ...] = ()
    # P was counted with the d -> 4d -> d MLP because no FFN size was given (said on the weights line).
    ffn_assumed: bool = False

    def __post_init__(self) -> None:
        if self.n_params <= 0:
            raise MemlensUsageError(f"the parameter count must be positive, not {self.n_params}")
        for name in ("hidden_size", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise MemlensUsageError(f"{name} must be positive, not {value}")
        if self.n_trainable is not None and not 0 <= self.n_trainable <= self.n_params:
            raise MemlensUsageError(f"n_trainable={self.n_trainable} is outside 0..{self.n_params}")

    # ---------------------------------------------------------------- derived
    @property
    def trainable_base_params(self) -> int:
        return self.n_params if self.n_trainable is None else self.n_trainable

    @property
    def kv_ratio(self) -> float:
        """kv-heads / heads (1.0 for plain multi-head attention or when unknown)."""
        if self.n_heads is None or self.n_kv_heads is None:
            return 1.0
        return self.n_kv_heads / self.n_heads

    def block_matrices(self) -> list[Matrix]:
        return [m for m in self.matrices if m.in_blocks]

    def lora_matrices(self, targets: tuple[str, ...] | list[str]) -> list[Matrix]:
        """The block matrices LoRA adapts for ``targets`` (peft-style: the module name's last part)."""
        wanted = {TARGET_ALIASES.get(t.strip().lower(), t.strip()) for t in targets if t.strip()}
        if not wanted:
            raise MemlensUsageError("LoRA needs at least one target module (e.g. q_proj,v_proj)")
        blocks = self.block_matrices()
        if not blocks:
            raise MemlensUsageError(
                "LoRA needs the layer shapes: give --hidden and --layers (and --ffn for MLP targets), "
                "a config.json or a module"
            )
        if ALL_LINEAR in wanted:
            return blocks
        chosen = [m for m in blocks if m.name.rsplit(".", 1)[-1] in wanted or m.name in wanted]
        unmatched = sorted(t for t in wanted if not any(m.name.rsplit(".", 1)[-1] == t or m.name == t for m in chosen))
        if unmatched:
            known = sorted({m.name.rsplit(".", 1)[-1] for m in blocks})
            raise MemlensUsageError(
                f"LoRA target(s) {', '.join(unmatched)} match no layer of this model; its layers are: "
                + ", ".join(known)
            )
        return chosen

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_numbers(
        cls,
        n_params: float | None = None,
        *,
        hidden_size: int | None = None,
        n_layers: int | None = None,
        n_heads: int | None = None,
        n_kv_heads: int | None = None,
        vocab_size: int | None = None,
        ffn_size: int | None = None,
        tie_embeddings: bool = False,
        gated_mlp: bool = True,
        linear_bias: bool = False,
        norm_bias: bool = False,
        max_positions: int = 0,
        source: str = "numbers",
    ) -> ModelSpec:
        """A spec from sizes. P is taken as given, or computed when d, L, V and the FFN size are known.

        The layout: per layer q/k/v/o projections (k, v with ``n_kv_heads`` heads), a gated MLP
        (gate, up, down) or a plain one (up, down), two norms; then embeddings, a final norm and
        a head unless ``tie_embeddings``.
        """
        for name, value in (("heads", n_heads), ("kv-heads", n_kv_heads), ("hidden size", hidden_size)):
            if value is not None and value <= 0:  # before dividing by it
                raise MemlensUsageError(f"{name} must be positive, not {value}")
        if n_heads is not None and n_kv_heads is not None and n_kv_heads > n_heads:
            raise MemlensUsageError(f"kv-heads ({n_kv_heads}) cannot exceed heads ({n_heads})")
        if hidden_size is not None and n_heads is not None and hidden_size % n_heads:
            raise MemlensUsageError(f"hidden size {hidden_size} is not divisible by {n_heads} heads")
        if n_kv_heads is not None and n_heads is None:
            raise MemlensUsageError("--kv-heads needs --heads")
        assumptions: list[str] = []
        if n_params is None and ffn_size is None and hidden_size is not None and n_layers is not None:
            # Counting P from sizes needs the MLP; without --ffn take the d -> 4d -> d MLP the
            # activation formulas (Megatron's 34*T*B*d) assume, rather than refuse.
            ffn_size, gated_mlp = 4 * hidden_size, False
            assumptions.append(
                f"--ffn not given: a d -> 4d -> d MLP assumed ({ffn_size:,} = 4 x {hidden_size:,}), "
                "as the activation formulas assume; give --ffn for a gated (LLaMA-style) MLP"
            )
        matrices: list[Matrix] = []
        vectors: int | None = None
        per_layer: int | None = None
        computed: int | None = None
        if hidden_size is not None and n_layers is not None:
            d, n_l = hidden_size, n_layers
            kv_dim = d if n_heads is None or n_kv_heads is None else d // n_heads * n_kv_heads
            attention = [
                Matrix("q_proj", d, d, n_l),
                Matrix("k_proj", kv_dim, d, n_l),
                Matrix("v_proj", kv_dim, d, n_l),
                Matrix("o_proj", d, d, n_l),
            ]
            matrices += attention
            norm = d * (2 if norm_bias else 1)
            # Two norms per layer and the final one; biases only where the MLP's size is known.
            vectors = (2 * n_l + 1) * norm + (sum(m.rows for m in matrices) * n_l if linear_bias else 0)
            if ffn_size is not None:
                mlp = [Matrix("up_proj", ffn_size, d, n_l), Matrix("down_proj", d, ffn_size, n_l)]
                if gated_mlp:
                    mlp.insert(0, Matrix("gate_proj", ffn_size, d, n_l))
                matrices += mlp
                biases = sum(m.rows for m in matrices) if linear_bias else 0
                per_layer = sum(m.rows * m.cols for m in matrices) + biases + 2 * norm
                vectors = (2 * n_l + 1) * norm + biases * n_l
            if vocab_size is not None:
                matrices.append(Matrix("embed_tokens", vocab_size, d, 1, in_blocks=False))
                if not tie_embeddings:
                    matrices.append(Matrix("lm_head", vocab_size, d, 1, in_blocks=False))
                if max_positions:
                    matrices.append(Matrix("embed_positions", max_positions, d, 1, in_blocks=False))
                if per_layer is not None:
                    head = 0 if tie_embeddings else vocab_size * d
                    computed = per_layer * n_l + vocab_size * d + head + max_positions * d + norm
        if n_params is None:
            if computed is None:
                missing = [
                    flag
                    for flag, value in (
                        ("--hidden", hidden_size),
                        ("--layers", n_layers),
                        ("--vocab", vocab_size),
                        ("--ffn", ffn_size),
                    )
                    if value is None
                ]
                raise MemlensUsageError(
                    "give the parameter count (--params) or the architecture; missing " + ", ".join(missing)
                )
            n_params = computed
        return cls(
            n_params=round(n_params),
            hidden_size=hidden_size,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads if n_kv_heads is not None else n_heads,
            vocab_size=vocab_size,
            ffn_size=ffn_size,
            tie_embeddings=tie_embeddings,
            matrices=tuple(matrices),
            params_per_layer=per_layer,
            source=source,
            vector_params=vectors,
            assumptions=tuple(assumptions),
            ffn_assumed=bool(assumptions),
        )

    @classmethod
    def from_config_json(cls, path: str | os.PathLike[str] | OpenedFile, n_params: float | None = None) -> ModelSpec:
        """A spec from a transformers-style ``config.json`` (read from disk, nothing downloaded):
        a path, or a file already opened and checked (``memlens mcp``). Only a regular file of at
        most ``CONFIG_MAX_BYTES`` is read: a FIFO is refused, not waited on."""
        from memlens.files import FileRefused, OpenedFile, open_regular

        name = path.name if isinstance(path, OpenedFile) else os.fspath(path)
        try:
            if isinstance(path, OpenedFile):
                data = path.read_bytes(CONFIG_MAX_BYTES)
            else:
                with open_regular(path, max_bytes=CONFIG_MAX_BYTES) as opened:
                    data = opened.read_bytes(CONFIG_MAX_BYTES)
            raw = json.loads(data.decode("utf-8"))
        except FileRefused as exc:
            raise MemlensUsageError(f"cannot read config {name}: {exc.reason}") from None
        except OSError as exc:
            raise MemlensUsageError(f"cannot read config {name}: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise MemlensUsageError(f"{name} is not UTF-8 text ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            raise MemlensUsageError(f"{name} is not valid JSON: {exc.msg} (line {exc.lineno})") from exc
        if not isinstance(raw, dict):
            raise MemlensUsageError(f"{name}: a config.json holds a JSON object")
        return cls.from_config_dict(raw, n_params=n_params, source=f"config:{name}")

    @classmethod
    def from_config_dict(
        cls, config: Mapping[str, Any], n_params: float | None = None, source: str = "config"
    ) -> ModelSpec:
        """Like ``from_config_json`` for an already-parsed config (also a nested ``text_config``)."""
        if "hidden_size" not in config and "n_embd" not in config and "d_model" not in config:
            nested = config.get("text_config")
            if isinstance(nested, Mapping):
                return cls.from_config_dict(nested, n_params=n_params, source=source)

        def pick(*keys: str) -> Any:
            for key in keys:
                if config.get(key) is not None:
                    return config[key]
            return None

        def as_int(value: Any, key: str) -> int | None:
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
                raise MemlensUsageError(f"{source}: {key} must be a whole number, not {value!r}")
            return int(value)

        model_type = str(config.get("model_type", "")).lower()
        gpt2_style = model_type in _GPT2_STYLE
        hidden = as_int(pick("hidden_size", "n_embd", "d_model"), "hidden_size")
        layers = as_int(pick("num_hidden_layers", "n_layer", "num_layers"), "num_hidden_layers")
        heads = as_int(pick("num_attention_heads", "n_head", "num_heads"), "num_attention_heads")
        kv_heads = as_int(pick("num_key_value_heads", "num_kv_heads"), "num_key_value_heads")
        vocab = as_int(pick("vocab_size"), "vocab_size")
        ffn = as_int(pick("intermediate_size", "n_inner", "ffn_dim"), "intermediate_size")
        if ffn is None and hidden is not None and gpt2_style:
            ffn = 4 * hidden
        tie_default = model_type not in _UNTIED_BY_DEFAULT
        tie = bool(config.get("tie_word_embeddings", tie_default))
        positions = as_int(pick("n_positions", "max_position_embeddings"), "n_positions") if gpt2_style else 0
        return cls.from_numbers(
            n_params,
            hidden_size=hidden,
            n_layers=layers,
            n_heads=heads,
            n_kv_heads=kv_heads,
            vocab_size=vocab,
            ffn_size=ffn,
            tie_embeddings=tie,
            gated_mlp=not gpt2_style,
            linear_bias=gpt2_style,
            norm_bias=gpt2_style,
            max_positions=positions or 0,
            source=source,
        )

    @classmethod
    def from_module(
        cls,
        module: Any,
        *,
        hidden_size: int | None = None,
        n_layers: int | None = None,
        n_heads: int | None = None,
        n_kv_heads: int | None = None,
        vocab_size: int | None = None,
    ) -> ModelSpec:
        """A spec from a live ``torch.nn.Module`` (meta-device modules work: nothing is allocated).

        Counts parameters (shared ones once), trainable ones and bytes per dtype; finds LoRA
        adapters (parameters under a ``lora_*`` submodule, as peft names ``lora_A``/``lora_B``),
        linear, embedding and attention layers. Sizes it cannot find stay ``None`` unless given.
        """
        from torch import nn

        if not isinstance(module, nn.Module):
            raise MemlensUsageError(f"from_module needs a torch.nn.Module, not {type(module).__name__}")
        n_base = n_base_trainable = n_adapters = n_vectors = 0
        adapter_matrices: list[Matrix] = []
        by_dtype: Counter[str] = Counter()
        for name, param in module.named_parameters():
            numel = param.numel()
            by_dtype[str(param.dtype).removeprefix("torch.")] += numel * param.element_size()
            if _LORA_NAME.search(name):
                n_adapters += numel
                if param.dim() == 2:
                    adapter_matrices.append(Matrix(name, int(param.shape[0]), int(param.shape[1])))
            else:
                n_base += numel
                n_base_trainable += numel if param.requires_grad else 0
                n_vectors += numel if param.dim() < 2 else 0
        if n_base == 0:
            raise MemlensUsageError(f"{type(module).__name__} has no parameters")

        matrices: list[Matrix] = []
        in_features: Counter[int] = Counter()
        found_heads: int | None = None
        found_ffn: int | None = None
        found_vocab: int | None = None
        found_hidden: int | None = None
        layer_counts = [0]
        seen_weights: set[int] = set()  # a tied head shares the embedding's weight: count it once
        for name, child in module.named_modules():
            weight = getattr(child, "weight", None)
            if isinstance(child, nn.Embedding | nn.Linear):
                if id(weight) in seen_weights:
                    continue
                seen_weights.add(id(weight))
            if _LORA_NAME.search(name):
                continue
            if isinstance(child, nn.Embedding):
                matrices.append(
                    Matrix(
                        name,
                        child.num_embeddings,
                        child.embedding_dim,
                        1,
                        in_blocks=False,
                        trainable=child.weight.requires_grad,
                    )
                )
                if found_vocab is None or child.num_embeddings > found_vocab:
                    found_vocab, found_hidden = child.num_embeddings, child.embedding_dim
            elif isinstance(child, nn.Linear):
                matrices.append(
                    Matrix(name, child.out_features, child.in_features, 1, trainable=child.weight.requires_grad)
                )
                in_features[child.in_features] += 1
            elif isinstance(child, nn.MultiheadAttention):
                found_heads = found_heads or child.num_heads
                if child.in_proj_weight is not None:
                    rows, cols = child.in_proj_weight.shape
                    matrices.append(
                        Matrix(
                            f"{name}.in_proj",
                            int(rows),
                            int(cols),
                            1,
                            trainable=child.in_proj_weight.requires_grad,
                        )
                    )
            elif isinstance(child, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer):
                found_ffn = found_ffn or child.linear1.out_features
            elif isinstance(child, nn.ModuleList) and len(child) > 1:
                kinds = {type(item) for item in child}
                if len(kinds) == 1:
                    layer_counts.append(len(child))
            for attr in ("num_heads", "n_heads", "num_attention_heads"):
                value = getattr(child, attr, None)
                if found_heads is None and isinstance(value, int) and value > 0:
                    found_heads = value
        # A Linear whose output is the vocabulary is the head, not a block projection.
        matrices = [
            replace(m, in_blocks=False) if m.in_blocks and found_vocab is not None and m.rows == found_vocab else m
            for m in matrices
        ]
        config = getattr(module, "config", None)

        def from_config(*keys: str) -> int | None:
            for key in keys:
                value = getattr(config, key, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            return None

        hidden = hidden_size or from_config("hidden_size", "n_embd", "d_model") or found_hidden
        if hidden is None and in_features:
            hidden = in_features.most_common(1)[0][0]
        layers = n_layers or from_config("num_hidden_layers", "n_layer") or (max(layer_counts) or None)
        heads = n_heads or from_config("num_attention_heads", "n_head") or found_heads
        kv = n_kv_heads or from_config("num_key_value_heads") or heads
        return cls(
            n_params=n_base,
            hidden_size=hidden,
            n_layers=layers,
            n_heads=heads,
            n_kv_heads=kv,
            vocab_size=vocab_size or from_config("vocab_size") or found_vocab,
            ffn_size=from_config("intermediate_size", "n_inner") or found_ffn,
            matrices=tuple(matrices),
            n_trainable=n_base_trainable,
            adapter_params=n_adapters,
            adapter_matrices=tuple(adapter_matrices),
            param_bytes_by_dtype=dict(by_dtype),
            source=f"module:{type(module).__name__}",
            vector_params=n_vectors,
        )
