"""Named GPT-NeoX shapes: the published Pythia suite, GPT-NeoX-20B, and small shapes for CPUs.

Pythia shapes follow EleutherAI's published table (Biderman et al. 2023, "Pythia", Table 1, and the
configs in EleutherAI/pythia): rotary on 25% of head dims, parallel residual, untied embeddings,
context 2048, MLP width 4 x hidden, vocabulary padded past the 50,277-token NeoX tokenizer.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Preset:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int = 50304
    max_position_embeddings: int = 2048
    rotary_pct: float = 0.25
    use_parallel_residual: bool = True
    tie_word_embeddings: bool = False
    published: bool = True
    """True for shapes with a published vocabulary (kept for tokenizers that fit); False for hftrain's own."""

    @property
    def intermediate_size(self) -> int:
        return 4 * self.hidden_size

    def config_fields(self) -> dict:
        fields = asdict(self)
        fields.pop("published")
        fields["intermediate_size"] = self.intermediate_size
        return fields


PRESETS: dict[str, Preset] = {
    # Pythia suite
    "pythia-14m": Preset(6, 128, 4),
    "pythia-31m": Preset(6, 256, 8),
    "pythia-70m": Preset(6, 512, 8),
    "pythia-160m": Preset(12, 768, 12),
    "pythia-410m": Preset(24, 1024, 16),
    "pythia-1b": Preset(16, 2048, 8),
    "pythia-1.4b": Preset(24, 2048, 16),
    "pythia-2.8b": Preset(32, 2560, 32),
    "pythia-6.9b": Preset(32, 4096, 32, vocab_size=50432),
    "pythia-12b": Preset(36, 5120, 40, vocab_size=50688),
    # GPT-NeoX-20B (Black et al. 2022)
    "neox-20b": Preset(44, 6144, 64, vocab_size=50432),
    # Small shapes for laptops and CI: vocabulary follows the tokenizer, context kept short.
    "cpu-tiny": Preset(2, 64, 4, vocab_size=0, max_position_embeddings=512, published=False),
    "cpu-small": Preset(4, 128, 4, vocab_size=0, max_position_embeddings=1024, published=False),
    "cpu-medium": Preset(6, 384, 6, vocab_size=0, max_position_embeddings=1024, published=False),
}


def preset_table() -> str:
    rows = [f"{'name':<12} {'layers':>6} {'hidden':>6} {'heads':>5} {'vocab':>6} {'context':>7}"]
    for name, p in PRESETS.items():
        vocab = p.vocab_size if p.published else "tok."
        rows.append(
            f"{name:<12} {p.num_hidden_layers:>6} {p.hidden_size:>6} {p.num_attention_heads:>5} {vocab:>6} "
            f"{p.max_position_embeddings:>7}"
        )
    return "\n".join(rows)
