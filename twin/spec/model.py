"""ModelSpec: the transformer being trained (decoder-only, GPT or Llama style)."""

from __future__ import annotations

from dataclasses import dataclass

from twin.spec.errors import check_choice, raise_if
from twin.spec.moe import MoESpec

ACTIVATIONS = ("gelu", "swiglu")
DTYPES = ("bf16", "fp16", "fp32")
NORMS = ("layernorm", "rmsnorm")
POSITION_EMBEDDINGS = ("learned", "rope")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer.

    The first eleven fields are the public config interface. ``norm``, ``bias``,
    ``position_embedding`` and ``dropout`` default (``None``) from the activation:
    ``gelu`` means GPT style (LayerNorm, biases, learned positions, dropout),
    ``swiglu`` means Llama style (RMSNorm, no biases, RoPE, no dropout).
    """

    name: str = "model"
    """Preset name, for reports."""
    num_layers: int = 2
    """Transformer layers L."""
    hidden_size: int = 64
    """Model dimension h."""
    num_heads: int = 4
    """Query heads a."""
    num_kv_heads: int = 4
    """Key/value heads (GQA when fewer than num_heads; MHA when equal)."""
    ffn_hidden_size: int = 256
    """MLP inner dimension f (4h for GPT, e.g. 14336 for Llama-3 8B)."""
    vocab_size: int = 512
    """Vocabulary V."""
    seq_len: int = 64
    """Training sequence length s."""
    activation: str = "gelu"
    """gelu (two MLP matrices) or swiglu (three)."""
    dtype: str = "bf16"
    """Training dtype of params, grads and activations: bf16, fp16 (mixed precision, fp32 master) or fp32."""
    tie_embeddings: bool = False
    """Share the input embedding and the LM head."""
    norm: str | None = None
    """layernorm or rmsnorm; None: from activation."""
    bias: bool | None = None
    """Linear layers carry biases; None: from activation."""
    position_embedding: str | None = None
    """learned (an s x h table) or rope (no parameters); None: from activation."""
    dropout: bool | None = None
    """Dropout after attention, MLP and embedding (its masks are stored); None: from activation."""
    kv_channels: int | None = None
    """Width d of one attention head (Megatron's --kv-channels, HF's head_dim) when it is not
    hidden_size / num_heads (Qwen3: 128 with h=2048, a=32); None: h / a."""
    moe: MoESpec | None = None
    """Mixture-of-experts layers (twin/spec/moe.py); None: a dense model."""

    def __post_init__(self) -> None:
        gpt = self.activation == "gelu"
        for field, default in (
            ("norm", "layernorm" if gpt else "rmsnorm"),
            ("bias", gpt),
            ("position_embedding", "learned" if gpt else "rope"),
            ("dropout", gpt),
        ):
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        if isinstance(self.moe, dict):  # from a schedule file or a run directory
            object.__setattr__(self, "moe", MoESpec(**self.moe))
        problems: list[str] = []
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                      "ffn_hidden_size", "vocab_size", "seq_len"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                problems.append(f"model.{field}={value!r} must be a positive integer")
        check_choice(problems, "model.activation", self.activation, ACTIVATIONS)
        check_choice(problems, "model.dtype", self.dtype, DTYPES)
        check_choice(problems, "model.norm", self.norm, NORMS)
        check_choice(problems, "model.position_embedding", self.position_embedding,
                     POSITION_EMBEDDINGS)
        kvc = self.kv_channels
        if kvc is not None and (isinstance(kvc, bool) or not isinstance(kvc, int) or kvc <= 0):
            problems.append(f"model.kv_channels={kvc!r} must be a positive integer or null")
        if self.moe is not None and self.moe.first_k_dense >= self.num_layers:
            problems.append(f"model.moe.first_k_dense={self.moe.first_k_dense} leaves no MoE "
                            f"layer of model.num_layers={self.num_layers}; use fewer dense "
                            "layers or model.moe=null")
        raise_if(problems)
        if self.kv_channels is None and self.hidden_size % self.num_heads:
            problems.append(
                f"model.num_heads={self.num_heads} does not divide "
                f"model.hidden_size={self.hidden_size}; use a divisor such as "
                f"{_divisors_near(self.hidden_size, self.num_heads)}")
        if self.num_heads % self.num_kv_heads:
            problems.append(
                f"model.num_kv_heads={self.num_kv_heads} does not divide "
                f"model.num_heads={self.num_heads}; use one of "
                f"{', '.join(map(str, _divisors(self.num_heads)))}")
        raise_if(problems)

    @property
    def head_dim(self) -> int:
        """d = h / a, or kv_channels when given."""
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of params, grads and activations."""
        return DTYPE_BYTES[self.dtype]

    @property
    def mlp_matrices(self) -> int:
        """Number of h x f matrices in the MLP: 2 for gelu, 3 for swiglu (gate, up, down)."""
        return 3 if self.activation == "swiglu" else 2


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _divisors_near(n: int, target: int) -> str:
    ds = sorted(_divisors(n), key=lambda d: abs(d - target))[:4]
    return ", ".join(map(str, sorted(ds)))
