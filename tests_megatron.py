"""Tests of torch_format.py and megatron_checkpoint.py (to be folded into test_all.py).

The Megatron-LM checkpoints and torch_sample.pt under data/megatron/ were written by real torch
(data/megatron/make_fixtures.py, run by hand in a venv of its own); expected.json holds what
that script's float64 forward of Megatron's GPT computed from the stored weights.
"""
import argparse
import collections
import json
import os
import pickle
import random
import shutil
import zipfile

import numpy as np
import pytest
from mindspore import Tensor

import checkpoint
import megatron_checkpoint as mc
import sample
import torch_format as tf
import train
from cli import HelpRequested
from config import ConfigError, to_namespace
from gpt import generate

train.setup_mindspore()        # CPU, threads, ops launched in this thread (before any op runs)

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "data", "megatron")
NAMES = ["tp1_gpt2", "tp2_llama_bf16", "pp2_vpp2_fp16", "legacy_tp2_pp2"]


def one_line(excinfo, *parts):
    message = str(excinfo.value)
    assert "\n" not in message, message
    for part in parts:
        assert str(part) in message, message


# ============================================================================ torch_format.py
def sample_object():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    random.seed(3)
    np.random.seed(3)
    enum = tf.foreign_class("megatron.core.enums", "ModelType")(1)
    return {"base": base, "column": base[:, 2], "transposed": base.T, "block": base[1:3, 1:5],
            "half": np.arange(6, dtype=np.float16).reshape(2, 3) / 4,
            "double": np.arange(3.0) / 3, "long": np.arange(-2, 3),
            "int": np.arange(4, dtype=np.int32),
            "int8": np.arange(-3, 3, dtype=np.int8), "uint8": np.arange(250, 256, dtype=np.uint8),
            "bool": np.array([True, False]), "scalar": np.array(2.5, np.float32),
            "empty": np.zeros((0, 3), np.float32), "big_endian": np.arange(3, dtype=">f4"),
            "bfloat16": tf.BFloat16.from_float32(np.array([1.5, -2.25, 3e-3], np.float32)),
            "args": argparse.Namespace(params_dtype=tf.TorchDtype("float16"), model_type=enum,
                                       layers=[1, 2.5, None], name="gpt", flags=(True, False)),
            "ordered": collections.OrderedDict([("b", 1), ("a", {"x": [np.int64(3)]})]),
            "np_rng_state": np.random.get_state(), "random_rng_state": random.getstate(),
            "np_uint32": np.arange(4, dtype=np.uint32), "np_scalar": np.float64(0.25)}


def assert_same(a, b, where="obj"):
    """Equal values of the same kinds, recursively (arrays by dtype, shape and values)."""
    if isinstance(a, tf.BFloat16):
        assert isinstance(b, tf.BFloat16), where
        np.testing.assert_array_equal(a.bits, b.bits, err_msg=where)
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and b.dtype == a.dtype.newbyteorder("="), where
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, argparse.Namespace):
        assert_same(vars(a), vars(b), where)
    elif isinstance(a, tf.Foreign):
        assert b.dotted() == a.dotted() and b.args == a.args and b.state == a.state, where
    else:
        assert type(a) is type(b) and a == b, where


def test_torch_format_round_trip_every_dtype_views_namespace_and_containers(tmp_path):
    """Every tensor dtype, BFloat16, views of one array, a Namespace with a torch dtype and a
    foreign enum, nested containers, numpy's and Python's random states come back as saved;
    the views are written on their base's storage (one storage for base and its three views)."""
    obj = sample_object()
    path = str(tmp_path / "x.pt")
    tf.save(obj, path)
    back = tf.load(path)
    assert_same(obj, back)
    assert isinstance(back["np_uint32"], np.ndarray) and back["np_uint32"].dtype == np.uint32
    np.random.set_state(back["np_rng_state"])              # usable as the states they are
    random.setstate(back["random_rng_state"])
    with zipfile.ZipFile(path) as archive:
        storages = [n for n in archive.namelist() if "/data/" in n]
        assert archive.namelist()[0] == "x/data.pkl" and "x/version" in archive.namelist()
    assert len(storages) == 12                            # 15 tensors, 3 of them views of base
    assert back["bfloat16"].float32().tolist() == [1.5, -2.25, np.float32(0.0030059814453125)]


def test_torch_format_reads_what_real_torch_wrote():
    """torch_sample.pt (torch.save of torch 2.13): views and shared storages at their offsets
    and strides, every dtype, a Parameter, args with torch dtypes and Megatron's ModelType
    (an inert placeholder), numpy's and Python's random states, the CPU generator's bytes."""
    s = tf.load(os.path.join(FIXTURES, "torch_sample.pt"))
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    for key, want in (("base", base), ("column", base[:, 2]), ("transposed", base.T),
                      ("block", base[1:3, 1:5]), ("strided", base.reshape(-1)[5:17:3]),
                      ("same", base), ("half", np.arange(6, dtype=np.float16).reshape(2, 3) / 4),
                      ("double", np.arange(3.0) / 3), ("long", np.arange(-2, 3)),
                      ("int", np.arange(4, dtype=np.int32)),
                      ("short", np.arange(3, dtype=np.int16)),
                      ("int8", np.arange(-3, 3, dtype=np.int8)),
                      ("uint8", np.arange(250, 256, dtype=np.uint8)),
                      ("bool", np.array([True, False, True])),
                      ("scalar", np.array(2.5, np.float32)),
                      ("empty", np.zeros((0, 3), np.float32)),
                      ("parameter", np.ones(2, np.float32)),
                      ("np_array", np.arange(3, dtype=np.int16))):
        assert_same(want, s[key], key)
    bf16 = tf.BFloat16.from_float32(np.array([1.5, -2.25, 3.0e-3, 65504.0], np.float32))
    np.testing.assert_array_equal(s["bfloat16"].bits, bf16.bits)          # torch's rounding
    args = s["args"]
    assert (args.params_dtype, args.fp16, args.main_params_dtype) == (
        tf.TorchDtype("bfloat16"), tf.TorchDtype("float16"), tf.TorchDtype("float32"))
    assert args.model_type.dotted() == "megatron.core.enums.ModelType"
    assert args.model_type.args == (1,)
    assert (args.layers, args.name) == ([1, 2], "gpt")
    want = np.random.RandomState(7).get_state()
    assert s["np_rng_state"][0] == want[0] and s["np_rng_state"][2:] == want[2:]
    np.testing.assert_array_equal(s["np_rng_state"][1], want[1])
    assert s["random_rng_state"] == random.Random(7).getstate()
    assert s["torch_rng_state"].dtype == np.uint8 and s["torch_rng_state"].size > 1000
    assert list(s["ordered"].items()) == [("b", 1), ("a", 2)]
    assert s["nested"] == {"t": (1, [2.5, None], {"x": True})} and s["np_scalar"] == 0.25


def test_torch_format_load_save_load_of_real_torch_file_is_exact(tmp_path):
    first = tf.load(os.path.join(FIXTURES, "torch_sample.pt"))
    tf.save(first, str(tmp_path / "again.pt"))
    assert_same(first, tf.load(str(tmp_path / "again.pt")))


def test_bfloat16_rounds_to_nearest_even():
    one, step = 1.0, 2.0 ** -7                       # bfloat16's spacing just above 1
    values = np.array([one + step / 2, one + 3 * step / 2, one + step / 2 + 2 ** -20, -0.0,
                       np.inf, np.nan], np.float32)
    back = tf.BFloat16.from_float32(values).float32()
    assert back[:5].tolist() == [one, one + 2 * step, one + step, 0.0, np.inf]
    assert np.signbit(back[3]) and np.isnan(back[5])


def _rewrite(path, change):
    """Rewrite the zip archive at `path`, each entry's bytes passed through change(name, data)."""
    with zipfile.ZipFile(path) as archive:
        entries = [(n, archive.read(n)) for n in archive.namelist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in entries:
            data = change(name, data)
            if data is not None:
                archive.writestr(name, data)


BROKEN = {
    "truncated": (lambda p: open(p, "r+b").truncate(os.path.getsize(p) // 2),
                  "not a file of torch.save, or a truncated one"),
    "not_zip": (lambda p: open(p, "wb").write(b"hello, not a checkpoint" * 10),
                "not a file of torch.save"),
    "no_data_pkl": (lambda p: _rewrite(p, lambda n, d: None if n.endswith("data.pkl") else d),
                    "a zip archive without data.pkl"),
    "short_storage": (lambda p: _rewrite(p, lambda n, d: d[:8] if n.endswith("/data/0") else d),
                      "holds 8 bytes, fewer than its 24 elements"),
    "missing_storage": (lambda p: _rewrite(p, lambda n, d: None if n.endswith("/data/0") else d),
                        "lacks x/data/0, a storage its tensors use"),
    "bad_pickle": (lambda p: _rewrite(p, lambda n, d: d[:40] if n.endswith("data.pkl") else d),
                   "is damaged: its pickle fails"),
    "old_format": (lambda p: open(p, "wb").write(b"\x80\x02" + b"\x00" * 30),
                   "format of before 1.6"),
}


@pytest.mark.parametrize("kind", BROKEN)
def test_torch_format_refuses_broken_files_in_one_line_naming_them(kind, tmp_path):
    path = str(tmp_path / "x.pt")
    tf.save({"w": np.arange(24, dtype=np.float32).reshape(4, 6), "n": 1}, path)
    breaker, message = BROKEN[kind]
    breaker(path)
    with pytest.raises(tf.TorchFormatError) as e:
        tf.load(path)
    one_line(e, path, message)


def archive(path, pickled):
    with zipfile.ZipFile(path, "w") as a:
        a.writestr("x/data.pkl", pickled)
        a.writestr("x/version", "3\n")


def test_torch_format_runs_nothing_from_the_file(tmp_path):
    """A global outside the known names is an inert placeholder (os.system is not called);
    a pickle setting the state of a shared class is refused."""
    witness = tmp_path / "ran"
    command = f"touch {witness}".encode()
    archive(tmp_path / "evil.pt", pickle.PROTO + b"\x02" + pickle.GLOBAL + b"os\nsystem\n"
            + pickle.SHORT_BINUNICODE + bytes([len(command)]) + command + pickle.TUPLE1
            + pickle.REDUCE + pickle.STOP)
    loaded = tf.load(str(tmp_path / "evil.pt"))
    assert isinstance(loaded, tf.Foreign) and loaded.dotted() == "os.system"
    assert loaded.args == (command.decode(),) and not witness.exists()
    archive(tmp_path / "build.pt", pickle.PROTO + b"\x02" + pickle.GLOBAL
            + b"argparse\nNamespace\n" + pickle.EMPTY_DICT + pickle.BUILD + pickle.STOP)
    with pytest.raises(tf.TorchFormatError) as e:
        tf.load(str(tmp_path / "build.pt"))
    one_line(e, "build.pt", "its pickle sets the state of")


def test_torch_format_refuses_a_missing_file_and_a_folder(tmp_path):
    for path in (str(tmp_path / "none.pt"), str(tmp_path)):
        with pytest.raises(tf.TorchFormatError) as e:
            tf.load(path)
        one_line(e, path, "not found (or not a file)")


def test_torch_format_save_is_atomic(tmp_path, monkeypatch):
    """An object that does not pickle, or a failure while writing, leaves the old file as it
    was and no temporary file."""
    path = str(tmp_path / "x.pt")
    tf.save({"w": np.ones(3, np.float32)}, path)
    with pytest.raises(pickle.PicklingError):              # dill (MindSpore imports it) not used
        tf.save({"f": lambda: 1}, path)
    assert os.listdir(tmp_path) == ["x.pt"]

    def full_disk(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(zipfile.ZipFile, "writestr", full_disk)
    with pytest.raises(OSError):
        tf.save({"w": np.zeros(3, np.float32)}, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["x.pt"]
    np.testing.assert_array_equal(tf.load(path)["w"], np.ones(3, np.float32))


# ======================================================================== megatron_checkpoint.py
def expected(name):
    with open(os.path.join(FIXTURES, name, "expected.json")) as f:
        return json.load(f)


def fixture(name):
    return os.path.join(FIXTURES, name)


def rank_file(root, tp_rank=0, pp_rank=0, pp=1):
    _, files = mc.checkpoint_files(root)
    return files[tp_rank, pp_rank]


def logits_after(model, ids):
    tokens = Tensor(np.array([ids], np.int32))
    positions = Tensor(np.arange(len(ids), dtype=np.int32)[None])
    return model(tokens, positions)[0, -1].asnumpy()


# another layout for each fixture: its own TP and PP changed
OTHER_LAYOUT = {
    "tp1_gpt2": ["--nproc", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "tp2_llama_bf16": ["--nproc", "2", "--pipeline-model-parallel-size", "2"],
    "pp2_vpp2_fp16": ["--nproc", "4", "--tensor-model-parallel-size", "2",
                      "--pipeline-model-parallel-size", "2",
                      "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                      "--global-batch-size", "2"],
    "legacy_tp2_pp2": ["--nproc", "2", "--tensor-model-parallel-size", "2"]}


@pytest.mark.parametrize("name", NAMES)
def test_megatron_checkpoint_imports_and_generates_what_torch_computed(name, tmp_path, capsys):
    """Each Megatron-LM checkpoint written by real torch (mcore names at TP1; TP2 with RoPE,
    SwiGLU, RMSNorm, GQA, untied, bfloat16; PP2 x virtual 2 in float16, tied; legacy names at
    TP2 x PP2) imports into one process: its logits after the prompt are those of the torch
    forward (1e-4) and greedy decoding gives torch's tokens. Imported into another layout it
    holds the same weights, and `generate` prints the same tokens."""
    want, root = expected(name), fixture(name)
    one, other = str(tmp_path / "one"), str(tmp_path / "other")
    mc.import_main([root, "--save", one])
    printed = capsys.readouterr().out
    assert f"imported {root} (iteration " in printed and f"{want['dtype']} weights" in printed
    model, tokenizer, _ = sample.load_model(one)
    assert tokenizer.vocab_size == want["vocab"]
    np.testing.assert_allclose(logits_after(model, want["prompt"])[: want["vocab"]],
                               want["prompt_logits"], atol=1e-4)
    assert generate(model, want["prompt"], len(want["greedy"]), temperature=0,
                    vocab_size=want["vocab"]) == want["greedy"]
    mc.import_main([root, "--save", other, *OTHER_LAYOUT[name]])
    meta = checkpoint.load_checkpoint(other, checkpoint.first_shard(other), stems=())[1]
    assert meta["optimizer_step"] is None and meta["layout"]["tp"] * meta["layout"]["pp"] > 1
    first, second = checkpoint.full_state(one)[0], checkpoint.full_state(other)[0]
    assert sorted(first) == sorted(second)
    for key in first:
        np.testing.assert_array_equal(first[key].astype(np.float32),
                                      second[key].astype(np.float32), err_msg=key)
    capsys.readouterr()
    prompt = " ".join(map(str, want["prompt"]))
    assert train.main(["generate", "--load", other, "--prompt", prompt, "--max-new-tokens",
                       str(len(want["greedy"])), "--temperature", "0"]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in want["prompt"] + want["greedy"]]


def test_read_checkpoint_gives_the_model_the_args_describe():
    """read_checkpoint: one-process float32 tensors, overrides naming each fixture's model
    (Megatron's activation rule included), the iteration."""
    tensors, overrides, iteration = mc.read_checkpoint(fixture("tp2_llama_bf16"))
    assert iteration == 20 and all(v.dtype == np.float32 for v in tensors.values())
    for item in ("model_config.hidden_act=swiglu", "model_config.normalization=RMSNorm",
                 "model_config.group_query_attention=true", "model_config.num_query_groups=2",
                 "model_config.position_embedding_type=rope", "model_config.add_bias_linear=false",
                 "model_config.qkv_has_bias=false", "model_config.vocab_size=256",
                 "model_config.untie_embeddings_and_output_weights=true",
                 "dataset_config.tokenizer_type=NullTokenizer", "dataset_config.vocab_size=250"):
        assert item in overrides, item
    assert tensors["model.layers.1.mlp.linear_fc1.weight"].shape == (128, 32)
    assert tensors["model.layers.0.self_attention.linear_qkv.weight"].shape == (64, 32)
    acts = {n: [o for o in mc.read_checkpoint(fixture(n))[1] if "hidden_act" in o]
            for n in ("tp1_gpt2", "pp2_vpp2_fp16", "legacy_tp2_pp2")}
    assert acts == {"tp1_gpt2": ["model_config.hidden_act=gelu_tanh"],        # bias fused: tanh
                    "pp2_vpp2_fp16": ["model_config.hidden_act=gelu"],
                    "legacy_tp2_pp2": ["model_config.hidden_act=gelu_tanh"]}   # --openai-gelu


def megatron_args(name, **changes):
    args = tf.load(rank_file(fixture(name)))["args"]
    vars(args).update(changes)
    return args


@pytest.mark.parametrize("legacy, flags, act", [
    (False, dict(bias_gelu_fusion=True, add_bias_linear=True), "gelu_tanh"),
    (False, dict(bias_gelu_fusion=False, add_bias_linear=True), "gelu"),
    (False, dict(bias_gelu_fusion=True, add_bias_linear=False), "gelu"),
    (False, dict(bias_gelu_fusion=False, openai_gelu=True), "gelu"),     # mcore ignores it
    (True, dict(bias_gelu_fusion=False, openai_gelu=True), "gelu_tanh"),
    (True, dict(bias_gelu_fusion=False, swiglu=True), "swiglu")])
def test_megatron_activation_rule(legacy, flags, act):
    overrides = mc.model_overrides(megatron_args("tp1_gpt2", **flags), legacy)
    assert f"model_config.hidden_act={act}" in overrides


def rank_model_tensors(root, tp_rank, pp_rank, pp):
    tensors = checkpoint.load_checkpoint(root, checkpoint.shard_name(tp_rank, pp_rank, pp))[0]
    return {k: v for k, v in tensors.items() if k.startswith("model.")}


def layer_offsets(root, tp, pp, tp_rank, pp_rank):
    """The first global layer of each model chunk of a rank, as training builds them."""
    meta = checkpoint.load_checkpoint(root, checkpoint.first_shard(root), stems=())[1]
    m = to_namespace(meta["config"]).model_config
    chunks = checkpoint.build_rank_chunks(m, tp, pp, tp_rank, pp_rank, meta["layout"]["vpp"])
    return [c.layer_offset for c in chunks]


def as_float32(value):
    return value.float32() if isinstance(value, tf.BFloat16) else value.astype(np.float32)


@pytest.mark.parametrize("name, flags", [
    ("tp1_gpt2", []),
    ("tp2_llama_bf16", ["--nproc", "2", "--tensor-model-parallel-size", "2"]),
    ("pp2_vpp2_fp16", ["--nproc", "2", "--pipeline-model-parallel-size", "2",
                       "--virtual-pipeline-model-parallel-size", "2", "--micro-batch-size", "1",
                       "--global-batch-size", "2"]),
    ("legacy_tp2_pp2", ["--nproc", "4", "--tensor-model-parallel-size", "2",
                        "--pipeline-model-parallel-size", "2"])])
def test_megatron_names_both_ways_match_megatrons_files(name, flags, tmp_path):
    """Imported into the fixture's own layout, each rank of this project holds what the
    Megatron rank file holds: rank_model_state names it as Megatron-core does (the same keys
    in the same order, `_extra_state` included, stage-local layer numbers, SwiGLU's and GQA's
    TP pieces) with the same values, and rank_tensors maps the file (mcore or legacy) back."""
    out = str(tmp_path / "out")
    mc.import_main([fixture(name), "--save", out, *flags])
    want = expected(name)
    tp, pp = want["tp"], want["pp"]
    for t in range(tp):
        for p in range(pp):
            ours = rank_model_tensors(out, t, p, pp)
            offsets = layer_offsets(out, tp, pp, t, p)
            theirs = tf.load(rank_file(fixture(name), t, p, pp))
            back = mc.rank_tensors(theirs, offsets)
            assert sorted(back) == sorted(ours)
            for key, value in back.items():
                np.testing.assert_array_equal(as_float32(value), ours[key], err_msg=key)
            state = mc.rank_model_state(ours, offsets)
            assert mc.rank_tensors(state, offsets).keys() == ours.keys()
            if want["legacy"]:
                continue
            assert list(state) == [k for k in theirs if k.startswith("model")]
            for key in state:
                assert list(state[key]) == list(theirs[key]), (t, p, key)
                for n, v in state[key].items():
                    if v is None:
                        assert theirs[key][n] is None, n
                    else:
                        np.testing.assert_array_equal(v, as_float32(theirs[key][n]), err_msg=n)


def test_project_ranks_written_as_megatron_files_read_back(tmp_path):
    """The way back, as --ckpt-format torch would write it: each rank of a TP2 x PP2 checkpoint
    of this project through rank_model_state into Megatron's folder layout (torch_format.save,
    the fixture's args with the new sizes) reads back to the same one-process weights."""
    ours = str(tmp_path / "ours")
    mc.import_main([fixture("tp2_llama_bf16"), "--save", ours, "--nproc", "4",
                    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    args = megatron_args("tp2_llama_bf16", tensor_model_parallel_size=2,
                         pipeline_model_parallel_size=2)
    root = tmp_path / "megatron"
    for t in range(2):
        for p in range(2):
            state = mc.rank_model_state(rank_model_tensors(ours, t, p, 2),
                                        layer_offsets(ours, 2, 2, t, p))
            folder = root / "iter_0000007" / checkpoint.shard_name(t, p, 2)
            folder.mkdir(parents=True)
            tf.save({"args": args, "checkpoint_version": 3.0, "iteration": 7, **state},
                    str(folder / mc.WEIGHTS_FILE))
    (root / "latest_checkpointed_iteration.txt").write_text("7")
    back, overrides, iteration = mc.read_checkpoint(str(root))
    first = checkpoint.full_state(ours)[0]
    assert iteration == 7 and sorted(back) == sorted(first)
    for key in back:
        np.testing.assert_array_equal(back[key], first[key], err_msg=key)


def test_project_name_aliases_and_refusals():
    """The legacy model's late *_norm names, transformer_engine's fused norms, `_extra_state`
    and RoPE's inv_freq (no weights); a module this project lacks is one line naming it."""
    assert mc.project_name("language_model.encoder.layers.1.input_norm.weight", 2) == \
        "layers.3.input_layernorm.weight"
    assert mc.project_name("language_model.encoder.layers.0.post_attention_norm.bias") == \
        "layers.0.pre_mlp_layernorm.bias"
    assert mc.project_name("language_model.encoder.final_norm.weight") == "final_layernorm.weight"
    assert mc.project_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 4) == \
        "layers.4.pre_mlp_layernorm.weight"
    assert mc.project_name("decoder.layers.0.self_attention.core_attention._extra_state") is None
    assert mc.project_name("language_model.rotary_pos_emb.inv_freq") is None
    assert mc.megatron_name("layers.5.mlp.linear_fc2.bias", 4) == \
        "decoder.layers.1.mlp.linear_fc2.bias"
    for name in ("decoder.layers.0.self_attention.q_layernorm.weight",
                 "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"):
        with pytest.raises(checkpoint.CheckpointError) as e:
            mc.project_name(name)
        one_line(e, name, "has no place in this project's GPT")
    with pytest.raises(checkpoint.CheckpointError) as e:
        mc.megatron_name("layers.0.post_attention_norm.weight")
    one_line(e, "has no Megatron-core counterpart", "sandwich norms")


def copied(name, tmp_path):
    root = str(tmp_path / name)
    shutil.copytree(fixture(name), root)
    return root


def change_file(path, **changes):
    """Rewrite a rank file with `changes` applied to its top level ("args": {...} to its args)."""
    state = tf.load(path)
    vars(state["args"]).update(changes.pop("args", {}))
    state.update(changes)
    tf.save(state, path)


REFUSED = {"num_experts": ("tp1_gpt2", 8, "args.num_experts=8 (a mixture of experts)"),
           "qk_layernorm": ("tp1_gpt2", True, "args.qk_layernorm=True (query and key layer norms)"),
           "rotary_percent": ("tp2_llama_bf16", 0.5,
                              "args.rotary_percent=0.5 (rotary embeddings on part of a head)"),
           "kv_channels": ("tp1_gpt2", 16, "args.kv_channels=16 (heads of another size"),
           "apply_residual_connection_post_layernorm": ("tp1_gpt2", True,
                                                        "the residual taken after the norm"),
           "squared_relu": ("tp1_gpt2", True, "the squared ReLU activation"),
           "multi_latent_attention": ("tp1_gpt2", True, "multi-latent attention"),
           "position_embedding_type": ("tp1_gpt2", "relative", "position embeddings other than")}


@pytest.mark.parametrize("key", REFUSED)
def test_import_refuses_a_model_it_cannot_hold_in_one_line(key, tmp_path):
    name, value, message = REFUSED[key]
    root, out = copied(name, tmp_path), str(tmp_path / "out")
    change_file(rank_file(root), args={key: value})
    with pytest.raises(ConfigError) as e:
        mc.import_main([root, "--save", out])
    one_line(e, rank_file(root), "this project's GPT cannot hold", message)
    assert not os.path.exists(out)


def test_rope_settings_matter_to_rope_models_alone():
    args = megatron_args("tp1_gpt2", rotary_percent=0.5, rotary_interleaved=True)
    assert "model_config.position_embedding_type=absolute" in mc.model_overrides(args)


def test_import_names_every_setting_it_cannot_hold(tmp_path):
    root = copied("tp1_gpt2", tmp_path)
    change_file(rank_file(root), args={"num_experts": 4, "qk_layernorm": True})
    with pytest.raises(ConfigError) as e:
        mc.import_main([root, "--save", str(tmp_path / "out")])
    one_line(e, "args.num_experts=4", "args.qk_layernorm=True")


def _break_folder(root, kind):
    tracker = os.path.join(root, "latest_checkpointed_iteration.txt")
    if kind == "no_tracker":
        os.remove(tracker)
    elif kind == "bad_tracker":
        open(tracker, "w").write("latest")
    elif kind == "missing_rank":
        os.remove(rank_file(root, 1, 1, 2))
    elif kind == "truncated_rank":
        path = rank_file(root, 1, 0, 2)
        open(path, "r+b").truncate(os.path.getsize(path) - 100)
    elif kind == "torch_dist":
        folder = os.path.join(root, "iter_0000040")
        shutil.rmtree(folder)
        os.makedirs(folder)
        open(os.path.join(folder, "__0_0.distcp"), "w").close()
        open(os.path.join(folder, ".metadata"), "w").close()
    elif kind == "old_version":
        change_file(rank_file(root), checkpoint_version=1.0)
    elif kind == "other_sizes":
        change_file(rank_file(root), args={"tensor_model_parallel_size": 1})
    elif kind == "other_model":
        for t, p in mc.checkpoint_files(root)[1]:
            change_file(rank_file(root, t, p, 2), args={"hidden_size": 64, "kv_channels": 16})


FOLDER_BREAKS = {
    "no_tracker": ("latest_checkpointed_iteration.txt is missing", ""),
    "bad_tracker": ("holds 'latest', not an iteration number or release", ""),
    "missing_rank": ("mp_rank_01_001/model_optim_rng.pt is missing: the checkpoint is incomplete",
                     ""),
    "truncated_rank": ("mp_rank_01_000/model_optim_rng.pt", "truncated"),
    "torch_dist": ("a torch_dist checkpoint (Megatron's default --ckpt-format)", ""),
    "old_version": ("has checkpoint_version 1.0", "per-group layout"),
    "other_sizes": ("its args say tensor x pipeline parallel 1 x 2, the folder holds 2 x 2", ""),
    "other_model": ("model.word_embeddings.weight of TP rank 0 has shape (128, 32)",
                    "no 1/2 piece of the model's (256, 64)")}


@pytest.mark.parametrize("kind", FOLDER_BREAKS)
def test_import_refuses_a_broken_megatron_folder_in_one_line(kind, tmp_path):
    root, out = copied("legacy_tp2_pp2", tmp_path), str(tmp_path / "out")
    _break_folder(root, kind)
    with pytest.raises((checkpoint.CheckpointError, ConfigError)) as e:
        mc.import_main([root, "--save", out])
    one_line(e, *FOLDER_BREAKS[kind])
    assert not os.path.exists(out)


def test_import_reads_a_release_checkpoint(tmp_path, capsys):
    root = copied("tp1_gpt2", tmp_path)
    os.rename(os.path.join(root, "iter_0000010"), os.path.join(root, "release"))
    open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w").write("release")
    assert mc.read_checkpoint(root)[2] == 0
    mc.import_main([root, "--save", str(tmp_path / "out")])
    assert "(iteration 0," in capsys.readouterr().out


def test_import_megatron_help_and_flags_checked_before_any_work(tmp_path):
    with pytest.raises(HelpRequested) as e:
        mc.import_main(["--help"])
    assert "usage: bash run.sh import-megatron DIR --save VALUE" in str(e.value)
    assert "--nproc" in str(e.value)
    (tmp_path / "file").write_text("")
    root = fixture("tp2_llama_bf16")
    for argv, message in (([root, "--save", str(tmp_path / "o"), "--nproc", "0"],
                           "--nproc must be"),
                          ([root, "--save", str(tmp_path / "file")], "is a file"),
                          (["--save", str(tmp_path / "o")], "import-megatron needs DIR first"),
                          ([root, "--save", str(tmp_path / "o"), "--nproc", "3",
                            "--tensor-model-parallel-size", "2"], "world size 3"),
                          ([root, "--save", str(tmp_path / "o"), "--bogus-flag", "1"],
                           "unknown flag --bogus-flag")):
        with pytest.raises(ConfigError) as e:
            mc.import_main(argv)
        one_line(e, message)
    assert sorted(os.listdir(tmp_path)) == ["file"]
    mc.import_main([root, "--save", str(tmp_path / "o")])
    with pytest.raises(ConfigError) as e:
        mc.import_main([root, "--save", str(tmp_path / "o")])
    one_line(e, "already holds a checkpoint")


def test_tokenizer_from_megatrons_args():
    """GPT2BPETokenizer: its files where they exist, else the project's copies of GPT-2's;
    NullTokenizer: Megatron's older vocab_size + 1 ids, or the newer vocab_size when only that
    fits; another tokenizer: NullTokenizer over the padded vocabulary, with a note."""
    data = os.path.join(HERE, "data")
    gpt2 = argparse.Namespace(tokenizer_type="GPT2BPETokenizer", vocab_file="/nowhere/vocab.json",
                              merge_file=os.path.join(data, "gpt2-merges.txt"))
    assert mc.tokenizer_overrides(gpt2, 50304) == ([
        "dataset_config.tokenizer_type=GPT2BPETokenizer",
        f"dataset_config.vocab_file={os.path.join(data, 'gpt2-vocab.json')}",
        f"dataset_config.merge_file={os.path.join(data, 'gpt2-merges.txt')}"], None)
    null = argparse.Namespace(tokenizer_type="NullTokenizer", vocab_size=250)
    assert mc.tokenizer_overrides(null, 256)[0][1] == "dataset_config.vocab_size=250"
    vars(null)["vocab_size"] = 256
    assert mc.tokenizer_overrides(null, 256)[0][1] == "dataset_config.vocab_size=255"
    other, note = mc.tokenizer_overrides(argparse.Namespace(tokenizer_type="HuggingFaceTokenizer"),
                                         512)
    assert other == ["dataset_config.tokenizer_type=NullTokenizer", "dataset_config.vocab_size=511"]
    assert "HuggingFaceTokenizer is not in this project" in note


def test_import_with_gpt2_tokenizer_generates_text(tmp_path, capsys):
    """A Megatron GPT with GPT-2's tokenizer whose vocab files are not on this machine imports
    with the project's copies and `generate` continues a text prompt."""
    root = copied("tp1_gpt2", tmp_path)
    path = rank_file(root)
    state = tf.load(path)
    word = state["model"]["embedding.word_embeddings.weight"]
    state["model"]["embedding.word_embeddings.weight"] = np.resize(word, (50304, word.shape[1]))
    vars(state["args"]).update(tokenizer_type="GPT2BPETokenizer", vocab_size=None,
                               padded_vocab_size=50304, vocab_file="/data/gpt2-vocab.json",
                               merge_file="/data/gpt2-merges.txt")
    tf.save(state, path)
    out = str(tmp_path / "out")
    mc.import_main([root, "--save", out])
    saved = checkpoint.load_checkpoint(out, stems=())[1]["config"]["dataset_config"]
    assert saved["vocab_file"] == os.path.join(HERE, "data", "gpt2-vocab.json")
    capsys.readouterr()
    assert train.main(["generate", "--load", out, "--prompt", "Hello", "--max-new-tokens", "3",
                       "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("Hello") and len(text.strip()) > len("Hello")
