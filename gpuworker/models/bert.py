"""BERT-family sentence encoders for /v1/embeddings: the encoder in plain PyTorch over packed
sequences (no padding: kernels/encoder_attention.py keeps each sentence's attention to itself), and
the sentence-transformers head read from the checkpoint (modules.json, 1_Pooling/config.json):
pooling, then normalisation.

Encoders take whole batches without a KV cache, so the paged attention of the decoders brings
nothing here.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from gpuworker.kernels.attention.encoder import encoder_attention, encoder_attention_reference

# Where a sentence-transformers checkpoint may declare the Matryoshka dimensions it was trained
# for (its vectors can be cut to any of them and renormalised); without it `dimensions` is refused.
MATRYOSHKA_KEY = "matryoshka_dimensions"
POOLING_MODES = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_dict(cls, raw: dict) -> "BertConfig":
        if raw.get("model_type") not in ("bert",) and "BertModel" not in (raw.get("architectures") or []):
            raise ValueError(f"not a BERT-family encoder (model_type {raw.get('model_type')!r})")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {raw['position_embedding_type']!r} is not supported; only 'absolute'"
            )
        if raw.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"hidden_act {raw['hidden_act']!r} is not supported")
        return cls(
            **{
                name: raw[name]
                for name in (
                    "vocab_size",
                    "hidden_size",
                    "num_hidden_layers",
                    "num_attention_heads",
                    "intermediate_size",
                    "max_position_embeddings",
                )
            },
            type_vocab_size=raw.get("type_vocab_size", 2),
            layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
            hidden_act=raw.get("hidden_act", "gelu"),
        )


@dataclass(frozen=True)
class SentenceHead:
    """What sentence-transformers does after the encoder: one pooling mode, then maybe normalise."""

    pooling: str
    normalize: bool
    max_seq_length: int | None
    matryoshka_dimensions: tuple[int, ...]

    @classmethod
    def read(cls, model_dir: Path) -> "SentenceHead":
        modules_file = model_dir / "modules.json"
        if not modules_file.is_file():  # a bare BertModel: mean pooling, as sentence-transformers defaults to
            return cls("mean_tokens", False, None, ())
        modules = json.loads(modules_file.read_text())
        pooling, normalize = "mean_tokens", False
        for module in modules:
            kind = module.get("type", "").rsplit(".", 1)[-1]
            if kind == "Pooling":
                config = json.loads((model_dir / module["path"] / "config.json").read_text())
                chosen = [mode for mode in POOLING_MODES if config.get(f"pooling_mode_{mode}")]
                if len(chosen) != 1:
                    raise ValueError(
                        f"{module['path']}/config.json: exactly one pooling mode of {POOLING_MODES} "
                        f"is supported, found {chosen}"
                    )
                pooling = chosen[0]
            elif kind == "Normalize":
                normalize = True
            elif kind != "Transformer":
                raise ValueError(f"modules.json: the module {module.get('type')!r} is not supported")
        bert_config = model_dir / "sentence_bert_config.json"
        max_seq = json.loads(bert_config.read_text()).get("max_seq_length") if bert_config.is_file() else None
        st_config = model_dir / "config_sentence_transformers.json"
        dims = json.loads(st_config.read_text()).get(MATRYOSHKA_KEY, []) if st_config.is_file() else []
        return cls(pooling, normalize, max_seq, tuple(int(d) for d in dims))


@dataclass(frozen=True)
class PackedBatch:
    """Token sequences back to back on the device: row t of the batch is token positions[t] of
    sequence seq_index[t]; sequence b owns rows [cu_seqlens[b], cu_seqlens[b+1])."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_index: torch.Tensor  # [T] int64
    cu_seqlens: torch.Tensor  # [B + 1] int32
    lengths: torch.Tensor  # [B] int64
    max_seqlen: int

    @classmethod
    def build(cls, token_ids: list[list[int]], device: str | torch.device) -> "PackedBatch":
        """From non-empty id lists, with numpy on the host (a tenth of torch's time per row here) and
        two copies to the device."""
        lengths = np.fromiter(map(len, token_ids), dtype=np.int64, count=len(token_ids))
        cu_seqlens = np.zeros(len(token_ids) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu_seqlens[1:])
        total = int(cu_seqlens[-1])
        rows = np.empty((3, total), dtype=np.int64)
        rows[0] = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=total)
        rows[2] = np.repeat(np.arange(len(token_ids)), lengths)
        rows[1] = np.arange(total) - cu_seqlens[:-1][rows[2]]
        rows_on_device = torch.from_numpy(rows).to(device, non_blocking=True)
        per_seq = torch.from_numpy(np.concatenate([cu_seqlens, lengths])).to(device, non_blocking=True)
        return cls(
            rows_on_device[0],
            rows_on_device[1],
            rows_on_device[2],
            per_seq[: len(token_ids) + 1].to(torch.int32),
            per_seq[len(token_ids) + 1 :],
            int(lengths.max(initial=0)),
        )


def _attention(qkv: torch.Tensor, batch: PackedBatch, scale: float) -> torch.Tensor:
    """Each sequence's own attention: the Triton kernel on a GPU, torch's SDPA over padded copies
    elsewhere (as the decoders' attention backends split)."""
    q, k, v = qkv.unbind(1)
    attend = encoder_attention if qkv.is_cuda else encoder_attention_reference
    return attend(q, k, v, batch.cu_seqlens, batch.max_seqlen, scale)


class _Layer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        h = c.hidden_size
        self.heads = c.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.up = nn.Linear(h, c.intermediate_size)
        self.down = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.act = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}[c.hidden_act]

    def forward(self, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        t, h = x.shape
        head_dim = h // self.heads
        attn = _attention(self.qkv(x).view(t, 3, self.heads, head_dim), batch, head_dim**-0.5)
        x = self.attn_norm(x + self.attn_out(attn.view(t, h)))
        return self.out_norm(x + self.down(self.act(self.up(x))))


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig, head: SentenceHead):
        super().__init__()
        self.config, self.head = config, head
        h = config.hidden_size
        self.word = nn.Embedding(config.vocab_size, h)
        self.position = nn.Embedding(config.max_position_embeddings, h)
        self.token_type = nn.Embedding(config.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))

    @property
    def dimensions(self) -> int:
        return self.config.hidden_size

    @property
    def max_tokens(self) -> int:
        limit = self.config.max_position_embeddings
        return min(limit, self.head.max_seq_length) if self.head.max_seq_length else limit

    @torch.inference_mode()
    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Sentence vectors [batch, hidden] (float32) of a packed batch."""
        x = self.word(batch.input_ids) + self.position(batch.positions) + self.token_type.weight[0]
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, batch)
        x = x.float()
        pooling = self.head.pooling
        if pooling == "cls_token":
            pooled = x[batch.cu_seqlens[:-1].long()]
        else:  # a segmented reduction: deterministic, unlike scattering into the sums with atomics
            reduce = "max" if pooling == "max_tokens" else "sum"
            pooled = torch.segment_reduce(x, reduce, lengths=batch.lengths, axis=0, unsafe=True)
            if pooling != "max_tokens":
                counts = batch.lengths[:, None].float()
                pooled = pooled / (counts if pooling == "mean_tokens" else counts.sqrt())
        return F.normalize(pooled, dim=-1) if self.head.normalize else pooled


def _hf_weights(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """Hugging Face BertModel names (with or without the `bert.` prefix) to this module's."""
    state = {name.removeprefix("bert."): tensor for name, tensor in state.items()}
    try:
        out = {
            "word.weight": state["embeddings.word_embeddings.weight"],
            "position.weight": state["embeddings.position_embeddings.weight"],
            "token_type.weight": state["embeddings.token_type_embeddings.weight"],
            "embed_norm.weight": state["embeddings.LayerNorm.weight"],
            "embed_norm.bias": state["embeddings.LayerNorm.bias"],
        }
        for i in range(layers):
            p = f"encoder.layer.{i}."
            for kind in ("weight", "bias"):
                out[f"layers.{i}.qkv.{kind}"] = torch.cat(
                    [state[f"{p}attention.self.{part}.{kind}"] for part in ("query", "key", "value")]
                )
                out[f"layers.{i}.attn_out.{kind}"] = state[f"{p}attention.output.dense.{kind}"]
                out[f"layers.{i}.attn_norm.{kind}"] = state[f"{p}attention.output.LayerNorm.{kind}"]
                out[f"layers.{i}.up.{kind}"] = state[f"{p}intermediate.dense.{kind}"]
                out[f"layers.{i}.down.{kind}"] = state[f"{p}output.dense.{kind}"]
                out[f"layers.{i}.out_norm.{kind}"] = state[f"{p}output.LayerNorm.{kind}"]
    except KeyError as exc:
        raise ValueError(f"the checkpoint lacks the BERT weight {exc.args[0]!r}") from None
    return out


def is_sentence_encoder(model_dir: str | Path) -> bool:
    """Whether a checkpoint directory holds a BERT-family encoder (served by /v1/embeddings)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return False
    raw = json.loads(config.read_text())
    return raw.get("model_type") == "bert" or "BertModel" in (raw.get("architectures") or [])


def load_bert_encoder(model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> BertEncoder:
    model_dir = Path(model_dir)
    config = BertConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    model = BertEncoder(config, SentenceHead.read(model_dir))
    weights = model_dir / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} does not exist; an encoder is loaded from one safetensors file")
    model.load_state_dict(_hf_weights(load_file(str(weights)), config.num_hidden_layers))
    return model.to(device=device, dtype=dtype).eval()
