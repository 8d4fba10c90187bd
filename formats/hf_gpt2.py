"""GPT-2 weights in and out: a Hugging Face GPT-2 directory (config.json + model.safetensors,
transformers' GPT2LMHeadModel) becomes a checkpoint of this project in any layout, and back.

    bash run.sh import-hf HF_DIR --save OUT [--nproc N] [layout flags]
    bash run.sh export-hf --load CKPT --save HF_DIR

Hugging Face's blocks use Conv1D, weights [in, out] (y = x W + b), where this project's linears
are [out, in]; c_attn's output is [Q | K | V] with the heads in order inside each, where
linear_qkv is laid out per head [q_i; k_i; v_i] (Megatron's per-group layout, one head per
group).
safetensors comes with MindSpore; torch is not needed.
"""
import json
import os
import shutil

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file, save as safetensors_bytes

from data import write_atomic
from formats.checkpoint import (build_rank_chunks, check_new_folder, first_shard, full_state,
                                latest_iteration, layout_of, load_checkpoint, write_layout)
from settings.cli import PROJECT, REQUIRED, load_config, parse_command
from settings.config import ConfigError, padded_vocab_size, to_namespace

# Hugging Face GPT-2 (transformers' GPT2LMHeadModel) names per block, Conv1D weights [in, out]
# (y = x W + b), against this project's [out, in]; c_attn's output is [Q | K | V], each
# head-major.
HF_BLOCK = {"ln_1": "input_layernorm", "attn.c_attn": "self_attention.linear_qkv",
            "attn.c_proj": "self_attention.linear_proj", "ln_2": "pre_mlp_layernorm",
            "mlp.c_fc": "mlp.linear_fc1", "mlp.c_proj": "mlp.linear_fc2"}
HF_TOP = {"wte.weight": "word_embeddings.weight", "wpe.weight": "position_embeddings",
          "ln_f.weight": "final_layernorm.weight", "ln_f.bias": "final_layernorm.bias"}
HF_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
# config.json keys without a default
HF_NEEDED = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size")
# transformers' GPT2Config default for the *_pdrop keys
HF_DROPOUT = 0.1


def _qkv_from_hf(x, heads):
    """[Q; K; V] rows (3h, ...) -> per head [q_i; k_i; v_i] (Megatron's layout with one head per
    group)."""
    return x.reshape(3, heads, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def _qkv_to_hf(x, heads):
    """Per head [q_i; k_i; v_i] rows (3h, ...) -> [Q; K; V], the inverse of _qkv_from_hf."""
    return x.reshape(heads, 3, -1, *x.shape[1:]).swapaxes(0, 1).reshape(x.shape)


def hf_to_project(weights, hf_config, padded_vocab):
    """Hugging Face GPT-2 tensors -> "model.<name>" tensors of this project (vocabulary rows
    padded with zeros to padded_vocab)."""
    # GPT2LMHeadModel's names start "transformer.", GPT2Model's do not
    weights = {k[len("transformer."):] if k.startswith("transformer.") else k: v
               for k, v in weights.items()}
    heads, out = hf_config["n_head"], {}
    for key, value in weights.items():
        if key in HF_TOP:
            out[HF_TOP[key]] = value
        elif key.startswith("h."):
            _, layer, rest = key.split(".", 2)
            module, _, leaf = rest.rpartition(".")
            # attn.bias / attn.masked_bias: causal-mask buffers
            if module not in HF_BLOCK:
                continue
            if leaf == "weight" and module not in ("ln_1", "ln_2"):
                value = value.T                        # Conv1D [in, out] -> [out, in]
            if module == "attn.c_attn":
                value = _qkv_from_hf(value, heads)
            out[f"layers.{layer}.{HF_BLOCK[module]}.{leaf}"] = value
    vocab = out.get("word_embeddings.weight")
    # another vocabulary size is left for check_weights to name
    if vocab is not None and len(vocab) == hf_config["vocab_size"]:
        padding = np.zeros((padded_vocab - len(vocab), vocab.shape[1]), vocab.dtype)
        out["word_embeddings.weight"] = np.concatenate([vocab, padding])
    return {f"model.{k}": np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def project_to_hf(tensors, model_cfg, vocab_size):
    """The inverse of hf_to_project: one-process tensors -> Hugging Face GPT-2 names and layouts."""
    back_top = {v: k for k, v in HF_TOP.items()}
    back_block = {v: k for k, v in HF_BLOCK.items()}
    out = {}
    for key, value in tensors.items():
        name = key[len("model."):]
        if not key.startswith("model.") or name == "output_layer.weight":
            continue
        if name in back_top:
            out[back_top[name]] = value[:vocab_size] if name == "word_embeddings.weight" else value
            continue
        _, layer, rest = name.split(".", 2)
        module, _, leaf = rest.rpartition(".")
        if module == "self_attention.linear_qkv":
            value = _qkv_to_hf(value, model_cfg.num_attention_heads)
        if leaf == "weight" and "layernorm" not in module:
            value = value.T
        out[f"h.{layer}.{back_block[module]}.{leaf}"] = np.ascontiguousarray(value)
    return {k: v.astype(np.float32) for k, v in out.items()}       # GPT-2's weights: float32


def read_hf_config(hf_dir):
    """The config.json of a Hugging Face GPT-2 directory, checked: JSON, GPT-2, the keys without
    a default."""
    path = os.path.join(hf_dir, "config.json")
    try:
        hf = json.load(open(path))
    except ValueError as e:                            # not JSON, or not UTF-8
        raise ConfigError(f"import-hf: {path} is not JSON ({e}): give transformers' "
                          "config.json") from None
    hf = hf if isinstance(hf, dict) else {}
    if hf.get("model_type") != "gpt2" or hf.get("activation_function", "gelu_new") not in HF_ACT:
        raise ConfigError(f"import-hf: {path} holds model_type {hf.get('model_type')!r} with "
                          f"activation {hf.get('activation_function')!r}; only GPT-2 with "
                          f"{', '.join(HF_ACT)} is mapped")
    missing = [k for k in HF_NEEDED if k not in hf]
    if missing:
        raise ConfigError(f"import-hf: {path} lacks {', '.join(missing)}: give the GPT-2 model's "
                          "own config.json")
    return hf


def check_weights(tensors, model_cfg, path):
    """One line naming the first weight of the model (built from config.json) that `path` lacks or
    holds in another shape."""
    [one] = build_rank_chunks(model_cfg, 1, 1)
    for name, param in one.parameters_and_names():
        got = tensors.get(f"model.{name}")
        if got is None or got.shape != tuple(param.shape):
            shape = "missing" if got is None else got.shape
            raise ConfigError(f"import-hf: {path} does not fit config.json: {name} is "
                              f"{shape}, config.json makes it {tuple(param.shape)}")


def _hf_flags(hf, drop):
    """The training flags of the model a GPT-2 config.json `hf` describes, its dropout `drop`
    (resid_pdrop and attn_pdrop) included."""
    h = hf["n_embd"]
    return ["--num-layers", str(hf["n_layer"]), "--hidden-size", str(h),
            "--num-attention-heads", str(hf["n_head"]),
            "--ffn-hidden-size", str(hf.get("n_inner") or 4 * h),
            "--seq-length", str(hf["n_positions"]),
            "--max-position-embeddings", str(hf["n_positions"]),
            "--norm-epsilon", str(hf.get("layer_norm_epsilon", 1e-5)),
            f"model_config.hidden_act={HF_ACT[hf.get('activation_function', 'gelu_new')]}",
            "--position-embedding-type", "absolute", "--normalization", "LayerNorm",
            "--hidden-dropout", str(drop["resid_pdrop"]),
            "--attention-dropout", str(drop["attn_pdrop"]),
            "--tokenizer-type", "GPT2BPETokenizer"]


def import_main(argv):
    """import-hf HF_DIR --save OUT [--nproc N] [layout flags] [flags]: a Hugging Face GPT-2
    directory (config.json, model.safetensors) as iteration 0 of a checkpoint in any layout."""
    options, argv = parse_command("import-hf", argv,
                                  {"--save": (REQUIRED, str, "new or empty folder"),
                                   "--nproc": (1, int, "ranks of the checkpoint's layout")},
                                  positional=("HF_DIR",), passthrough="layout and training flags",
                                  about="A Hugging Face GPT-2 folder (config.json, "
                                        "model.safetensors) as a checkpoint.")
    hf_dir, save, world = options["hf_dir"], options["save"], options["nproc"]
    check_new_folder("import-hf", save, world)
    for f in ("config.json", "model.safetensors"):
        if not os.path.isfile(os.path.join(hf_dir, f)):
            raise ConfigError(f"import-hf: {os.path.join(hf_dir, f)} not found: give a Hugging "
                              "Face GPT-2 directory")
    hf = read_hf_config(hf_dir)
    drop = {k: hf.get(k, HF_DROPOUT) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    cfg = load_config(os.path.join(PROJECT, "config.yaml"), _hf_flags(hf, drop) + argv, world)
    model_cfg = cfg.model_config
    padded = padded_vocab_size(model_cfg, hf["vocab_size"])
    model_cfg.vocab_size = model_cfg.padded_vocab_size = padded
    cfg.training_config.output_dir = save
    weights_path = os.path.join(hf_dir, "model.safetensors")
    try:
        weights = load_file(weights_path)
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"import-hf: {weights_path} is damaged or truncated ({e}): download "
                          "it again") from None
    tensors = hf_to_project(weights, hf, padded)
    check_weights(tensors, model_cfg, weights_path)
    # Megatron drops out the embeddings at hidden_dropout
    if drop["embd_pdrop"] != drop["resid_pdrop"]:
        print(f"import-hf: embd_pdrop={drop['embd_pdrop']} not kept: the embeddings' dropout is "
              f"hidden_dropout_rate={model_cfg.hidden_dropout_rate} (resid_pdrop)")
    meta = {"iteration": 0, "consumed_train_samples": 0, "optimizer_step": None,
            "opt_param_scheduler": None, "grad_scaler": None, "rng_state": None,
            "imported_from": os.path.abspath(hf_dir)}
    path = write_layout(save, tensors, meta, cfg)
    print(f"imported {hf_dir} ({hf['n_layer']} layers, hidden {hf['n_embd']}) to {path}, "
          f"layout {layout_of(cfg)}")


# the GPT-2 BPE files: dataset_config's key, the command line's flag, the name in a HF folder
GPT2_FILES = (("vocab_file", "--vocab-file", "vocab.json"),
              ("merge_file", "--merge-file", "merges.txt"))


def _inside(path, folder):
    """`path` resolves (symbolic links followed) to a file inside `folder`."""
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([real, root]) == root


def gpt2_tokenizer_files(dataset_cfg, load, options):
    """{name in a Hugging Face folder: file} of the GPT-2 BPE files to copy: those `options`
    names (the command line's --vocab-file, --merge-file), else the checkpoint's dataset_config's
    when they are inside its folder `load` or are the project's copies, else the project's copies
    when those paths do not resolve from here. A checkpoint naming a file elsewhere is refused:
    its meta is the checkpoint's word, and a crafted one could name any readable file."""
    files = {}
    for key, flag, name in GPT2_FILES:
        own = os.path.join(PROJECT, "data", "gpt2-" + name)
        given, saved = options[key], getattr(dataset_cfg, key)
        found = isinstance(saved, str) and os.path.isfile(saved)
        if given and not os.path.isfile(given):
            raise ConfigError(f"export-hf: {flag} {given} not found: give GPT-2's {name}")
        if given:
            files[name] = given
        elif found and (_inside(saved, load) or os.path.realpath(saved) == os.path.realpath(own)):
            files[name] = saved
        elif found:
            raise ConfigError(f"export-hf: the checkpoint's dataset_config.{key}={saved} is "
                              f"outside --load {load}; export-hf copies only files in the "
                              f"checkpoint's folder, the project's or named on its command line: "
                              f"give {flag} {saved} to copy it")
        elif os.path.isfile(own):
            files[name] = own
        else:
            raise ConfigError(f"export-hf: dataset_config.{key}={saved} not found, nor the "
                              f"project's data/gpt2-{name}")
    return files


def _gpt2_differences(model_cfg):
    """The settings of `model_cfg` that GPT-2 has no place for, as "key=value" strings."""
    gpt2 = (("position_embedding_type", "absolute"), ("normalization", "LayerNorm"),
            ("untie_embeddings_and_output_weights", False), ("use_sandwich_norm", False),
            ("add_bias_linear", True), ("qkv_has_bias", True), ("out_proj_has_bias", True),
            ("num_moe_experts", None))
    differences = [f"{k}={getattr(model_cfg, k)}" for k, want in gpt2
                   if getattr(model_cfg, k) != want]
    grouped = model_cfg.num_query_groups != model_cfg.num_attention_heads
    if model_cfg.hidden_act not in ("gelu_tanh", "gelu") or grouped:
        differences.append(f"hidden_act={model_cfg.hidden_act}, "
                           f"num_query_groups={model_cfg.num_query_groups}")
    return differences


def _hf_config(model_cfg, vocab):
    """transformers' GPT2Config (config.json) of `model_cfg` with `vocab` rows."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"],
            "n_layer": model_cfg.num_layers,
            "n_embd": model_cfg.hidden_size, "n_head": model_cfg.num_attention_heads,
            "n_inner": model_cfg.ffn_hidden_size, "n_positions": model_cfg.max_position_embeddings,
            "n_ctx": model_cfg.max_position_embeddings, "vocab_size": vocab,
            "layer_norm_epsilon": model_cfg.norm_epsilon,
            "activation_function": "gelu_new" if model_cfg.hidden_act == "gelu_tanh" else "gelu",
            "tie_word_embeddings": True, "bos_token_id": 50256, "eos_token_id": 50256,
            # the weights' dtype: transformers 4.56+ and 5 read "dtype", earlier 4.x "torch_dtype"
            "dtype": "float32", "torch_dtype": "float32",
            "resid_pdrop": model_cfg.hidden_dropout_rate,
            "embd_pdrop": model_cfg.hidden_dropout_rate,
            "attn_pdrop": model_cfg.attention_dropout_rate}


def _write_hf_tokenizer(save, tokenizer_files, max_length):
    """GPT-2's BPE files and the two JSON files transformers' AutoTokenizer reads, into `save`."""
    for name, source in tokenizer_files.items():
        shutil.copyfile(source, os.path.join(save, name))
    special = {k: "<|endoftext|>" for k in ("bos_token", "eos_token", "unk_token")}
    write_atomic(os.path.join(save, "special_tokens_map.json"), json.dumps(special, indent=1))
    tokenizer_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": max_length,
                        **special}
    write_atomic(os.path.join(save, "tokenizer_config.json"),
                 json.dumps(tokenizer_config, indent=1))


def export_main(argv):
    """export-hf --load CKPT --save HF_DIR: the latest checkpoint as a Hugging Face GPT-2
    directory, with the tokenizer files transformers' AutoTokenizer reads when the model used
    GPT-2's BPE."""
    options, _ = parse_command("export-hf", argv,
                               {"--load": (REQUIRED, str, "checkpoint folder (any layout)"),
                                "--save": (REQUIRED, str, "folder for the Hugging Face files"),
                                "--vocab-file": (None, str, "GPT-2's vocab.json to copy (else "
                                                 "the checkpoint's, if in --load)"),
                                "--merge-file": (None, str, "GPT-2's merges.txt to copy (else "
                                                 "the checkpoint's, if in --load)")},
                               about="The latest checkpoint of --load as a Hugging Face GPT-2 "
                                     "folder.")
    load, save = options["load"], options["save"]
    if os.path.exists(save) and not os.path.isdir(save):
        raise ConfigError(f"export-hf: --save {save} is a file; give a new or existing folder")
    latest_iteration(load)
    _, meta = load_checkpoint(load, first_shard(load), stems=())
    cfg = to_namespace(meta["config"])
    model_cfg, dataset_cfg = cfg.model_config, cfg.dataset_config
    differences = _gpt2_differences(model_cfg)
    if differences:
        raise ConfigError(f"export-hf: GPT-2 cannot hold this model ({', '.join(differences)})")
    gpt2_bpe = dataset_cfg.tokenizer_type == "GPT2BPETokenizer"
    tokenizer_files = gpt2_tokenizer_files(dataset_cfg, load, options) if gpt2_bpe else {}
    # GPT-2's 50,257 tokens, without this project's padding rows
    vocab = 50257 if gpt2_bpe else model_cfg.padded_vocab_size
    tensors, meta = full_state(load, optimizer=False)
    weights = project_to_hf(tensors, model_cfg, vocab)
    os.makedirs(save, exist_ok=True)
    # "pt": the format transformers' loaders accept in the header (4.x refuses "np"); the bytes
    # of a float32 tensor are the same whoever writes them
    write_atomic(os.path.join(save, "model.safetensors"),
                 safetensors_bytes(weights, metadata={"format": "pt"}))
    write_atomic(os.path.join(save, "config.json"),
                 json.dumps(_hf_config(model_cfg, vocab), indent=1))
    if gpt2_bpe:
        _write_hf_tokenizer(save, tokenizer_files, model_cfg.max_position_embeddings)
    note = ""
    if not gpt2_bpe:
        note = f"; no tokenizer files: {dataset_cfg.tokenizer_type} has no transformers counterpart"
    print(f"exported {load} (iteration {meta['iteration']}) to {save}{note}")


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: hf_gpt2.py is a library: run `bash run.sh import-hf ...` or "
                     "`bash run.sh export-hf ...` (bash run.sh --help lists the commands)")
