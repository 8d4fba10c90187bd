"""The generate command: text sampled from the latest checkpoint, whatever layout wrote it.

    bash run.sh generate --load DIR [--prompt TEXT] [--max-new-tokens N] [--temperature T]
                         [--top-k K] [--seed S]
                         [--tokenizer-type ... --vocab-file ... --merge-file ...]

Every flag is checked before the weights are read; the text is printed as it is sampled.
MindSpore must be set up first (train.setup_mindspore, which train.main calls).
"""
import numpy as np
import mindspore as ms

from formats import checkpoint
from gpt import generate
from settings.cli import REQUIRED, parse_command
from settings.config import ConfigError, to_namespace
from tokenizer import build_tokenizer

TOKENIZER_KEYS = ("tokenizer_type", "vocab_file", "merge_file", "vocab_size")
GENERATE_FLAGS = {
    "--load": (REQUIRED, str, "checkpoint folder written by training (any layout)"),
    "--prompt": ("\n", str, "text to continue; empty starts a document (GPT-2's <|endoftext|>)"),
    "--max-new-tokens": (100, int, "tokens to sample, printed as they come (the context slides)"),
    "--temperature": (1.0, float, "softmax temperature; 0 is greedy"),
    "--top-k": (0, int, "sample among the k likeliest tokens; 0 keeps all"),
    "--seed": (0, int, "sampling seed"),
    # the tokenizer flags, spelled as in training
    **{f"--{k.replace('_', '-')}": (None, int if k == "vocab_size" else str,
                                    "replaces the checkpoint's (as in training)")
       for k in TOKENIZER_KEYS}}


def load_model(load_dir, tokenizer=None):
    """(one-process GPTModel, tokenizer, model config) from the latest checkpoint in load_dir,
    whatever layout saved it; `tokenizer` replaces the checkpoint's."""
    tensors, meta = checkpoint.full_state(load_dir, optimizer=False)
    cfg = to_namespace(meta["config"])
    dataset_cfg, model_cfg = cfg.dataset_config, cfg.model_config
    if tokenizer is None:
        tokenizer = build_tokenizer(dataset_cfg.tokenizer_type, dataset_cfg.vocab_file,
                                    dataset_cfg.merge_file, dataset_cfg.vocab_size)
    [model] = checkpoint.build_rank_chunks(model_cfg, 1, 1)                # one process
    for name, param in checkpoint.named_state(model):
        param.set_data(ms.Tensor(tensors[f"model.{name}"]))
    return model, tokenizer, model_cfg


def checked_tokenizer(load_dir, flags):
    """The checkpoint's tokenizer with the tokenizer flags given replacing its settings, checked to
    fit the model's vocabulary (read from the checkpoint's meta.json, before any weights)."""
    _, meta = checkpoint.load_checkpoint(load_dir, checkpoint.first_shard(load_dir), stems=())
    saved = meta["config"]["dataset_config"]
    settings = {k: saved[k] if flags[k] is None else flags[k] for k in TOKENIZER_KEYS}
    try:
        tokenizer = build_tokenizer(**settings)
    except (OSError, KeyError, ValueError) as e:
        # a missing file, a vocab.json that is not GPT-2's, ...
        raise ConfigError(f"generate: {settings['tokenizer_type']}: {e} (check --tokenizer-type, "
                          "--vocab-file, --merge-file, --vocab-size)") from None
    padded = meta["config"]["model_config"]["padded_vocab_size"]
    if tokenizer.vocab_size > padded:
        raise ConfigError(f"generate: the tokenizer's {tokenizer.vocab_size} tokens do not fit "
                          f"the model's vocabulary of {padded} (trained on mock data?): give the "
                          "tokenizer flags it was trained with (--tokenizer-type, --vocab-file, "
                          "--merge-file, --vocab-size)")
    return tokenizer


class TextStream:
    """generate's on_token: prints the text of the tokens sampled so far as soon as it is whole (a
    UTF-8 character can span byte-level tokens). Each piece is decoded after the last token shown,
    whose own text is then cut off, so that separators (NullTokenizer's spaces) come out as one
    decode of everything would give them; `close` prints a character left unfinished."""

    def __init__(self, tokenizer, context):
        self.decode, self.shown, self.pending = tokenizer.decode, list(context[-1:]), []

    def __call__(self, token):
        self.pending.append(token)
        if not self.decode(self.shown + self.pending).endswith("\ufffd"):
            self.close()

    def close(self):
        """Print what the pending tokens add to the text after the last token shown."""
        text = self.decode(self.shown + self.pending)[len(self.decode(self.shown)):]
        print(text, end="", flush=True)
        self.shown, self.pending = (self.pending or self.shown)[-1:], []


def generate_main(argv):
    """generate --load DIR [flags]: see the module docstring."""
    options, _ = parse_command("generate", argv, GENERATE_FLAGS,
                               about="Sample text from the latest checkpoint of --load.")
    if not options["temperature"] >= 0:
        raise ConfigError("generate: --temperature must be >= 0 (0 is greedy), "
                          f"got {options['temperature']}")
    if options["max_new_tokens"] < 1:
        raise ConfigError("generate: --max-new-tokens must be positive, "
                          f"got {options['max_new_tokens']}")
    if options["seed"] < 0:
        raise ConfigError(f"generate: --seed must be >= 0, got {options['seed']}")
    tokenizer = checked_tokenizer(options["load"], options)
    n = tokenizer.vocab_size
    if not 0 <= options["top_k"] <= n:
        raise ConfigError(f"generate: --top-k must be 0 (all tokens) up to the vocabulary's {n}, "
                          f"got {options['top_k']}")
    try:
        # an empty prompt starts a document, as GPT-2 does
        ids = tokenizer.encode(options["prompt"]) or [tokenizer.eod]
    except ValueError:                                 # NullTokenizer reads space-separated ids
        ids = None
    if ids is None or not all(0 <= i < n for i in ids):
        raise ConfigError(f"generate: --prompt {options['prompt']!r} is not text of the tokenizer "
                          f"(ids 0..{n - 1})")
    model, _, _ = load_model(options["load"], tokenizer)
    print(options["prompt"], end="", flush=True)
    stream = TextStream(tokenizer, ids)
    generate(model, ids, options["max_new_tokens"], options["temperature"], options["top_k"], n,
             np.random.default_rng(options["seed"]), on_token=stream)
    stream.close()
    print()


if __name__ == "__main__":          # imported by train.py, not a script
    raise SystemExit("error: sample.py is a library: run `bash run.sh generate ...`"
                     " (bash run.sh --help lists the commands)")
