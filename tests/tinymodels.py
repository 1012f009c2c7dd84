"""Small random-weight GGUF models that the real llama-server loads (built with the gguf package)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

N_VOCAB = 259  # <unk> <s> </s> + 256 byte tokens: SPM needs every byte token
FIM_PIECES = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def _tokenizer(writer: gguf.GGUFWriter, n_vocab: int = N_VOCAB, special: tuple[str, ...] = ()) -> None:
    """SPM vocabulary: the 259 tokens it needs, the `special` pieces (user-defined: a projector's
    image markers), then filler pieces up to n_vocab (128k-262k like real models)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(special)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [gguf.TokenType.USER_DEFINED] * len(special)
    extra = max(0, n_vocab - len(tokens))
    tokens += [f"\u2581t{i}" for i in range(extra)]
    types += [gguf.TokenType.NORMAL] * extra
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def _mat(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    if rows * cols > 1 << 22:  # vocabulary-sized matrices: memory is what is tested, not their values
        return np.full((rows, cols), 0.01, dtype=np.float16)
    return (rng.standard_normal((rows, cols)) * 0.02).astype(np.float16)


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def write_llama(
    path: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_ff: int = 512,
    n_ctx_train: int = 4096,
    arch: str = "llama",
    n_swa: int = 0,
    seed: int = 0,
    omit: tuple[str, ...] = (),
    n_vocab: int = N_VOCAB,
    tied: bool = False,
    pooling: int | None = None,
    cls_labels: tuple[str, ...] = (),
    matrix_type: str = "f16",
    special: tuple[str, ...] = (),
    fim: bool = False,
) -> Path:
    """A llama (GQA) model, or with arch="gemma3" and n_swa > 0 a sliding-window one.

    `omit` leaves tensors out: the metadata still reads fine, llama-server refuses to load it.
    `n_vocab` up to 262144 gives the vocabulary-sized embeddings and logits of real models;
    `tied` leaves out output.weight (llama.cpp then duplicates token_embd onto the output device).
    `matrix_type` (f16, q8_0, q4_0) is the blocks' matrices' type (quantized ones a CPU may repack).
    arch="qwen3" with pooling=4 (rank) and `cls_labels` is a reranker as convert_hf_to_gguf writes
    Qwen3-Reranker: classifier.output_labels and a cls.output.weight head of one row per label.
    `fim` adds fill-in-the-middle tokens (Qwen2.5-Coder's pieces and ids in the metadata): /infill serves it.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if pooling is not None:  # an embedding model: {arch}.pooling_type (1 mean, 2 cls, 3 last)
        w.add_pooling_type(gguf.PoolingType(pooling))
    if n_swa:
        w.add_sliding_window(n_swa)
    if cls_labels:
        w.add_classifier_output_labels(list(cls_labels))
    if fim:  # the pieces follow the byte tokens: ids 259, 260, 261
        special = (*FIM_PIECES, *special)
        for key, offset in ((gguf.Keys.Tokenizer.FIM_PRE_ID, 0), (gguf.Keys.Tokenizer.FIM_SUF_ID, 1),
                            (gguf.Keys.Tokenizer.FIM_MID_ID, 2)):  # fmt: skip
            w.add_uint32(key, 259 + offset)
    _tokenizer(w, n_vocab, special)

    q, kv = n_head * head_dim, n_head_kv * head_dim
    add_tensor = w.add_tensor

    def add(name: str, value: np.ndarray, **kw) -> None:
        if name not in omit:
            add_tensor(name, value, **kw)

    w.add_tensor = add  # type: ignore[method-assign]
    qtype = {"f16": None, "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[matrix_type]

    def matrix(name: str, rows: int, cols: int) -> None:
        if qtype is None:
            w.add_tensor(name, _mat(rng, rows, cols))
        else:
            values = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
            w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    n_vocab = max(n_vocab, N_VOCAB + len(special))
    w.add_tensor("token_embd.weight", _mat(rng, n_vocab, n_embd))
    w.add_tensor("output_norm.weight", _ones(n_embd))
    if arch in ("llama", "qwen3") and not tied:
        w.add_tensor("output.weight", _mat(rng, n_vocab, n_embd))
    if cls_labels:
        w.add_tensor("cls.output.weight", _mat(rng, len(cls_labels), n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        matrix(p + "attn_q.weight", q, n_embd)
        matrix(p + "attn_k.weight", kv, n_embd)
        matrix(p + "attn_v.weight", kv, n_embd)
        matrix(p + "attn_output.weight", n_embd, q)
        w.add_tensor(p + "ffn_norm.weight", _ones(n_embd))
        matrix(p + "ffn_gate.weight", n_ff, n_embd)
        matrix(p + "ffn_up.weight", n_ff, n_embd)
        matrix(p + "ffn_down.weight", n_embd, n_ff)
        if arch in ("gemma3", "qwen3"):
            w.add_tensor(p + "attn_q_norm.weight", _ones(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", _ones(head_dim))
        if arch == "gemma3":
            w.add_tensor(p + "post_attention_norm.weight", _ones(n_embd))
            w.add_tensor(p + "post_ffw_norm.weight", _ones(n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_lora(
    path: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_ff: int = 512,
    n_vocab: int = N_VOCAB,
    arch: str = "llama",
    rank: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ("attn_q", "attn_v"),
    blocks: tuple[int, ...] | None = None,
    token_embd: bool = False,
    output: bool = False,
    dtype: str = "f16",
    strength: float = 0.05,
    seed: int = 0,
) -> Path:
    """A LoRA adapter (general.type adapter, adapter.type lora) for write_llama's model of the same
    shape, as convert_lora_to_gguf writes one: per target matrix W (ggml ne [n_in, n_out]) a
    lora_a of ne [n_in, rank] and a lora_b of ne [rank, n_out]; token_embd's pair is flipped.
    `strength`: the values' standard deviation (1.0 changes a tiny model's answers for sure)."""
    path = Path(path)
    np_type = {"f16": np.float16, "f32": np.float32}[dtype]

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * strength).astype(np_type)

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_name(path.stem)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    q, kv = n_head * head_dim, n_head_kv * head_dim
    shapes = {  # numpy (n_out, n_in)
        "attn_q": (q, n_embd), "attn_k": (kv, n_embd), "attn_v": (kv, n_embd), "attn_output": (n_embd, q),
        "ffn_gate": (n_ff, n_embd), "ffn_up": (n_ff, n_embd), "ffn_down": (n_embd, n_ff),
    }  # fmt: skip

    def pair(name: str, n_out: int, n_in: int) -> None:
        w.add_tensor(name + ".lora_a", rand(rank, n_in))
        w.add_tensor(name + ".lora_b", rand(n_out, rank))

    if token_embd:  # A is [rank, n_vocab] in ggml, B [rank, n_embd]: flipped (llm_build_inp_embd)
        w.add_tensor("token_embd.weight.lora_a", rand(max(n_vocab, N_VOCAB), rank))
        w.add_tensor("token_embd.weight.lora_b", rand(n_embd, rank))
    for i in range(n_layer) if blocks is None else blocks:
        for t in targets:
            pair(f"blk.{i}.{t}.weight", *shapes[t])
    if output:
        pair("output.weight", max(n_vocab, N_VOCAB), n_embd)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gemma3(path: str | Path, *, n_layer: int = 6, n_swa: int = 512, **kw) -> Path:
    return write_llama(path, arch="gemma3", n_layer=n_layer, n_swa=n_swa, **kw)


def write_deepseek2_mla(path: str | Path, *, n_layer: int = 4, kv_lora_rank: int = 512, rope_dim: int = 64) -> Path:
    """Metadata-only MLA model (no tensors): enough for the memory model, not for llama-server."""
    path = Path(path)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    w.add_context_length(163840)
    w.add_embedding_length(2048)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(4096)
    w.add_head_count(16)
    w.add_head_count_kv(1)
    w.add_key_length(kv_lora_rank + rope_dim)
    w.add_value_length(kv_lora_rank)
    w.add_kv_lora_rank(kv_lora_rank)
    w.add_key_length_mla(192)
    w.add_value_length_mla(128)
    w.add_rope_dimension_count(rope_dim)
    w.add_tensor("token_embd.weight", np.zeros((8, 2048), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_moe(
    path: str | Path,
    *,
    arch: str = "qwen3moe",
    n_layer: int = 4,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 128,
    n_ff_shexp: int = 256,
    n_ctx_train: int = 32768,
    n_vocab: int = N_VOCAB,
    expert_type: str = "f16",
    seed: int = 0,
) -> Path:
    """A Mixture-of-Experts model llama-server loads: qwen3moe (routed experts, q/k norms) or
    qwen2moe (routed experts plus a gated shared expert, attention biases).

    Expert tensors are 3-D (numpy (n_expert, rows, cols)), named blk.N.ffn_{gate,up,down}_exps
    like the real files, so --n-cpu-moe's and -ot's patterns match them the same way.
    """
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(path.stem)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff_exp * n_expert_used)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _tokenizer(w, n_vocab)
    n_vocab = max(n_vocab, N_VOCAB)
    q, kv = n_head * head_dim, n_head_kv * head_dim

    def experts(name: str, rows: int, cols: int) -> None:
        values = (rng.standard_normal((n_expert, rows, cols)) * 0.02).astype(np.float32)
        if expert_type == "f16":
            w.add_tensor(name, values.astype(np.float16))
            return
        qtype = gguf.GGMLQuantizationType[expert_type.upper()]  # e.g. q4_0: the CPU may repack it
        w.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    w.add_tensor("token_embd.weight", _mat(rng, n_vocab, n_embd))
    w.add_tensor("output_norm.weight", _ones(n_embd))
    w.add_tensor("output.weight", _mat(rng, n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        w.add_tensor(p + "attn_q.weight", _mat(rng, q, n_embd))
        w.add_tensor(p + "attn_k.weight", _mat(rng, kv, n_embd))
        w.add_tensor(p + "attn_v.weight", _mat(rng, kv, n_embd))
        w.add_tensor(p + "attn_output.weight", _mat(rng, n_embd, q))
        if arch == "qwen3moe":
            w.add_tensor(p + "attn_q_norm.weight", _ones(head_dim))
            w.add_tensor(p + "attn_k_norm.weight", _ones(head_dim))
        else:
            w.add_tensor(p + "attn_q.bias", np.zeros(q, dtype=np.float32))
            w.add_tensor(p + "attn_k.bias", np.zeros(kv, dtype=np.float32))
            w.add_tensor(p + "attn_v.bias", np.zeros(kv, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", _ones(n_embd))
        w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((n_expert, n_embd)) * 0.02).astype(np.float32))
        experts(p + "ffn_gate_exps.weight", n_ff_exp, n_embd)
        experts(p + "ffn_up_exps.weight", n_ff_exp, n_embd)
        experts(p + "ffn_down_exps.weight", n_embd, n_ff_exp)
        if arch == "qwen2moe":
            w.add_tensor(p + "ffn_gate_inp_shexp.weight", _ones(n_embd))
            w.add_tensor(p + "ffn_gate_shexp.weight", _mat(rng, n_ff_shexp, n_embd))
            w.add_tensor(p + "ffn_up_shexp.weight", _mat(rng, n_ff_shexp, n_embd))
            w.add_tensor(p + "ffn_down_shexp.weight", _mat(rng, n_embd, n_ff_shexp))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gpt_oss(
    path: str | Path,
    *,
    n_layer: int = 4,
    n_embd: int = 256,
    n_head: int = 4,
    n_head_kv: int = 2,
    head_dim: int = 64,
    n_expert: int = 8,
    n_expert_used: int = 2,
    n_ff_exp: int = 128,
    n_swa: int = 128,
    n_ctx_train: int = 32768,
    n_vocab: int = N_VOCAB,
    seed: int = 0,
) -> Path:
    """A gpt-oss-style model: sliding-window and full attention layers alternating (llama.cpp's
    pattern 2 for this architecture), attention sinks, biases everywhere, routed experts with biases."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_name(path.stem)
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(150000.0)
    w.add_sliding_window(n_swa)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_expert_used)
    w.add_expert_feed_forward_length(n_ff_exp)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    _tokenizer(w, n_vocab)
    n_vocab = max(n_vocab, N_VOCAB)
    q, kv = n_head * head_dim, n_head_kv * head_dim

    def zeros(*shape: int) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    w.add_tensor("token_embd.weight", _mat(rng, n_vocab, n_embd))
    w.add_tensor("output_norm.weight", _ones(n_embd))
    w.add_tensor("output.weight", _mat(rng, n_vocab, n_embd))
    for i in range(n_layer):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", _ones(n_embd))
        w.add_tensor(p + "post_attention_norm.weight", _ones(n_embd))
        for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(p + name + ".weight", _mat(rng, rows, n_embd))
            w.add_tensor(p + name + ".bias", zeros(rows))
        w.add_tensor(p + "attn_output.weight", _mat(rng, n_embd, q))
        w.add_tensor(p + "attn_output.bias", zeros(n_embd))
        w.add_tensor(p + "attn_sinks.weight", zeros(n_head))
        w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((n_expert, n_embd)) * 0.02).astype(np.float32))
        w.add_tensor(p + "ffn_gate_inp.bias", zeros(n_expert))
        for name, rows, cols in (("ffn_gate_exps", n_ff_exp, n_embd), ("ffn_up_exps", n_ff_exp, n_embd),
                                 ("ffn_down_exps", n_embd, n_ff_exp)):  # fmt: skip
            w.add_tensor(p + name + ".weight", (rng.standard_normal((n_expert, rows, cols)) * 0.02).astype(np.float16))
            w.add_tensor(p + name + ".bias", zeros(n_expert, rows))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
