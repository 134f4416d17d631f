"""`hftrain export CKPT --format gguf --out FILE [--quant f32|f16|q8_0]`: one GGUF file that llama.cpp runs.

Written with the `gguf` package alone (its writer, tensor-name map and quantizers; no llama.cpp checkout, no
compiler), as llama.cpp's own converter does for GPTNeoXForCausalLM (MODEL_ARCH.GPTNEOX):

* hyper-parameters: context, width, layers, heads, FFN width, rotary dimensions (partial_rotary_factor x head dim)
  and base, parallel residual (NeoX variants with `use_parallel_residual: false` too), layer-norm epsilon;
* tensors by the package's name map; NeoX's fused query_key_value is interleaved per head ([h][q,k,v][d]) and
  llama.cpp wants [Q; K; V], so it is re-ordered; a tied head is written as its own `output` tensor (llama.cpp's
  NeoX graph requires one); 1-D tensors (norms, biases) stay f32; q8_0 needs rows of a multiple of 32 values, and a
  matrix whose rows are not is written in f16 (llama.cpp's converter does the same);
* the tokenizer (byte-level BPE: hftrain's trained tokenizers, GPT-2, Pythia's): tokens padded to the model's
  vocabulary as unused `[PAD<id>]` entries, merges, token types, BOS/EOS, pre-tokenizer `gpt-2`.

Memory is one tensor at a time: the tensor table is written first, then each tensor is read from safetensors,
converted and written. The file is written beside --out and linked into place at the end, so a failed export
leaves no FILE and never replaces one that is there. Anything this cannot convert faithfully is refused naming why.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hftrain.errors import HftrainError

QUANTS = ("f32", "f16", "q8_0")
ACTIVATIONS = ("gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh")  # llama.cpp's NeoX graph computes GELU
PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for the GPT-2 split regex that byte-level BPE uses (ByteLevel use_regex)


def export_gguf(checkpoint: Path, out: Path, quant: str = "f16", merge: bool = False) -> Path:
    """Any hftrain checkpoint or model directory -> one GGUF file at `out`."""
    from hftrain.export.model_dir import export

    if quant not in QUANTS:
        raise HftrainError(f"--quant {quant}: choose one of {', '.join(QUANTS)}.")
    if out.exists() or out.is_symlink():
        raise HftrainError(f"--out {out}: exists; give a new file name (an export never replaces a file).")
    if not out.parent.is_dir():
        raise HftrainError(f"--out {out}: its folder {out.parent} does not exist; create it or give another path.")
    name = _model_name(checkpoint)
    if _is_model_dir(checkpoint):
        return _write_file(checkpoint, out, quant, name)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.model-", dir=out.parent) as tmp:
        model_dir = export(checkpoint, Path(tmp) / "model", merge=merge)  # FSDP, ZeRO-3, adapter: one model first
        return _write_file(model_dir, out, quant, name)


def _model_name(checkpoint: Path) -> str:
    """general.name: the run's name for its final model, RUN-checkpoint-N for a checkpoint, else the folder's."""
    path = checkpoint.resolve()
    if path.name == "final":
        return path.parent.name
    return f"{path.parent.name}-{path.name}" if path.name.startswith("checkpoint-") else path.name


def _is_model_dir(path: Path) -> bool:
    """A standard model directory (final/, a single-process or DDP checkpoint, an export) that needs no
    consolidation."""
    from hftrain.checkpoint.adapter import is_adapter_dir

    return (path / "config.json").is_file() and (path / "model.safetensors").is_file() and not is_adapter_dir(path)


def _write_file(model_dir: Path, out: Path, quant: str, name: str) -> Path:
    from hftrain.checkpoint.files import check_weights
    from hftrain.checkpoint.integrity import check_files

    check_files(model_dir)
    check_weights(model_dir)
    config = {**_config(model_dir), "name": name}
    vocab = tokenizer_vocab(model_dir, config["vocab_size"])
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        _write(model_dir, partial, quant, config, vocab)
        try:
            os.link(partial, out)  # fails if --out appeared meanwhile: never replaced
        except FileExistsError:
            raise HftrainError(
                f"--out {out}: was created by something else while this export ran; this export kept nothing."
            ) from None
    except OSError as err:
        raise HftrainError(f"--out {out}: could not write the GGUF file ({err.strerror or err}).") from None
    finally:
        partial.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------- the model
def _config(model_dir: Path) -> dict[str, Any]:
    """The hyper-parameters llama.cpp's NeoX graph reads, after refusing what it would compute differently."""
    from transformers import AutoConfig

    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    where = model_dir / "config.json"
    if raw.get("model_type") != "gpt_neox":
        raise HftrainError(
            f"{where}: model_type {raw.get('model_type')!r}; GGUF export converts GPT-NeoX models (gpt_neox) only."
        )
    config = AutoConfig.from_pretrained(model_dir)  # defaults filled in as transformers would load the model
    rope = dict(getattr(config, "rope_parameters", None) or {})
    factor = rope.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0))
    head_dim = config.hidden_size // config.num_attention_heads
    problems = []
    if config.hidden_act not in ACTIVATIONS:
        problems.append(f"hidden_act {config.hidden_act!r} (llama.cpp's GPT-NeoX computes GELU)")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope['rope_type']!r} (llama.cpp's GPT-NeoX reads plain rotary embeddings)")
    if not getattr(config, "attention_bias", True):
        problems.append("attention_bias false (llama.cpp's GPT-NeoX expects the attention biases)")
    if int(factor * head_dim) % 2:
        problems.append(f"{int(factor * head_dim)} rotary dimensions per head (must be even)")
    if problems:
        raise HftrainError(f"{where}: cannot be converted to GGUF faithfully: {'; '.join(problems)}.")
    return {
        "vocab_size": config.vocab_size,
        "context": config.max_position_embeddings,
        "width": config.hidden_size,
        "layers": config.num_hidden_layers,
        "heads": config.num_attention_heads,
        "ffn": config.intermediate_size,
        "rotary_dims": int(factor * head_dim),
        "rope_base": float(rope.get("rope_theta", getattr(config, "rotary_emb_base", 10000.0))),
        "parallel_residual": bool(config.use_parallel_residual),
        "eps": float(config.layer_norm_eps),
    }


def _tensors(model_dir: Path, config: dict[str, Any]) -> list[tuple[str, str, tuple[int, ...]]]:
    """(GGUF name, safetensors name, shape) of every tensor to write, in file order."""
    import gguf
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPTNEOX, config["layers"])
    listed, head = [], None
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            target = names.get_name(key, try_suffixes=(".weight", ".bias"))
            if target is None:
                if key.endswith(("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")):
                    continue  # buffers that older NeoX checkpoints saved; llama.cpp recomputes them
                raise HftrainError(
                    f"{model_dir / 'model.safetensors'}: tensor {key!r} has no GGUF name; not a GPT-NeoX weight."
                )
            shape = tuple(f.get_slice(key).get_shape())
            listed.append((target, key, shape))
            head = key if target == "output.weight" else head
    if head is None:  # tied embeddings: llama.cpp's NeoX graph reads its own output tensor
        embed = next(k for t, k, _ in listed if t == "token_embd.weight")
        listed.append(("output.weight", embed, next(s for t, _, s in listed if t == "token_embd.weight")))
    return listed


def _stored_type(shape: tuple[int, ...], quant: str) -> Any:
    from gguf import GGMLQuantizationType as T

    if len(shape) < 2 or quant == "f32":
        return T.F32
    if quant == "q8_0" and shape[-1] % 32 == 0:
        return T.Q8_0
    return T.F16


def _converted(gguf_name: str, tensor: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    """NeoX's query_key_value, [head][q,k,v][head_dim] along its output dimension, as [Q; K; V]."""
    if ".attn_qkv." in gguf_name:
        heads, head_dim = config["heads"], config["width"] // config["heads"]
        rest = tensor.shape[1:]
        tensor = tensor.reshape(heads, 3, head_dim, *rest).swapaxes(0, 1).reshape(3 * heads * head_dim, *rest)
    return np.ascontiguousarray(tensor)


def _encoded(tensor: np.ndarray, kind: Any) -> np.ndarray:
    import gguf

    if kind == gguf.GGMLQuantizationType.F32:
        return tensor.astype(np.float32)
    if kind == gguf.GGMLQuantizationType.F16:
        return tensor.astype(np.float16)
    return gguf.quants.quantize(tensor.astype(np.float32), kind)


def _nbytes(shape: tuple[int, ...], kind: Any) -> int:
    import gguf

    size, (block, type_size) = int(np.prod(shape)), gguf.GGML_QUANT_SIZES[kind]
    return size // block * type_size


def _write(model_dir: Path, path: Path, quant: str, config: dict[str, Any], vocab: dict[str, Any]) -> None:
    import gguf
    import torch
    from safetensors import safe_open

    writer = gguf.GGUFWriter(str(path), arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPTNEOX])
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[quant]
    writer.add_name(config["name"])
    writer.add_context_length(config["context"])
    writer.add_embedding_length(config["width"])
    writer.add_block_count(config["layers"])
    writer.add_feed_forward_length(config["ffn"])
    writer.add_head_count(config["heads"])
    writer.add_rope_dimension_count(config["rotary_dims"])
    writer.add_rope_freq_base(config["rope_base"])
    writer.add_parallel_residual(config["parallel_residual"])
    writer.add_layer_norm_eps(config["eps"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, vocab)
    tensors = _tensors(model_dir, config)
    for gguf_name, _, shape in tensors:
        kind = _stored_type(shape, quant)
        writer.add_tensor_info(
            gguf_name,
            shape,
            np.dtype(np.float32 if kind == gguf.GGMLQuantizationType.F32 else np.float16),
            _nbytes(shape, kind),
            raw_dtype=kind,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for gguf_name, key, shape in tensors:  # one tensor in memory at a time
            tensor = f.get_tensor(key).to(torch.float32).numpy()
            writer.write_tensor_data(_encoded(_converted(gguf_name, tensor, config), _stored_type(shape, quant)))
    writer.close()


# ------------------------------------------------------------------------------------------ the tokenizer
def tokenizer_vocab(model_dir: Path, vocab_size: int) -> dict[str, Any]:
    """tokens, types, merges and special ids for GGUF, from the model directory's tokenizer.json (byte-level BPE)."""
    import gguf
    from transformers import AutoTokenizer

    where = model_dir / "tokenizer.json"
    if not where.is_file():
        raise HftrainError(
            f"{model_dir}: no tokenizer.json; GGUF export needs the model's fast tokenizer beside its weights."
        )
    spec = json.loads(where.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or not _byte_level(spec):
        raise HftrainError(
            f"{where}: a {model.get('type')} tokenizer with pre-tokenizer {json.dumps(spec.get('pre_tokenizer'))}; "
            "GGUF export converts byte-level BPE tokenizers (GPT-2's, Pythia's, hftrain's trained ones)."
        )
    ids = dict(model["vocab"])
    special = {t["content"]: t for t in spec.get("added_tokens") or []}
    ids.update({content: t["id"] for content, t in special.items()})
    if max(ids.values()) >= vocab_size:
        raise HftrainError(f"{where}: token id {max(ids.values())} is past the model's vocab_size {vocab_size}.")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, i in ids.items():
        tokens[i] = token
        added = special.get(token)
        types[i] = (
            gguf.TokenType.NORMAL
            if added is None
            else gguf.TokenType.CONTROL
            if added.get("special")
            else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    return {
        "tokens": tokens,
        "types": types,
        "merges": merges,
        "eos": eos,
        "bos": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos,
    }


def _byte_level(spec: dict[str, Any]) -> bool:
    """ByteLevel pre-tokenization with GPT-2's split regex and no prefix space (what llama.cpp's gpt-2 mode does),
    and a normalizer that changes nothing llama.cpp would not (none, or NFC)."""
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    normalizer = spec.get("normalizer")
    return (
        [s.get("type") for s in steps] == ["ByteLevel"]
        and steps[0].get("use_regex", True)
        and not steps[0].get("add_prefix_space", False)
        and (normalizer is None or normalizer.get("type") == "NFC")
    )


def _add_tokenizer(writer: Any, vocab: dict[str, Any]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    if vocab["eos"] is not None:
        writer.add_eos_token_id(vocab["eos"])
        writer.add_bos_token_id(vocab["bos"])
    writer.add_add_bos_token(False)  # NeoX models are trained without a BOS token in front
