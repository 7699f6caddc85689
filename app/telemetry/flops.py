"""Model geometry read from a `transformers` config, and training FLOPs per token.

Shared by the planner (`app plan`) and MFU telemetry, so both count a token's work the same way.

The convention is PaLM's (Chowdhery et al. 2022, appendix B), which is also Megatron-LM's
(Narayanan et al. 2021, eq. 3): *model* FLOPs of a forward and backward pass (3x the forward),
activation recomputation not counted, a multiply-add is 2 FLOPs:

    flops/token = 6 * N_layers                      # every matmul weight: 2 fwd + 4 bwd per token
                + 12 * L * d_attn * S_a             # QK^T and AV: 2 matmuls x 2 FLOPs x S_a x
                                                    # d_attn, x3 for fwd+bwd; the full S_a x S_a
                                                    # matrix is counted, also for causal models
                                                    # (no halving)
                + 6 * f_head * (d * V [+ d * d])    # the LM head on the positions it runs on

S_a, the attention span, is the tokens a real token attends to: S with --packing concat; with
"doc" and "doc-packed", where attention stays inside a document, the mean over real tokens of
their document's length, sum(len^2) / sum(len) over the split's laid-out documents (the loader's
`attention_span`, O(documents) once at start-up): a document of len tokens costs len^2, as
flash-attention's variable-length kernels spend. Counting S there would credit a doc-packed run
of short documents with the whole window's S x S (SDPA with a mask does compute it, but as waste,
not model FLOPs). A sliding-window layer (ModernBERT's local layers) is still counted at S_a.

N_layers counts the transformer blocks' matmul weights only (Q, K, V, O and the MLP's 2 or 3
matrices); embeddings are lookups (no FLOPs), norms and biases are negligible. d_attn = heads x
head_dim. f_head is the fraction of positions the head runs on: 1 for causal LM; for this app's
MLM training it is the masked fraction (~15%), because `SparseHeadBertForMaskedLM` runs the head
(its d x d transform and the d x V decoder) on the labelled positions only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from data_tools.errors import UserError

# Families whose MLP is gated (SwiGLU/GeGLU: gate, up and down projections).
GATED_MLP_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2",
                             "gemma3", "olmo", "olmo2", "phi3", "granite", "modernbert"})
# Encoder families whose MLM head has a d x d transform before the decoder.
MLM_TRANSFORM_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "electra", "modernbert"})


@dataclass(frozen=True)
class ModelShape:
    """A transformer's geometry, as the memory and FLOPs formulas need it."""

    model_type: str
    """`config.model_type` ("bert", "gpt2", "llama", ...): selects the per-family details."""
    hidden: int
    """d: width of the residual stream."""
    layers: int
    """L: transformer blocks."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (= heads without grouped-query attention)."""
    head_dim: int
    """Width of one head (usually hidden / heads)."""
    intermediate: int
    """f: the MLP's inner width (GPT-2: n_inner or 4 * hidden)."""
    vocab: int
    """V: vocabulary size (rows of the embedding and of the LM head)."""
    positions: int
    """Longest sequence the position embeddings (or rotary setup) allow."""
    gated_mlp: bool
    """Three MLP matrices (gate, up, down) instead of two."""

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def layer_matmul_params(self) -> int:
        """Weights of one block's matmuls: Q and O (d x d_attn), K and V (d x d_kv), the MLP."""
        d = self.hidden
        return 2 * d * self.q_dim + 2 * d * self.kv_dim + self.mlp_matrices * d * self.intermediate

    @property
    def has_mlm_transform(self) -> bool:
        return self.model_type in MLM_TRANSFORM_TYPES

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """Read a `transformers` config generically (GPT-2 maps n_embd etc. via attribute_map)."""
        hidden = _int(config, "hidden_size")
        heads = _int(config, "num_attention_heads")
        layers = _int(config, "num_hidden_layers")
        vocab = _int(config, "vocab_size")
        head_dim = getattr(config, "head_dim", None)
        if hidden % heads and not head_dim:
            raise UserError(f"hidden size {hidden} is not divisible by {heads} attention heads")
        head_dim = head_dim or hidden // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise UserError(f"{heads} attention heads are not divisible by {kv_heads} key/value "
                            f"heads")
        inner = (getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None)
                 or 4 * hidden)
        positions = (getattr(config, "max_position_embeddings", None)
                     or getattr(config, "n_positions", None) or 0)
        shape = cls(model_type=config.model_type, hidden=hidden, layers=layers, heads=heads,
                    kv_heads=int(kv_heads), head_dim=int(head_dim), intermediate=int(inner),
                    vocab=vocab, positions=int(positions),
                    gated_mlp=config.model_type in GATED_MLP_TYPES)
        for name in ("layers", "intermediate"):
            if getattr(shape, name) < 1:
                raise UserError(f"{name} {getattr(shape, name)}: must be at least 1")
        return shape


def _int(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"model config: {name} is {value!r}; expected a positive integer")
    return value


def head_fraction(objective: str, mask_prob: float = 0.15, sparse_mlm_head: bool = True) -> float:
    """Fraction of positions the LM head runs on in training (see the module docstring)."""
    if objective == "mlm" and sparse_mlm_head:
        return mask_prob
    return 1.0


def flops_breakdown(shape: ModelShape, seq_len: int, head_frac: float = 1.0,
                    attention_span: float | None = None) -> dict[str, float]:
    """Training FLOPs per token by term: "matmuls", "attention", "head" (see module docstring);
    `attention_span`: S_a, seq_len when not given."""
    if seq_len < 1:
        raise UserError(f"--seq-len {seq_len}: must be at least 1")
    span = seq_len if attention_span is None else min(float(attention_span), seq_len)
    head_params = shape.hidden * shape.vocab
    if shape.has_mlm_transform:
        head_params += shape.hidden * shape.hidden
    return {"matmuls": 6.0 * shape.layers * shape.layer_matmul_params,
            "attention": 12.0 * shape.layers * shape.q_dim * span,
            "head": 6.0 * head_frac * head_params}


def flops_per_token(shape: ModelShape, seq_len: int, head_frac: float = 1.0,
                    attention_span: float | None = None) -> float:
    """Training (forward + backward) model FLOPs per token."""
    return sum(flops_breakdown(shape, seq_len, head_frac, attention_span).values())


def mfu(tokens_per_sec: float, flops_token: float, peak_tflops: float, devices: int = 1) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' dense peak."""
    return tokens_per_sec * flops_token / (peak_tflops * 1e12 * devices)
