"""Zoo presets: sizes and training budgets for each pair of models."""

from __future__ import annotations

from dataclasses import dataclass, field

PRESET_NAMES = ("tiny", "demo")
# Every LM of a preset, saved as ``lm-<role>``, in training order: the draft (the edge LM distilled towards the
# cloud LM) after those two; the micro LM (a smaller edge LM, the weak side of the LM pair with a real gap) last,
# with its own seed, so adding it changed no other model's weights.
LM_ROLES = ("edge", "cloud", "draft", "micro")


@dataclass(frozen=True, slots=True)
class LMShape:
    """Shape of one Llama-family causal LM."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_params(self, vocab_size: int) -> int:
        """Parameters with tied embeddings (norm weights included)."""
        d, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = 2 * d * d + 2 * d * kv + 3 * d * self.intermediate_size + 2 * d
        return self.num_layers * per_layer + vocab_size * d + d

    def flops_per_token(self, vocab_size: int) -> int:
        """Forward multiply-accumulates per token, excluding attention over the context (2x for FLOPs)."""
        d, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        per_layer = 2 * d * d + 2 * d * kv + 3 * d * self.intermediate_size
        return 2 * (self.num_layers * per_layer + vocab_size * d)


@dataclass(frozen=True, slots=True)
class LMTraining:
    """Training budget of one LM (fixed steps, so a run is reproducible)."""

    num_steps: int
    batch_size: int
    seq_len: int
    learning_rate: float
    warmup_steps: int
    weight_decay: float = 0.1


@dataclass(frozen=True, slots=True)
class Preset:
    """Everything a zoo build of one preset needs to know."""

    name: str
    seed: int
    vocab_size: int
    max_position_embeddings: int
    edge: LMShape
    cloud: LMShape
    edge_training: LMTraining
    cloud_training: LMTraining
    # The cloud model's speculative draft: the edge LM distilled towards the cloud LM's next-token distribution.
    draft_training: LMTraining
    # A third, smaller edge LM (not served by the agent): with lm-cloud, the LM pair with a real quality gap
    # inside the training window (the lm-edge/lm-cloud pair is near-equal there).
    micro: LMShape
    micro_training: LMTraining
    max_train_files: int | None
    include_test_tree: bool
    num_eval_windows: int
    digits_small_hidden: tuple[int, ...]
    digits_large_hidden: tuple[int, ...]
    digits_epochs: int
    is_committed: bool = False
    notes: dict[str, str] = field(default_factory=dict)


TINY = Preset(
    name="tiny",
    seed=1234,
    vocab_size=1024,
    max_position_embeddings=256,
    edge=LMShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176),
    cloud=LMShape(hidden_size=128, num_layers=5, num_heads=4, num_kv_heads=2, intermediate_size=352),
    edge_training=LMTraining(num_steps=60, batch_size=8, seq_len=128, learning_rate=3e-3, warmup_steps=10),
    cloud_training=LMTraining(num_steps=60, batch_size=8, seq_len=128, learning_rate=2e-3, warmup_steps=10),
    draft_training=LMTraining(
        num_steps=20, batch_size=8, seq_len=128, learning_rate=1e-3, warmup_steps=5, weight_decay=0.0
    ),
    micro=LMShape(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=96),
    micro_training=LMTraining(num_steps=30, batch_size=8, seq_len=128, learning_rate=3e-3, warmup_steps=5),
    max_train_files=120,
    include_test_tree=False,
    num_eval_windows=16,
    digits_small_hidden=(32,),
    digits_large_hidden=(256, 128),
    digits_epochs=30,
)

DEMO = Preset(
    name="demo",
    seed=20261130,
    vocab_size=4096,
    max_position_embeddings=512,
    edge=LMShape(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
    cloud=LMShape(hidden_size=256, num_layers=9, num_heads=4, num_kv_heads=2, intermediate_size=768),
    edge_training=LMTraining(num_steps=2000, batch_size=16, seq_len=256, learning_rate=3e-3, warmup_steps=100),
    cloud_training=LMTraining(num_steps=2200, batch_size=16, seq_len=256, learning_rate=2.5e-3, warmup_steps=100),
    draft_training=LMTraining(
        num_steps=1000, batch_size=16, seq_len=256, learning_rate=1e-3, warmup_steps=20, weight_decay=0.0
    ),
    micro=LMShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176),
    micro_training=LMTraining(num_steps=800, batch_size=16, seq_len=256, learning_rate=3e-3, warmup_steps=50),
    max_train_files=None,
    include_test_tree=True,
    num_eval_windows=128,
    digits_small_hidden=(32,),
    digits_large_hidden=(256, 128),
    digits_epochs=60,
    is_committed=True,
)

PRESETS = {p.name: p for p in (TINY, DEMO)}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown zoo preset {name!r}; choose one of {', '.join(PRESET_NAMES)}") from None
